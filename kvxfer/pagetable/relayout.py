"""Landing plans and the host re-layout: a transfer between two layouts as large contiguous pieces in the
source's layout, then one vectorised copy on the receiver that puts every run in place.

A templated plan (``kvxfer.extractor.plan_templated``: one BlockPlan per segment shape) may cut the bytes
into millions of small runs (256 bytes for HND -> NHD). ``landing_plan`` turns it into two steps:

1. ``transfer``: a BlockPlan from the source slots to a *landing region* of the receiver, moving per source
   slot the union of every run the phases read from it, coalesced in the source's layout (one piece per
   slot for a block-size change or a head-order change: whole blocks), packed slot after slot;
2. ``relayout``: the phases again, reading from the landing region instead of the source slots, which the
   receiver runs on its own memory (``relayout_host`` on the CPU) once the transfer is done and before
   the KV is published, so no reader sees it half placed.

Both are O(blocks + template runs) like the plan they come from, and the transfer's descriptors are as
large as the source layout allows, which is what moves at the backend's full rate.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError
from kvxfer.memory_region import MemoryRegion
from kvxfer.pagetable.blocks import BlockPlan

U64 = npt.NDArray[np.uint64]
#: Bytes ``relayout_host`` gathers before it scatters them (a piece that stays in the CPU's cache).
RELAYOUT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class LandingPlan:
    """``transfer`` (source slots -> landing slots ``0..K-1``, large pieces in the source layout) and
    ``relayout`` (landing -> destination, one BlockPlan per phase); ``landing_bytes``: the landing region
    the receiver provides, ``slot_bytes`` of it per source slot."""

    transfer: BlockPlan
    relayout: tuple[BlockPlan, ...]
    landing_bytes: int
    slot_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes the re-layout writes into the destination."""
        return sum(p.total_bytes for p in self.relayout)

    def pieces(self, max_bytes: int) -> list[tuple[BlockPlan, tuple[BlockPlan, ...]]]:
        """The plan cut into consecutive runs of landing slots of at most ``max_bytes`` each (one slot at
        least): per piece, the part of ``transfer`` that fills those slots and the part of every
        ``relayout`` phase that reads only them, so a piece can be re-laid out as soon as its own
        transfer is in. Together the pieces move and place exactly what the plan does."""
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise PageTableError(f"LandingPlan.pieces: max_bytes must be a positive int, got {max_bytes!r}")
        k = self.transfer.num_blocks
        if k == 0:
            return [(self.transfer, self.relayout)]
        per = max(1, max_bytes // max(1, self.slot_bytes))
        out = []
        t = self.transfer
        for lo in range(0, k, per):
            hi = min(k, lo + per)
            transfer = BlockPlan(t.src_slots[lo:hi], t.dst_slots[lo:hi], t.src_step, t.src_offset, t.dst_step,
                                 t.dst_offset, t.nbytes, t.src_region, t.dst_region)
            phases = []
            for p in self.relayout:   # a phase's source slots are landing slot ids
                mine = (p.src_slots >= np.uint64(lo)) & (p.src_slots < np.uint64(hi))
                phases.append(BlockPlan(p.src_slots[mine], p.dst_slots[mine], p.src_step, p.src_offset, p.dst_step,
                                        p.dst_offset, p.nbytes, p.src_region, p.dst_region))
            out.append((transfer, tuple(phases)))
        return out


def landing_plan(phases: Sequence[BlockPlan], landing_base: int, landing_region: int) -> LandingPlan:
    """The landing form of ``phases`` (see the module docstring) for a landing region at ``landing_base``
    with index ``landing_region`` among the receiver's registered regions. Every phase must read each
    source region with one slot stride (the layouts' slot stride: what ``plan_templated`` gives), else
    PageTableError."""
    live = [p for p in phases if len(p)]
    if not live:
        empty = np.empty(0, np.uint64)
        none = BlockPlan(empty, empty, empty, empty, empty, empty, empty, np.empty(0, np.uint32), np.empty(0, np.uint32))
        return LandingPlan(none, (), 0, 0)
    step = np.concatenate([p.src_step for p in live])
    offset = np.concatenate([p.src_offset for p in live])
    nbytes = np.concatenate([p.nbytes for p in live])
    region = np.concatenate([p.src_region for p in live])
    keep = nbytes > 0
    step, offset, nbytes, region = step[keep], offset[keep], nbytes[keep], region[keep]
    # The union of the runs, per source region, coalesced: the pieces every landing slot holds.
    pieces: list[tuple[U64, U64, U64, npt.NDArray[np.uint32]]] = []
    for r in np.unique(region).tolist():
        mine = np.flatnonzero(region == r)
        if int(step[mine].min()) != int(step[mine].max()):
            raise PageTableError(f"landing_plan: source region {r} is read with two slot strides; the phases "
                                 f"must come from one pair of layouts")
        order = mine[np.argsort(offset[mine], kind="stable")]
        o, e = offset[order], offset[order] + nbytes[order]
        reach = np.maximum.accumulate(e)
        starts = np.flatnonzero(np.r_[True, o[1:] > reach[:-1]])
        piece_off = o[starts]
        pieces.append((piece_off, np.maximum.reduceat(e, starts) - piece_off,
                       np.full(starts.size, int(step[mine][0]), np.uint64), np.full(starts.size, r, np.uint32)))
    piece_off = np.concatenate([x[0] for x in pieces])
    piece_len = np.concatenate([x[1] for x in pieces])
    piece_step = np.concatenate([x[2] for x in pieces])
    piece_region = np.concatenate([x[3] for x in pieces])
    cum = np.concatenate([[0], np.cumsum(piece_len)]).astype(np.uint64)
    slot_bytes = int(cum[-1])
    src_slots = np.unique(np.concatenate([p.src_slots for p in live]))
    k = src_slots.size
    base = np.uint64(landing_base)
    transfer = BlockPlan(src_slots, np.arange(k, dtype=np.uint64), piece_step, piece_off,
                         np.full(piece_off.size, slot_bytes, np.uint64), base + cum[:-1], piece_len,
                         piece_region, np.full(piece_off.size, landing_region, np.uint32))
    relayout = []
    for p in live:
        t_keep = p.nbytes > 0
        t_off, t_reg = p.src_offset[t_keep], p.src_region[t_keep]
        j = _piece_of(piece_region, piece_off, t_reg, t_off)
        src_offset = base + cum[:-1][j] + (t_off - piece_off[j])
        landing_ids = np.searchsorted(src_slots, p.src_slots).astype(np.uint64)
        relayout.append(BlockPlan(landing_ids, p.dst_slots, np.full(t_off.size, slot_bytes, np.uint64), src_offset,
                                  p.dst_step[t_keep], p.dst_offset[t_keep], p.nbytes[t_keep],
                                  np.full(t_off.size, landing_region, np.uint32), p.dst_region[t_keep]))
    return LandingPlan(transfer, tuple(relayout), k * slot_bytes, slot_bytes)


def _piece_of(piece_region: npt.NDArray[np.uint32], piece_off: U64, region: npt.NDArray[np.uint32],
              offset: U64) -> npt.NDArray[np.intp]:
    """Index of the piece (grouped by region, sorted by offset inside one) holding each (region, offset)."""
    out = np.empty(offset.size, np.intp)
    for r in np.unique(region).tolist():
        mine = np.flatnonzero(piece_region == r)
        at = region == r
        out[at] = mine[np.searchsorted(piece_off[mine], offset[at], side="right") - 1]
    return out


def _host_view(region: MemoryRegion) -> npt.NDArray[np.uint8]:
    """The bytes of a host region, as a writable numpy array over its memory."""
    if region.memory_kind not in ("cpu", "pinned"):
        raise PageTableError(f"relayout_host: region [{region.base_address:#x}, +{region.nbytes}) is "
                             f"{region.memory_kind!r} memory; the host re-layout reads and writes CPU memory")
    return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.base_address))


