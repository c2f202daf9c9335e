"""ucx backend, one-sided path: puts and gets through UCP RMA on ucxx's handles (``ucp_rma.py``).

Exact bytes both ways (with and without peer-failure handling, i.e. over tcp and over shared
memory/CMA), the target's service thread never asked, keys negotiated through the metadata blob
(a peer without them is served two-sided), refused out-of-bounds runs, a stalled peer (timeout, no
hang), a peer killed mid-transfer (a clear error), and processes that exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.errors import DecodeError, PageTableError, PeerUnreachable, TransferTimeout, TransportError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import available_backends, create
from kvxfer.transport.base import Transport
from kvxfer.transport.metadata import TransportMetadata
from tests.support.transport_helpers.pairs import connected_pair, drain_notifications
from tests.support.transport_helpers.peer import RemotePeer
from tests.support.transport_helpers.plans import (
    PAGE,
    expected_after,
    make_buffers,
    pair,
    random_pages,
    regions_of,
)

REASON = available_backends()["ucx"]
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
_names = iter(range(1_000_000))
SIZES = [256 * 1024, 192 * 1024]


def _pair(seed: int, a_opts: dict[str, Any] | None = None, b_opts: dict[str, Any] | None = None
          ) -> tuple[Transport, Transport, list[npt.NDArray[np.uint8]], list[npt.NDArray[np.uint8]]]:
    n = next(_names)
    return connected_pair("ucx", (f"ra{n}", f"rb{n}"), (SIZES, SIZES[::-1]), seed, a_opts, b_opts)


def _requests_seen(t: Transport) -> list[str]:
    """Record the transfer requests ``t``'s service thread is asked to serve (two-sided path only)."""
    seen: list[str] = []
    on_request = t._on_request  # type: ignore[attr-defined]

    def spy(kind: str, *args: Any) -> None:
        seen.append(kind)
        on_request(kind, *args)
    t._on_request = spy  # type: ignore[attr-defined]
    return seen


