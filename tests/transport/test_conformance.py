"""Transport conformance suite: every backend, in one process and across two processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import PageTableError, PeerUnreachable, TransferCancelled, TransferTimeout, TransportError
from kvxfer.pagetable import BlockPlan, PageTable, PhasedPlan, TransferPlan
from kvxfer.transport import TransferStatus, Transport, available_backends, create
from tests.support.transport_helpers.peer import RemotePeer, table_wire
from tests.support.transport_helpers.plans import (
    PAGE,
    expected_after,
    expected_after_blocks,
    make_buffers,
    pair,
    random_block_plan,
    random_pages,
    regions_of,
)

AVAILABLE = available_backends()
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(AVAILABLE[b] is not None, reason=str(AVAILABLE[b])))
            for b in ("loopback", "nixl", "ucx")]
REMOTE_BACKENDS = [p for p in BACKENDS if p.values[0] != "loopback"]
SIZES_A = [256 * 1024, 192 * 1024]
SIZES_B = [128 * 1024, 320 * 1024]
_names = iter(range(1_000_000))


def drain(t: Transport, want: int, timeout: float = 5.0, settle: float = 0.05) -> dict[str, list[bytes]]:
    """Notifications until ``want`` arrived (or timeout), then a short settle to catch duplicates."""
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + timeout
    while sum(map(len, got.values())) < want and time.monotonic() < deadline:
        for k, v in t.notifications().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.002)
    time.sleep(settle)
    for k, v in t.notifications().items():
        got.setdefault(k, []).extend(v)
    return got


class Pair:
    """Two connected transports of one backend in this process, each over two seeded host regions."""

    def __init__(self, backend: str, seed: int) -> None:
        n = next(_names)
        self.a_bufs, self.b_bufs = make_buffers(SIZES_A, seed), make_buffers(SIZES_B, seed + 1)
        self.a, self.b = create(backend, f"a{n}"), create(backend, f"b{n}")
        self.a.register(regions_of(self.a_bufs))
        self.b.register(regions_of(self.b_bufs))
        self.a.connect(self.b.name, self.b.metadata())
        self.b.connect(self.a.name, self.a.metadata())

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=BACKENDS)
def pair_of(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param, seed=7)
    yield p
    p.close()


def make_plan(rng: np.random.Generator, src_regions: Any, dst_regions: Any, pages: int,
              coalesced: bool) -> TransferPlan:
    src = random_pages(rng, list(src_regions), pages, PAGE, coalesced)
    dst = random_pages(rng, list(dst_regions), pages, PAGE, coalesced)
    return pair(src, dst)


# --- one process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "fragmented"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_random_plans_move_exact_bytes(pair_of: Pair, op: str, coalesced: bool) -> None:
    p = pair_of
    rng = np.random.default_rng(11)
    for round_no in range(3):
        if op == "write":
            plan = make_plan(rng, p.a.regions, p.b.regions, 60, coalesced)
            want_b = expected_after(plan, list(p.a.regions), p.a_bufs, list(p.b.regions), p.b_bufs)
            want_a = [x.copy() for x in p.a_bufs]
        else:
            plan = make_plan(rng, p.b.regions, p.a.regions, 60, coalesced)
            want_a = expected_after(plan, list(p.b.regions), p.b_bufs, list(p.a.regions), p.a_bufs)
            want_b = [x.copy() for x in p.b_bufs]
        assert (len(plan) < 60) if coalesced else (len(plan) == 60)
        handle = getattr(p.a, op)(p.b.name, plan, notify=b"n%d" % round_no)
        handle.wait(10.0)
        assert handle.status is TransferStatus.DONE and handle.nbytes == 60 * PAGE
        for got, want in zip(p.a_bufs + p.b_bufs, want_a + want_b, strict=True):
            assert np.array_equal(got, want)
        assert drain(p.b, 1) == {p.a.name: [b"n%d" % round_no]}
        assert p.a.notifications() == {}


@pytest.mark.parametrize("op", ["write", "read"])
def test_block_plans_move_exact_bytes(pair_of: Pair, op: str) -> None:
    """A BlockPlan (template over both regions of each side, random slot pairs) moves exactly the runs its
    definition names (expected bytes computed run by run, not through ``expand``), then notifies."""
    p = pair_of
    rng = np.random.default_rng(17)
    for round_no in range(2):
        if op == "write":
            plan = random_block_plan(rng, list(p.a.regions), list(p.b.regions), 12, 4, 1024)
            want_b = expected_after_blocks(plan, list(p.a.regions), p.a_bufs, list(p.b.regions), p.b_bufs)
            want_a = [x.copy() for x in p.a_bufs]
        else:
            plan = random_block_plan(rng, list(p.b.regions), list(p.a.regions), 12, 4, 1024)
            want_a = expected_after_blocks(plan, list(p.b.regions), p.b_bufs, list(p.a.regions), p.a_bufs)
            want_b = [x.copy() for x in p.b_bufs]
        handle = getattr(p.a, op)(p.b.name, plan, notify=b"blocks%d" % round_no)
        handle.wait(10.0)
        assert handle.status is TransferStatus.DONE and handle.nbytes == 12 * 4 * 1024
        for got, want in zip(p.a_bufs + p.b_bufs, want_a + want_b, strict=True):
            assert np.array_equal(got, want)
        assert drain(p.b, 1) == {p.a.name: [b"blocks%d" % round_no]}


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_hostile_block_plan_is_refused_naming_the_side(pair_of: Pair, op: str) -> None:
    """A block past the peer's region, or two blocks on one destination slot: PageTableError naming the
    side (local/remote) and the run, nothing written, no notification."""
    p = pair_of
    before = [x.copy() for x in p.a_bufs + p.b_bufs]
    rng = np.random.default_rng(5)
    src_regions, dst_regions = (list(p.a.regions), list(p.b.regions)) if op == "write" else \
        (list(p.b.regions), list(p.a.regions))
    good = random_block_plan(rng, src_regions, dst_regions, 6, 2, 1024)
    far = good.src_slots.copy() if op == "read" else good.dst_slots.copy()
    far[3] = 10_000   # far past the remote side's regions
    twice = good.dst_slots.copy()
    twice[4] = twice[1]
    fields = [good.src_step, good.src_offset, good.dst_step, good.dst_offset, good.nbytes, good.src_region,
              good.dst_region]
    past = BlockPlan(good.src_slots, far, *fields) if op == "write" else BlockPlan(far, good.dst_slots, *fields)
    for plan, words in ((past, r"remote .*block 3.*outside region"),
                        (BlockPlan(good.src_slots, twice, *fields), ("remote" if op == "write" else "local") + " .*overlap")):
        with pytest.raises(PageTableError, match=words):
            getattr(p.a, op)(p.b.name, plan, notify=b"never")
    assert drain(p.b, 1, timeout=0.1) == {}
    for got, want in zip(p.a_bufs + p.b_bufs, before, strict=True):
        assert np.array_equal(got, want)


def _two_phases(rng: np.random.Generator, src_regions: list[Any], dst_regions: list[Any]) -> PhasedPlan:
    """Two BlockPlans of different templates over both regions of each side, the second's destination slots
    none of the first's: one transfer's phases."""
    a = random_block_plan(rng, src_regions, dst_regions, 6, 4, 1024)
    b = random_block_plan(rng, src_regions, dst_regions, 5, 4, 1024)
    slots = min(r.nbytes for r in dst_regions) // int(a.dst_step[0])   # every region holds this many slots
    free = np.setdiff1d(np.arange(slots, dtype=np.uint64), a.dst_slots)
    b = BlockPlan(b.src_slots, rng.choice(free, 5, replace=False).astype(np.uint64), b.src_step, b.src_offset,
                  b.dst_step, b.dst_offset, b.nbytes, b.src_region, b.dst_region)
    return PhasedPlan((a, b))


@pytest.mark.parametrize("op", ["write", "read"])
def test_phased_plans_move_exact_bytes_and_refuse_a_byte_written_twice(pair_of: Pair, op: str) -> None:
    """A PhasedPlan (two BlockPlans, one transfer) moves exactly both phases' runs (computed run by run) and
    notifies once; one whose second phase writes a destination slot of the first (each phase fine on its
    own) is refused naming the side and the overlap, nothing written, no notification."""
    p = pair_of
    rng = np.random.default_rng(23)
    src_t, dst_t = (p.a, p.b) if op == "write" else (p.b, p.a)
    src_bufs, dst_bufs = (p.a_bufs, p.b_bufs) if op == "write" else (p.b_bufs, p.a_bufs)
    plan = _two_phases(rng, list(src_t.regions), list(dst_t.regions))
    want = list(dst_bufs)
    for phase in plan.phases:
        want = expected_after_blocks(phase, list(src_t.regions), src_bufs, list(dst_t.regions), want)
    getattr(p.a, op)(p.b.name, plan, notify=b"phases").wait(10.0)
    assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
    assert drain(p.b, 1) == {p.a.name: [b"phases"]}
    first, second = plan.phases
    clash = BlockPlan(second.src_slots, np.concatenate([first.dst_slots[:1], second.dst_slots[1:]]),
                      first.src_step, first.src_offset, first.dst_step, first.dst_offset, first.nbytes,
                      first.src_region, first.dst_region)
    before = [x.copy() for x in p.a_bufs + p.b_bufs]
    with pytest.raises(PageTableError, match=("remote" if op == "write" else "local") + " .*overlap"):
        getattr(p.a, op)(p.b.name, PhasedPlan((first, clash)), notify=b"never")
    assert drain(p.b, 1, timeout=0.1) == {}
    assert all(np.array_equal(got, w) for got, w in zip(p.a_bufs + p.b_bufs, before, strict=True))


def _first_local_page(p: Pair) -> PageTable:
    a0 = p.a.regions[0]
    return PageTable(np.array([a0.base_address], np.uint64), np.array([PAGE], np.uint64), np.array([0], np.uint32))


def _page_past_the_peer(p: Pair) -> PageTable:
    """One page of the peer's region 1 that runs one byte past its end."""
    b1 = p.b.regions[1]
    return PageTable(np.array([b1.end_address - PAGE + 1], np.uint64), np.array([PAGE], np.uint64),
                     np.array([1], np.uint32))


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a prepared post checked or expanded its plan again")