def _rows(view: npt.NDArray[np.uint8], row: int) -> npt.NDArray[np.uint8]:
    """``view`` as rows of ``row`` bytes (a tail shorter than a row, which no run reaches, left out)."""
    return view[:view.size // row * row].reshape(-1, row)


def _row_plan(p: BlockPlan, src_regions: Sequence[MemoryRegion], dst_regions: Sequence[MemoryRegion]
              ) -> tuple[int, list[tuple[int, int, npt.NDArray[np.int64], npt.NDArray[np.int64]]]]:
    """A plan as row copies: the row size (the largest dividing every offset inside a region, stride and
    length) and, per (source region, destination region), the source and destination row indices."""
    sbase = np.array([r.base_address for r in src_regions], np.uint64)[p.src_region]
    dbase = np.array([r.base_address for r in dst_regions], np.uint64)[p.dst_region]
    soff, doff = p.src_offset - sbase, p.dst_offset - dbase   # slot 0's offsets inside each region
    row = int(np.gcd.reduce(np.concatenate([p.nbytes, soff, doff, p.src_step, p.dst_step]))) or 1
    out = []
    for rs, rd in sorted({(int(a), int(b)) for a, b in zip(p.src_region, p.dst_region, strict=True)}):
        t = np.flatnonzero((p.src_region == rs) & (p.dst_region == rd) & (p.nbytes > 0))
        if not t.size:
            continue
        s_rows = (p.src_slots[:, None] * p.src_step[t] + soff[t]) // np.uint64(row)
        d_rows = (p.dst_slots[:, None] * p.dst_step[t] + doff[t]) // np.uint64(row)
        count = np.broadcast_to((p.nbytes[t] // np.uint64(row)).astype(np.int64), s_rows.shape).ravel()
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        out.append((rs, rd, np.repeat(s_rows.ravel().astype(np.int64), count) + within,
                    np.repeat(d_rows.ravel().astype(np.int64), count) + within))
    return row, out


def relayout_host(plans: Sequence[BlockPlan], src_regions: Sequence[MemoryRegion],
                  dst_regions: Sequence[MemoryRegion]) -> None:
    """Run ``plans`` as host copies, every run at once: the memory is seen as rows of the largest size
    dividing every run's offset, stride and length, and each plan's rows are gathered and scattered in
    numpy indexings per (source region, destination region), 1 MiB at a time. The plans are validated
    first (bounds, no destination byte twice)."""
    for p in plans:
        p.validate(src_regions, dst_regions)
    views_s: dict[int, npt.NDArray[np.uint8]] = {}
    views_d: dict[int, npt.NDArray[np.uint8]] = {}
    for p in plans:
        if not len(p):
            continue
        row, pairs = _row_plan(p, src_regions, dst_regions)
        for rs, rd, s_idx, d_idx in pairs:
            src = _rows(views_s.setdefault(rs, _host_view(src_regions[rs])), row)
            dst = _rows(views_d.setdefault(rd, _host_view(dst_regions[rd])), row)
            # In pieces of about RELAYOUT_CHUNK_BYTES: the gathered rows stay in cache until scattered.
            step = max(1, RELAYOUT_CHUNK_BYTES // row)
            for lo in range(0, s_idx.size, step):
                dst[d_idx[lo:lo + step]] = src[s_idx[lo:lo + step]]


class _CudaBytes:
    """A CUDA region as an object torch reads through ``__cuda_array_interface__`` (no copy)."""

    def __init__(self, region: MemoryRegion) -> None:
        self.__cuda_array_interface__ = {"shape": (region.nbytes,), "typestr": "|u1",
                                         "data": (region.base_address, False), "version": 3}


def relayout_torch(plans: Sequence[BlockPlan], src_regions: Sequence[MemoryRegion],
                   dst_regions: Sequence[MemoryRegion]) -> None:
    """``relayout_host`` with torch on the regions' own device (CUDA regions: gathered and scattered by
    the GPU, the row indices uploaded once per plan; host regions: torch on the CPU). Rows move as 8-,
    4- or 2-byte words where their size allows. Returns when the copies are queued on the current
    stream (a caller that publishes the KV synchronizes first)."""
    import torch

    for p in plans:
        p.validate(src_regions, dst_regions)

    def view(region: MemoryRegion) -> torch.Tensor:
        if region.memory_kind == "cuda":
            return torch.as_tensor(_CudaBytes(region), device=f"cuda:{region.device_id}")
        return torch.from_numpy(_host_view(region))

    for p in plans:
        if not len(p):
            continue
        row, pairs = _row_plan(p, src_regions, dst_regions)
        word = next(w for w in (8, 4, 2, 1) if row % w == 0)
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        for rs, rd, s_idx, d_idx in pairs:
            sv, dv = view(src_regions[rs]), view(dst_regions[rd])
            src = sv[:sv.numel() // row * row].view(dtype).view(-1, row // word)
            dst = dv[:dv.numel() // row * row].view(dtype).view(-1, row // word)
            si = torch.from_numpy(s_idx).to(src.device, non_blocking=True)
            di = torch.from_numpy(d_idx).to(dst.device, non_blocking=True)
            dst[di] = src[si]


__all__ = ["LandingPlan", "landing_plan", "relayout_host", "relayout_torch"]
