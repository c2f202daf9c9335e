"""PageTable and TransferPlan: coalesce, split, chunks, validate and the bounded wire codec."""

from __future__ import annotations

import contextlib
import itertools
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError
from kvxfer.pagetable import PLAN_MAGIC, TABLE_MAGIC, WIRE_VERSION, PageTable, TransferPlan, wire


def table(addr: list[int], nbytes: list[int], region: list[int] | None = None, **coords: list[int]) -> PageTable:
    return PageTable(np.array(addr, np.uint64), np.array(nbytes, np.uint64),
                     np.array(region if region is not None else [0] * len(addr), np.uint32),
                     {k: np.array(v, np.int64) for k, v in coords.items()})


def rows(t: PageTable) -> list[tuple[int, int, int]]:
    return list(zip(t.addr.tolist(), t.nbytes.tolist(), t.region.tolist(), strict=True))


# --- PageTable -----------------------------------------------------------------------------------
def test_coalesce_merges_only_consecutive_adjacent_entries_of_one_region() -> None:
    t = table([100, 110, 200, 250, 300, 50, 60], [10, 90, 50, 50, 8, 10, 4], [0, 0, 0, 0, 1, 1, 1], layer=[0] * 7)
    c = t.coalesce()
    # 100..200 and 200..300 touch but 300 is in region 1; 50 after 300 is not adjacent going forward
    assert rows(c) == [(100, 200, 0), (300, 8, 1), (50, 14, 1)]
    assert c.total_bytes == t.total_bytes and c.coords == {}
    assert rows(table([10, 0], [5, 10]).coalesce()) == [(10, 5, 0), (0, 10, 0)]   # order is kept


def test_split_cuts_long_entries_into_max_bytes_pieces() -> None:
    t = table([0, 1000, 5000], [10, 4, 0], [0, 1, 2])
    assert rows(t.split(4)) == [(0, 4, 0), (4, 4, 0), (8, 2, 0), (1000, 4, 1), (5000, 0, 2)]
    assert rows(t.split(100)) == rows(t)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(PageTableError, match="max_bytes"):
            t.split(bad)  # type: ignore[arg-type]


def test_chunks_are_consecutive_balanced_and_never_cut_entries() -> None:
    t = table(list(range(0, 800, 100)), [100] * 8, layer=list(range(8)))
    parts = t.chunks(4)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert [p.coords["layer"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(p) for p in t.chunks(3)] == [3, 2, 3]
    assert len(t.chunks(100)) == 8 and len(t.chunks(1)) == 1
    assert PageTable.empty().chunks(3) == []
    skewed = table([0, 1000, 2000, 3000], [1000, 10, 10, 10])
    assert [len(p) for p in skewed.chunks(2)] == [1, 3]
    with pytest.raises(PageTableError, match="n must be"):
        t.chunks(0)


def test_validate_names_the_first_bad_entry() -> None:
    regions = [MemoryRegion(1000, 100), MemoryRegion(5000, 50)]
    table([1000, 5040], [100, 10], [0, 1]).validate(regions)
    with pytest.raises(PageTableError, match=r"entry 1: .* outside region 1"):
        table([1000, 5041], [10, 10], [0, 1]).validate(regions)
    with pytest.raises(PageTableError, match="entry 0: region 2 not registered"):
        table([1000], [1], [2]).validate(regions)
    with pytest.raises(PageTableError, match="entry 0"):
        table([999], [2], [0]).validate(regions)
    with pytest.raises(PageTableError, match="entry 0"):
        table([2**64 - 8], [16], [0]).validate([MemoryRegion(2**64 - 32, 31)])


def test_constructor_refuses_ragged_arrays_and_bad_coords() -> None:
    with pytest.raises(PageTableError, match="equal length"):
        PageTable(np.zeros(2, np.uint64), np.zeros(3, np.uint64), np.zeros(2, np.uint32))
    with pytest.raises(PageTableError, match="coords"):
        table([1, 2], [1, 1], layer=[1])
    with pytest.raises(PageTableError, match="identifier"):
        PageTable(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(1, np.uint32), {"bad name": np.zeros(1)})


def test_concat_and_take_keep_coords() -> None:
    a, b = table([0], [4], layer=[3]), table([8, 16], [4, 4], layer=[5, 6])
    c = PageTable.concat([a, b])
    assert rows(c) == [(0, 4, 0), (8, 4, 0), (16, 4, 0)] and c.coords["layer"].tolist() == [3, 5, 6]
    assert c.take(np.array([2, 0])).coords["layer"].tolist() == [6, 3]
    assert PageTable.concat([a, table([1], [1])]).coords == {}
    assert len(PageTable.concat([])) == 0


tables = st.integers(0, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 2**63), min_size=n, max_size=n), st.lists(st.integers(0, 2**20), min_size=n, max_size=n),
    st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n),
    st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n)))


