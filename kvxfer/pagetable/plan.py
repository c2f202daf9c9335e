"""TransferPlan: paired source and destination page tables (entry ``i`` of src moves to entry ``i`` of dst)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError
from kvxfer.memory_region import MemoryRegion
from kvxfer.pagetable import ops, wire
from kvxfer.pagetable.table import _SMALL, PageTable

PLAN_MAGIC = b"KVTP"
_PLAN_COLUMNS: tuple[tuple[str, np.dtype[np.generic]], ...] = (("src_addr", np.dtype(np.uint64)), ("dst_addr", np.dtype(np.uint64)),
                 ("nbytes", np.dtype(np.uint64)), ("src_region", np.dtype(np.uint32)),
                 ("dst_region", np.dtype(np.uint32)))


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Entry ``i`` of ``src`` moves to entry ``i`` of ``dst`` (equal counts, equal sizes)."""

    src: PageTable
    dst: PageTable

    def __post_init__(self) -> None:
        if len(self.src) != len(self.dst):
            raise PageTableError(f"TransferPlan: {len(self.src)} source entries vs {len(self.dst)} destination")
        if not np.array_equal(self.src.nbytes, self.dst.nbytes):
            i = int(np.argmax(self.src.nbytes != self.dst.nbytes))
            raise PageTableError(f"TransferPlan entry {i}: source {int(self.src.nbytes[i])} bytes vs "
                                 f"destination {int(self.dst.nbytes[i])}")

    def __len__(self) -> int:
        return len(self.src)

    def __repr__(self) -> str:
        return f"TransferPlan({len(self)} entries, {self.total_bytes} bytes)"

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return self.src.total_bytes

    @classmethod
    def empty(cls) -> TransferPlan:
        """A plan that moves nothing."""
        return cls(PageTable.empty(), PageTable.empty())

    @classmethod
    def concat(cls, plans: Sequence[TransferPlan]) -> TransferPlan:
        """The entries of ``plans`` one after the other."""
        return cls(PageTable.concat([p.src for p in plans]), PageTable.concat([p.dst for p in plans]))

    def take(self, index: npt.NDArray[np.integer] | slice) -> TransferPlan:
        """The entries at ``index`` (index array, boolean mask or slice) on both sides."""
        return TransferPlan(self.src.take(index), self.dst.take(index))

    # --- reshaping ------------------------------------------------------------------------------
    def sort_by_source(self) -> TransferPlan:
        """The same entries ordered by (source region, source address), stable; ``self`` when already so.

        In that order every pair that is adjacent on the source side is consecutive, so ``coalesce``
        afterwards yields the fewest entries the plan's granularity allows."""
        region, addr = self.src.region, self.src.addr
        if len(self) < 2:
            return self
        ordered = (region[1:] > region[:-1]) | ((region[1:] == region[:-1]) & (addr[1:] >= addr[:-1]))
        if ordered.all():
            return self
        if region[0] == region[-1] and (region == region[0]).all():
            return self.take(np.argsort(addr, kind="stable"))
        return self.take(np.lexsort((addr, region)))

    def coalesce(self) -> TransferPlan:
        """Merge entry ``i + 1`` into entry ``i`` when BOTH sides are memory-adjacent in the same region."""
        joins = (ops.joins_previous(self.src.addr, self.src.nbytes, self.src.region)
                 & ops.joins_previous(self.dst.addr, self.dst.nbytes, self.dst.region))
        starts = ops.run_starts(joins)
        if starts.size == len(self):
            return TransferPlan(PageTable(self.src.addr, self.src.nbytes, self.src.region),
                                PageTable(self.dst.addr, self.dst.nbytes, self.dst.region))
        nbytes = ops.run_lengths(self.src.nbytes, starts)
        return TransferPlan(PageTable(self.src.addr[starts], nbytes, self.src.region[starts]),
                            PageTable(self.dst.addr[starts], nbytes, self.dst.region[starts]))

    def split(self, max_bytes: int) -> TransferPlan:
        """Cut every entry longer than ``max_bytes`` into pieces of at most ``max_bytes`` on both sides."""
        entry, offset, length = ops.split_pieces(self.src.nbytes, max_bytes)
        return TransferPlan(PageTable(self.src.addr[entry] + offset, length, self.src.region[entry]),
                            PageTable(self.dst.addr[entry] + offset, length, self.dst.region[entry]))

    def chunks(self, n: int) -> list[TransferPlan]:
        """At most ``n`` consecutive, non-empty sub-plans of nearly equal bytes (entries are not cut)."""
        return [self.take(slice(a, b)) for a, b in ops.balanced_cuts(self.src.nbytes, n)]

    # --- checks ---------------------------------------------------------------------------------
    def validate(self, src_regions: Sequence[MemoryRegion], dst_regions: Sequence[MemoryRegion]) -> None:
        """Raise PageTableError when an entry lies outside its registered region on either side, or when
        two destination entries overlap (no destination byte may be written twice)."""
        # Both sides share one length column (checked at construction): whether it is uniform is
        # worked out once here (one pass) and spares each side its end-address pass.
        length = None
        if len(self) > _SMALL:
            first = int(self.src.nbytes[0])
            if 0 < first < 1 << 62 and bool((self.src.nbytes == np.uint64(first)).all()):
                length = first
        try:
            self.src.validate(src_regions, length)
        except PageTableError as exc:
            raise PageTableError(f"TransferPlan source {exc}") from exc
        try:
            self.dst.validate(dst_regions, length)
        except PageTableError as exc:
            raise PageTableError(f"TransferPlan destination {exc}") from exc
        if len(self.dst) <= _SMALL:
            self._check_disjoint_small()
        else:
            self._check_disjoint_vectorised(dst_regions, length)

    def _check_disjoint_vectorised(self, dst_regions: Sequence[MemoryRegion], length: int | None = None) -> None:
        if _uniform_and_disjoint(self.dst, dst_regions, length):
            return
        keep = np.flatnonzero(self.dst.nbytes > 0)
        if keep.size < 2:
            return
        order = keep[np.argsort(self.dst.addr[keep], kind="stable")]
        start = self.dst.addr[order]
        end = start + self.dst.nbytes[order]
        reach = np.maximum.accumulate(end)
        clash = start[1:] < reach[:-1]
        if clash.any():
            j = int(np.argmax(clash)) + 1
            i = int(order[int(np.argmax(end[:j] > start[j]))])
            k = int(order[j])
            raise PageTableError(
                f"TransferPlan destination entries {i} [{int(self.dst.addr[i]):#x}, +{int(self.dst.nbytes[i])}) "
                f"and {k} [{int(self.dst.addr[k]):#x}, +{int(self.dst.nbytes[k])}) overlap: a byte would be "
                f"written twice")

    def _check_disjoint_small(self) -> None:
        """The overlap check of ``validate`` for a few entries, in plain Python (same message)."""
        addr, nbytes = self.dst.addr.tolist(), self.dst.nbytes.tolist()
        order = sorted((i for i, b in enumerate(nbytes) if b > 0), key=lambda i: addr[i])
        reach = 0
        for j, k in enumerate(order):
            if j and addr[k] < reach:
                i = next(x for x in order[:j] if addr[x] + nbytes[x] > addr[k])
                raise PageTableError(
                    f"TransferPlan destination entries {i} [{addr[i]:#x}, +{nbytes[i]}) and {k} "
                    f"[{addr[k]:#x}, +{nbytes[k]}) overlap: a byte would be written twice")
            reach = max(reach, addr[k] + nbytes[k])

    # --- wire format ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Versioned little-endian encoding of both sides (coords are not sent)."""
        cols: dict[str, wire.Column] = {"src_addr": self.src.addr, "dst_addr": self.dst.addr, "nbytes": self.src.nbytes,
                "src_region": self.src.region, "dst_region": self.dst.region}
        return wire.encode(PLAN_MAGIC, [(name, dt, cols[name]) for name, dt in _PLAN_COLUMNS], {})

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TransferPlan:
        """Decode ``to_bytes`` output; malformed or hostile input raises PageTableError only."""
        fixed, named = wire.decode(data, PLAN_MAGIC, "TransferPlan", _PLAN_COLUMNS)
        if named:
            raise PageTableError(f"TransferPlan.from_bytes: unexpected named columns {sorted(named)}")
        nbytes = fixed["nbytes"].astype(np.uint64)
        src_addr, dst_addr = fixed["src_addr"].astype(np.uint64), fixed["dst_addr"].astype(np.uint64)
        wire.check_no_wrap(src_addr, nbytes, "TransferPlan.from_bytes source")
        wire.check_no_wrap(dst_addr, nbytes, "TransferPlan.from_bytes destination")
        return cls(PageTable(src_addr, nbytes, fixed["src_region"].astype(np.uint32)),
                   PageTable(dst_addr, nbytes, fixed["dst_region"].astype(np.uint32)))


