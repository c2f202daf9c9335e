"""Cross-node KV transfer on one machine: a prefill process in its own network namespace (a veth link to
this one, UCX limited to TCP on it) against the same prefill on 127.0.0.1 (UCX's default transports
between two local processes: shared memory / CMA), and TCP over loopback as the middle case.

Per case: one ``kvxfer serve prefill`` process (nixl, push) and one decode worker in this process; for
each prompt length, ``--iters`` requests with distinct prompts (no prefix reuse on either side). Figures:
decode's ``transfer_s`` (prefill's first write posted to its last completion, as prefill reports it) and
TTFT, medians; GB/s = KV bytes moved / transfer time. Each request's tokens and committed KV are checked
by the KV oracle (not timed). Needs root and ``ip netns`` for the namespace rows. Prints a table and
writes JSON to benchmarks/results/bench_netns.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvxfer.cli.demo import WorkerProcess
from kvxfer.disagg.oracle import DEFAULT_POSITIONS, KVOracle
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.model import preset

SECRET = "bench-netns-secret-0123456789abcd"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def namespace(tag: str) -> Iterator[tuple[str, str, str, str]]:
    """A namespace joined by a veth pair: (namespace, its address, host device, namespace device)."""
    ns, host, peer = f"kvb{tag}", f"kb{tag}h", f"kb{tag}p"
    ip("netns", "add", ns)
    try:
        ip("link", "add", host, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", ns)
        ip("addr", "add", "10.80.1.1/24", "dev", host)
        ip("link", "set", host, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", "10.80.1.2/24", "dev", peer)
        ip("netns", "exec", ns, "ip", "link", "set", peer, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, "10.80.1.2", host, peer
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", ns)
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", host)


@contextlib.contextmanager
def ucx_env(settings: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES")}
    for k in saved:
        os.environ.pop(k, None)
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_case(label: str, listen: str, prefill_ucx: dict[str, str], decode_ucx: dict[str, str],
             prefix: Sequence[str], lengths: list[int], iters: int, oracle: KVOracle) -> list[dict[str, float | str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "UCX_NET_DEVICES")}
    env.update(KVXFER_SECRET=SECRET, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **prefill_ucx,
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = WorkerProcess(["prefill", "--backend", "nixl", "--name", f"nb-prefill-{os.getpid()}-{time.time_ns()}",
                          "--listen", listen, "--blocks", "2048"], env, 120.0, prefix=prefix)
    rows: list[dict[str, float | str]] = []
    try:
        with ucx_env(decode_ucx):
            decode = DecodeWorker(WorkerConfig(f"nb-decode-{time.time_ns()}", backend="nixl", num_blocks=2048),
                                  SECRET, prefill=proc.address)
        with decode:
            rng = np.random.default_rng(len(label))
            decode.generate(rng.integers(0, 512, 64), 1, timeout=120)   # connection warm-up, not counted
            for n in lengths:
                transfer, ttft, nbytes, wrong = [], [], 0, 0
                for _ in range(iters):
                    tokens = rng.integers(0, 512, n)
                    res = decode.generate(tokens, 2, timeout=300, return_kv=DEFAULT_POSITIONS)
                    transfer.append(res.transfer_s)
                    ttft.append(res.ttft_s)
                    nbytes = res.bytes_moved
                    wrong += not oracle.check_request(tokens, 2, res.tokens, res.prompt_kv).ok
                t = float(np.median(transfer))
                rows.append({"case": label, "tokens": n, "kv_mib": nbytes / 2**20, "transfer_ms": t * 1e3,
                             "gb_per_s": nbytes / t / 1e9, "ttft_ms": float(np.median(ttft)) * 1e3, "wrong": wrong})
    finally:
        proc.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    oracle = KVOracle(preset("tiny"))
    rows: list[dict[str, float | str]] = []
    if os.geteuid() == 0:   # first: UCX caches the routing table when a process first uses it
        with namespace(str(os.getpid() % 100000)) as (ns, address, host, peer):
            rows += run_case("namespace via veth, UCX TCP", f"tcp://{address}:0",
                             {"UCX_TLS": "tcp", "UCX_NET_DEVICES": peer}, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host},
                             ("ip", "netns", "exec", ns), lengths, a.iters, oracle)
    else:
        print("not root: the namespace rows are skipped", file=sys.stderr)
    rows += run_case("127.0.0.1, UCX default", "tcp://127.0.0.1:0", {}, {}, (), lengths, a.iters, oracle)
    rows += run_case("127.0.0.1, UCX TCP only", "tcp://127.0.0.1:0", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
                     {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, (), lengths, a.iters, oracle)
    print(f"{'case':<30} {'tokens':>7} {'KV MiB':>7} {'transfer ms':>12} {'GB/s':>6} {'TTFT ms':>8} {'wrong':>6}")
    for r in rows:
        print(f"{r['case']:<30} {r['tokens']:>7} {r['kv_mib']:>7.1f} {r['transfer_ms']:>12.2f} {r['gb_per_s']:>6.2f} "
              f"{r['ttft_ms']:>8.1f} {r['wrong']:>6}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_netns.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "iters": a.iters, "rows": rows}, f, indent=2)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
