"""Discovery in a real etcd server (Debian's ``etcd-server``; skipped with the reason when not installed):
workers register under leases, a decode worker follows the registered prefills (a join is used at once,
a revoked or expired registration removes the prefill), and a SIGKILLed ``kvxfer serve prefill --etcd``
disappears when its lease runs out."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from kvxfer.cli.demo import WorkerProcess
from kvxfer.disagg.discovery import (
    EtcdClient,
    PeerWatcher,
    WorkerRecord,
    follow_prefills,
    key_of,
    register_worker,
)
from kvxfer.disagg.router import KVRouter
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ConfigError, PeerUnreachable, ProtocolError
from tests.disagg.test_router import prefills_with_events
from tests.e2e.test_loopback import (  # noqa: F401 (_one_thread: autouse leak check)
    KV,
    NEW,
    SECRET,
    _one_thread,
    assert_matches_reference,
    name,
    prompts,
)

ETCD = shutil.which("etcd")
pytestmark = pytest.mark.skipif(ETCD is None, reason="needs an etcd server binary: apt-get install etcd-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    """A private etcd server on free ports, its data in a temporary directory."""
    assert ETCD is not None
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen([ETCD, "--name", "kvxfer-test", "--data-dir", data, "--listen-client-urls", url,
                                 "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                 "--initial-cluster", f"kvxfer-test=http://127.0.0.1:{peer}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            etcd = EtcdClient(url)

            def up() -> bool:
                try:
                    etcd.get_prefix("/")
                    return True
                except PeerUnreachable:
                    return False
            wait_for(up, "etcd answers", 20.0)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def test_records_leases_and_bad_input(etcd_url: str) -> None:
    etcd = EtcdClient(etcd_url)
    record = WorkerRecord("prefill", "p", "tcp://127.0.0.1:1", "ab" * 32, 2, "tcp://127.0.0.1:2")
    assert WorkerRecord.from_json(record.to_json()) == record
    with pytest.raises(ProtocolError, match="not a worker record"):
        WorkerRecord.from_json('{"role": "prefill"}')
    with pytest.raises(ConfigError, match="http"):
        EtcdClient("127.0.0.1:2379")
    lease = etcd.grant(2)
    etcd.put("/kvxfer/t1/prefill/p", record.to_json(), lease)
    assert etcd.get_prefix("/kvxfer/t1/") == {"/kvxfer/t1/prefill/p": record.to_json()}
    etcd.revoke(lease)
    assert etcd.get_prefix("/kvxfer/t1/") == {}
    with pytest.raises(PeerUnreachable, match="etcd at"):
        EtcdClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5).get_prefix("/")


def test_decode_follows_registered_prefills(etcd_url: str) -> None:
    """Two prefills register; the decode (no static list) finds both and serves; one deregisters and is
    dropped; a third registers and the next requests use it; a malformed record is ignored."""
    etcd = EtcdClient(etcd_url)
    cluster = f"c{os.getpid()}-{time.monotonic_ns()}"
    pre = [PrefillWorker(WorkerConfig(name("prefill"), num_blocks=64), SECRET) for _ in range(3)]
    regs = []
    try:
        regs = [register_worker(p, etcd, cluster) for p in pre[:2]]
        stored = WorkerRecord.from_json(etcd.get_prefix(key_of(cluster, "prefill", pre[0].config.name))
                                        [key_of(cluster, "prefill", pre[0].config.name)])
        assert stored.address == pre[0].address and stored.fingerprint == pre[0].layouts[0].fingerprint.hex()
        etcd.put(key_of(cluster, "prefill", "garbage"), "not json")
        with DecodeWorker(WorkerConfig(name("decode")), SECRET) as decode:
            watcher = follow_prefills(decode, etcd, cluster)
            try:
                wait_for(lambda: sorted(decode.prefills) == sorted(p.address for p in pre[:2]), "both prefills are added")
                batch = prompts(81, prefix=0, count=4)
                results = [f.result(timeout=60) for f in [decode.submit(t, NEW, return_kv=KV) for t in batch]]
                for res, tokens in zip(results, batch, strict=True):
                    assert_matches_reference(res, tokens, NEW)
                regs[0].close()
                wait_for(lambda: decode.prefills == [pre[1].address], "the deregistered prefill is dropped")
                regs.append(register_worker(pre[2], etcd, cluster))
                wait_for(lambda: pre[2].address in decode.prefills, "the registered prefill is added", 5.0)
                res = decode.generate(prompts(82)[0], NEW, timeout=60, return_kv=KV, prefill=pre[2].address)
                assert res.prefill == pre[2].address
                assert_matches_reference(res, prompts(82)[0], NEW)
                assert watcher.error == ""
            finally:
                watcher.close()
    finally:
        for r in regs[1:]:
            r.close()
        for p in pre:
            p.close()


def test_a_killed_prefill_process_expires_from_etcd(etcd_url: str) -> None:
    """``kvxfer serve prefill --etcd``: registered once listening; SIGKILLed, its key goes when its
    2 s lease runs out and a watcher reports it removed."""
    etcd = EtcdClient(etcd_url)
    cluster = f"k{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "KVXFER_SECRET": SECRET, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = WorkerProcess(["prefill", "--backend", "loopback", "--name", name("prefill"), "--etcd", etcd_url,
                          "--cluster", cluster, "--etcd-ttl", "2"], env, 60.0)
    removed: list[WorkerRecord] = []
    watcher = PeerWatcher(etcd, cluster, "prefill", lambda r: None, removed.append, interval_s=0.1)
    try:
        wait_for(lambda: [r.address for r in watcher.known.values()] == [proc.address], "the prefill registers")
        proc.kill()
        wait_for(lambda: [r.address for r in removed] == [proc.address], "its lease expires", 10.0)
        assert etcd.get_prefix(f"/kvxfer/{cluster}/") == {}
    finally:
        watcher.close()
        proc.stop()
    assert len(removed) == 1


def test_a_sigtermed_prefill_process_deregisters_at_once_and_exits_zero(etcd_url: str) -> None:
    """``kvxfer serve prefill --etcd`` with a 30 s lease gets SIGTERM: its key is gone long before the
    lease could run out (revoked as the drain starts), and the process exits 0."""
    etcd = EtcdClient(etcd_url)
    cluster = f"t{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "KVXFER_SECRET": SECRET, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = WorkerProcess(["prefill", "--backend", "loopback", "--name", name("prefill"), "--etcd", etcd_url,
                          "--cluster", cluster, "--etcd-ttl", "30"], env, 60.0)
    try:
        wait_for(lambda: len(etcd.get_prefix(f"/kvxfer/{cluster}/")) == 1, "the prefill registers")
        t0 = time.monotonic()
        proc.proc.terminate()
        wait_for(lambda: etcd.get_prefix(f"/kvxfer/{cluster}/") == {}, "its key goes", 10.0)
        assert time.monotonic() - t0 < 10.0
        assert proc.proc.wait(30) == 0, "".join(proc.stderr[-10:])
    finally:
        proc.stop()


def test_a_routing_decode_learns_event_endpoints_from_etcd(etcd_url: str) -> None:
    """``serve decode --etcd --kv-route``: the router follows the event endpoints prefills registered, so
    a prefix's later requests go to the prefill that computed it; a deregistered prefill leaves both."""
    etcd = EtcdClient(etcd_url)
    cluster = f"r{os.getpid()}-{time.monotonic_ns()}"
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with prefills_with_events(2, zctx) as workers:
            regs = [register_worker(w, etcd, cluster, events=ep, replay=rp) for w, ep, rp in workers]
            router = KVRouter({}, tokens_per_block=16, zmq_context=zctx)
            try:
                with DecodeWorker(WorkerConfig(name("decode")), SECRET, router=router) as decode:
                    watcher = follow_prefills(decode, etcd, cluster, router=router)
                    try:
                        wait_for(lambda: len(router.workers) == 2 and len(decode.prefills) == 2, "both are followed")
                        system = np.random.default_rng(3).integers(0, 512, 64)
                        first = decode.generate(np.concatenate([system, [1]]), NEW, timeout=60)
                        wait_for(lambda: router.cached_blocks(first.prefill) >= 4, "the prefix is announced")
                        tokens = np.concatenate([system, [2, 3]])
                        again = decode.generate(tokens, NEW, timeout=60, return_kv=KV)
                        assert again.prefill == first.prefill and again.reused_tokens_prefill == 64
                        assert_matches_reference(again, tokens, NEW)
                        gone = next(r for r, (w, _, _) in zip(regs, workers, strict=True) if w.address == first.prefill)
                        gone.close()
                        wait_for(lambda: first.prefill not in router.workers and first.prefill not in decode.prefills,
                                 "the deregistered prefill leaves the router and the decode")
                    finally:
                        watcher.close()
            finally:
                for r in regs:
                    r.close()
    finally:
        zctx.term()
