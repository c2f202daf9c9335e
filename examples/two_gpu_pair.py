"""Two processes, two GPUs: a prefill worker on cuda:0 and a decode worker on cuda:1 (with one GPU both
share cuda:0), KV pages moved GPU to GPU by cuda_ipc (CUDA IPC handles, one batched copy), nixl or ucx.
The tokens are checked against one process doing both.

    PYTHONPATH=. python examples/two_gpu_pair.py --backend cuda_ipc --model small --prompt-tokens 4096
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection

import numpy as np
import torch

from kvxfer.transport.registry import backend_names

SECRET = "two-gpu-example-shared-secret"


def _prefill(conn: Connection, model: str, backend: str, device: str) -> None:
    """Child process: serve prefill on ``device`` until told to stop."""
    torch.set_num_threads(1)
    from kvxfer.disagg.worker import WorkerConfig
    from kvxfer.disagg.worker_prefill import PrefillWorker
    from kvxfer.model import preset
    with PrefillWorker(WorkerConfig("gpu-prefill", preset(model), device=device, backend=backend), SECRET) as worker:
        conn.send(worker.address)
        conn.recv()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=backend_names(cross_process=True), default="cuda_ipc")
    ap.add_argument("--model", default="tiny", help="model preset (tiny, small, medium)")
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("two_gpu_pair needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from kvxfer.cache.manager import KVCacheManager
    from kvxfer.disagg.worker import WorkerConfig
    from kvxfer.disagg.worker_decode import DecodeWorker
    from kvxfer.model import ReferenceModel, preset

    prefill_dev = "cuda:0"
    decode_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    cfg = preset(a.model)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(child, a.model, a.backend, prefill_dev), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            print("prefill process did not start", file=sys.stderr)
            return 2
        address = parent.recv()
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, a.prompt_tokens)
        with DecodeWorker(WorkerConfig("gpu-decode", cfg, device=decode_dev, backend=a.backend), SECRET,
                          prefill=address, mode=a.mode) as decode:
            res = decode.generate(tokens, a.max_new_tokens)
        manager = KVCacheManager(cfg.cache_config(16, -(-(a.prompt_tokens + a.max_new_tokens) // 16) + 4, decode_dev,
                                                  enable_prefix_reuse=False))
        expected = ReferenceModel(cfg, decode_dev).generate(manager, tokens, a.max_new_tokens)
    finally:
        parent.send("stop")
        proc.join(30)
    ok = res.tokens == expected
    print(f"prefill {prefill_dev} -> decode {decode_dev} over {a.backend} ({a.mode}): {res.bytes_moved} bytes in "
          f"{res.transfer_s * 1e3:.2f} ms ({res.bytes_moved / max(res.transfer_s, 1e-9) / 1e9:.2f} GB/s), "
          f"TTFT {res.ttft_s * 1e3:.1f} ms; tokens {'match' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
