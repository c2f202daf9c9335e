"""nixl backend, the post path of plans of the KV pool's shape (every entry of a side in one registered region,
one length that is also the grid unit: a layer-wise chunk): such plans land exactly whatever their size,
region and length, and every fault the general path refuses is refused here too, before NIXL makes a request,
with the side named, no byte moved and no notification. Real NIXL agents over UCX in this process, two
regions a side (the plans use the second, whose grid cells do not start at 0)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.errors import PageTableError
from kvxfer.pagetable import BlockPlan, PageTable, PhasedPlan, TransferPlan
from kvxfer.transport import Transport, available_backends
from kvxfer.transport import nixl as nixl_backend
from tests.support.transport_helpers.pairs import connected_pair, drain_notifications
from tests.support.transport_helpers.plans import PAGE, expected_after, expected_after_blocks

REASON = available_backends()["nixl"]
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
_names = itertools.count()
#: Region 1 of each side: 4,096 pages, so 200 one-page entries are few against the grid (sorted check) and
#: 200 three-page ones many (marked grid).
SIZES = [1 << 20, 16 << 20]


class Pair:
    """Two connected nixl transports over two seeded regions each, counting the NIXL requests ``a`` makes."""

    def __init__(self) -> None:
        n = next(_names)
        self.a, self.b, self.a_bufs, self.b_bufs = connected_pair("nixl", (f"cells{n}a", f"cells{n}b"),
                                                                  (SIZES, SIZES), 40 + n)
        self.made = 0
        core: Any = self.a._core  # type: ignore[attr-defined]
        agent: Any = self.a._agent  # type: ignore[attr-defined]
        for owner, verb in ((core, "make"), (agent, "make_prepped_xfer"), (agent, "initialize_xfer")):
            real = getattr(owner, verb)

            def counted(*args: Any, _real: Any = real, **kw: Any) -> Any:
                self.made += 1
                return _real(*args, **kw)
            setattr(owner, verb, counted)

    def sides(self, op: str) -> tuple[Transport, list[npt.NDArray[np.uint8]], Transport, list[npt.NDArray[np.uint8]]]:
        """(source transport, its buffers, destination transport, its buffers) of ``op`` posted by ``a``."""
        return (self.a, self.a_bufs, self.b, self.b_bufs) if op == "write" else (self.b, self.b_bufs, self.a, self.a_bufs)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def agents() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def cells(t: Transport, region: int, count: int, length: int, rng: np.random.Generator, shift: int = 0) -> PageTable:
    """``count`` distinct entries of ``length`` bytes in ``region`` of ``t``, in random order, each on a cell
    of ``length`` bytes counted from the region's base plus ``shift``."""
    r = t.regions[region]
    slots = (r.nbytes - shift) // length
    pick = rng.choice(slots, size=count, replace=False).astype(np.uint64)
    return PageTable(np.uint64(r.base_address + shift) + pick * np.uint64(length), np.full(count, length, np.uint64),
                     np.full(count, region, np.uint32))


def post_and_check(p: Pair, op: str, plan: TransferPlan) -> None:
    """``a`` posts ``plan`` for ``op`` with a notification: one NIXL request, the destination exactly as the
    plan says, the notification delivered once."""
    src, src_bufs, dst, dst_bufs = p.sides(op)
    want = expected_after(plan, list(src.regions), src_bufs, list(dst.regions), dst_bufs)
    made = p.made
    getattr(p.a, op)(p.b.name, plan, notify=b"chunk").wait(10.0)
    assert p.made == made + 1
    assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
    assert drain_notifications(p.b, 1) == [b"chunk"]


def plan_for(op: str, local: PageTable, remote: PageTable) -> TransferPlan:
    return TransferPlan(local, remote) if op == "write" else TransferPlan(remote, local)


@pytest.mark.parametrize("length", [PAGE, 3 * PAGE])
@pytest.mark.parametrize("entries", [2, 16, 40, 200])
@pytest.mark.parametrize("op", ["write", "read"])
def test_chunks_in_one_region_a_side_land_exactly(agents: Pair, op: str, entries: int, length: int) -> None:
    """A chunk of one-cell entries in the second region of each side (its cells start past the first
    region's: dropping that offset moves the first region's bytes), of a power-of-two length and of another
    (three pages), checked through lists (a few entries) and arrays (many, sorted and marked), lands exactly
    with one request."""
    rng = np.random.default_rng(entries * 7 + length)
    local = cells(agents.a, 1, entries, length, rng)
    remote = cells(agents.b, 1, entries, length, rng)
    post_and_check(agents, op, plan_for(op, local, remote))


