"""ucx backend specifics of the two-sided path (one-sided RMA off, ``rma=False``): scatter-gather messages
(one per transfer) against one message per run, the capability byte of the metadata, and large run
counts. The one-sided path: test_ucx_rma.py."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.errors import DecodeError, KvxferError, TransferFailed, TransferTimeout
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import available_backends, create
from kvxfer.transport.base import Transport
from kvxfer.transport.metadata import TransportMetadata
from tests.support.transport_helpers.pairs import connected_pair, drain_notifications
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


def _pair(sg_a: bool, sg_b: bool, sizes: list[int], seed: int
          ) -> tuple[Transport, Transport, list[npt.NDArray[np.uint8]], list[npt.NDArray[np.uint8]]]:
    n = next(_names)
    return connected_pair("ucx", (f"ua{n}", f"ub{n}"), (sizes, sizes), seed,
                          {"scatter_gather": sg_a, "rma": False}, {"scatter_gather": sg_b, "rma": False})


@pytest.mark.parametrize("modes", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["sg-sg", "runs-runs", "sg-runs", "runs-sg"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_fragmented_plans_exact_bytes_in_every_mode_pair(modes: tuple[bool, bool], op: str) -> None:
    """Either side may lack scatter-gather: the initiator falls back to one message per run."""
    a, b, a_bufs, b_bufs = _pair(*modes, [256 * 1024, 128 * 1024], seed=11)
    try:
        rng = np.random.default_rng(5)
        for i in range(3):
            src_side, dst_side = (a, b) if op == "write" else (b, a)
            src = random_pages(rng, list(src_side.regions), 40, PAGE, coalesced=False)
            dst = random_pages(rng, list(dst_side.regions), 40, PAGE, coalesced=False)
            plan = pair(src, dst)
            src_bufs, dst_bufs = (a_bufs, b_bufs) if op == "write" else (b_bufs, a_bufs)
            want = expected_after(plan, list(src_side.regions), src_bufs, list(dst_side.regions), dst_bufs)
            getattr(a, op)(b.name, plan, notify=b"n%d" % i).wait(10.0)
            for got, exp in zip(dst_bufs, want, strict=True):
                np.testing.assert_array_equal(got, exp)
        assert drain_notifications(b, 3) == [b"n0", b"n1", b"n2"]
    finally:
        a.close()
        b.close()


def test_scatter_gather_is_negotiated_from_the_capability_byte() -> None:
    a, b, _, _ = _pair(True, False, [64 * 1024], seed=3)
    try:
        assert TransportMetadata.decode(a.metadata()).backend_blob[0] == 1
        assert TransportMetadata.decode(b.metadata()).backend_blob[0] == 0
        assert a._peer_iov == {b.name: False} and b._peer_iov == {a.name: True}  # type: ignore[attr-defined]
    finally:
        a.close()
        b.close()


def test_malformed_blob_is_refused() -> None:
    t = create("ucx", "blobcheck")
    try:
        t.register(regions_of(make_buffers([PAGE], seed=1)))
        md = TransportMetadata("ucx", "other", (), b"\x07abc").encode()
        with pytest.raises(DecodeError, match="not a ucx one"):
            t.connect("other", md)
    finally:
        t.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_many_small_runs_in_one_scatter_message(op: str) -> None:
    """20,000 runs of 64 bytes in random order, exact bytes, in one message each way."""
    a, b, a_bufs, b_bufs = _pair(True, True, [4 << 20], seed=21)
    try:
        rng = np.random.default_rng(9)
        n, unit = 20_000, 64
        slots_a = rng.choice((4 << 20) // unit, n, replace=False).astype(np.uint64)
        slots_b = rng.choice((4 << 20) // unit, n, replace=False).astype(np.uint64)
        ta = PageTable(np.uint64(a.regions[0].base_address) + slots_a * np.uint64(unit),
                       np.full(n, unit, np.uint64), np.zeros(n, np.uint32))
        tb = PageTable(np.uint64(b.regions[0].base_address) + slots_b * np.uint64(unit),
                       np.full(n, unit, np.uint64), np.zeros(n, np.uint32))
        plan = TransferPlan(ta, tb) if op == "write" else TransferPlan(tb, ta)
        src_bufs, dst_bufs = (a_bufs, b_bufs) if op == "write" else (b_bufs, a_bufs)
        before = dst_bufs[0].copy()
        src_slots, dst_slots = (slots_a, slots_b) if op == "write" else (slots_b, slots_a)
        getattr(a, op)(b.name, plan).wait(20.0)
        want = before.reshape(-1, unit)
        want[dst_slots.astype(np.int64)] = src_bufs[0].reshape(-1, unit)[src_slots.astype(np.int64)]
        np.testing.assert_array_equal(dst_bufs[0].reshape(-1, unit), want)
    finally:
        a.close()
        b.close()


def test_cancelled_scatter_read_writes_nothing_even_when_the_data_comes_later() -> None:
    """A cancelled read withdraws its scatter-gather receive: data the peer sends afterwards (here: its
    service thread is held busy until after the cancel) never lands in the pages, and the peer keeps its
    unreceived send until UCX is done with it."""
    a, b, a_bufs, _ = _pair(True, True, [256 * 1024], seed=31)
    try:
        rng = np.random.default_rng(2)
        dst = random_pages(rng, list(a.regions), 48, PAGE, coalesced=False)
        src = random_pages(rng, list(b.regions), 48, PAGE, coalesced=False)
        before = a_bufs[0].copy()
        b._submit(lambda: time.sleep(0.5))  # type: ignore[attr-defined]
        handle = a.read(b.name, TransferPlan(src, dst), notify=b"never")
        time.sleep(0.05)
        assert handle.cancel() is True
        time.sleep(1.0)  # b answers the read and sends, into a withdrawn receive
        np.testing.assert_array_equal(a_bufs[0], before)
        assert a._draining == []  # type: ignore[attr-defined]
        # b's send of the aborted read is never received: b keeps it (and its iov array) until UCX is done.
        assert b._call(lambda: [len(x.requests) for x in b._draining], "draining") == [1]  # type: ignore[attr-defined]
        assert drain_notifications(b, 0, timeout=0.1) == []
    finally:
        a.close()
        b.close()


def test_a_write_cancelled_while_its_sends_are_in_flight_keeps_them_until_ucx_is_done() -> None:
    """A peer answers a write but never receives its data (its receives are not posted), so the write's
    scatter-gather send stays in flight inside UCX. Cancelling the write cannot withdraw a send: the send
    and its iov array (which UCX reads) are kept until UCX is done, never dropped with the transfer (that
    crashed the service thread in ``progress``). A later write between the two lands exactly."""
    from kvxfer.transport.ucx import _Batch
    a, b, a_bufs, b_bufs = _pair(True, True, [1 << 20, 1 << 20], seed=41)
    post_receives = b._post_receives  # type: ignore[attr-defined]
    try:
        rng = np.random.default_rng(4)
        plan = pair(random_pages(rng, list(a.regions), 40, 8 * PAGE, coalesced=False),
                    random_pages(rng, list(b.regions), 40, 8 * PAGE, coalesced=False))
        b._post_receives = lambda table, tag_base, iov: _Batch()  # type: ignore[attr-defined]
        handle = a.write(b.name, plan, notify=b"dropped")
        deadline = time.monotonic() + 5.0
        while a._call(lambda: a._outgoing[handle.id].stage, "stage") != "sending":  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the write never started sending"
            time.sleep(0.001)
        assert handle.cancel() is True
        kept = a._call(lambda: [len(batch.requests) for batch in a._draining], "draining")  # type: ignore[attr-defined]
        assert kept == [1], f"the cancelled write's in-flight send was not kept: {kept}"
        b._post_receives = post_receives  # type: ignore[attr-defined]
        again = pair(random_pages(rng, list(a.regions), 40, PAGE, coalesced=False),
                     random_pages(rng, list(b.regions), 40, PAGE, coalesced=False))
        want = expected_after(again, list(a.regions), [x.copy() for x in a_bufs], list(b.regions),
                              [x.copy() for x in b_bufs])
        a.write(b.name, again, notify=b"again").wait(10.0)
        assert drain_notifications(b, 1) == [b"again"]
        assert all(np.array_equal(x, y) for x, y in zip(b_bufs, want, strict=True))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_requests_from_a_peer_this_transport_did_not_connect_are_dropped(op: str) -> None:
    """c knows b's metadata but b never connected c: b neither lets c write its pages nor sends c its
    pages, and delivers no notification; c's transfer times out (nothing hangs)."""
    a, b, _, b_bufs = _pair(True, True, [256 * 1024], seed=51)
    c_bufs = make_buffers([256 * 1024], 52)
    c = create("ucx", f"uc{next(_names)}", rma=False)
    c.register(regions_of(c_bufs))
    c.connect(b.name, b.metadata())
    try:
        rng = np.random.default_rng(6)
        mine = random_pages(rng, list(c.regions), 40, PAGE, coalesced=False)
        theirs = random_pages(rng, list(b.regions), 40, PAGE, coalesced=False)
        b_before, c_before = b_bufs[0].copy(), c_bufs[0].copy()
        handle = c.write(b.name, pair(mine, theirs), notify=b"x") if op == "write" else \
            c.read(b.name, pair(theirs, mine), notify=b"x")
        with pytest.raises(TransferTimeout):
            handle.wait(1.0)
        np.testing.assert_array_equal(b_bufs[0], b_before)
        np.testing.assert_array_equal(c_bufs[0], c_before)
        assert drain_notifications(b, 0, timeout=0.1) == []
        # b's own connected peer is served as before.
        plan = pair(random_pages(rng, list(a.regions), 40, PAGE, coalesced=False), theirs)
        a.write(b.name, plan, notify=b"ok").wait(10.0)
        assert drain_notifications(b, 1) == [b"ok"]
    finally:
        handle.cancel()
        c.close()
        a.close()
        b.close()


