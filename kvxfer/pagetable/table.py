"""PageTable: a struct of numpy arrays saying which bytes (absolute address, length, region) move."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]


@dataclass(frozen=True, eq=False)
class PageTable:
    """Entries ``i``: ``nbytes[i]`` bytes at absolute address ``addr[i]`` inside registered region
    ``region[i]``. ``coords`` optionally carries the logical coordinates of each entry (equal-length
    int arrays such as ``layer``, ``block``, ``head_start``...) while they are needed for pairing."""

    addr: U64
    nbytes: U64
    region: U32
    coords: Mapping[str, npt.NDArray[np.int64]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        addr = np.ascontiguousarray(self.addr, dtype=np.uint64)
        nbytes = np.ascontiguousarray(self.nbytes, dtype=np.uint64)
        region = np.ascontiguousarray(self.region, dtype=np.uint32)
        if not (addr.ndim == nbytes.ndim == region.ndim == 1) or not (addr.size == nbytes.size == region.size):
            raise PageTableError(f"PageTable arrays must be 1-D of equal length, got {addr.shape}, "
                                 f"{nbytes.shape}, {region.shape}")
        for name, arr in self.coords.items():
            if np.shape(arr) != addr.shape:
                raise PageTableError(f"PageTable.coords[{name!r}] has shape {np.shape(arr)}, expected {addr.shape}")
        object.__setattr__(self, "addr", addr)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "region", region)

    def __len__(self) -> int:
        return int(self.addr.size)

    @property
    def total_bytes(self) -> int:
        """Sum of all entries' lengths."""
        return int(self.nbytes.sum(dtype=np.uint64))

    @classmethod
    def empty(cls) -> PageTable:
        return cls(np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.uint32))

    def validate(self, regions: Sequence[MemoryRegion]) -> None:
        """Raise PageTableError naming the first entry outside its region (or overflowing 64 bits)."""
        n = len(self)
        if not n:
            return
        if int(self.region.max()) >= len(regions):
            i = int(np.argmax(self.region >= len(regions)))
            raise PageTableError(f"entry {i}: region {int(self.region[i])} not registered "
                                 f"({len(regions)} regions)")
        base = np.array([r.base_address for r in regions], dtype=np.uint64)[self.region]
        end = np.array([r.end_address for r in regions], dtype=np.uint64)[self.region]
        stop = self.addr + self.nbytes
        bad = (self.addr < base) | (stop < self.addr) | (stop > end)
        if bad.any():
            i = int(np.argmax(bad))
            r = regions[int(self.region[i])]
            raise PageTableError(
                f"entry {i}: [{int(self.addr[i]):#x}, +{int(self.nbytes[i])}) lies outside region "
                f"{int(self.region[i])} [{r.base_address:#x}, {r.end_address:#x})")


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

    @property
    def total_bytes(self) -> int:
        return self.src.total_bytes
