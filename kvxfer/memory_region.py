"""MemoryRegion: a contiguous range of memory a transport registers and page tables are checked
against. A leaf module (no torch, no cache import) so page tables and transports need nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxfer.errors import LayoutError

if TYPE_CHECKING:
    import torch

_MAX_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class MemoryRegion:
    """A contiguous range of registered-able memory: what a transport registers and validates against."""

    base_address: int
    nbytes: int
    memory_kind: str = "cpu"
    device_id: int = 0

    def __post_init__(self) -> None:
        for name in ("base_address", "nbytes", "device_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise LayoutError(f"MemoryRegion.{name} must be an int >= 0, got {v!r}")
        if self.base_address + self.nbytes > _MAX_U64:
            raise LayoutError(f"MemoryRegion [{self.base_address:#x} + {self.nbytes}] overflows 64 bits")

    @property
    def end_address(self) -> int:
        """First address past the region."""
        return self.base_address + self.nbytes

    def contains(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) lies inside the region."""
        return self.base_address <= addr and addr + nbytes <= self.end_address

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor) -> MemoryRegion:
        """The region covering a contiguous tensor's bytes (torch is only needed by the caller)."""
        if not tensor.is_contiguous():
            raise LayoutError("MemoryRegion.of_tensor needs a contiguous tensor")
        kind = "cuda" if tensor.is_cuda else ("pinned" if tensor.is_pinned() else "cpu")
        return cls(int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size()), kind,
                   int(tensor.device.index or 0))
