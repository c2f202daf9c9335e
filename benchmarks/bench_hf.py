"""transformers model generation with its KV in kvxfer pages (``HFModel.generate``) next to the same model
generating alone with its own DynamicCache (``HFModel.dense_generate``), measured in the same run.

Every timed run's tokens are compared with the DynamicCache's (a mismatch stops the benchmark).
Medians of ``--repeat`` runs; one torch thread on the CPU.

    PYTHONPATH=$PWD python benchmarks/bench_hf.py [--presets tiny tiny-swa] [--prompt 256] [--new 32]
    PYTHONPATH=$PWD python benchmarks/bench_hf.py --presets llama-3.2-1b --device cuda:0 --prompt 2048
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvxfer.cache import KVCacheManager
from kvxfer.model.hf import HFSource


def timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Wall time of one call ``fn(*args)`` (the device synchronised at both ends) and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "tiny-swa"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="generated tokens")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    print(f"{'preset':<14} {'device':<8} {'prompt':>6} {'new':>4} {'paged ms':>9} {'dense ms':>9} {'paged/dense':>11}")
    for name in args.presets:
        source = HFSource(preset=name)
        model = source.load(device)
        blocks = -(-(args.prompt + args.new) // args.tokens_per_block) + 2
        manager = KVCacheManager(source.kv_spec.cache_config(args.tokens_per_block, blocks, args.device,
                                                             enable_prefix_reuse=False))
        tokens = np.random.default_rng(0).integers(0, source.vocab_size, args.prompt)
        model.generate(manager, tokens, 2)          # warm-up (kernels, allocator)
        model.dense_generate(tokens, 2)
        paged_s, dense_s = [], []
        for _ in range(args.repeat):
            t, got = timed(device, model.generate, manager, tokens, args.new)
            paged_s.append(t)
            t, (want, _) = timed(device, model.dense_generate, tokens, args.new)
            dense_s.append(t)
            if got != want:
                raise SystemExit(f"{name}: paged tokens {got} != DynamicCache tokens {want}")
        row = {"preset": name, "device": args.device, "prompt": args.prompt, "new": args.new,
               "paged_s": statistics.median(paged_s), "dense_s": statistics.median(dense_s)}
        rows.append(row)
        print(f"{name:<14} {args.device:<8} {args.prompt:>6} {args.new:>4} {row['paged_s'] * 1e3:>9.1f} "
              f"{row['dense_s'] * 1e3:>9.1f} {row['paged_s'] / row['dense_s']:>11.2f}")
    out = pathlib.Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC)
    path = out / f"hf-{stamp:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps({"date": stamp.isoformat(), "machine": platform.platform(), "args": vars(args),
                                "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