def test_disconnecting_a_peer_ends_its_transfers_into_this_side() -> None:
    """b starts a write into a but never sends its data; a disconnects b: a's receive for it is withdrawn
    and nothing of b's transfer stays behind (b's later messages would be dropped, so it could never
    commit); a's pages are untouched."""
    from kvxfer.transport.ucx import _Batch
    a, b, a_bufs, _ = _pair(True, True, [256 * 1024], seed=61)
    try:
        rng = np.random.default_rng(7)
        plan = pair(random_pages(rng, list(b.regions), 40, PAGE, coalesced=False),
                    random_pages(rng, list(a.regions), 40, PAGE, coalesced=False))
        b._post_sends = lambda ep, table, tag_base, iov: _Batch()  # type: ignore[attr-defined]
        before = a_bufs[0].copy()
        handle = b.write(a.name, plan, notify=b"never")
        deadline = time.monotonic() + 5.0
        while not a._call(lambda: len(a._incoming), "incoming"):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "a never saw the write request"
            time.sleep(0.001)
        a.disconnect(b.name)
        assert a._call(lambda: (len(a._incoming), len(a._draining)), "state") == (0, 0)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(a_bufs[0], before)
        assert drain_notifications(a, 0, timeout=0.1) == []
        handle.cancel()
    finally:
        a.close()
        b.close()


