"""Trace of the control-plane hops of ``kv_pushed`` between a prefill worker (its own process) and a
decode worker (this one), on the CPU: where the milliseconds of bench e2e's "messages" go. Both
processes stamp events with the system-wide monotonic clock: the prefill engine sending, its I/O
thread waking and handing the frame to ZeroMQ, decode's I/O thread receiving it, decode's engine
handling it. Prints medians over the requests.

  PYTHONPATH=$PWD python scripts/trace_control_hops.py [--backend ucx] [--requests 30] [--tokens 256]
"""
import argparse
import multiprocessing as mp
import statistics
import threading
import time

import numpy as np
import torch

SECRET = "0" * 64


def instrument(events: list) -> None:
    """Wrap the control-plane steps to append (time, what, thread name) to ``events``."""
    from kvxfer.disagg import control, worker_decode

    def mark(what: str) -> None:
        events.append((time.monotonic(), what, threading.current_thread().name))

    def before(cls, name, what, only=None):
        orig = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if only is None or only(args, kwargs):
                mark(what)
            return orig(self, *args, **kwargs)
        setattr(cls, name, wrapped)

    pushed = lambda a, k: a and a[0] == "kv_pushed"  # noqa: E731
    before(control.PeerConnection, "send", "engine sends", pushed)
    before(control.PeerConnection, "send_urgent", "engine sends", pushed)
    before(control._Endpoint, "_drain_wake", "io wakes")
    before(control._Endpoint, "_send_now", "io sends")
    before(control._Endpoint, "_on_frames", "io receives")
    before(worker_decode.DecodeWorker, "_on_prefill", "decode engine", lambda a, k: a[1].type == "kv_pushed")


def prefill_process(queue: mp.Queue, backend: str) -> None:
    torch.set_num_threads(1)
    events: list = []
    instrument(events)
    from kvxfer.disagg.worker import WorkerConfig
    from kvxfer.disagg.worker_prefill import PrefillWorker
    from kvxfer.model import preset
    with PrefillWorker(WorkerConfig("p", model=preset("tiny"), num_blocks=256, backend=backend), SECRET) as worker:
        queue.put(worker.address)
        queue.get()
    queue.put(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(1)
    events: list = []
    instrument(events)
    from kvxfer.disagg.worker import WorkerConfig
    from kvxfer.disagg.worker_decode import DecodeWorker
    from kvxfer.model import preset
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=prefill_process, args=(queue, a.backend))
    child.start()
    address = queue.get(timeout=120)
    with DecodeWorker(WorkerConfig("d", model=preset("tiny"), num_blocks=256, backend=a.backend), SECRET,
                      prefill=address) as decode:
        rng = np.random.default_rng(0)
        decode.generate(rng.integers(0, 512, 64), 1)
        results = [decode.generate(rng.integers(0, 512, a.tokens), 1) for _ in range(a.requests)]
    queue.put("done")
    events = sorted(events + queue.get(timeout=60))
    child.join(30)
    hops = {"prefill engine -> its I/O thread wakes": [], "I/O thread wakes -> frame to ZeroMQ": [],
            "ZeroMQ (TCP) -> decode I/O thread": [], "decode I/O thread -> decode engine": []}
    for k, ev in enumerate(events):
        if ev[1] != "engine sends" or not ev[2].endswith("-p"):
            continue
        later = events[k:]
        woke = next(e for e in later if e[1] == "io wakes" and e[2].endswith("-p"))
        sent = next(e for e in later if e[1] == "io sends" and e[2].endswith("-p"))
        got = next(e for e in later if e[1] == "io receives" and e[2].endswith("-d") and e[0] >= sent[0])
        handled = next(e for e in later if e[1] == "decode engine")
        for name, (x, y) in zip(hops, ((ev, woke), (woke, sent), (sent, got), (got, handled)), strict=True):
            hops[name].append(y[0] - x[0])
    for name, values in hops.items():
        print(f"{name:42s} p50 {statistics.median(values) * 1e6:7.0f} us")
    messages = [r.messages_s for r in results]
    print(f"{'bench e2e messages (both control trips)':42s} p50 {statistics.median(messages) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
