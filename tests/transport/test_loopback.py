"""Loopback fault hooks, metadata decoding of hostile input, and the backend registry."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import (
    BackendUnavailable,
    ConfigError,
    DecodeError,
    LayoutError,
    PageTableError,
    PeerUnreachable,
    TransferCancelled,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from kvxfer.pagetable import TransferPlan
from kvxfer.transport import LoopbackFaults, TransferStatus, TransportMetadata, available_backends, create
from kvxfer.transport.copy import GATHER_MIN_RUNS, copy_plan, merge_adjacent
from tests.support.transport_helpers.plans import (
    PAGE,
    expected_after,
    make_buffers,
    pair,
    random_pages,
    regions_of,
)

_n = iter(range(1_000_000))


class Pair:
    def __init__(self, faults: LoopbackFaults | None = None, seed: int = 3) -> None:
        n = next(_n)
        self.a_bufs, self.b_bufs = make_buffers([64 * PAGE], seed), make_buffers([64 * PAGE], seed + 1)
        self.a = create("loopback", f"fa{n}", faults=faults)
        self.b = create("loopback", f"fb{n}")
        self.a.register(regions_of(self.a_bufs))
        self.b.register(regions_of(self.b_bufs))
        self.a.connect(self.b.name, self.b.metadata())
        self.b.connect(self.a.name, self.a.metadata())

    def plan(self, pages: int = 8, seed: int = 0, coalesced: bool = False) -> TransferPlan:
        rng = np.random.default_rng(seed)
        return pair(random_pages(rng, list(self.a.regions), pages, PAGE, coalesced),
                    random_pages(rng, list(self.b.regions), pages, PAGE, coalesced))

    def expected_b(self, plan: TransferPlan) -> np.ndarray:
        return expected_after(plan, list(self.a.regions), self.a_bufs, list(self.b.regions), self.b_bufs)[0]


def test_fail_nth_post_writes_nothing() -> None:
    p = Pair(LoopbackFaults(fail_post=2))
    first, second, third = p.plan(seed=1), p.plan(seed=2), p.plan(seed=3)
    p.a.write(p.b.name, first, notify=b"1").wait(1)
    before = p.b_bufs[0].copy()
    h = p.a.write(p.b.name, second, notify=b"2")
    assert h.status is TransferStatus.FAILED
    with pytest.raises(TransferFailed, match=rf"transfer {h.id} .*'{p.b.name}'.*post #2"):
        h.wait(1)
    assert np.array_equal(p.b_bufs[0], before)
    want = p.expected_b(third)
    p.a.write(p.b.name, third, notify=b"3").wait(1)
    assert np.array_equal(p.b_bufs[0], want)
    assert p.b.notifications() == {p.a.name: [b"1", b"3"]}


def test_never_complete_times_out_then_cancels_cleanly() -> None:
    p = Pair(LoopbackFaults(never_complete=True))
    before = p.b_bufs[0].copy()
    h = p.a.write(p.b.name, p.plan(), notify=b"x")
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match=f"transfer {h.id}"):
        h.wait(0.1)
    assert 0.09 <= time.monotonic() - t0 < 1.0
    assert not h.done()
    assert h.cancel() is True
    with pytest.raises(TransferCancelled):
        h.wait(0)
    assert h.cancel() is True and h.status is TransferStatus.CANCELLED
    assert np.array_equal(p.b_bufs[0], before) and p.b.notifications() == {}


def test_delay_completes_late_and_cancel_during_delay_writes_nothing() -> None:
    p = Pair(LoopbackFaults(delay_s=0.15))
    plan = p.plan(seed=4)
    want = p.expected_b(plan)
    h = p.a.write(p.b.name, plan, notify=b"late")
    assert not h.done() and h.finished_at == 0.0
    t0 = time.monotonic()
    h.wait(2)
    assert time.monotonic() - t0 >= 0.1
    time.sleep(0.05)   # looked at later: finished_at stays when the transfer completed
    assert t0 + 0.1 <= h.finished_at <= time.monotonic() - 0.05
    assert np.array_equal(p.b_bufs[0], want)
    before = p.b_bufs[0].copy()
    h2 = p.a.write(p.b.name, p.plan(seed=5), notify=b"never")
    assert h2.cancel() is True
    time.sleep(0.2)
    assert h2.status is TransferStatus.CANCELLED and np.array_equal(p.b_bufs[0], before)
    assert p.b.notifications() == {p.a.name: [b"late"]}


def test_drop_and_duplicate_notifications() -> None:
    p = Pair(LoopbackFaults(drop_notification=1, duplicate_notification=3))
    for i in range(4):
        p.a.write(p.b.name, p.plan(seed=i), notify=b"%d" % i).wait(1)
    assert p.b.notifications() == {p.a.name: [b"1", b"2", b"2", b"3"]}


def test_corrupt_inverts_exact_byte_range() -> None:
    p = Pair(LoopbackFaults(corrupt=(PAGE - 10, 20)))
    plan = p.plan(pages=4, seed=9)
    want = p.expected_b(plan)
    p.a.write(p.b.name, plan).wait(1)
    got = p.b_bufs[0]
    diff = np.flatnonzero(got != want)
    assert diff.size == 20
    stream = np.concatenate([got[int(a - p.b.regions[0].base_address):][:int(n)]
                             for a, n in zip(plan.dst.addr, plan.dst.nbytes, strict=True)])
    wstream = np.concatenate([want[int(a - p.b.regions[0].base_address):][:int(n)]
                              for a, n in zip(plan.dst.addr, plan.dst.nbytes, strict=True)])
    assert np.array_equal(np.flatnonzero(stream != wstream), np.arange(PAGE - 10, PAGE + 10))
    assert np.array_equal(stream[PAGE - 10:PAGE + 10], wstream[PAGE - 10:PAGE + 10] ^ 0xFF)


def test_closed_peer_fails_pending_transfer() -> None:
    p = Pair(LoopbackFaults(delay_s=0.05))
    h = p.a.write(p.b.name, p.plan())
    p.b.close()
    time.sleep(0.06)
    with pytest.raises(PeerUnreachable, match=f"transfer {h.id}"):
        h.wait(1)


def test_duplicate_name_and_registration_rules() -> None:
    p = Pair()
    with pytest.raises(TransportError, match="already exists"):
        create("loopback", p.a.name)
    with pytest.raises(TransportError, match="already registered"):
        p.a.register(regions_of(p.a_bufs))
    with pytest.raises(TransportError, match="transport name"):
        create("loopback", "bad name with spaces")
    fresh = create("loopback", f"fresh{next(_n)}")
    with pytest.raises(LayoutError, match="empty"):
        fresh.register([MemoryRegion(4096, 0)])
    with pytest.raises(LayoutError, match="memory kind"):
        fresh.register([MemoryRegion(4096, 10, "disk")])
    fresh.close()


@pytest.mark.parametrize("pages,coalesced", [(GATHER_MIN_RUNS + 40, False), (300, True), (5, False)])
def test_copy_plan_paths_match_numpy(pages: int, coalesced: bool) -> None:
    """The gather/scatter path (many small runs), the memmove path and run merging give exact bytes."""
    src_bufs, dst_bufs = make_buffers([400 * 1024, 300 * 1024], 5), make_buffers([512 * 1024], 6)
    rng = np.random.default_rng(pages)
    src = random_pages(rng, regions_of(src_bufs), pages, 1024, coalesced)
    dst = random_pages(rng, regions_of(dst_bufs), pages, 1024, coalesced)
    plan = pair(src, dst)
    want = expected_after(plan, regions_of(src_bufs), src_bufs, regions_of(dst_bufs), dst_bufs)
    copy_plan(plan, regions_of(src_bufs), regions_of(dst_bufs))
    assert np.array_equal(dst_bufs[0], want[0])


def test_merge_adjacent_merges_only_runs_adjacent_on_both_sides() -> None:
    src = np.array([0, 10, 20, 40], np.uint64)
    dst = np.array([100, 110, 125, 145], np.uint64)
    n = np.array([10, 10, 20, 5], np.uint64)
    s, d, m = merge_adjacent(src, dst, n)
    assert s.tolist() == [0, 20] and d.tolist() == [100, 125] and m.tolist() == [20, 25]


# --- metadata ---------------------------------------------------------------------------------------
def test_metadata_round_trip() -> None:
    md = TransportMetadata("nixl", "x", (MemoryRegion(4096, 8192, "cpu", 0), MemoryRegion(1 << 40, 5, "cuda", 3)),
                           b"blob")
    assert TransportMetadata.decode(md.encode()) == md


@pytest.mark.parametrize("obj,words", [
    ({"v": 2, "backend": "x", "name": "y", "regions": [], "blob": b""}, "version"),
    ({"v": 1, "backend": "", "name": "y", "regions": [], "blob": b""}, "backend"),
    ({"v": 1, "backend": "x", "name": "y", "regions": [[1, 2, "tape", 0]], "blob": b""}, r"regions\[0\].kind"),
    ({"v": 1, "backend": "x", "name": "y", "regions": [[1, -2, "cpu", 0]], "blob": b""}, "nbytes"),
    ({"v": 1, "backend": "x", "name": "y", "regions": [[(1 << 64) - 1, 2, "cpu", 0]], "blob": b""}, "overflows"),
    ({"v": 1, "backend": "x", "name": "y", "regions": [[1, 2, "cpu"]], "blob": b""}, "regions"),
    ({"v": 1, "backend": "x", "name": "y", "regions": [], "blob": "text"}, "blob"),
    ([1, 2], "expected a map"),
])
def test_metadata_rejects_bad_fields(obj: object, words: str) -> None:
    with pytest.raises(DecodeError, match=words):
        TransportMetadata.decode(msgpack.packb(obj, use_bin_type=True))


def test_metadata_rejects_hostile_length_without_allocating() -> None:
    # A map header claiming 2**32-1 entries, and an array header claiming 2**32-1 regions.
    with pytest.raises(DecodeError):
        TransportMetadata.decode(b"\xdf\xff\xff\xff\xff")
    with pytest.raises(DecodeError):
        TransportMetadata.decode(msgpack.packb({"v": 1})[:-1] + b"\xdd\xff\xff\xff\xff")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_metadata_decode_never_crashes(data: bytes) -> None:
    try:
        md = TransportMetadata.decode(data)
    except DecodeError:
        return
    assert isinstance(md, TransportMetadata) and all(isinstance(r, MemoryRegion) for r in md.regions)


def test_registry() -> None:
    avail = available_backends()
    assert set(avail) == {"loopback", "nixl", "ucx", "cuda_ipc"} and avail["loopback"] is None
    if not torch.cuda.is_available():
        assert avail["cuda_ipc"] is not None and "CUDA" in avail["cuda_ipc"]
    with pytest.raises(ConfigError, match="unknown transport backend 'tcp'"):
        create("tcp", "x")
    assert issubclass(BackendUnavailable, TransportError)


def test_a_backend_may_check_the_plan_while_it_moves() -> None:
    """``Transport._backend_post_checking`` (cuda_ipc's kernel path): the backend gets the full host check
    as a callable to run once its copy has started; a refused plan raises the same PageTableError as on
    the check-first path, a good one returns the backend's handle. (This stand-in starts nothing before
    the check: the loopback copy would not confine runs to their regions.)"""
    from kvxfer.transport.loopback import LoopbackTransport

    events: list[str] = []

    class Launching(LoopbackTransport):
        def _backend_post_checking(self, op: Any, peer: str, plan: TransferPlan, notify: bytes | None,
                                   transfer_id: int, check: Any, *, settled: bool = False) -> Any:
            events.append("start")
            try:
                check()
            except PageTableError:
                events.append("refused")
                raise
            events.append("checked")
            return self._backend_post(op, peer, plan, notify, transfer_id)

    p = Pair()
    a = Launching(f"{p.a.name}-launching")
    a.register(regions_of(p.a_bufs))
    a.connect(p.b.name, p.b.metadata())
    p.b.connect(a.name, a.metadata())
    good = p.plan(seed=5)
    want = p.expected_b(good)
    a.write(p.b.name, good, notify=b"ok").wait(1)
    assert events == ["start", "checked"] and np.array_equal(p.b_bufs[0], want)
    assert p.b.notifications() == {a.name: [b"ok"]}
    bad = TransferPlan(good.src, type(good.dst)(good.dst.addr, good.dst.nbytes, good.dst.region + np.uint32(1)))
    with pytest.raises(PageTableError) as launched:
        a.write(p.b.name, bad, notify=b"no")
    with pytest.raises(PageTableError) as checked_first:
        p.a.write(p.b.name, bad, notify=b"no")
    assert events[2:] == ["start", "refused"]
    assert str(launched.value).replace(a.name, "A") == str(checked_first.value).replace(p.a.name, "A")
    assert "not registered" in str(launched.value) and p.b.notifications() == {}