@pytest.mark.parametrize("kind", ["runs", "blocks"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_a_prepared_plan_moves_the_bytes_of_each_post(pair_of: Pair, op: str, kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare`` once, then three posts with the source rewritten before each: every post lands the bytes
    the source holds at that post, exactly where the plan's definition says (expected run by run), then
    notifies. The transport checks the plan at ``prepare`` only: posts run with its checks made to raise
    (loopback's simulated peer still checks against its real registration, as a NIC does), and a BlockPlan
    that the backend cannot move as such is expanded at most once (at prepare or the first post)."""
    p = pair_of
    rng = np.random.default_rng(23)
    (src_t, src_bufs), (dst_t, dst_bufs) = ((p.a, p.a_bufs), (p.b, p.b_bufs)) if op == "write" else \
        ((p.b, p.b_bufs), (p.a, p.a_bufs))
    plan: TransferPlan | BlockPlan = make_plan(rng, src_t.regions, dst_t.regions, 40, False) if kind == "runs" else \
        random_block_plan(rng, list(src_t.regions), list(dst_t.regions), 10, 3, 1024)
    prepared = p.a.prepare(op, p.b.name, plan)
    assert (prepared.op, prepared.peer, prepared.nbytes) == (op, p.b.name, plan.total_bytes)
    monkeypatch.setattr(Transport, "_check_plan", _refuse)
    monkeypatch.setattr(Transport, "_check_block_plan", _refuse)
    expand = BlockPlan.expand
    expansions: list[int] = []
    monkeypatch.setattr(BlockPlan, "expand", lambda self: expansions.append(1) or expand(self))
    for round_no in range(3):
        for buf in src_bufs:
            buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
        untouched = [x.copy() for x in src_bufs]
        if isinstance(plan, BlockPlan):
            want = expected_after_blocks(plan, list(src_t.regions), src_bufs, list(dst_t.regions), dst_bufs)
        else:
            want = expected_after(plan, list(src_t.regions), src_bufs, list(dst_t.regions), dst_bufs)
        handle = prepared.post(notify=b"prepared%d" % round_no)
        handle.wait(10.0)
        assert handle.status is TransferStatus.DONE and handle.nbytes == plan.total_bytes
        for got, w in zip(dst_bufs + src_bufs, want + untouched, strict=True):
            assert np.array_equal(got, w)
        assert drain(p.b, 1) == {p.a.name: [b"prepared%d" % round_no]}
    assert len(expansions) <= (1 if kind == "blocks" else 0)   # at the first post, or at prepare (nixl)


def test_a_bad_plan_is_refused_at_prepare_naming_what_is_wrong(pair_of: Pair) -> None:
    """The same refusals as ``write``/``read`` (side, region, overlap), made by ``prepare``; and a bad op, an
    unknown peer or no plan at all. Nothing is written, nothing notified."""
    p = pair_of
    before = [x.copy() for x in p.a_bufs + p.b_bufs]
    local, past_end = _first_local_page(p), _page_past_the_peer(p)
    with pytest.raises(PageTableError, match="remote"):
        p.a.prepare("write", p.b.name, TransferPlan(local, past_end))
    with pytest.raises(PageTableError, match="remote"):
        p.a.prepare("read", p.b.name, TransferPlan(past_end, local))
    good = random_block_plan(np.random.default_rng(3), list(p.a.regions), list(p.b.regions), 6, 2, 1024)
    twice = good.dst_slots.copy()
    twice[4] = twice[1]
    with pytest.raises(PageTableError, match=r"remote .*overlap"):
        p.a.prepare("write", p.b.name, BlockPlan(good.src_slots, twice, good.src_step, good.src_offset, good.dst_step,
                                                 good.dst_offset, good.nbytes, good.src_region, good.dst_region))
    with pytest.raises(TransportError, match="op must be 'write' or 'read'"):
        p.a.prepare("copy", p.b.name, good)  # type: ignore[arg-type]
    with pytest.raises(PeerUnreachable, match="'nobody' is not connected"):
        p.a.prepare("write", "nobody", good)
    with pytest.raises(PageTableError, match="expected a TransferPlan, BlockPlan or PhasedPlan"):
        p.a.prepare("write", p.b.name, [1, 2, 3])  # type: ignore[arg-type]
    assert drain(p.b, 1, timeout=0.1) == {}
    for got, want in zip(p.a_bufs + p.b_bufs, before, strict=True):
        assert np.array_equal(got, want)


def test_a_prepared_transfer_is_bound_to_its_connection(pair_of: Pair) -> None:
    """A post after the peer was disconnected, or reconnected (its regions may have changed), after
    ``release`` (also by ``with``), or after ``close`` is refused naming why, and moves nothing; bad
    arguments to ``post`` are refused as ``write``'s; the plan prepared again works."""
    p = pair_of
    plan = make_plan(np.random.default_rng(29), p.a.regions, p.b.regions, 8, False)
    before = [x.copy() for x in p.b_bufs]
    prepared = p.a.prepare("write", p.b.name, plan)
    with pytest.raises(TransportError, match="notify must be bytes"):
        prepared.post(notify="text")  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="settled applies to writes only"):
        p.a.prepare("read", p.b.name, TransferPlan(plan.dst, plan.src)).post(settled=True)
    p.a.disconnect(p.b.name)
    with pytest.raises(PeerUnreachable, match="is not connected since this write was prepared"):
        prepared.post()
    p.a.connect(p.b.name, p.b.metadata())
    with pytest.raises(PeerUnreachable, match="reconnected"):
        prepared.post()
    assert all(np.array_equal(got, want) for got, want in zip(p.b_bufs, before, strict=True))
    with p.a.prepare("write", p.b.name, plan) as again:
        again.post(notify=b"again").wait(10.0)
    assert drain(p.b, 1) == {p.a.name: [b"again"]}
    with pytest.raises(TransportError, match="released"):
        again.post()
    third = p.a.prepare("write", p.b.name, plan)
    p.a.close()
    with pytest.raises(TransportError, match="closed"):
        third.post()


def test_connecting_a_connected_peer_again_with_the_same_metadata_keeps_its_connection(pair_of: Pair) -> None:
    """Two callers that each make sure a peer is connected (concurrent requests) must not cut each other's
    transfers: the same metadata again leaves the connection, and what was prepared on it, as it was."""
    p = pair_of
    plan = make_plan(np.random.default_rng(31), p.a.regions, p.b.regions, 8, False)
    prepared = p.a.prepare("write", p.b.name, plan)
    p.a.connect(p.b.name, p.b.metadata())
    prepared.post(notify=b"same").wait(10.0)
    prepared.release()
    assert drain(p.b, 1) == {p.a.name: [b"same"]}


def test_concurrent_connects_of_one_peer_connect_it_once(pair_of: Pair) -> None:
    """Two threads making sure the same unseen peer is connected at once (two requests for a new prefill):
    the backend connects it once, and a transfer on it then lands."""
    import threading

    p = pair_of
    p.a.disconnect(p.b.name)
    metadata = p.b.metadata()
    calls: list[str] = []
    real = p.a._backend_connect

    def slow_connect(peer: str, md: Any) -> None:
        calls.append(peer)
        time.sleep(0.2)   # both callers are inside connect while the first is still connecting
        real(peer, md)

    p.a._backend_connect = slow_connect   # type: ignore[method-assign]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def connect() -> None:
        start.wait()
        try:
            p.a.connect(p.b.name, metadata)
        except BaseException as exc:   # reported below
            errors.append(exc)

    threads = [threading.Thread(target=connect) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and calls == [p.b.name]
    plan = make_plan(np.random.default_rng(32), p.a.regions, p.b.regions, 8, False)
    want = expected_after(plan, list(p.a.regions), p.a_bufs, list(p.b.regions), p.b_bufs)
    p.a.write(p.b.name, plan).wait(10.0)
    assert all(np.array_equal(x, y) for x, y in zip(p.b_bufs, want, strict=True))


def test_empty_plan_completes_and_notifies(pair_of: Pair) -> None:
    p = pair_of
    empty = TransferPlan(PageTable.empty(), PageTable.empty())
    h = p.a.write(p.b.name, empty, notify=b"empty")
    h.wait(5.0)
    assert h.status is TransferStatus.DONE and h.nbytes == 0
    assert drain(p.b, 1) == {p.a.name: [b"empty"]}


@pytest.mark.parametrize("op", ["write", "read"])
def test_plan_outside_registered_memory_is_refused(pair_of: Pair, op: str) -> None:
    p = pair_of
    before = [x.copy() for x in p.a_bufs + p.b_bufs]
    a0, b1 = p.a.regions[0], p.b.regions[1]
    local, past_end = _first_local_page(p), _page_past_the_peer(p)
    bad_region = PageTable(np.array([b1.base_address], np.uint64), np.array([PAGE], np.uint64),
                           np.array([2], np.uint32))
    local_past = PageTable(np.array([a0.end_address], np.uint64), np.array([PAGE], np.uint64),
                           np.array([0], np.uint32))
    remote_ok = PageTable(np.array([b1.base_address], np.uint64), np.array([PAGE], np.uint64),
                          np.array([1], np.uint32))
    cases = [(local, past_end, "remote"), (local, bad_region, "not registered"), (local_past, remote_ok, "local")]
    for loc, rem, words in cases:
        plan = TransferPlan(loc, rem) if op == "write" else TransferPlan(rem, loc)
        with pytest.raises(PageTableError, match=words):
            getattr(p.a, op)(p.b.name, plan, notify=b"never")
    assert drain(p.b, 1, timeout=0.1) == {}
    for got, want in zip(p.a_bufs + p.b_bufs, before, strict=True):
        assert np.array_equal(got, want)


def test_unknown_peer_and_closed_transport(pair_of: Pair) -> None:
    p = pair_of
    plan = TransferPlan(PageTable.empty(), PageTable.empty())
    with pytest.raises(PeerUnreachable, match="'nobody' is not connected"):
        p.a.write("nobody", plan)
    p.a.disconnect(p.b.name)
    with pytest.raises(PeerUnreachable, match=p.b.name):
        p.a.read(p.b.name, plan)
    p.a.close()
    with pytest.raises(TransportError, match="closed"):
        p.a.metadata()


def test_connect_checks_metadata(pair_of: Pair) -> None:
    p = pair_of
    md = p.b.metadata()
    with pytest.raises(TransportError, match="metadata names peer"):
        p.a.connect("someone-else", md)
    with pytest.raises(TransportError, match="backend"):
        other = "nixl" if p.a.backend != "nixl" else "loopback"
        from kvxfer.transport.metadata import TransportMetadata
        p.a.connect(p.b.name, TransportMetadata(other, p.b.name, p.b.regions).encode())


def test_cancel_right_after_post_is_all_or_nothing(pair_of: Pair) -> None:
    """A cancel either wins (TransferCancelled, no notification) or is too late (done, notified)."""
    p = pair_of
    rng = np.random.default_rng(3)
    plan = make_plan(rng, p.a.regions, p.b.regions, 80, coalesced=False)
    h = p.a.write(p.b.name, plan, notify=b"c")
    cancelled = h.cancel()
    if cancelled:
        with pytest.raises(TransferCancelled, match=f"transfer {h.id}"):
            h.wait(5.0)
        assert h.status is TransferStatus.CANCELLED
        assert drain(p.b, 1, timeout=0.3) == {}
    else:
        h.wait(5.0)
        assert drain(p.b, 1) == {p.a.name: [b"c"]}


# --- cross-process -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=REMOTE_BACKENDS)
def remote(request: pytest.FixtureRequest) -> Iterator[RemotePeer]:
    peer = RemotePeer(request.param, 21, SIZES_A, SIZES_B)
    yield peer
    peer.close()


@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "fragmented"])
def test_cross_process_both_directions_exact_bytes(remote: RemotePeer, coalesced: bool) -> None:
    r = remote
    rng = np.random.default_rng(5 if coalesced else 6)
    for op in ("write", "read"):
        remote_before = r.remote_bytes()
        local_before = [b.copy() for b in r.bufs]
        if op == "write":
            plan = make_plan(rng, r.local.regions, r.local.peer_regions(r.name), 70, coalesced)
            want_remote = expected_after(plan, list(r.local.regions), local_before,
                                         list(r.local.peer_regions(r.name)), remote_before)
            want_local = local_before
        else:
            plan = make_plan(rng, r.local.peer_regions(r.name), r.local.regions, 70, coalesced)
            want_local = expected_after(plan, list(r.local.peer_regions(r.name)), remote_before,
                                        list(r.local.regions), local_before)
            want_remote = remote_before
        getattr(r.local, op)(r.name, plan, notify=op.encode()).wait(10.0)
        assert all(np.array_equal(g, w) for g, w in zip(r.bufs, want_local, strict=True))
        assert all(np.array_equal(g, w) for g, w in zip(r.remote_bytes(), want_remote, strict=True))
        got = r.call("notifications", 1, 5.0)
        time.sleep(0.05)
        extra = r.call("notifications", 1, 0.05)
        assert got == {r.local.name: [op.encode()]} and extra == {}


def test_cross_process_peer_initiates_both_directions(remote: RemotePeer) -> None:
    """The peer writes into and reads from this process while this process's application only waits."""
    r = remote
    rng = np.random.default_rng(9)
    peer_regions = list(r.local.peer_regions(r.name))
    for op in ("write", "read"):
        remote_before = r.remote_bytes()
        local_before = [b.copy() for b in r.bufs]
        if op == "write":  # peer -> us
            plan = make_plan(rng, peer_regions, r.local.regions, 50, coalesced=False)
            want_local = expected_after(plan, peer_regions, remote_before, list(r.local.regions), local_before)
            want_remote = remote_before
        else:  # peer <- us
            plan = make_plan(rng, r.local.regions, peer_regions, 50, coalesced=True)
            want_remote = expected_after(plan, list(r.local.regions), local_before, peer_regions, remote_before)
            want_local = local_before
        assert r.call(op, r.local.name, table_wire(plan.src), table_wire(plan.dst), b"p" + op.encode(), 10.0) == "done"
        assert all(np.array_equal(g, w) for g, w in zip(r.bufs, want_local, strict=True))
        assert all(np.array_equal(g, w) for g, w in zip(r.remote_bytes(), want_remote, strict=True))
        assert drain(r.local, 1) == {r.name: [b"p" + op.encode()]}


def test_cross_process_refuses_outside_peer_regions(remote: RemotePeer) -> None:
    r = remote
    before = r.remote_bytes()
    peer_last = r.local.peer_regions(r.name)[-1]
    plan = TransferPlan(
        PageTable(np.array([r.local.regions[0].base_address], np.uint64), np.array([2 * PAGE], np.uint64),
                  np.array([0], np.uint32)),
        PageTable(np.array([peer_last.end_address - PAGE], np.uint64), np.array([2 * PAGE], np.uint64),
                  np.array([len(r.local.peer_regions(r.name)) - 1], np.uint32)))
    with pytest.raises(PageTableError, match="remote destination"):
        r.local.write(r.name, plan, notify=b"x")
    assert all(np.array_equal(g, w) for g, w in zip(r.remote_bytes(), before, strict=True))
    assert r.call("notifications", 1, 0.1) == {}


@pytest.mark.parametrize("backend", REMOTE_BACKENDS)
def test_cross_process_stalled_then_killed_peer(backend: str) -> None:
    """A stopped peer: with nixl (one-sided over shared memory/CMA) the read completes without the peer's
    help and the notification is there when the peer resumes; with ucx (one-sided, over tcp with
    peer-failure handling: UCX emulates the get with the peer's help) ``wait`` times out, ``cancel`` says
    it is too late (posted runs cannot be withdrawn), and the read completes exactly, notification
    included, once the peer resumes. A killed peer: an error within the timeout, no hang."""
    r = RemotePeer(backend, 31, SIZES_A, SIZES_B)
    try:
        rng = np.random.default_rng(1)
        plan = make_plan(rng, r.local.peer_regions(r.name), r.local.regions, 64, coalesced=False)
        remote_before = r.remote_bytes()
        want_local = expected_after(plan, list(r.local.peer_regions(r.name)), remote_before,
                                    list(r.local.regions), [b.copy() for b in r.bufs])
        os.kill(r.proc.pid, signal.SIGSTOP)
        try:
            h = r.local.read(r.name, plan, notify=b"stalled")
            t0 = time.monotonic()
            if backend == "nixl":
                h.wait(5.0)
                assert all(np.array_equal(g, w) for g, w in zip(r.bufs, want_local, strict=True))
            else:
                with pytest.raises(TransferTimeout, match=f"transfer {h.id}"):
                    h.wait(0.3)
                assert 0.25 <= time.monotonic() - t0 < 2.0
                assert h.cancel() is False
                assert h.status is TransferStatus.PENDING
        finally:
            os.kill(r.proc.pid, signal.SIGCONT)
        h.wait(5.0)
        assert all(np.array_equal(g, w) for g, w in zip(r.bufs, want_local, strict=True))
        assert r.call("notifications", 1, 0.5) == {r.local.name: [b"stalled"]}

        big = make_plan(rng, r.local.peer_regions(r.name), r.local.regions, 100, coalesced=True)
        h = r.local.read(r.name, big)
        r.proc.kill()
        r.proc.join(10)
        t0 = time.monotonic()
        with contextlib.suppress(TransportError):
            h.wait(1.0)
        h2 = r.local.read(r.name, big, notify=b"dead")
        with pytest.raises(TransportError, match=f"transfer {h2.id}"):
            h2.wait(1.0)
        assert time.monotonic() - t0 < 4.0
        h2.cancel()
    finally:
        r.close()