def test_a_peers_transfers_in_flight_here_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """b holds at most ``MAX_INCOMING_PER_PEER`` of a's transfers in flight (here 2, whose data a never
    sends): a's next request is refused with the reason; closing a ends the two it holds."""
    from kvxfer.transport import ucx as ucx_module
    from kvxfer.transport.ucx import _Batch
    monkeypatch.setattr(ucx_module, "MAX_INCOMING_PER_PEER", 2)
    a, b, _, b_bufs = _pair(True, True, [256 * 1024], seed=71)
    try:
        rng = np.random.default_rng(8)
        a._post_sends = lambda ep, table, tag_base, iov: _Batch()  # type: ignore[attr-defined]
        before = b_bufs[0].copy()

        def write() -> Any:
            return a.write(b.name, pair(random_pages(rng, list(a.regions), 40, PAGE, coalesced=False),
                                        random_pages(rng, list(b.regions), 40, PAGE, coalesced=False)))
        held = [write(), write()]
        deadline = time.monotonic() + 5.0
        while b._call(lambda: len(b._incoming), "incoming") < 2:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "b never took the first two writes"
            time.sleep(0.001)
        with pytest.raises(TransferFailed, match="2 transfers in flight here already"):
            write().wait(5.0)
        np.testing.assert_array_equal(b_bufs[0], before)
        a.close()
        for h in held:   # failed at once (their peer disconnected by the close), not left pending
            with pytest.raises(KvxferError, match=r"disconnected|closed"):
                h.wait(1.0)
    finally:
        a.close()
        b.close()


def test_a_request_reusing_a_transfer_id_in_flight_is_refused() -> None:
    """A second request under the id of a's transfer still in flight at b is refused; the first keeps its
    posted receive (replacing it would drop a request UCX still works on)."""
    a, b, _, _ = _pair(True, True, [256 * 1024], seed=81)
    try:
        rng = np.random.default_rng(9)
        runs = random_pages(rng, list(b.regions), 40, PAGE, coalesced=False)
        msg = {"k": "wreq", "id": 7, "from": a.name, "addr": a._address, "notify": None, "iov": True,  # type: ignore[attr-defined]
               "runs": [runs.addr.tobytes(), runs.nbytes.tobytes(), runs.region.tobytes()]}

        def twice() -> tuple[Any, Any]:
            b._on_control(dict(msg))  # type: ignore[attr-defined]
            first = b._incoming[(a.name, 7)].batch  # type: ignore[attr-defined]
            b._on_control(dict(msg))  # type: ignore[attr-defined]
            return first, b._incoming[(a.name, 7)].batch  # type: ignore[attr-defined]
        first, kept = b._call(twice, "requests")  # type: ignore[attr-defined]
        assert kept is first and len(first.requests) == 1
    finally:
        a.close()
        b.close()
