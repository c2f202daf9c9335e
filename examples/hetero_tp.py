"""Heterogeneous tensor parallelism: one prefill rank (all KV heads, 16 tokens per block, HND) feeds two
decode ranks (one KV head each, 8 tokens per block, NHD). ``plan_transfer`` pairs every (prefill rank,
decode rank) by heads and tokens; the decode worker holds both ranks and runs the model over them.

    PYTHONPATH=. python examples/hetero_tp.py --backend loopback --mode pull
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.model import ReferenceModel, preset
from kvxfer.transport.registry import host_backends


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=host_backends(), default="loopback")
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--decode-ranks", type=int, default=2, help="decode tensor-parallel ranks (divides 2 KV heads)")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = preset("tiny")
    secret = "hetero-tp-example-shared-secret"
    pcfg = WorkerConfig("hetero-prefill", model, tokens_per_block=16, head_order="HND", tp_size=1, backend=a.backend)
    dcfg = WorkerConfig("hetero-decode", model, tokens_per_block=8, head_order="NHD", tp_size=a.decode_ranks,
                        backend=a.backend)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, model.vocab_size, 40)
    ref = ReferenceModel(model)
    manager = KVCacheManager(model.cache_config(16, 256, enable_prefix_reuse=False))
    bad = 0
    with PrefillWorker(pcfg, secret) as prefill, \
            DecodeWorker(dcfg, secret, prefill=prefill.address, mode=a.mode) as decode:
        for lay in decode.layouts:
            fmt = lay.formats[0][1]
            print(f"decode rank: heads [{fmt.head_start}, {fmt.head_start + fmt.num_heads}) of {fmt.total_heads}, "
                  f"{lay.tokens_per_block} tokens/block, {fmt.order}")
        for _ in range(a.requests):
            tokens = np.concatenate([prefix, rng.integers(0, model.vocab_size, int(rng.integers(5, 30)))])
            res = decode.generate(tokens, a.max_new_tokens)
            match = res.tokens == ref.generate(manager, tokens, a.max_new_tokens)
            bad += not match
            print(f"{res.request_id}: {tokens.size} prompt tokens, {res.reused_tokens_decode} reused on decode, "
                  f"{res.bytes_moved} bytes -> {'match' if match else 'MISMATCH'}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
