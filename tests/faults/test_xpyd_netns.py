"""xPyD across network namespaces ("nodes" on one machine): each prefill process runs in a namespace of
its own, joined to this one by a veth pair, and UCX is limited to TCP over the veth devices
(``UCX_TLS=tcp``), so every KV byte crosses a real network path. Needs root and ``ip netns`` (skipped
with the reason otherwise). Same checks as the 127.0.0.1 run: the KV oracle on every request, a SIGKILL
and a join, 0 wrong, nothing held.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from kvxfer.cli.demo import WorkerProcess
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import query_status
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.errors import KvxferError, PeerUnreachable
from tests.faults.conftest import assert_settled
from tests.faults.test_process_faults import (  # noqa: F401 (autouse child check)
    HEARTBEAT_LIMIT,
    LEASE_S,
    MARGIN,
    RECONNECT_S,
    SECRET,
    _no_child_left,
    _started,
    name,
    reap,
    wait_until,
)
from tests.test_e2e import KV, NEW, assert_matches_reference, prompts

NODES = 4
SUBNET = 79


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _netns_reason() -> str | None:
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"kvxprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    return None


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[tuple[str, str, str]]]:
    """``NODES`` namespaces, each (namespace, its address, this side's veth device), removed afterwards."""
    reason = _netns_reason()
    if reason is not None:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    made: list[tuple[str, str, str]] = []
    try:
        for i in range(NODES):
            ns, host, peer = f"kvx{tag}n{i}", f"kx{tag}h{i}", f"kx{tag}p{i}"
            _ip("netns", "add", ns)
            made.append((ns, f"10.{SUBNET}.{i + 1}.2", host))
            _ip("link", "add", host, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("addr", "add", f"10.{SUBNET}.{i + 1}.1/24", "dev", host)
            _ip("link", "set", host, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"10.{SUBNET}.{i + 1}.2/24", "dev", peer)
            _ip("netns", "exec", ns, "ip", "link", "set", peer, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield made
    finally:
        for ns, _, host in made:
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", ns)      # takes its veth end, and so the pair, with it
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("link", "del", host)


def spawn_in(node: tuple[str, str, str]) -> WorkerProcess:
    ns, address, host = node
    env = {**os.environ, "KVXFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "UCX_TLS": "tcp", "UCX_NET_DEVICES": host.replace("h", "p", 1),
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = WorkerProcess(["prefill", "--backend", "nixl", "--name", name("prefill"),
                          "--listen", f"tcp://{address}:0"], env, 60.0, prefix=("ip", "netns", "exec", ns))
    _started.append(proc)
    return proc


@contextlib.contextmanager
def ucx_over(devices: list[str]) -> Iterator[None]:
    """UCX settings for the transports created inside: TCP only, on these devices (restored after)."""
    saved = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES")}
    os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES=",".join(devices))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rx_bytes(device: str) -> int:
    """Bytes this side of a veth pair received (from its namespace)."""
    with open(f"/sys/class/net/{device}/statistics/rx_bytes") as f:
        return int(f.read())


def test_three_prefill_nodes_two_decodes_across_namespaces(nodes: list[tuple[str, str, str]]) -> None:
    procs: list[WorkerProcess] = []
    joined: WorkerProcess | None = None
    decodes: list[DecodeWorker] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            procs = list(pool.map(spawn_in, nodes[:3]))
        addresses = [p.address for p in procs]
        with ucx_over([host for _, _, host in nodes]):
            for _ in range(2):
                decodes.append(DecodeWorker(WorkerConfig(name("decode"), backend="nixl", num_blocks=512,
                                                         lease_s=LEASE_S), SECRET, prefill=addresses,
                                            connect_timeout=RECONNECT_S))
        before = sum(rx_bytes(host) for _, _, host in nodes)
        warm = [(d.submit(t, NEW, return_kv=KV), t) for d in decodes for t in prompts(90, prefix=0, count=3)]
        for fut, tokens in warm:
            assert_matches_reference(fut.result(timeout=90), tokens, NEW)
        moved = sum(fut.result().bytes_moved for fut, _ in warm)
        # The KV crossed the veth links (pushed by prefill from its namespace), not shared memory.
        assert sum(rx_bytes(host) for _, _, host in nodes) - before >= moved > 0
        assert {fut.result().prefill for fut, _ in warm} == set(addresses)

        victim = procs[0]
        rng = np.random.default_rng(91)
        sent: list[tuple[Future[GenerationResult], np.ndarray, str]] = []
        for i in range(9):
            target = addresses[i % 3]
            tokens = rng.integers(0, 512, 1500 if target == victim.address else 300)
            sent.append((decodes[i % 2].submit(tokens, NEW, return_kv=KV, prefill=target), tokens, target))
        wait_until(lambda: int(query_status(victim.address, SECRET)["jobs"]) > 0, 30, "the victim works")
        victim.kill()
        failed = 0
        for fut, tokens, target in sent:
            try:
                got = fut.result(timeout=90)
            except KvxferError as exc:
                assert target == victim.address and isinstance(exc, PeerUnreachable), exc
                failed += 1
                continue
            assert_matches_reference(got, tokens, NEW)
        assert failed >= 1

        joined = spawn_in(nodes[3])
        for d in decodes:
            d.add_prefill(joined.address)
        fresh = [(d.submit(t, NEW, return_kv=KV), t) for d in decodes for t in prompts(92, prefix=0, count=3)]
        results = [fut.result(timeout=90) for fut, _ in fresh]
        for res, (_, tokens) in zip(results, fresh, strict=True):
            assert_matches_reference(res, tokens, NEW)
        assert joined.address in {r.prefill for r in results} and victim.address not in {r.prefill for r in results}
        for d in decodes:
            wait_until(lambda d=d: d.held_slots() == 0, HEARTBEAT_LIMIT + 3 * LEASE_S + MARGIN,  # type: ignore[misc]
                       "decode frees the lost prefill's quarantined blocks")
            assert_settled(d, timeout=MARGIN)
        for p in [*procs[1:], joined]:
            wait_until(lambda p=p: int(query_status(p.address, SECRET)["held_slots"]) == 0,  # type: ignore[misc]
                       MARGIN, f"prefill {p.address} frees every block")
    finally:
        for d in decodes:
            d.close()
        reap(*procs, joined)
