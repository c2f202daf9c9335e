"""A prefill worker and a decode worker on the CPU, in one process: the decode side asks for a prompt's
KV, the prefill side computes and sends it, decode continues generation; the tokens are checked
against one process doing both.

    PYTHONPATH=. python examples/cpu_pair.py --backend loopback --mode push
    PYTHONPATH=. python examples/cpu_pair.py --backend nixl --mode pull --prompt "hello hello hello"
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.model import ByteTokenizer, ReferenceModel, preset
from kvxfer.transport.registry import host_backends


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=host_backends(), default="loopback")
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--layerwise", action="store_true", help="send each layer as soon as it is computed")
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = preset("tiny")
    secret = "cpu-pair-example-shared-secret"   # in production: $KVXFER_SECRET or a secret file
    tok = ByteTokenizer(model.vocab_size)
    ids = tok.encode(a.prompt)
    with PrefillWorker(WorkerConfig("example-prefill", model, backend=a.backend), secret) as prefill, \
            DecodeWorker(WorkerConfig("example-decode", model, backend=a.backend), secret, prefill=prefill.address,
                         mode=a.mode, layerwise=a.layerwise) as decode:
        first = decode.generate(ids, a.max_new_tokens)
        again = decode.generate(ids + tok.encode(" And again."), a.max_new_tokens)   # shares the prefix
    ref = ReferenceModel(model)
    manager = KVCacheManager(model.cache_config(16, 256, enable_prefix_reuse=False))
    ok = first.tokens == ref.generate(manager, ids, a.max_new_tokens) and \
        again.tokens == ref.generate(manager, ids + tok.encode(" And again."), a.max_new_tokens)
    for r in (first, again):
        print(f"{r.request_id}: {r.prompt_tokens} prompt tokens ({r.reused_tokens_decode} already on decode), "
              f"{r.bytes_moved} bytes moved, TTFT {r.ttft_s * 1e3:.1f} ms -> tokens {r.tokens}")
    print("tokens match single-process generation" if ok else "MISMATCH against single-process generation")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
