"""PageTable: a struct of numpy arrays saying which bytes (absolute address, length, region) move."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError
from kvxfer.memory_region import MemoryRegion
from kvxfer.pagetable import ops, wire

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]

TABLE_MAGIC = b"KVPT"
_TABLE_COLUMNS: tuple[tuple[str, np.dtype[np.generic]], ...] = (("addr", np.dtype(np.uint64)), ("nbytes", np.dtype(np.uint64)), ("region", np.dtype(np.uint32)))


#: Tables of at most this many entries are validated in plain Python (a few microseconds).
_SMALL = 16

@dataclass(frozen=True, eq=False)
class PageTable:
    """Entries ``i``: ``nbytes[i]`` bytes at absolute address ``addr[i]`` inside registered region
    ``region[i]``. ``coords`` optionally carries the logical coordinates of each entry (equal-length
    int64 arrays such as ``layer``, ``block``, ``head_start``...) while they are needed for pairing;
    operations that reshape entries (coalesce, split) drop them."""

    addr: U64
    nbytes: U64
    region: U32
    coords: Mapping[str, I64] = field(default_factory=dict)

    def __post_init__(self) -> None:
        addr = np.ascontiguousarray(self.addr, dtype=np.uint64)
        nbytes = np.ascontiguousarray(self.nbytes, dtype=np.uint64)
        region = np.ascontiguousarray(self.region, dtype=np.uint32)
        if not (addr.ndim == nbytes.ndim == region.ndim == 1) or not (addr.size == nbytes.size == region.size):
            raise PageTableError(f"PageTable arrays must be 1-D of equal length, got {addr.shape}, "
                                 f"{nbytes.shape}, {region.shape}")
        coords: dict[str, I64] = {}
        for name, arr in self.coords.items():
            if not isinstance(name, str) or not name.isidentifier() or len(name) > wire.MAX_NAME_LEN:
                raise PageTableError(f"PageTable.coords: name {name!r} is not an identifier of <= "
                                     f"{wire.MAX_NAME_LEN} chars")
            if np.shape(arr) != addr.shape:
                raise PageTableError(f"PageTable.coords[{name!r}] has shape {np.shape(arr)}, expected {addr.shape}")
            coords[name] = np.ascontiguousarray(arr, dtype=np.int64)
        if len(coords) > wire.MAX_NAMED_COLUMNS:
            raise PageTableError(f"PageTable.coords: {len(coords)} columns, at most {wire.MAX_NAMED_COLUMNS}")
        object.__setattr__(self, "addr", addr)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "region", region)
        object.__setattr__(self, "coords", coords)

    def __len__(self) -> int:
        return int(self.addr.size)

    def __repr__(self) -> str:
        return (f"PageTable({len(self)} entries, {self.total_bytes} bytes, "
                f"regions {sorted(set(self.region.tolist()))[:8]}, coords {sorted(self.coords)})")

    @property
    def total_bytes(self) -> int:
        """Sum of all entries' lengths."""
        return int(self.nbytes.sum(dtype=np.uint64))

    @classmethod
    def empty(cls) -> PageTable:
        """A table with no entries."""
        return cls(np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.uint32))

    @classmethod
    def concat(cls, tables: Sequence[PageTable]) -> PageTable:
        """The entries of ``tables`` one after the other; coords survive only when every table has the
        same coordinate names."""
        if not tables:
            return cls.empty()
        names = set(tables[0].coords)
        keep = all(set(t.coords) == names for t in tables)
        coords = {n: np.concatenate([t.coords[n] for t in tables]) for n in tables[0].coords} if keep else {}
        return cls(np.concatenate([t.addr for t in tables]), np.concatenate([t.nbytes for t in tables]),
                   np.concatenate([t.region for t in tables]), coords)

    def take(self, index: npt.NDArray[np.integer] | slice) -> PageTable:
        """The entries at ``index`` (an index array, boolean mask or slice), coords included."""
        return PageTable(self.addr[index], self.nbytes[index], self.region[index],
                         {n: c[index] for n, c in self.coords.items()})

    # --- reshaping ------------------------------------------------------------------------------
    def coalesce(self) -> PageTable:
        """Merge each entry into its predecessor when it starts where that one ends in the same region.

        Order is kept, so only consecutive entries merge (sort by address first to merge more)."""
        starts = ops.run_starts(ops.joins_previous(self.addr, self.nbytes, self.region))
        if starts.size == len(self):
            return PageTable(self.addr, self.nbytes, self.region)
        return PageTable(self.addr[starts], ops.run_lengths(self.nbytes, starts), self.region[starts])

    def split(self, max_bytes: int) -> PageTable:
        """Cut every entry longer than ``max_bytes`` into consecutive pieces of at most ``max_bytes``."""
        entry, offset, length = ops.split_pieces(self.nbytes, max_bytes)
        return PageTable(self.addr[entry] + offset, length, self.region[entry])

    def chunks(self, n: int) -> list[PageTable]:
        """At most ``n`` consecutive, non-empty parts of nearly equal bytes (entries are not cut: use
        ``split`` first for finer parts); an empty table gives no part."""
        return [self.take(slice(a, b)) for a, b in ops.balanced_cuts(self.nbytes, n)]

    # --- checks ---------------------------------------------------------------------------------
    def validate(self, regions: Sequence[MemoryRegion], uniform_length: int | None = None) -> None:
        """Raise PageTableError naming the first entry outside its region (or overflowing 64 bits).
        ``uniform_length``: every entry is known to be this long (a plan checked it once for both sides)."""
        n = len(self)
        if not n:
            return
        if n <= _SMALL:
            self._validate_small(regions)
        else:
            self._validate_vectorised(regions, uniform_length)

    def _validate_vectorised(self, regions: Sequence[MemoryRegion], uniform_length: int | None = None) -> None:
        first, last = int(self.region.min()), int(self.region.max())
        if last >= len(regions):
            i = int(np.argmax(self.region >= len(regions)))
            raise PageTableError(f"entry {i}: region {int(self.region[i])} not registered "
                                 f"({len(regions)} regions)")
        if first == last and uniform_length is not None:
            # One region, one length (the common KV table): two reductions, the sums in Python ints.
            r = regions[first]
            if int(self.addr.min()) >= r.base_address and int(self.addr.max()) + uniform_length <= r.end_address:
                return
        stop = self.addr + self.nbytes
        if first == last:   # one region: bounds against scalars, no gathers
            r = regions[first]
            if int(self.addr.min()) >= r.base_address and int(stop.max()) <= r.end_address and \
                    not bool((stop < self.addr).any()):
                return
        base = np.array([r.base_address for r in regions], dtype=np.uint64)[self.region]
        end = np.array([r.end_address for r in regions], dtype=np.uint64)[self.region]
        bad = (self.addr < base) | (stop < self.addr) | (stop > end)
        if bad.any():
            i = int(np.argmax(bad))
            r = regions[int(self.region[i])]
            raise PageTableError(
                f"entry {i}: [{int(self.addr[i]):#x}, +{int(self.nbytes[i])}) lies outside region "
                f"{int(self.region[i])} [{r.base_address:#x}, {r.end_address:#x})")

    def _validate_small(self, regions: Sequence[MemoryRegion]) -> None:
        """``validate`` for a few entries in plain Python (numpy's per-call cost would dominate): the
        same checks, in the same order, with the same messages."""
        addr, nbytes, region = self.addr.tolist(), self.nbytes.tolist(), self.region.tolist()
        for i, r in enumerate(region):
            if r >= len(regions):
                raise PageTableError(f"entry {i}: region {r} not registered ({len(regions)} regions)")
        for i, (a, b, r) in enumerate(zip(addr, nbytes, region, strict=True)):
            reg = regions[r]
            if a < reg.base_address or a + b > reg.end_address:
                raise PageTableError(f"entry {i}: [{a:#x}, +{b}) lies outside region {r} "
                                     f"[{reg.base_address:#x}, {reg.end_address:#x})")

    # --- wire format ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Versioned little-endian encoding (see ``kvxfer.pagetable.wire``), coords included."""
        return wire.encode(TABLE_MAGIC, [(name, dt, getattr(self, name)) for name, dt in _TABLE_COLUMNS],
                           self.coords)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> PageTable:
        """Decode ``to_bytes`` output; malformed or hostile input raises PageTableError only."""
        fixed, named = wire.decode(data, TABLE_MAGIC, "PageTable", _TABLE_COLUMNS)
        addr, nbytes = fixed["addr"].astype(np.uint64), fixed["nbytes"].astype(np.uint64)
        wire.check_no_wrap(addr, nbytes, "PageTable.from_bytes")
        return cls(addr, nbytes, fixed["region"].astype(np.uint32),
                   {k: v.astype(np.int64) for k, v in named.items()})