@settings(max_examples=60, deadline=None)
@given(tables)
def test_table_wire_round_trip(cols: tuple[list[int], list[int], list[int], list[int]]) -> None:
    addr, nbytes, region, layer = cols
    t = table(addr, nbytes, region, layer=layer, block=list(range(len(addr))))
    back = PageTable.from_bytes(t.to_bytes())
    assert rows(back) == rows(t)
    assert {k: v.tolist() for k, v in back.coords.items()} == {k: v.tolist() for k, v in t.coords.items()}
    assert list(back.coords) == ["layer", "block"]


@settings(max_examples=60, deadline=None)
@given(tables, st.integers(2**14, 2**33))
def test_split_then_coalesce_gives_back_the_coalesced_table(cols: tuple[list[int], ...], step: int) -> None:
    addr, nbytes, region, _ = cols
    t = table(addr, nbytes, region)
    pieces = t.split(step)
    assert pieces.total_bytes == t.total_bytes
    assert int(pieces.nbytes.max(initial=0)) <= step
    assert rows(pieces.coalesce()) == rows(t.coalesce().coalesce())


def test_decoder_refuses_each_malformation_with_page_table_error() -> None:
    good = table([1, 2], [3, 4], [0, 1], layer=[7, 8]).to_bytes()
    header = wire.encode_header(TABLE_MAGIC, wire.WireHeader(2, ("layer",)))
    assert good.startswith(header) and len(good) == len(header) + 2 * (8 + 8 + 4 + 8)
    size = len(header) - wire.PREFIX.size
    columns = good[len(header):]

    def with_header(h: wire.WireHeader) -> bytes:
        return wire.encode_header(TABLE_MAGIC, h) + columns
    cases = {
        "truncated header": good[:6],
        "truncated header \\(9 header bytes": good[:wire.PREFIX.size + size - 1],
        "bad magic": b"XXXX" + good[4:],
        "unsupported version": good[:4] + struct.pack("<H", WIRE_VERSION + 1) + good[6:],
        "header says": good[:-1],
        "payload has": good + b"\0",
        "malformed header": good[:wire.PREFIX.size] + b"\xc1" + good[wire.PREFIX.size + 1:],
        "matching regex": with_header(wire.WireHeader(2, ("1ayer",))),
        "length <= 64": with_header(wire.WireHeader(2, tuple(f"c{i}" for i in range(65)))),
        "repeat a name": with_header(wire.WireHeader(2, ("layer", "layer"))),
        "overflows": table([2**64 - 1], [2]).to_bytes(),
    }
    for what, data in cases.items():
        with pytest.raises(PageTableError, match=what):
            PageTable.from_bytes(data)
    with pytest.raises(PageTableError, match="expected bytes"):
        PageTable.from_bytes("text")  # type: ignore[arg-type]


def test_hostile_count_is_refused_without_allocating() -> None:
    header = wire.encode_header(TABLE_MAGIC, wire.WireHeader(2**62))
    with pytest.raises(PageTableError, match=r"header says 4611686018427387904 entries"):
        PageTable.from_bytes(header + b"\0" * 40)
    with pytest.raises(PageTableError, match="header says"):
        TransferPlan.from_bytes(wire.encode_header(PLAN_MAGIC, wire.WireHeader(2**63)) + b"\0" * 32)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_fuzz_arbitrary_bytes_only_raise_page_table_error(data: bytes) -> None:
    for cls in (PageTable, TransferPlan):
        try:
            out = cls.from_bytes(data)
        except PageTableError:
            continue
        assert len(out) * 20 <= len(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decoder_fuzz_mutated_valid_messages(data: st.DataObject) -> None:
    """Valid encodings with bytes flipped, cut or appended decode or raise PageTableError, nothing else."""
    t = table([1, 2, 3], [3, 4, 5], [0, 1, 2], layer=[7, 8, 9])
    for good in (t.to_bytes(), TransferPlan(t, t).to_bytes()):
        buf = bytearray(good)
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(buf)))
        tail = data.draw(st.binary(max_size=8))
        for cls in (PageTable, TransferPlan):
            with contextlib.suppress(PageTableError):
                cls.from_bytes(bytes(buf[:cut]) + tail)


