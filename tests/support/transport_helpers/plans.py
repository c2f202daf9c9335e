"""Seeded memory and plans for transport tests: regions backed by numpy, random page plans."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.pagetable import BlockPlan, PageTable, TransferPlan

PAGE = 4096


def make_buffers(sizes: list[int], seed: int | None) -> list[npt.NDArray[np.uint8]]:
    """Page-aligned host buffers, filled with seeded random bytes (zeros when seed is None)."""
    out = []
    for i, n in enumerate(sizes):
        raw = np.zeros(n + PAGE, dtype=np.uint8)
        off = (-raw.ctypes.data) % PAGE
        buf = raw[off:off + n]
        if seed is not None:
            buf[:] = np.random.default_rng(seed * 1000 + i).integers(0, 256, n, dtype=np.uint8)
        out.append(buf)
    return out


def regions_of(bufs: list[npt.NDArray[np.uint8]]) -> list[MemoryRegion]:
    return [MemoryRegion(int(b.ctypes.data), int(b.nbytes), "cpu", 0) for b in bufs]


def random_pages(rng: np.random.Generator, regions: list[MemoryRegion], count: int, page: int,
                 coalesced: bool) -> PageTable:
    """``count`` distinct pages of ``page`` bytes spread over ``regions``; coalesced: whole runs of
    consecutive pages (as consecutive slots give), else one entry per page in random order."""
    slots = [r.nbytes // page for r in regions]
    total = sum(slots)
    pick = np.sort(rng.choice(total, size=count, replace=False))
    if not coalesced:
        pick = rng.permutation(pick)
    first = np.cumsum(slots) - np.array(slots)
    region = (np.searchsorted(first, pick, side="right") - 1).astype(np.uint32)
    base = np.array([r.base_address for r in regions], dtype=np.uint64)[region]
    addr = base + (pick - first[region]).astype(np.uint64) * np.uint64(page)
    table = PageTable(addr, np.full(count, page, np.uint64), region)
    return merge(table) if coalesced else table


def merge(t: PageTable) -> PageTable:
    """Merge entries that follow each other in memory (in order, same region)."""
    if len(t) < 2:
        return t
    follows = (t.addr[:-1] + t.nbytes[:-1] == t.addr[1:]) & (t.region[:-1] == t.region[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return PageTable(t.addr[starts], np.add.reduceat(t.nbytes, starts).astype(np.uint64), t.region[starts])


def pair(src: PageTable, dst: PageTable) -> TransferPlan:
    """Cut two tables of equal total size at every boundary of either, giving a valid plan."""
    cuts = np.union1d(np.cumsum(src.nbytes), np.cumsum(dst.nbytes)).astype(np.uint64)
    starts = np.concatenate(([0], cuts[:-1])).astype(np.uint64)

    def cut(t: PageTable) -> PageTable:
        ends = np.cumsum(t.nbytes).astype(np.uint64)
        i = np.searchsorted(ends, starts, side="right")
        within = starts - (ends[i] - t.nbytes[i])
        return PageTable(t.addr[i] + within, cuts - starts, t.region[i])

    return TransferPlan(cut(src), cut(dst))


def expected_after(plan: TransferPlan, src_regions: list[MemoryRegion], src_bytes: list[npt.NDArray[np.uint8]],
                   dst_regions: list[MemoryRegion], dst_bytes: list[npt.NDArray[np.uint8]]
                   ) -> list[npt.NDArray[np.uint8]]:
    """What the destination regions hold after the plan ran (computed with numpy, not the transport)."""
    out = [b.copy() for b in dst_bytes]
    for s, d, n, sr, dr in zip(plan.src.addr.tolist(), plan.dst.addr.tolist(), plan.src.nbytes.tolist(),
                               plan.src.region.tolist(), plan.dst.region.tolist(), strict=True):
        so = s - src_regions[sr].base_address
        do = d - dst_regions[dr].base_address
        out[dr][do:do + n] = src_bytes[sr][so:so + n]
    return out


def random_block_plan(rng: np.random.Generator, src_regions: list[MemoryRegion], dst_regions: list[MemoryRegion],
                      blocks: int, runs: int, run_bytes: int) -> BlockPlan:
    """A valid BlockPlan: ``runs`` template runs of ``run_bytes`` spread over both sides' regions (a slot of
    ``2 x runs x run_bytes`` bytes per side, the runs in shuffled places inside it), ``blocks`` random
    slot pairs, the destination slots distinct."""
    step = 2 * runs * run_bytes

    def side(regions: list[MemoryRegion]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint32]]:
        region = rng.integers(0, len(regions), runs).astype(np.uint32)
        place = rng.permutation(2 * runs)[:runs].astype(np.uint64) * np.uint64(run_bytes)
        base = np.array([r.base_address for r in regions], np.uint64)[region]
        slots = min(regions[int(r)].nbytes // step for r in set(region.tolist()))
        return base + place, np.uint64(slots), region

    src_offset, src_slots, src_region = side(src_regions)
    dst_offset, dst_slots, dst_region = side(dst_regions)
    assert min(int(src_slots), int(dst_slots)) >= blocks
    return BlockPlan(rng.integers(0, int(src_slots), blocks).astype(np.uint64),
                     rng.choice(int(dst_slots), blocks, replace=False).astype(np.uint64),
                     np.full(runs, step, np.uint64), src_offset, np.full(runs, step, np.uint64), dst_offset,
                     np.full(runs, run_bytes, np.uint64), src_region, dst_region)


def expected_after_blocks(plan: BlockPlan, src_regions: list[MemoryRegion], src_bytes: list[npt.NDArray[np.uint8]],
                          dst_regions: list[MemoryRegion], dst_bytes: list[npt.NDArray[np.uint8]]
                          ) -> list[npt.NDArray[np.uint8]]:
    """What the destination regions hold after the block plan ran, run by run from its definition
    (``slot x step + offset``), not through ``BlockPlan.expand``."""
    out = [b.copy() for b in dst_bytes]
    for b in range(plan.num_blocks):
        for t in range(plan.runs_per_block):
            n = int(plan.nbytes[t])
            s = int(plan.src_slots[b]) * int(plan.src_step[t]) + int(plan.src_offset[t])
            d = int(plan.dst_slots[b]) * int(plan.dst_step[t]) + int(plan.dst_offset[t])
            sr, dr = int(plan.src_region[t]), int(plan.dst_region[t])
            so, do = s - src_regions[sr].base_address, d - dst_regions[dr].base_address
            out[dr][do:do + n] = src_bytes[sr][so:so + n]
    return out
