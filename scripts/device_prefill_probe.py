"""Is the 1B model's 4k prefill slower on a compute thread than on the main thread (issue 17, goal 5: the H200's
4k TTFT ratio of 1.126 in run 58 was all in the prefill worker's compute, 200.8 ms against 181.8)?

One process, the e2e bench's baseline (``single_process_ttft``: cache, prefill, first token) on the bench's
settings (one torch thread, 0.5 ms GIL switch interval), timed alternately on the main thread and on a
second thread (as the prefill worker's ComputeThread runs it), each with and without an idle thread beside
it waiting on an Event (as the worker's engine does). Medians; prints one line, JSON to argv[1]. ``MODEL``/``DEVICE``
in the environment pick another preset/device (a CPU smoke run: ``MODEL=tiny DEVICE=cpu``).

  PYTHONPATH=. python3 scripts/device_prefill_probe.py $OUT/prefill_probe.json [tokens] [iters]
"""
import json
import os
import statistics
import sys
import threading

import numpy as np
import torch

from kvxfer.cache.manager import KVCacheManager
from kvxfer.cli.bench_e2e import TOKENS_PER_BLOCK, single_process_ttft
from kvxfer.model import ReferenceModel, preset


def main() -> None:
    tokens_n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    torch.set_num_threads(1)
    sys.setswitchinterval(0.5e-3)
    device = os.environ.get("DEVICE", "cuda:0")
    name = os.environ.get("MODEL", "llama-3.2-1b")
    cfg = preset(name)
    model = ReferenceModel(cfg, device)
    manager = KVCacheManager(cfg.cache_config(TOKENS_PER_BLOCK, tokens_n // TOKENS_PER_BLOCK + 64, device))
    rng = np.random.default_rng(0)

    def once() -> float:
        took, _, _ = single_process_ttft(model, manager, rng.integers(0, cfg.vocab_size, tokens_n), 1024)
        return took * 1e3

    def on_thread() -> float:
        out: list[float] = []
        t = threading.Thread(target=lambda: out.append(once()))
        t.start()
        t.join()
        return out[0]

    def idle_engine(stop: threading.Event) -> None:   # as the worker's engine thread between events
        while not stop.wait(1.0):
            pass

    once(), on_thread()   # warm-up: kernels, cuBLAS handles of both threads
    times: dict[str, list[float]] = {k: [] for k in ("main", "thread", "main+idle", "thread+idle")}
    for i in range(iters):
        order = list(times) if i % 2 == 0 else list(reversed(times))
        for kind in order:
            stop = threading.Event()
            idle = None
            if kind.endswith("+idle"):
                idle = threading.Thread(target=idle_engine, args=(stop,))
                idle.start()
            times[kind].append(once() if kind.startswith("main") else on_thread())
            stop.set()
            if idle is not None:
                idle.join()
    res = {"model": name, "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else device, "tokens": tokens_n, "iters": iters,
           **{k: statistics.median(v) for k, v in times.items()}, "samples": times}
    print(f"{res['gpu']}: {name} prefill of {tokens_n} tokens, median of {iters} ms: " +
          ", ".join(f"{k} {res[k]:.1f}" for k in times), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
