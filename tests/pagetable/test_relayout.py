"""Landing plans and the host re-layout: a transfer between two layouts moves large pieces in the source's
layout into a landing region of the receiver, then one vectorised host copy puts every cell in place;
checked by logical position (the extractor tests' oracle, from the managers' own buffer views)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError, TransferCancelled, TransferFailed
from kvxfer.extractor import plan_templated
from kvxfer.pagetable import BlockPlan
from kvxfer.pagetable.relayout import landing_plan, relayout_host, relayout_torch
from kvxfer.transport import LoopbackFaults, TransferStatus, create
from kvxfer.transport.relayout import read_relayout, relayout_landed
from tests.extractor.test_plan import (
    RELATIONS,
    Side,
    expectation,
    fill_source,
    make_side,
    random_shape,
    random_side,
    related_side,
    side,
)

_names = itertools.count()


def pair_of_sides(rng: np.random.Generator, src_changes: dict[str, Any], dst_changes: dict[str, Any]) -> tuple[Side, Side]:
    src = side(1, tokens=29, **src_changes)
    dst = side(2, tokens=29, shuffle=True, **dst_changes)
    fill_source(src, rng)
    for pool in dst.pools():
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    return src, dst


def landing_buffer(nbytes: int) -> tuple[np.ndarray, MemoryRegion]:
    raw = np.zeros(max(nbytes, 1) + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    buf = raw[off:off + max(nbytes, 1)]
    return buf, MemoryRegion(int(buf.ctypes.data), buf.size)


def assert_in_place(src: Side, dst: Side, layers: Any = None, token_range: Any = None) -> None:
    want, _ = expectation(src, dst, layers, token_range)
    for i, (got, w) in enumerate(zip(dst.pools(), want, strict=True)):
        assert np.array_equal(got, w), f"region {i}: {int((got != w).sum())} bytes differ"


CHANGES = [
    ({}, {"tpb": 8}),                                                   # 4 -> 8 tokens per block
    ({}, {"tpb": 2}),                                                   # 4 -> 2
    ({}, {"order": "NHD"}),                                             # HND -> NHD
    ({}, {"tpb": 3, "order": "NHD"}),                                   # 4 -> 3 and the head order
    ({}, {"tpb": 8, "tp_size": 2, "tp_rank": 1}),                       # TP 1 -> 2 with 4 -> 8
    ({"tp_size": 2, "tp_rank": 1}, {"tpb": 2}),                         # TP 2 -> 1 (rank 1) with 4 -> 2
    ({"coalesce": False}, {"tpb": 2, "order": "NHD"}),                  # per-layer pools at the source
]
IDS = ["tpb4to8", "tpb4to2", "hnd-nhd", "tpb4to3-nhd", "tp1to2-tpb4to8", "tp2to1-tpb4to2", "expanded-src"]


@pytest.mark.parametrize(("src_changes", "dst_changes"), CHANGES, ids=IDS)
def test_a_pull_into_the_landing_region_then_the_host_relayout_puts_every_cell_in_place(
        src_changes: dict[str, Any], dst_changes: dict[str, Any]) -> None:
    """Through a transport (loopback): the receiver reads the landing plan's pieces from the source into
    its landing region, then re-lays them out on the host; every destination cell holds the source's
    (layer, role, head, token), nothing else changed. A block-size or head-order change moves whole
    source blocks: as many pieces as source slots x regions read."""
    rng = np.random.default_rng(5)
    src, dst = pair_of_sides(rng, src_changes, dst_changes)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    dst_regions = list(dst.mgr.memory_regions())
    probe = landing_plan(phases, 0, len(dst_regions))
    _buf, landing = landing_buffer(probe.landing_bytes)
    lp = landing_plan(phases, landing.base_address, len(dst_regions))
    n = next(_names)
    a, b = create("loopback", f"rl-src{n}"), create("loopback", f"rl-dst{n}")
    try:
        a.register(list(src.mgr.memory_regions()))
        b.register([*dst_regions, landing])
        a.connect(b.name, b.metadata())
        b.connect(a.name, a.metadata())
        b.read(a.name, lp.transfer).wait(10.0)
        relayout_host(lp.relayout, b.regions, b.regions)
    finally:
        a.close()
        b.close()
    assert_in_place(src, dst)
    if "tp_size" not in src_changes and "tp_size" not in dst_changes:
        assert lp.transfer.runs_per_block == len(set(lp.transfer.src_region.tolist()))   # whole slots per region
    assert lp.total_bytes == sum(p.total_bytes for p in phases)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), relation=st.sampled_from(RELATIONS), ranged=st.booleans())
def test_landing_then_relayout_equals_the_plan_for_random_layout_pairs(seed: int, relation: str,
                                                                        ranged: bool) -> None:
    """Random shapes and layouts related as ``relation``, any token range: the landing copy (run on the
    host here) and the re-layout put every cell where the position oracle says, and nothing else."""
    rng = np.random.default_rng(seed)
    shape = random_shape(rng)
    sp = random_side(rng)
    src = make_side(rng, **shape, **sp)
    dst = make_side(rng, **shape, **related_side(rng, sp, relation))
    lo, hi = sorted(int(x) for x in rng.integers(0, 31, 2))
    token_range = (lo, hi) if ranged else None
    fill_source(src, rng)
    for pool in dst.pools():
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids, token_range=token_range)
    if phases is None:
        assert len(src.layout.layer_groups) > 1 or len(dst.layout.layer_groups) > 1
        return
    dst_regions = list(dst.mgr.memory_regions())
    size = landing_plan(phases, 0, 0).landing_bytes
    _buf, landing = landing_buffer(size)
    lp = landing_plan(phases, landing.base_address, 0)
    relayout_host([lp.transfer], list(src.mgr.memory_regions()), [landing])
    relayout_host(lp.relayout, [landing], dst_regions)
    assert_in_place(src, dst, None, token_range)


def test_a_relayout_with_two_landing_slots_exchanged_fails_the_position_oracle() -> None:
    """Mutation: the re-layout reading two source blocks from each other's landing slots passes every
    bounds and overlap check but puts tokens in the wrong blocks; the oracle must see it."""
    rng = np.random.default_rng(6)
    src, dst = pair_of_sides(rng, {}, {"tpb": 8})
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    dst_regions = list(dst.mgr.memory_regions())
    _buf, landing = landing_buffer(landing_plan(phases, 0, 0).landing_bytes)
    lp = landing_plan(phases, landing.base_address, 0)
    relayout_host([lp.transfer], list(src.mgr.memory_regions()), [landing])
    first = lp.relayout[0]
    ids = first.src_slots.copy()
    ids[[0, 1]] = ids[[1, 0]]
    swapped = BlockPlan(ids, first.dst_slots, first.src_step, first.src_offset, first.dst_step, first.dst_offset,
                        first.nbytes, first.src_region, first.dst_region)
    relayout_host([swapped, *lp.relayout[1:]], [landing], dst_regions)
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_in_place(src, dst)


def test_relayout_host_refuses_device_memory_and_plans_outside_their_regions() -> None:
    buf, region = landing_buffer(4096)
    gpu = MemoryRegion(region.base_address, 4096, device_id=0, memory_kind="cuda")
    one = np.array([0], np.uint64)
    plan = BlockPlan(one, one, one, np.array([region.base_address], np.uint64), one,
                     np.array([region.base_address + 2048], np.uint64), np.array([1024], np.uint64),
                     np.zeros(1, np.uint32), np.zeros(1, np.uint32))
    with pytest.raises(PageTableError, match="cuda"):
        relayout_host([plan], [gpu], [gpu])
    buf[:1024] = 7
    relayout_host([plan], [region], [region])
    assert (buf[2048:3072] == 7).all()
    far = BlockPlan(one, one, one, np.array([region.base_address], np.uint64), one,
                    np.array([region.base_address + 3584], np.uint64), np.array([1024], np.uint64),
                    np.zeros(1, np.uint32), np.zeros(1, np.uint32))
    with pytest.raises(PageTableError, match="outside region"):
        relayout_host([far], [region], [region])


def _pull_pair(faults: Any = None) -> tuple[Side, Side, Any, Any, Any, Any]:
    rng = np.random.default_rng(9)
    src, dst = pair_of_sides(rng, {}, {"tpb": 2, "order": "NHD"})
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    dst_regions = list(dst.mgr.memory_regions())
    buf, landing = landing_buffer(landing_plan(phases, 0, len(dst_regions)).landing_bytes)
    lp = landing_plan(phases, landing.base_address, len(dst_regions))
    n = next(_names)
    a = create("loopback", f"rr-src{n}")
    b = create("loopback", f"rr-dst{n}", **({"faults": faults} if faults is not None else {}))
    a.register(list(src.mgr.memory_regions()))
    b.register([*dst_regions, landing])
    a.connect(b.name, b.metadata())
    b.connect(a.name, a.metadata())
    return src, dst, a, b, lp, buf


def test_a_pull_with_relayout_is_done_only_with_every_cell_in_place() -> None:
    """``read_relayout``: while the landing read is pending the destination pages are untouched; the
    handle is done only after the re-layout, and then every cell is in place; the peer gets the notice."""
    src, dst, a, b, lp, _buf = _pull_pair(LoopbackFaults(delay_s=0.2))
    try:
        before = dst.snapshot()
        handle = read_relayout(b, a.name, lp, notify=b"landed")
        assert not handle.done()
        assert all(np.array_equal(got, was) for got, was in zip(dst.pools(), before, strict=True))
        handle.wait(10.0)
        assert handle.status is TransferStatus.DONE and handle.nbytes == lp.total_bytes
        assert_in_place(src, dst)
        deadline = time.monotonic() + 5.0
        got: dict[str, list[bytes]] = {}
        while not got and time.monotonic() < deadline:
            got = a.notifications()
            time.sleep(0.01)
        assert got == {b.name: [b"landed"]}
    finally:
        a.close()
        b.close()


def test_a_failed_landing_read_leaves_the_destination_untouched() -> None:
    """The read fails (the transport's first post): the handle fails naming the landing read, and no
    destination byte changed (the re-layout never ran). Mutation: running the re-layout whatever the
    read's end would write the landing region's stale bytes into the pages."""
    _src, dst, a, b, lp, _buf = _pull_pair(LoopbackFaults(fail_post=1))
    try:
        before = dst.snapshot()
        handle = read_relayout(b, a.name, lp)
        with pytest.raises(TransferFailed, match="landing read"):
            handle.wait(10.0)
        assert all(np.array_equal(got, was) for got, was in zip(dst.pools(), before, strict=True))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("src_changes", "dst_changes"), CHANGES, ids=IDS)
def test_the_torch_relayout_puts_every_cell_in_place_like_the_host_one(src_changes: dict[str, Any],
                                                                       dst_changes: dict[str, Any]) -> None:
    """``relayout_torch`` (the GPU's path; here on CPU tensors over the same memory) after the landing copy
    lands every cell where the position oracle says, with the rows moved as the widest words they allow."""
    rng = np.random.default_rng(8)
    src, dst = pair_of_sides(rng, src_changes, dst_changes)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    dst_regions = list(dst.mgr.memory_regions())
    _buf, landing = landing_buffer(landing_plan(phases, 0, 0).landing_bytes)
    lp = landing_plan(phases, landing.base_address, 0)
    relayout_host([lp.transfer], list(src.mgr.memory_regions()), [landing])
    relayout_torch(lp.relayout, [landing], dst_regions)
    assert_in_place(src, dst)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("src_changes", "dst_changes"), CHANGES, ids=IDS)
@pytest.mark.parametrize("how", ["torch", "block kernels"])
def test_the_gpu_relayout_puts_every_cell_in_place(src_changes: dict[str, Any], dst_changes: dict[str, Any],
                                                   how: str) -> None:
    """The landing region and the destination pools on the GPU: ``relayout_torch`` gathers and scatters
    there, or cuda_copy's block kernels copy the re-layout plans (what a landing read's completion runs);
    copied back, every cell is where the position oracle says."""
    rng = np.random.default_rng(10)
    src, dst = pair_of_sides(rng, src_changes, dst_changes)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    cpu_regions = list(dst.mgr.memory_regions())
    pools = [torch.from_numpy(p).cuda() for p in dst.pools()]
    gpu_regions = [MemoryRegion.of_tensor(t) for t in pools]
    size = landing_plan(phases, 0, 0).landing_bytes
    host_landing_buf, host_landing = landing_buffer(size)
    lp = landing_plan(phases, host_landing.base_address, 0)
    relayout_host([lp.transfer], list(src.mgr.memory_regions()), [host_landing])
    landing_t = torch.from_numpy(host_landing_buf).cuda()
    landing = MemoryRegion.of_tensor(landing_t)
    shift_src = np.uint64(landing.base_address) - np.uint64(host_landing.base_address)
    moved = []
    for p in lp.relayout:
        d_shift = np.array([g.base_address - c.base_address for g, c in zip(gpu_regions, cpu_regions, strict=True)],
                           dtype=np.int64)[p.dst_region]
        moved.append(BlockPlan(p.src_slots, p.dst_slots, p.src_step, p.src_offset + shift_src, p.dst_step,
                               (p.dst_offset.astype(np.int64) + d_shift).astype(np.uint64), p.nbytes,
                               p.src_region, p.dst_region))
    if how == "torch":
        relayout_torch(moved, [landing], gpu_regions)
    else:   # as a landing read's completion runs it: the transport's regions, the landing region first
        pytest.importorskip("kvxfer.transport.cuda_copy", reason="needs cuda-python")
        registered = SimpleNamespace(regions=(landing, *gpu_regions))   # every pool's region id is >= 1
        renumbered = [dataclasses.replace(p, src_region=np.zeros_like(p.src_region), dst_region=p.dst_region + 1)
                      for p in moved]
        relayout_landed(registered, renumbered)   # type: ignore[arg-type]
    torch.cuda.synchronize()
    for host, dev in zip(dst.pools(), pools, strict=True):
        host[:] = dev.cpu().numpy()
    assert_in_place(src, dst)


@pytest.mark.parametrize(("src_changes", "dst_changes"), CHANGES, ids=IDS)
@pytest.mark.parametrize("piece_slots", [1, 3])
def test_a_pipelined_pull_places_every_cell_and_notifies_once_after_every_piece(
        src_changes: dict[str, Any], dst_changes: dict[str, Any], piece_slots: int) -> None:
    """``read_relayout(piece_bytes=...)``: the landing read in pieces of one or three landing slots, each
    re-laid out while the next moves; done only with every cell in place (the position oracle), the
    peer's notice arriving once. Mutation: dropping a phase's slots from a piece (or a piece) leaves
    cells out of place."""
    rng = np.random.default_rng(12)
    src, dst = pair_of_sides(rng, src_changes, dst_changes)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    dst_regions = list(dst.mgr.memory_regions())
    _buf, landing = landing_buffer(landing_plan(phases, 0, len(dst_regions)).landing_bytes)
    lp = landing_plan(phases, landing.base_address, len(dst_regions))
    n = next(_names)
    a, b = create("loopback", f"rp-src{n}"), create("loopback", f"rp-dst{n}")
    try:
        a.register(list(src.mgr.memory_regions()))
        b.register([*dst_regions, landing])
        a.connect(b.name, b.metadata())
        b.connect(a.name, a.metadata())
        handle = read_relayout(b, a.name, lp, notify=b"landed", piece_bytes=piece_slots * lp.slot_bytes)
        handle.wait(10.0)
        assert handle.status is TransferStatus.DONE and handle.nbytes == lp.total_bytes
        assert getattr(handle, "pieces", 1) == -(-lp.transfer.num_blocks // piece_slots)
        assert_in_place(src, dst)
        time.sleep(0.05)
        assert a.notifications() == {b.name: [b"landed"]}
    finally:
        a.close()
        b.close()


def test_landing_pieces_cover_the_plan_exactly() -> None:
    """Every landing slot is in exactly one piece, and every re-layout block pair in the piece of its slot."""
    rng = np.random.default_rng(13)
    src, dst = pair_of_sides(rng, {}, {"tpb": 2, "order": "NHD"})
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    lp = landing_plan(phases, 1 << 30, 0)
    pieces = lp.pieces(2 * lp.slot_bytes)
    assert np.array_equal(np.concatenate([t.dst_slots for t, _ in pieces]), lp.transfer.dst_slots)
    for k, phase in enumerate(lp.relayout):
        got = np.concatenate([ph[k].src_slots for _, ph in pieces])
        assert np.array_equal(np.sort(got), np.sort(phase.src_slots))
        for t, ph in pieces:
            assert set(ph[k].src_slots.tolist()) <= set(t.dst_slots.tolist())
    with pytest.raises(PageTableError, match="positive"):
        lp.pieces(0)


def test_a_failed_piece_fails_the_pipelined_pull_once_no_relayout_runs() -> None:
    """The second piece's read fails: the handle fails naming the landing read, after the first piece's
    re-layout ended (no byte of the pages changes after the failure is reported), and no notice is sent."""
    _src, dst, a, b, lp, _buf = _pull_pair(LoopbackFaults(fail_post=2))
    try:
        handle = read_relayout(b, a.name, lp, notify=b"never", piece_bytes=lp.slot_bytes)
        with pytest.raises(TransferFailed, match="landing read of piece 2"):
            handle.wait(10.0)
        after = dst.snapshot()
        time.sleep(0.05)
        assert all(np.array_equal(got, was) for got, was in zip(dst.pools(), after, strict=True))
        assert a.notifications() == {}
    finally:
        a.close()
        b.close()


def test_a_pipelined_pull_is_cancelled_while_a_piece_is_in_flight() -> None:
    """A stalled read (the peer never completes it): the pipelined handle stays pending, its cancel
    succeeds, and waiting then raises TransferCancelled; the pages were never written."""
    _src, dst, a, b, lp, _buf = _pull_pair(LoopbackFaults(never_complete=True))
    try:
        before = dst.snapshot()
        handle = read_relayout(b, a.name, lp, notify=b"never", piece_bytes=lp.slot_bytes)
        assert not handle.done()
        assert handle.cancel()
        with pytest.raises(TransferCancelled):
            handle.wait(1.0)
        assert handle.status is TransferStatus.CANCELLED
        assert all(np.array_equal(got, was) for got, was in zip(dst.pools(), before, strict=True))
    finally:
        a.close()
        b.close()
