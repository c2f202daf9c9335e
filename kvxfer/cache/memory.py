"""Memory pools: one zeroed torch byte tensor per pool. ``MemoryRegion`` lives in the leaf module
``kvxfer.memory_region`` (re-exported here for existing imports)."""

from __future__ import annotations

import torch

from kvxfer.errors import ConfigError
from kvxfer.memory_region import MemoryRegion

__all__ = ["MemoryRegion", "allocate_pool"]


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