# --- TransferPlan --------------------------------------------------------------------------------
def test_plan_refuses_unequal_sides() -> None:
    with pytest.raises(PageTableError, match="2 source entries vs 1"):
        TransferPlan(table([0, 8], [8, 8]), table([0], [8]))
    with pytest.raises(PageTableError, match="entry 1: source 8 bytes vs destination 4"):
        TransferPlan(table([0, 8], [8, 8]), table([0, 8], [8, 4]))


def test_plan_coalesce_needs_both_sides_adjacent() -> None:
    src = table([0, 10, 20, 30], [10, 10, 10, 10])
    dst = table([100, 110, 500, 510], [10, 10, 10, 10])
    c = TransferPlan(src, dst).coalesce()
    assert rows(c.src) == [(0, 20, 0), (20, 20, 0)] and rows(c.dst) == [(100, 20, 0), (500, 20, 0)]
    other_region = TransferPlan(src, table([100, 110, 120, 130], [10] * 4, [0, 1, 1, 1])).coalesce()
    assert len(other_region) == 2


def test_plan_sort_by_source_then_coalesce_finds_every_merge() -> None:
    src = table([20, 0, 10], [10, 10, 10])
    dst = table([520, 500, 510], [10, 10, 10])
    plan = TransferPlan(src, dst)
    assert len(plan.coalesce()) == 2
    merged = plan.sort_by_source().coalesce()
    assert rows(merged.src) == [(0, 30, 0)] and rows(merged.dst) == [(500, 30, 0)]
    in_order = TransferPlan(table([0, 5], [5, 5]), table([0, 5], [5, 5]))
    assert in_order.sort_by_source() is in_order


def test_plan_split_chunks_and_wire() -> None:
    plan = TransferPlan(table([0, 100], [10, 3], [0, 1]), table([1000, 50], [10, 3], [2, 0]))
    s = plan.split(4)
    assert rows(s.src) == [(0, 4, 0), (4, 4, 0), (8, 2, 0), (100, 3, 1)]
    assert rows(s.dst) == [(1000, 4, 2), (1004, 4, 2), (1008, 2, 2), (50, 3, 0)]
    assert [p.total_bytes for p in s.chunks(2)] == [8, 5]
    back = TransferPlan.from_bytes(s.to_bytes())
    assert rows(back.src) == rows(s.src) and rows(back.dst) == rows(s.dst)
    assert len(s.to_bytes()) == wire.PREFIX.size + 3 + 4 * 32   # prefix, header [4, []], 4 rows of 32 bytes
    assert len(TransferPlan.from_bytes(TransferPlan.empty().to_bytes())) == 0


def test_plan_validate_refuses_overlapping_destination_and_outside_entries() -> None:
    regions = [MemoryRegion(0, 100), MemoryRegion(1000, 100)]
    ok = TransferPlan(table([0, 10], [10, 10]), table([1000, 1010], [10, 10], [1, 1]))
    ok.validate(regions, regions)
    twice = TransferPlan(table([0, 10, 20], [10, 10, 10]), table([1050, 1000, 1005], [10, 10, 10], [1, 1, 1]))
    with pytest.raises(PageTableError, match=r"destination entries 1 .* and 2 .* overlap"):
        twice.validate(regions, regions)
    # reads may overlap (one source byte to two places), writes may not
    TransferPlan(table([0, 0], [10, 10]), table([1000, 1010], [10, 10], [1, 1])).validate(regions, regions)
    with pytest.raises(PageTableError, match="source entry 0"):
        TransferPlan(table([95], [10]), table([1000], [10], [1])).validate(regions, regions)
    with pytest.raises(PageTableError, match="destination entry 0"):
        TransferPlan(table([0], [10]), table([1095], [10], [1])).validate(regions, regions)


