"""Figures of RELIABILITY.md "Control plane and engine under stress": handshake flood, memory over many connections,
reconnect lag, sealing cost, and the engine's responsiveness during a long prefill.

    python benchmarks/bench_reliability.py [--connections 10000] [--flood 1000] [--json]

Every figure is a median over its repetitions unless it says otherwise; the machine's other load
shows in the spread, so the run prints min and max too.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from typing import Any

import numpy as np
import zmq

from kvxfer.disagg.auth import AuthKey
from kvxfer.disagg.control import ControlServer, connect
from kvxfer.disagg.handshake import ClientHandshake, LocalIdentity
from kvxfer.disagg.messages import Heartbeat, encode, encode_frame
from kvxfer.disagg.seal import SealedChannel
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import query_status
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import PeerUnreachable

SECRET = "bench-reliability-secret-0123456789"


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def _threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("kvxfer-"))


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def flood(strangers: int, repeats: int = 5) -> dict[str, Any]:
    """``strangers`` hellos without the secret from a thread while a correct client connects, repeatedly;
    the server's hello rate under the flood and how long the correct handshakes took."""
    ident = LocalIdentity("decode", "flooded", None, "", b"", 1.0)
    srv = ControlServer(ident, SECRET, accept_roles=("client",))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, strangers + 64)
    socks = []
    for _ in range(strangers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(srv.address)
        socks.append(s)
    hellos = [encode_frame(ClientHandshake(LocalIdentity("client", f"s{i}", None, "", b"", 1.0),
                                     AuthKey(b"x" * 16)).hello()) for i in range(strangers)]
    go = threading.Event()

    def run() -> None:
        go.wait()
        for s, h in zip(socks, hellos, strict=True):
            s.send(h)

    sender = threading.Thread(target=run, daemon=True)
    sender.start()
    t0 = time.monotonic()
    go.set()
    connects: list[float] = []
    refused = 0
    while srv.num_pending + srv.evicted < strangers or len(connects) < repeats:
        c0 = time.monotonic()
        try:
            client = connect(srv.address, LocalIdentity("client", f"ok{len(connects)}", None, "", b"", 1.0), SECRET,
                             timeout=5.0)
            srv.accept(5.0)
            client.close()
            connects.append(time.monotonic() - c0)
        except PeerUnreachable:
            refused += 1
        if time.monotonic() - t0 > 120:
            break
    processed = srv.num_pending + srv.evicted
    took = time.monotonic() - t0
    sender.join(30)
    for s in socks:
        s.close()
    ctx.destroy(linger=0)
    srv.close()
    return {"strangers": strangers, "max_pending": srv.max_pending, "evicted": srv.evicted,
            "hellos_per_s": processed / took, "correct_connect_s": _spread(connects), "correct_refused": refused}


def connections(n: int) -> dict[str, Any]:
    """``n`` authenticated status connections to one prefill, one after the other: RSS and threads."""
    samples = []
    with PrefillWorker(WorkerConfig("bench-rel-prefill"), SECRET) as prefill:
        t0 = time.monotonic()
        for i in range(1, n + 1):
            query_status(prefill.address, SECRET, timeout=10.0)
            if i in (1, n // 10, n // 5, n // 2, n) or i % 2000 == 0:
                samples.append({"connections": i, "rss_kib": _rss_kib(), "kvxfer_threads": _threads(),
                                "live_peers": len(prefill.server.peers),
                                "waiting": prefill.engine.num_connections_waiting})
        per = (time.monotonic() - t0) / n
    return {"connections": n, "per_connection_ms": per * 1e3, "samples": samples}


def reconnect(repeats: int = 5, down_s: float = 1.5) -> dict[str, Any]:
    """Prefill closed for ``down_s`` (longer than one reconnect attempt fails) and back at the same
    address: seconds from its listening again to decode's first successful request."""
    tokens = np.arange(40) % 512
    lags: list[float] = []
    first = PrefillWorker(WorkerConfig("bench-rel-p0"), SECRET)
    address = first.address
    with DecodeWorker(WorkerConfig("bench-rel-d"), SECRET, prefill=address) as decode:
        decode.generate(tokens, 4, timeout=60)
        for r in range(repeats):
            first.close()
            time.sleep(down_s)
            first = PrefillWorker(WorkerConfig(f"bench-rel-p{r + 1}"), SECRET, bind=address)
            t0 = time.monotonic()
            while True:
                try:
                    decode.generate(tokens, 4, timeout=60)
                    break
                except PeerUnreachable:
                    time.sleep(0.005)
            lags.append(time.monotonic() - t0)
    first.close()
    return {"down_s": down_s, "first_success_after_listening_s": _spread(lags)}


def sealing(iters: int = 20000) -> dict[str, Any]:
    """Seal + open of one frame (the whole per-message cost sealing adds) at three sizes, in µs."""
    a, b = bytes(range(32)), bytes(range(1, 33))
    out = {}
    for size in (64, 1024, 65536):
        tx, rx = SealedChannel(a, b), SealedChannel(b, a)
        frame = bytes(size)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters if size < 65536 else iters // 10):
                rx.open(tx.seal(frame))
            times.append((time.perf_counter() - t0) / (iters if size < 65536 else iters // 10) * 1e6)
        out[f"{size}B_us"] = _spread(times)
    enc = encode(Heartbeat())
    tx, rx = SealedChannel(a, b), SealedChannel(b, a)
    t0 = time.perf_counter()
    for _ in range(iters):
        rx.open(tx.seal(enc))
    out["heartbeat_us"] = (time.perf_counter() - t0) / iters * 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--connections", type=int, default=10000)
    ap.add_argument("--flood", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    logging.getLogger("kvxfer").setLevel(logging.ERROR)
    res = {"sealing": sealing(), "flood": flood(a.flood), "reconnect": reconnect(),
           "connections": connections(a.connections)}
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
