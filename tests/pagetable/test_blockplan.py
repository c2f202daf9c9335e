"""BlockPlan (one run template + slot pairs) and plan_blocks: the runs it names are plan_transfer's, byte
for byte by logical position, and its O(B + T) checks give the verdict of the expanded plan's checks."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import LayoutMismatch, PageTableError, ReadOnlyPageError
from kvxfer.extractor import TemplateCache, blocks, plan_blocks, plan_templated, plan_transfer
from kvxfer.pagetable import BlockPlan, TransferPlan
from tests.extractor.test_plan import (
    RELATIONS,
    check_plans,
    fill_source,
    make_side,
    random_shape,
    random_side,
    related_side,
    side,
)


def verdict(fn: Any) -> str | None:
    try:
        fn()
    except PageTableError as exc:
        return "overlap" if "overlap" in str(exc) else "bounds"
    return None


def same_runs(a: TransferPlan, b: TransferPlan) -> bool:
    """The same (source, destination, length, regions) runs, in any order."""
    def rows(p: TransferPlan) -> list[tuple[int, ...]]:
        return sorted(zip(p.src.addr.tolist(), p.dst.addr.tolist(), p.src.nbytes.tolist(), p.src.region.tolist(),
                          p.dst.region.tolist(), strict=True))
    return rows(a) == rows(b)


# --- plan_blocks against plan_transfer, by logical position ----------------------------------------
@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), relation=st.sampled_from(RELATIONS), subset=st.booleans(),
       ranged=st.booleans())
def test_a_block_plan_moves_exactly_the_cells_plan_transfer_moves(seed: int, relation: str, subset: bool,
                                                                  ranged: bool) -> None:
    """Random layouts related as ``relation``: when plan_blocks gives a plan, its expansion writes every
    destination byte with the source's (layer, role, head, token) and nothing else, once (the oracle of
    the plan_transfer tests, computed from the managers' own buffer views); when it gives None, the
    pair is one it does not cover (several layer groups, other tokens per block, a cut block)."""
    rng = np.random.default_rng(seed)
    shape = random_shape(rng)
    sp = random_side(rng)
    dp = related_side(rng, sp, relation)
    src = make_side(rng, **shape, **sp)
    dst = make_side(rng, **shape, **dp)
    layers = sorted(rng.choice(shape["layers"], int(rng.integers(1, shape["layers"] + 1)), replace=False).tolist()) \
        if subset else None
    token_range = None
    if ranged:   # whole blocks when ranged, so that the block form applies more often
        a, b = sorted(int(x) for x in rng.integers(0, 9, 2))
        token_range = (a * sp["tpb"], b * sp["tpb"])
    fill_source(src, rng)
    for pool in dst.pools():
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    bp = plan_blocks(src.layout, src.ids, dst.layout, dst.ids, layers=layers, token_range=token_range)
    full = plan_transfer(src.layout, src.ids, dst.layout, dst.ids, layers=layers, token_range=token_range)
    if bp is None:
        assert (len(src.layout.layer_groups) > 1 or len(dst.layout.layer_groups) > 1
                or sp["tpb"] != dp["tpb"] or (sp["tokens"] % sp["tpb"] or dp["tokens"] % dp["tpb"])), \
            "plan_blocks refused a pair it covers"
        return
    bp.validate(src.mgr.memory_regions(), dst.mgr.memory_regions())
    plan = bp.expand()
    assert plan.total_bytes == full.total_bytes == bp.total_bytes
    assert same_runs(plan.sort_by_source().coalesce(), full) or len(full) < len(plan)
    check_plans(dst, [(src, plan)], layers, token_range)
    again = BlockPlan.from_bytes(bp.to_bytes())
    assert same_runs(again.expand(), plan)


def named_pair(**changes: Any) -> tuple[Any, Any]:
    src = side(1, tokens=32, **changes.get("src", {}))
    dst = side(2, tokens=32, shuffle=True, **changes.get("dst", {}))
    rng = np.random.default_rng(3)
    fill_source(src, rng)
    for pool in dst.pools():
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    return src, dst


@pytest.mark.parametrize("changes", [
    {},                                                                             # identical layouts
    {"dst": {"tp_size": 2, "tp_rank": 1}},                                          # TP 1 -> 2, rank 1
    {"dst": {"tp_size": 2, "tp_rank": 0, "order": "NHD"}},                          # TP and the head order
    {"src": {"coalesce": False}},                                                   # expanded -> coalesced
    {"dst": {"coalesce": False, "tp_size": 4, "tp_rank": 3}},                       # coalesced -> expanded, TP
], ids=["identical", "tp1to2", "tp-nhd", "expanded-src", "expanded-dst-tp4"])
def test_named_layout_pairs_give_a_block_plan_that_lands_by_position(changes: dict[str, Any]) -> None:
    src, dst = named_pair(**changes)
    bp = plan_blocks(src.layout, src.ids, dst.layout, dst.ids)
    assert bp is not None and bp.num_blocks == 8
    full = plan_transfer(src.layout, src.ids, dst.layout, dst.ids)
    assert bp.total_bytes == full.total_bytes
    bp.validate(src.mgr.memory_regions(), dst.mgr.memory_regions())
    check_plans(dst, [(src, bp.expand())])


def test_a_block_plan_with_the_slot_pairs_swapped_fails_the_position_oracle() -> None:
    """Mutation: the same template with two destination slots exchanged moves the right bytes to the wrong
    blocks; the position-keyed oracle must see it (it would not, were it a digest in plan order)."""
    src, dst = named_pair(dst={"tp_size": 2, "tp_rank": 1})
    bp = plan_blocks(src.layout, src.ids, dst.layout, dst.ids)
    assert bp is not None
    slots = bp.dst_slots.copy()
    slots[[0, 1]] = slots[[1, 0]]
    swapped = BlockPlan(bp.src_slots, slots, bp.src_step, bp.src_offset, bp.dst_step, bp.dst_offset, bp.nbytes,
                        bp.src_region, bp.dst_region)
    with pytest.raises(AssertionError, match="bytes differ"):
        check_plans(dst, [(src, swapped.expand())])


def test_plan_blocks_refuses_what_plan_transfer_refuses_and_declines_what_it_cannot_shape() -> None:
    src, dst = named_pair()
    with pytest.raises(LayoutMismatch):
        plan_blocks(src.layout, src.ids, side(4, tokens=32, head_dim=8).layout, dst.ids)
    with pytest.raises(ReadOnlyPageError):
        plan_blocks(src.layout, src.ids, dst.layout, dst.ids, token_range=(0, 32), dst_committed=8)
    assert plan_blocks(src.layout, src.ids, dst.layout, dst.ids, token_range=(2, 32)) is None   # cuts block 0
    other = side(5, tokens=32, tpb=8)
    assert plan_blocks(src.layout, src.ids, other.layout, other.ids) is None
    windowed = side(6, tokens=32, windows=[None, 8])
    assert plan_blocks(windowed.layout, windowed.ids, windowed.layout, windowed.ids) is None


# --- BlockPlan checks --------------------------------------------------------------------------------
REGIONS = [MemoryRegion(1 << 20, 1 << 16), MemoryRegion(1 << 24, 1 << 16)]


def block_plan(dst_slots: list[int], dst_step: list[int], dst_offset: list[int], nbytes: list[int],
               dst_region: list[int] | None = None) -> BlockPlan:
    t = len(nbytes)
    return BlockPlan(np.arange(len(dst_slots)), np.array(dst_slots), np.full(t, 4096), np.full(t, 1 << 30),
                     np.array(dst_step), np.array(dst_offset), np.array(nbytes),
                     np.zeros(t, np.uint32), np.array(dst_region if dst_region is not None else [0] * t))


SRC = [MemoryRegion(1 << 30, 1 << 20)]


def test_two_blocks_on_one_destination_slot_are_an_overlap() -> None:
    bp = block_plan([3, 5, 3], [1024], [(1 << 20)], [512])
    with pytest.raises(PageTableError, match="overlap"):
        bp.validate(SRC, REGIONS)
    block_plan([3, 5, 4], [1024], [(1 << 20)], [512]).validate(SRC, REGIONS)


def test_a_template_wider_than_its_slot_stride_overlaps_the_next_slot() -> None:
    # Runs at offsets 0 and 1024 of a 1024-byte stride: slot 1's first run is slot 0's second.
    bp = block_plan([0, 1], [1024, 1024], [1 << 20, (1 << 20) + 1024], [512, 512])
    with pytest.raises(PageTableError, match="overlap"):
        bp.validate(SRC, REGIONS)
    block_plan([0, 2], [1024, 1024], [1 << 20, (1 << 20) + 1024], [512, 512]).validate(SRC, REGIONS)


def test_a_run_past_its_region_names_the_block_and_the_template_run() -> None:
    bp = block_plan([0, 63, 64], [1024], [1 << 20], [1024])   # slot 64 starts at the region's end
    with pytest.raises(PageTableError, match=r"destination run \(block 2, template run 0\).*outside region 0"):
        bp.validate(SRC, REGIONS)
    with pytest.raises(PageTableError, match="region 2 not registered"):
        block_plan([0], [1024], [1 << 20], [1024], [2]).validate(SRC, REGIONS)


def test_aliased_destination_regions_are_checked_by_address() -> None:
    aliased = [MemoryRegion(1 << 20, 1 << 16), MemoryRegion(1 << 20, 1 << 16)]
    bp = block_plan([0, 1], [1024, 1024], [1 << 20, 1 << 20], [512, 512], [0, 1])
    with pytest.raises(PageTableError, match="overlap"):
        bp.validate(SRC, aliased)
    block_plan([0, 1], [1024, 1024], [1 << 20, 1 << 24], [512, 512], [0, 1]).validate(SRC, REGIONS)   # apart


def test_addresses_past_2_63_are_refused_at_construction() -> None:
    with pytest.raises(PageTableError, match="overflow"):
        block_plan([1 << 40], [1 << 30], [0], [16])


def test_the_wire_form_round_trips_and_hostile_bytes_raise_page_table_errors() -> None:
    bp = block_plan([3, 5, 4], [1024, 1024], [1 << 20, (1 << 20) + 512], [512, 256])
    again = BlockPlan.from_bytes(bp.to_bytes())
    assert same_runs(again.expand(), bp.expand())
    raw = bp.to_bytes()
    for bad in (b"", raw[:7], raw[:20], raw[:-1], raw + b"\0", b"\xff" * 8 + raw[8:], raw[:8] + b"XXXX" + raw[12:]):
        with pytest.raises(PageTableError):
            BlockPlan.from_bytes(bad)
    with pytest.raises(PageTableError):
        BlockPlan.from_bytes("not bytes")  # type: ignore[arg-type]


def test_the_arrays_of_a_block_plan_are_its_own_and_read_only() -> None:
    slots = np.array([1, 2], np.uint64)
    bp = block_plan([1, 2], [1024], [1 << 20], [512])
    assert slots.flags.writeable
    with pytest.raises(ValueError):
        bp.dst_slots[0] = 1


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_the_shape_check_agrees_with_the_expanded_plans_check(data: st.DataObject) -> None:
    """Random small block plans over two regions (sometimes aliased): ``validate``'s verdict (accepted,
    out of bounds, overlap) is the expanded TransferPlan's own."""
    t = data.draw(st.integers(1, 4))
    b = data.draw(st.integers(1, 5))
    unit = 256
    aliased = data.draw(st.booleans())
    dst_regions = [MemoryRegion(1 << 20, 64 * unit), MemoryRegion((1 << 20) if aliased else (1 << 24), 64 * unit)]
    region = [data.draw(st.integers(0, 1)) for _ in range(t)]
    step = [data.draw(st.sampled_from([0, unit, 2 * unit, 4 * unit])) for _ in range(t)]
    offset = [dst_regions[r].base_address + data.draw(st.integers(0, 8)) * unit // 2 for r in region]
    nbytes = [data.draw(st.sampled_from([0, unit // 2, unit, 2 * unit])) for _ in range(t)]
    slots = [data.draw(st.integers(0, 20)) for _ in range(b)]
    bp = BlockPlan(np.arange(b), np.array(slots), np.full(t, 4 * unit), np.full(t, 1 << 30), np.array(step),
                   np.array(offset), np.array(nbytes), np.zeros(t, np.uint32), np.array(region))
    got = verdict(lambda: bp.validate(SRC, dst_regions))
    want = verdict(lambda: bp.expand().validate(SRC, dst_regions))
    assert got == want, (got, want, bp)


def test_one_block_whose_template_runs_have_different_steps_is_checked_at_its_addresses() -> None:
    """Found by the property test: one block at slot 1, a run of step 256 at offset 0 and a run of step 0
    at offset 128. The offsets alone do not meet, the addresses (256 and 128 + 256 bytes) do."""
    base = 1 << 20
    bp = BlockPlan(np.zeros(1), np.ones(1), np.full(2, 4096), np.array([1 << 30, (1 << 30) + 1024]),
                   np.array([256, 0]), np.array([base, base + 128]), np.array([128, 256]), np.zeros(2, np.uint32),
                   np.zeros(2, np.uint32))
    with pytest.raises(PageTableError, match="overlap"):
        bp.validate(SRC, REGIONS)


# --- plan_templated: any block sizes, head splits and orders, O(blocks + template) ------------------
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), relation=st.sampled_from(RELATIONS), subset=st.booleans(),
       ranged=st.booleans())
def test_templated_plans_move_exactly_the_cells_plan_transfer_moves(seed: int, relation: str, subset: bool,
                                                                    ranged: bool) -> None:
    """Random layouts related as ``relation`` (tokens per block included) and any token range: the phases'
    expansions together write every destination byte with the source's (layer, role, head, token) once,
    move plan_transfer's bytes, and hold fewer runs than the expansion (slot pairs + template runs); None
    only for several layer groups."""
    rng = np.random.default_rng(seed)
    shape = random_shape(rng)
    sp = random_side(rng)
    dp = related_side(rng, sp, relation)
    src = make_side(rng, **shape, **sp)
    dst = make_side(rng, **shape, **dp)
    layers = sorted(rng.choice(shape["layers"], int(rng.integers(1, shape["layers"] + 1)), replace=False).tolist()) \
        if subset else None
    token_range = None
    if ranged:
        a, b = sorted(int(x) for x in rng.integers(0, 31, 2))
        token_range = (a, b)
    fill_source(src, rng)
    for pool in dst.pools():
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids, layers=layers, token_range=token_range)
    full = plan_transfer(src.layout, src.ids, dst.layout, dst.ids, layers=layers, token_range=token_range)
    if phases is None:
        assert len(src.layout.layer_groups) > 1 or len(dst.layout.layer_groups) > 1
        return
    for bp in phases:
        bp.validate(src.mgr.memory_regions(), dst.mgr.memory_regions())
    plan = TransferPlan.concat([bp.expand() for bp in phases])
    assert plan.total_bytes == full.total_bytes == sum(bp.total_bytes for bp in phases)
    check_plans(dst, [(src, plan)], layers, token_range)


@pytest.mark.parametrize("changes", [
    {"dst": {"tpb": 8}},                                                            # 4 -> 8 tokens per block
    {"dst": {"tpb": 2}},                                                            # 4 -> 2
    {"dst": {"tpb": 3, "order": "NHD"}},                                            # 4 -> 3 and the head order
    {"dst": {"tpb": 8, "tp_size": 2, "tp_rank": 1}},                                # TP 1 -> 2 with 4 -> 8
    {"src": {"tp_size": 2, "tp_rank": 0}, "dst": {"tpb": 2}},                       # TP 2 -> 1 (rank 0) with 4 -> 2
], ids=["tpb4to8", "tpb4to2", "tpb4to3-nhd", "tp1to2-tpb4to8", "tp2to1-tpb4to2"])
def test_block_size_changes_give_a_few_phases_that_land_by_position(changes: dict[str, Any]) -> None:
    """A block-size change cuts the transfer into a few segment shapes ((ts + td) / gcd - 1 at most: the
    cuts of both block grids inside one common period), each one BlockPlan; together they land every cell
    where it belongs."""
    src, dst = named_pair(**changes)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    ts, td = src.layout.tokens_per_block, dst.layout.tokens_per_block
    assert phases is not None and 1 < len(phases) <= (ts + td) // math.gcd(ts, td) - 1
    full = plan_transfer(src.layout, src.ids, dst.layout, dst.ids)
    assert sum(bp.total_bytes for bp in phases) == full.total_bytes
    assert sum(bp.num_blocks for bp in phases) <= 2 * 32   # one slot pair per segment: O(blocks)
    check_plans(dst, [(src, TransferPlan.concat([bp.expand() for bp in phases]))])


@pytest.mark.parametrize("changes", [
    {"dst": {"tpb": 8}},
    {"dst": {"tpb": 2, "order": "NHD"}},
    {"dst": {"tpb": 3, "tp_size": 2, "tp_rank": 1}},
    {"src": {"coalesce": False}, "dst": {"order": "NHD"}},
], ids=["tpb4to8", "tpb4to2-nhd", "tpb4to3-tp", "expanded-nhd"])
def test_a_prompt_ending_inside_a_block_costs_one_probe_and_moves_plan_transfers_runs(
        changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The last segment of a prompt that ends inside a block is a shorter shape from the same offsets as a
    whole one: its template comes from one probe placed inside the whole segment's runs (not three), and for
    every end the phases move exactly plan_transfer's runs and land by position."""
    src, dst = named_pair(**changes)
    probes: list[tuple[int, int]] = []
    real = blocks.plan_transfer

    def counted(*args: Any, **kw: Any) -> TransferPlan:
        probes.append(kw["token_range"])
        return real(*args, **kw)

    monkeypatch.setattr(blocks, "plan_transfer", counted)
    templates = TemplateCache()
    ts, td = src.layout.tokens_per_block, dst.layout.tokens_per_block
    whole = ts * td // math.gcd(ts, td) * (32 // (ts * td // math.gcd(ts, td)))
    assert plan_templated(src.layout, src.ids, dst.layout, dst.ids, token_range=(0, whole), templates=templates)
    made = len(templates)
    for end in range(1, whole):
        before, shapes = len(probes), len(templates)
        phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids, token_range=(0, end), templates=templates)
        assert phases is not None
        assert len(probes) - before == len(templates) - shapes     # one probe per new shape
        full = real(src.layout, src.ids, dst.layout, dst.ids, token_range=(0, end))
        assert same_runs(TransferPlan.concat([bp.expand() for bp in phases]), full)
        check_plans(dst, [(src, TransferPlan.concat([bp.expand() for bp in phases]))], None, (0, end))
    assert len(templates) > made


def test_a_shorter_segments_runs_with_the_other_sides_stride_fail_the_checks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: a placement that gives each short run the other side's slot stride (4 and 8 tokens per block:
    they differ) moves bytes to the wrong slots: the plan's bounds or the byte-by-position oracle see it."""
    src, dst = named_pair(dst={"tpb": 8})
    real = blocks._derive_within

    def shifted(wider: Any, *args: Any) -> Any:
        template = real(wider, *args)
        if template is None:
            return template
        assert not np.array_equal(template[0], template[2])
        return (template[2], template[1], template[0], *template[3:])

    monkeypatch.setattr(blocks, "_derive_within", shifted)
    templates = TemplateCache()
    assert plan_templated(src.layout, src.ids, dst.layout, dst.ids, token_range=(0, 32), templates=templates)
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids, token_range=(0, 29), templates=templates)
    assert phases is not None
    with pytest.raises((AssertionError, PageTableError), match=r"bytes differ|outside region"):
        check_plans(dst, [(src, TransferPlan.concat([bp.expand() for bp in phases]))], None, (0, 29))


def test_a_phase_with_two_segments_exchanged_fails_the_position_oracle() -> None:
    """Mutation: one phase with two segments' destination slots exchanged moves the right bytes to the
    wrong blocks (every check on bounds and overlap still passes); the position-keyed oracle must see it."""
    src, dst = named_pair(dst={"tpb": 8})
    phases = plan_templated(src.layout, src.ids, dst.layout, dst.ids)
    assert phases is not None
    bp = phases[-1]
    assert bp.num_blocks >= 2
    slots = bp.dst_slots.copy()
    slots[[0, 1]] = slots[[1, 0]]
    swapped = BlockPlan(bp.src_slots, slots, bp.src_step, bp.src_offset, bp.dst_step, bp.dst_offset, bp.nbytes,
                        bp.src_region, bp.dst_region)
    with pytest.raises(AssertionError, match="bytes differ"):
        check_plans(dst, [(src, TransferPlan.concat([p.expand() for p in [*phases[:-1], swapped]]))])