@pytest.mark.parametrize("clash", ["same slot", "same slot other order", "straddles", "none"])
def test_plan_validate_uniform_power_of_two_entries(clash: str) -> None:
    """The O(n) check for equal power-of-two entries on slot boundaries (the common KV plan) finds the
    same overlaps as the sort; entries off the slot grid fall back to the sort and are still refused."""
    regions = [MemoryRegion(4096, 64 * 16), MemoryRegion(65536, 64 * 16)]
    src = table([4096 + 16 * i for i in range(4)], [16] * 4)
    dst_addr = {"same slot": [65536, 65536 + 32, 4096, 65536 + 32], "same slot other order":
                [65536 + 48, 4096 + 16, 65536, 4096 + 16], "straddles": [65536, 65536 + 24, 4096, 65536 + 32],
                "none": [65536 + 48, 4096, 65536, 4096 + 16]}[clash]
    region = [1 if a >= 65536 else 0 for a in dst_addr]
    plan = TransferPlan(src, table(dst_addr, [16] * 4, region))
    if clash == "none":
        plan.validate(regions, regions)
    else:
        with pytest.raises(PageTableError, match="overlap"):
            plan.validate(regions, regions)


def _outcome(fn: object) -> str | None:
    try:
        fn()   # type: ignore[operator]
    except PageTableError as exc:
        return str(exc)
    return None


_SMALL_REGIONS = [MemoryRegion(0x10000, 0x1000), MemoryRegion(0x40000, 0x800)]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(-0x80, 0x1100), st.sampled_from([0, 1, 16, 64, 0x100, 0x400])),
                min_size=1, max_size=16),
       st.booleans())
def test_small_tables_are_validated_exactly_as_large_ones(entries: list[tuple[int, int, int]], big_len: bool) -> None:
    """The plain-Python path for <= 16 entries agrees with the vectorised one: same verdict, same message
    (bounds, unregistered regions, 64-bit wrap-around, overlapping destinations)."""
    region = np.array([r for r, _, _ in entries], dtype=np.uint32)
    base = np.array([_SMALL_REGIONS[min(r, 1)].base_address for r, _, _ in entries], dtype=np.int64)
    addr = (base + np.array([o for _, o, _ in entries])).astype(np.uint64)
    nbytes = np.array([n for _, _, n in entries], dtype=np.uint64)
    if big_len:   # one entry that wraps around 2**64
        nbytes[0] = np.uint64(2**64 - 16)
    table = PageTable(addr, nbytes, region)
    verdict = _outcome(lambda: table._validate_small(_SMALL_REGIONS))
    assert verdict == _outcome(lambda: table._validate_vectorised(_SMALL_REGIONS))
    if len(set(nbytes.tolist())) == 1 and int(nbytes[0]) > 0:   # the one-length fast path, same verdict
        assert verdict == _outcome(lambda: table._validate_vectorised(_SMALL_REGIONS, int(nbytes[0])))
    if verdict is None:   # validate checks overlaps only between entries inside their regions
        plan = TransferPlan(table, table)
        assert _outcome(plan._check_disjoint_small) == \
            _outcome(lambda: plan._check_disjoint_vectorised(_SMALL_REGIONS))


def test_small_path_mutation_is_caught() -> None:
    """The comparison above can fail: a small table one byte past its region is refused by both paths."""
    table = PageTable(np.array([0x10000 + 0x1000 - 16], np.uint64), np.array([17], np.uint64), np.zeros(1, np.uint32))
    assert _outcome(lambda: table._validate_small(_SMALL_REGIONS)) is not None
    assert _outcome(lambda: table._validate_small(_SMALL_REGIONS)) == \
        _outcome(lambda: table._validate_vectorised(_SMALL_REGIONS))


@settings(max_examples=300, deadline=None)
@given(st.integers(17, 60), st.sampled_from([16, 64, 48]), st.sampled_from([0, 8, 64]), st.booleans(),
       st.integers(0, 3), st.randoms(use_true_random=False))