def two_regions(t: Transport, entries: int, rng: np.random.Generator) -> PageTable:
    """Half the entries in region 0 of ``t``, half in region 1."""
    return PageTable.concat([cells(t, r, entries // 2, PAGE, rng) for r in (0, 1)])


@pytest.mark.parametrize("entries", [8, 200])
@pytest.mark.parametrize("shape", ["off the grid", "off the grid, three pages", "two lengths",
                                   "two regions local", "two regions remote"])
def test_chunks_of_other_shapes_take_the_general_path_and_land_exactly(agents: Pair, shape: str,
                                                                       entries: int) -> None:
    """Entries off the grid of their length (half-page offsets of one-page entries, one-page offsets of
    three-page ones: a smaller grid unit), of two lengths, or spread over both regions of one side are not
    of that shape: they land exactly all the same. Mutation: taking the first entry's length, region or cell
    grid for all moves other bytes than the plan's."""
    rng = np.random.default_rng(entries)
    local = cells(agents.a, 1, entries, PAGE, rng)
    remote = cells(agents.b, 1, entries, PAGE, rng)
    if shape == "off the grid":
        local = cells(agents.a, 1, entries, PAGE, rng, shift=PAGE // 2)
    elif shape == "off the grid, three pages":
        local = cells(agents.a, 1, entries, 3 * PAGE, rng, shift=PAGE)
        remote = cells(agents.b, 1, entries, 3 * PAGE, rng)
    elif shape == "two lengths":
        local = cells(agents.a, 1, entries, 2 * PAGE, rng)
        remote = cells(agents.b, 1, entries, 2 * PAGE, rng)
        nbytes = local.nbytes.copy()
        nbytes[::2] = PAGE   # every other entry moves its first page only
        local, remote = (PageTable(t.addr, nbytes, t.region) for t in (local, remote))
    elif shape == "two regions local":
        local = two_regions(agents.a, entries, rng)
    else:
        remote = two_regions(agents.b, entries, rng)
    post_and_check(agents, "write", plan_for("write", local, remote))


FAULTS = ["local below the base", "remote below the base", "local past the end", "remote past the end",
          "local ends past the end", "local region", "remote region", "overlap", "other region's bytes"]


@pytest.mark.parametrize(("entries", "length"), [(3, PAGE), (40, PAGE), (200, PAGE), (200, 3 * PAGE)])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", ["write", "read"])
def test_faults_are_refused_before_nixl_sees_the_plan(agents: Pair, op: str, fault: str, entries: int,
                                                      length: int) -> None:
    """One bad entry (the last) among good ones: below a region's base, starting at or running past its
    end, in a region that is not registered (all entries, so the plan keeps the shape), two entries onto one
    destination cell, or an entry that names region 1 but lies in region 0; checked through lists (a few
    entries) and arrays (many: sorted, and marked on the grid for three-page cells). Refused with the
    general path's message (the side named), no request made, no byte moved on either side, no
    notification. Mutation: dropping any one bound, the region check or the distinct-cells check lets the
    post through."""
    rng = np.random.default_rng(entries)
    tables = {"local": cells(agents.a, 1, entries, length, rng), "remote": cells(agents.b, 1, entries, length, rng)}
    side = fault.split()[0] if fault.split()[0] in tables else ("remote" if op == "write" else "local")
    t = tables[side]
    region = (agents.a if side == "local" else agents.b).regions[1]
    other = (agents.a if side == "local" else agents.b).regions[0]
    addr, reg = t.addr.copy(), t.region.copy()
    if fault.endswith("below the base"):
        addr[-1] = np.uint64(region.base_address - length)
    elif fault.endswith("ends past the end"):
        addr[-1] = np.uint64(region.end_address - length // 2)
    elif fault.endswith("past the end"):
        addr[-1] = np.uint64(region.end_address)
    elif fault.endswith("region"):
        reg[:] = 2
    elif fault == "overlap":   # the destination side: two entries onto one cell
        addr[-1] = addr[0]
    else:
        addr[-1] = np.uint64(other.base_address)
    tables[side] = PageTable(addr, t.nbytes, reg)
    plan = plan_for(op, tables["local"], tables["remote"])
    before = [x.copy() for x in agents.a_bufs + agents.b_bufs]
    made = agents.made
    words = {"overlap": "overlap", "local region": "not registered", "remote region": "not registered"}.get(
        fault, side)
    with pytest.raises(PageTableError, match=words):
        getattr(agents.a, op)(agents.b.name, plan, notify=b"never")
    assert agents.made == made
    assert drain_notifications(agents.b, 1, timeout=0.05) == []
    assert all(np.array_equal(got, w) for got, w in zip(agents.a_bufs + agents.b_bufs, before, strict=True))


def shifted_block_plan(rng: np.random.Generator, p: Pair, op: str, blocks: int, run_bytes: int,
                       half: bool) -> BlockPlan:
    """A BlockPlan of ``blocks`` slot pairs whose template offsets lie one slot below their region's base
    (slot 0 is never named), four runs of ``run_bytes`` per slot at distinct multiples of ``run_bytes``,
    shifted by half a run when ``half`` (runs of two grid cells); the source's runs in regions 0 and 1, the
    destination's in region 1."""
    src, _, dst, _ = p.sides(op)
    runs = 4
    step = 4 * runs * run_bytes

    def offsets(t: Transport, regions: list[int]) -> npt.NDArray[np.uint64]:
        base = np.array([t.regions[r].base_address for r in regions], np.uint64)
        place = rng.choice(step // run_bytes - 1, runs, replace=False).astype(np.uint64) * np.uint64(run_bytes)
        return base - np.uint64(step) + place + np.uint64(run_bytes // 2 if half else 0)

    src_region = np.array([0, 1, 0, 1], np.uint32)
    dst_region = np.ones(runs, np.uint32)
    slots = min(t.regions[0].nbytes for t in (src, dst)) // step
    return BlockPlan(rng.choice(np.arange(1, slots), blocks, replace=False).astype(np.uint64),
                     rng.choice(np.arange(1, slots), blocks, replace=False).astype(np.uint64),
                     np.full(runs, step, np.uint64), offsets(src, src_region.tolist()),
                     np.full(runs, step, np.uint64), offsets(dst, dst_region.tolist()),
                     np.full(runs, run_bytes, np.uint64), src_region, dst_region)


@pytest.mark.parametrize("place", ["cell", "half cell"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_block_plans_are_posted_without_their_expansion_and_land_exactly(agents: Pair, op: str, place: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A BlockPlan (past the size below which its expansion is posted instead) goes to NIXL as one request
    whose cells come from its template (no expansion is made: ``BlockPlan.expand`` is not called), with
    template offsets below the region's base (slot 0 unused), source runs in two regions, and runs of one
    grid cell or of two (offsets at half a run): the destination holds exactly what the plan's runs name,
    computed run by run. Mutation: dropping the regions' first cells, a run's cells past its first, or the
    signed offset moves other bytes."""
    monkeypatch.setattr(nixl_backend, "EXPANDED_BLOCK_RUNS", 0)
    rng = np.random.default_rng(3 if place == "cell" else 4)
    plan = shifted_block_plan(rng, agents, op, 6, 2 * PAGE, place != "cell")
    src, src_bufs, dst, dst_bufs = agents.sides(op)
    want = expected_after_blocks(plan, list(src.regions), src_bufs, list(dst.regions), dst_bufs)
    made = agents.made
    expand = BlockPlan.expand
    try:
        BlockPlan.expand = None  # type: ignore[assignment,method-assign]   # any expansion fails the post
        getattr(agents.a, op)(agents.b.name, plan, notify=b"blocks").wait(10.0)
    finally:
        BlockPlan.expand = expand  # type: ignore[method-assign]
    assert agents.made == made + 1
    assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
    assert drain_notifications(agents.b, 1) == [b"blocks"]


@pytest.mark.parametrize("fault", ["none", "past the end", "overlap"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_small_block_plans_of_one_region_a_side_land_exactly_or_are_refused_by_block(agents: Pair, op: str,
                                                                                      fault: str) -> None:
    """A small BlockPlan whose runs lie in one region a side (posted as its expansion on the per-entry path)
    lands exactly with one request; one with a slot past the destination's region or two blocks on one
    destination slot is refused naming the side and the block (the BlockPlan's own check), nothing moved."""
    rng = np.random.default_rng(9)
    runs, length = 4, 2 * PAGE
    step = 2 * runs * length
    src, src_bufs, dst, dst_bufs = agents.sides(op)

    def offsets(t: Transport) -> npt.NDArray[np.uint64]:
        place = rng.permutation(2 * runs)[:runs].astype(np.uint64) * np.uint64(length)
        return np.uint64(t.regions[1].base_address) + place

    dst_slots = rng.choice(20, 8, replace=False).astype(np.uint64)
    if fault == "past the end":
        dst_slots[3] = dst.regions[1].nbytes // step
    elif fault == "overlap":
        dst_slots[4] = dst_slots[1]
    plan = BlockPlan(rng.choice(20, 8, replace=False).astype(np.uint64), dst_slots, np.full(runs, step, np.uint64),
                     offsets(src), np.full(runs, step, np.uint64), offsets(dst), np.full(runs, length, np.uint64),
                     np.ones(runs, np.uint32), np.ones(runs, np.uint32))
    before = [x.copy() for x in agents.a_bufs + agents.b_bufs]
    made = agents.made
    side = "remote" if op == "write" else "local"
    if fault == "none":
        want = expected_after_blocks(plan, list(src.regions), src_bufs, list(dst.regions), dst_bufs)
        getattr(agents.a, op)(agents.b.name, plan, notify=b"small").wait(10.0)
        assert agents.made == made + 1
        assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
        assert drain_notifications(agents.b, 1) == [b"small"]
        return
    words = rf"{side} .*block 3.*outside region" if fault == "past the end" else rf"{side} .*overlap"
    with pytest.raises(PageTableError, match=words):
        getattr(agents.a, op)(agents.b.name, plan, notify=b"never")
    assert agents.made == made
    assert drain_notifications(agents.b, 1, timeout=0.05) == []
    assert all(np.array_equal(got, w) for got, w in zip(agents.a_bufs + agents.b_bufs, before, strict=True))


@pytest.mark.parametrize("op", ["write", "read"])
def test_phased_plans_are_posted_as_one_request_without_their_expansion(agents: Pair, op: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A PhasedPlan (two BlockPlans of different templates, runs of two cells in one, the second phase's
    destination slots none of the first's) goes to NIXL as one request over both phases' cells, no
    expansion made, and lands exactly. Mutation: posting one phase's cells only, or each with its own
    unit, moves other bytes."""
    monkeypatch.setattr(nixl_backend, "EXPANDED_BLOCK_RUNS", 0)
    rng = np.random.default_rng(12)
    a = shifted_block_plan(rng, agents, op, 4, 2 * PAGE, False)
    b = shifted_block_plan(rng, agents, op, 2, 2 * PAGE, True)
    free = np.setdiff1d(np.arange(1, 8, dtype=np.uint64), a.dst_slots)[:2]
    b = BlockPlan(b.src_slots, free, b.src_step, b.src_offset, b.dst_step, b.dst_offset, b.nbytes, b.src_region,
                  b.dst_region)
    plan = PhasedPlan((a, b))
    src, src_bufs, dst, dst_bufs = agents.sides(op)
    want = list(dst_bufs)
    for phase in plan.phases:
        want = expected_after_blocks(phase, list(src.regions), src_bufs, list(dst.regions), want)
    made = agents.made
    expand, phased_expand = BlockPlan.expand, PhasedPlan.expand
    try:
        BlockPlan.expand = PhasedPlan.expand = None  # type: ignore[assignment,method-assign]
        getattr(agents.a, op)(agents.b.name, plan, notify=b"phases").wait(10.0)
    finally:
        BlockPlan.expand, PhasedPlan.expand = expand, phased_expand  # type: ignore[method-assign]
    assert agents.made == made + 1
    assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
    assert drain_notifications(agents.b, 1) == [b"phases"]