def _uniform_and_disjoint(dst: PageTable, regions: Sequence[MemoryRegion], length: int | None = None) -> bool:
    """True when every entry has the same power-of-two length L >= 2, starts at a multiple of L inside
    its (already validated) region, and no two entries start at the same place: then none overlap. An
    O(n) check for the common KV plan, where sorting would cost O(n log n): each entry marks its L-slot
    in one boolean array over the regions' slots, and n distinct marks mean n distinct starts (cheaper
    than ``bincount`` + ``max`` over the same slots). False means "not shown", and the caller sorts. ``length``: the caller already knows
    every entry is this long."""
    n = len(dst)
    if n < 2:
        return n == 1
    if length is None:
        length = int(dst.nbytes[0])
        if length <= 0 or not bool((dst.nbytes == np.uint64(length)).all()):
            return False
    if length < 2 or length & (length - 1):
        return False
    shift = length.bit_length() - 1
    slots = np.array([r.nbytes for r in regions], dtype=np.int64) >> shift
    total = int(slots.sum())
    if total > 8 * n + (1 << 16):
        return False
    mask = length - 1
    first = int(dst.region[0])
    one = len(regions) == 1 or int(dst.region.min()) == int(dst.region.max())
    if one and not regions[first].base_address & mask:
        # One L-aligned region: entries must be L-aligned addresses (one OR over them all); slot =
        # addr >> shift - base slot.
        if int(np.bitwise_or.reduce(dst.addr)) & mask:
            return False
        index = np.right_shift(dst.addr, np.uint64(shift))
        np.subtract(index, np.uint64(regions[first].base_address >> shift), out=index)
    else:
        if not one and not regions_disjoint(regions):   # two names for one buffer: slots would not tell
            return False
        base = np.array([r.base_address for r in regions], dtype=np.uint64)
        index = dst.addr - (base[first] if one else base[dst.region])
        if int(np.bitwise_or.reduce(index)) & mask:
            return False
        np.right_shift(index, np.uint64(shift), out=index)
        if not one:
            index += (np.cumsum(slots) - slots).astype(np.uint64)[dst.region]
    if int(index.max()) >= total:   # an entry outside its regions (not validated; below wraps up): not shown
        return False
    seen = np.zeros(total, dtype=np.bool_)
    seen[index.view(np.int64)] = True   # every index < total, so none reads as a negative (wrapping) one
    return int(np.count_nonzero(seen)) == n


def regions_disjoint(regions: Sequence[MemoryRegion]) -> bool:
    """True when no two of ``regions`` share a byte. Registration allows aliases (two pools over one
    buffer), and a check that reasons per region must then fall back to absolute addresses."""
    spans = sorted((r.base_address, r.end_address) for r in regions)
    return all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