@pytest.mark.parametrize("error_handling", [True, False], ids=["peer-failure-handling", "no-handling"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("runs", [1, 70])
def test_one_sided_transfers_move_exact_bytes(op: str, error_handling: bool, runs: int) -> None:
    """Scattered pages over two regions a side land exactly, notifications once each, in order; the
    target's service thread is never asked to serve a request (the runs moved one-sidedly)."""
    opts = {"error_handling": error_handling}
    a, b, a_bufs, b_bufs = _pair(11, opts, opts)
    seen = _requests_seen(b)
    try:
        assert a.rma_unavailable_reason is None  # type: ignore[attr-defined]
        rng = np.random.default_rng(5)
        for i in range(3):
            src_side, dst_side = (a, b) if op == "write" else (b, a)
            src = random_pages(rng, list(src_side.regions), runs, PAGE, coalesced=False)
            dst = random_pages(rng, list(dst_side.regions), runs, PAGE, coalesced=False)
            plan = pair(src, dst)
            src_bufs, dst_bufs = (a_bufs, b_bufs) if op == "write" else (b_bufs, a_bufs)
            untouched = [x.copy() for x in src_bufs]
            want = expected_after(plan, list(src_side.regions), src_bufs, list(dst_side.regions), dst_bufs)
            getattr(a, op)(b.name, plan, notify=b"n%d" % i).wait(10.0)
            assert all(np.array_equal(g, w) for g, w in zip(dst_bufs, want, strict=True))
            assert all(np.array_equal(g, w) for g, w in zip(src_bufs, untouched, strict=True))
        assert drain_notifications(b, 3) == [b"n0", b"n1", b"n2"]
        assert seen == []
    finally:
        a.close()
        b.close()


def test_empty_one_sided_plan_completes_and_notifies() -> None:
    a, b, _, _ = _pair(13)
    try:
        empty = PageTable(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint32))
        a.write(b.name, TransferPlan(empty, empty), notify=b"e").wait(5.0)
        assert drain_notifications(b, 1) == [b"e"]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_side_without_rma_is_served_two_sided(side: str) -> None:
    """Either side turning one-sided transfers off (or a peer whose blob has no keys) keeps the pair on
    the two-sided protocol, exact bytes both ways."""
    a, b, a_bufs, b_bufs = _pair(17, {"rma": side != "a"}, {"rma": side != "b"})
    seen = _requests_seen(b)
    try:
        flags = TransportMetadata.decode((a if side == "a" else b).metadata()).backend_blob[0]
        assert flags & 2 == 0
        rng = np.random.default_rng(7)
        for op in ("write", "read"):
            src_side, dst_side = (a, b) if op == "write" else (b, a)
            plan = pair(random_pages(rng, list(src_side.regions), 40, PAGE, coalesced=False),
                        random_pages(rng, list(dst_side.regions), 40, PAGE, coalesced=False))
            src_bufs, dst_bufs = (a_bufs, b_bufs) if op == "write" else (b_bufs, a_bufs)
            want = expected_after(plan, list(src_side.regions), src_bufs, list(dst_side.regions), dst_bufs)
            getattr(a, op)(b.name, plan, notify=op.encode()).wait(10.0)
            assert all(np.array_equal(g, w) for g, w in zip(dst_bufs, want, strict=True))
        assert seen == ["wreq", "rreq"]
        assert drain_notifications(b, 2) == [b"write", b"read"]
    finally:
        a.close()
        b.close()


def test_the_blob_carries_one_key_per_region_with_its_extent_and_a_bad_one_is_refused() -> None:
    t = create("ucx", f"rk{next(_names)}")
    try:
        t.register(regions_of(make_buffers([PAGE, 2 * PAGE], seed=1)))
        blob = TransportMetadata.decode(t.metadata()).backend_blob
        assert blob[0] & 2 and int.from_bytes(blob[1:5], "little") == 2
        first = t.regions[0]   # the first key's extent: the region it was mapped for
        assert int.from_bytes(blob[5:13], "little") == first.base_address
        assert int.from_bytes(blob[13:21], "little") == first.nbytes
        regions = t.regions
        extent = (0).to_bytes(8, "little") * 2
        for bad, why in ((b"\x02" + (1 << 13).to_bytes(4, "little") + b"addr", "remote keys \\(at most"),
                         (b"\x02" + (2).to_bytes(4, "little") + extent + (1 << 20).to_bytes(4, "little"),
                          "remote key of"),
                         (b"\x02" + (2).to_bytes(4, "little") + b"\x00" * 10, "truncated key extent"),
                         (b"\x02\x02\x00", "truncated key count")):
            md = TransportMetadata("ucx", "other", regions, bad).encode()
            with pytest.raises(DecodeError, match=why):
                t.connect("other", md)
    finally:
        t.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_run_outside_the_regions_is_refused_and_nothing_moves(op: str) -> None:
    """One run crossing the end of the peer's last region (and, reading, of this side's): refused before
    UCX is asked, naming the side; neither side's bytes change and no notification follows."""
    a, b, a_bufs, b_bufs = _pair(19)
    try:
        before_a, before_b = [x.copy() for x in a_bufs], [x.copy() for x in b_bufs]
        last = b.regions[-1]
        good = PageTable(np.array([a.regions[0].base_address, a.regions[0].base_address + 4 * PAGE], np.uint64),
                         np.array([PAGE, PAGE], np.uint64), np.zeros(2, np.uint32))
        over = PageTable(np.array([b.regions[0].base_address, last.end_address - PAGE // 2], np.uint64),
                         np.array([PAGE, PAGE], np.uint64), np.array([0, len(b.regions) - 1], np.uint32))
        if op == "write":
            with pytest.raises(PageTableError, match="remote destination"):
                a.write(b.name, TransferPlan(good, over), notify=b"x")
        else:
            with pytest.raises(PageTableError, match="remote source"):
                a.read(b.name, TransferPlan(over, good), notify=b"x")
            local_over = PageTable(np.array([a.regions[1].end_address - 8], np.uint64), np.array([PAGE], np.uint64),
                                   np.array([1], np.uint32))
            with pytest.raises(PageTableError, match="local destination"):
                a.read(b.name, TransferPlan(PageTable(over.addr[:1], over.nbytes[:1], over.region[:1]), local_over))
        assert all(np.array_equal(g, w) for g, w in zip(a_bufs, before_a, strict=True))
        assert all(np.array_equal(g, w) for g, w in zip(b_bufs, before_b, strict=True))
        assert drain_notifications(b, 0, timeout=0.1) == []
    finally:
        a.close()
        b.close()


def test_a_disconnected_peer_is_refused_and_a_cancel_is_too_late() -> None:
    a, b, _, _ = _pair(23)
    try:
        rng = np.random.default_rng(3)
        plan = pair(random_pages(rng, list(a.regions), 8, PAGE, coalesced=False),
                    random_pages(rng, list(b.regions), 8, PAGE, coalesced=False))
        h = a.write(b.name, plan, notify=b"c")
        assert h.cancel() is False   # posted runs cannot be withdrawn: it completes normally
        h.wait(5.0)
        assert drain_notifications(b, 1) == [b"c"]
        a.disconnect(b.name)
        with pytest.raises(PeerUnreachable):
            a.write(b.name, plan)
    finally:
        a.close()
        b.close()


# --- across processes --------------------------------------------------------------------------------
def _Remote(seed: int, options: dict[str, Any], sizes: list[int]) -> RemotePeer:
    """A ucx transport in a spawned process and one here, both with ``options``, over ``sizes``."""
    return RemotePeer("ucx", seed, sizes, sizes, options)


@pytest.mark.parametrize("error_handling", [True, False], ids=["peer-failure-handling", "no-handling"])
def test_cross_process_exact_bytes_and_the_peer_exits_0(error_handling: bool) -> None:
    r = _Remote(41, {"error_handling": error_handling}, SIZES)
    try:
        rng = np.random.default_rng(8)
        peer_regions = list(r.local.peer_regions(r.name))
        for op in ("write", "read"):
            remote_before, local_before = r.remote_bytes(), [b.copy() for b in r.bufs]
            if op == "write":
                plan = pair(random_pages(rng, list(r.local.regions), 60, PAGE, coalesced=False),
                            random_pages(rng, peer_regions, 60, PAGE, coalesced=False))
                want_remote = expected_after(plan, list(r.local.regions), local_before, peer_regions, remote_before)
                want_local = local_before
            else:
                plan = pair(random_pages(rng, peer_regions, 60, PAGE, coalesced=False),
                            random_pages(rng, list(r.local.regions), 60, PAGE, coalesced=False))
                want_local = expected_after(plan, peer_regions, remote_before, list(r.local.regions), local_before)
                want_remote = remote_before
            getattr(r.local, op)(r.name, plan, notify=op.encode()).wait(10.0)
            assert all(np.array_equal(g, w) for g, w in zip(r.bufs, want_local, strict=True))
            assert all(np.array_equal(g, w) for g, w in zip(r.remote_bytes(), want_remote, strict=True))
            assert r.call("notifications", 1, 5.0) == {r.local.name: [op.encode()]}
    finally:
        status = r.close()
    assert status == 0


def test_cross_process_stalled_peer_times_out_then_a_killed_one_fails_clearly() -> None:
    """With peer-failure handling UCX moves the runs over tcp with the peer's help: a stopped peer leaves
    the write pending, ``wait`` raises TransferTimeout on time (no hang); killing the peer then fails the
    same write with PeerUnreachable naming the transfer, promptly, and a later write fails the same way."""
    big = [32 << 20]
    r = _Remote(43, {"error_handling": True}, big)
    try:
        rng = np.random.default_rng(9)
        plan = pair(random_pages(rng, list(r.local.regions), 512, 16 * PAGE, coalesced=False),
                    random_pages(rng, list(r.local.peer_regions(r.name)), 512, 16 * PAGE, coalesced=False))
        pid = r.proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        h = r.local.write(r.name, plan, notify=b"lost")
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"transfer {h.id}"):
            h.wait(0.5)
        assert 0.45 <= time.monotonic() - t0 < 2.0
        r.proc.kill()
        r.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match=f"transfer {h.id}"):
            h.wait(10.0)
        h2 = r.local.write(r.name, plan)
        with pytest.raises(TransportError, match=f"transfer {h2.id}"):
            h2.wait(10.0)
        assert time.monotonic() - t0 < 10.0
    finally:
        r.close()


_SCRIPT = """
import multiprocessing as mp, numpy as np, sys
from tests.transport.test_ucx_rma import _Remote, SIZES
from tests.support.transport_helpers.plans import PAGE, pair, random_pages
if __name__ == "__main__":
    r = _Remote(47, {"error_handling": sys.argv[1] == "1"}, SIZES)
    rng = np.random.default_rng(1)
    plan = pair(random_pages(rng, list(r.local.regions), 30, PAGE, coalesced=False),
                random_pages(rng, list(r.local.peer_regions(r.name)), 30, PAGE, coalesced=False))
    for _ in range(5):
        r.local.write(r.name, plan, notify=b"w").wait(10.0)
        r.local.read(r.name, pair(plan.dst, plan.src)).wait(10.0)
    sys.exit(0 if r.close() == 0 else 3)
"""


@pytest.mark.parametrize("error_handling", ["1", "0"], ids=["peer-failure-handling", "no-handling"])
def test_both_processes_exit_0_after_one_sided_transfers(error_handling: str) -> None:
    """Keys destroyed and memory unmapped at close, then interpreter exit: no crash in either process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, error_handling], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