def test_uniform_length_plans_are_refused_exactly_when_bytes_overlap(n: int, length: int, skew: int, two: bool,
                                                                    clashes: int, rnd: Any) -> None:
    """Plans of more than 16 entries of one length (the vectorised fast paths: one pass for the
    shared length, the slot count for overlaps) against a brute-force oracle over byte intervals:
    refused for overlap exactly when two destination intervals share a byte, else accepted."""
    regions = [MemoryRegion(0x100000 + skew, 64 * 256), MemoryRegion(0x200000, 64 * 256)]
    slots = rnd.sample(range(250), n)
    dst_region = [rnd.randrange(2) if two else 0 for _ in range(n)]
    dst_addr = [regions[r].base_address + s * 64 for r, s in zip(dst_region, slots, strict=True)]
    for _ in range(clashes):   # move one entry onto (or across) another's bytes
        i, j = rnd.sample(range(n), 2)
        dst_addr[i], dst_region[i] = dst_addr[j] + rnd.choice([0, 8, length - 8]), dst_region[j]
    src = table([regions[0].base_address + 64 * i for i in range(n)], [length] * n)
    plan = TransferPlan(src, table(dst_addr, [length] * n, dst_region))
    spans = sorted((a, a + length) for a in dst_addr)
    overlap = any(b[0] < a[1] for a, b in itertools.pairwise(spans))
    outside = any(not regions[r].contains(a, length) for a, r in zip(dst_addr, dst_region, strict=True))
    got = _outcome(lambda: plan.validate(regions, regions))
    if outside:
        assert got is not None and "outside region" in got
    elif overlap:
        assert got is not None and "overlap" in got
    else:
        assert got is None


def test_the_slot_marks_of_an_unvalidated_table_outside_its_region_show_nothing() -> None:
    """``_uniform_and_disjoint`` marks each entry's slot in an array over the regions' slots; an entry
    past its region (a caller that did not validate first) must give "not shown", never an index error
    or a wrapped (negative) index that would hide a clash."""
    from kvxfer.pagetable.plan import _uniform_and_disjoint
    regions = [MemoryRegion(0x100000, 64 * 32)]
    inside = table([0x100000 + 64 * i for i in range(20)], [64] * 20)
    assert _uniform_and_disjoint(inside, regions)
    past = table([0x100000 + 64 * i for i in range(19)] + [0x100000 + 64 * 40], [64] * 20)
    assert not _uniform_and_disjoint(past, regions)
    below = table([0x100000 + 64 * i for i in range(19)] + [0x100000 - 64], [64] * 20)
    assert not _uniform_and_disjoint(below, regions)
    twice = table([0x100000 + 64 * i for i in range(19)] + [0x100000], [64] * 20)
    assert not _uniform_and_disjoint(twice, regions)


def test_an_overlap_between_two_regions_that_alias_one_buffer_is_refused() -> None:
    """Registration allows two regions over the same bytes (pools that alias on purpose). Entries at one
    address in the two regions write the same bytes twice, though their slots within each region differ:
    the per-region slot marks must not call them disjoint (they did, before ``regions_disjoint``)."""
    regions = [MemoryRegion(1 << 20, 1 << 16), MemoryRegion(1 << 20, 1 << 16)]
    n = 32
    addr = [(1 << 20) + 256 * i for i in range(n - 1)] + [1 << 20]   # the last one (region 1) = entry 0
    dst = table(addr, [256] * n, [0] * (n - 1) + [1])
    src = table([(1 << 30) + 256 * i for i in range(n)], [256] * n)
    with pytest.raises(PageTableError, match=r"entries 0 .* and 31 .* overlap"):
        TransferPlan(src, dst).validate([MemoryRegion(1 << 30, 1 << 20)], regions)
    apart = [MemoryRegion(1 << 20, 1 << 16), MemoryRegion(1 << 24, 1 << 16)]   # the same offsets, two buffers
    moved = table([*addr[:-1], 1 << 24], [256] * n, [0] * (n - 1) + [1])
    TransferPlan(src, moved).validate([MemoryRegion(1 << 30, 1 << 20)], apart)
