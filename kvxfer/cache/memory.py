"""Memory pools: one torch tensor per pool, and the MemoryRegion each publishes for transports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvxfer.errors import ConfigError, LayoutError

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
        """The region covering a contiguous tensor's bytes."""
        if not tensor.is_contiguous():
            raise LayoutError("MemoryRegion.of_tensor needs a contiguous tensor")
        kind = "cuda" if tensor.is_cuda else ("pinned" if tensor.is_pinned() else "cpu")
        return cls(int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size()), kind,
                   int(tensor.device.index or 0))


def allocate_pool(nbytes: int, device: str, *, pinned: bool = False) -> torch.Tensor:
    """A zeroed byte tensor of ``nbytes`` on ``device`` (page-locked when ``pinned`` on a CUDA host).

    Zeroed so a peer never reads another request's stale KV from a fresh pool.
    """
    if nbytes <= 0:
        raise ConfigError(f"pool size must be > 0 bytes, got {nbytes}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available on this machine")
    if pinned and dev.type == "cpu" and torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.zeros(nbytes, dtype=torch.uint8, device=dev)
