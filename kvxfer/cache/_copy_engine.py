"""The reference design's ``_copy_engine`` module name, for code written against it: ``CopyTask`` and
``batched_copy``, stream-ordered copies of equal-sized ranges between cache levels in memory (GPU or
host; UVA addresses), queued with kvxfer's raw-stream copy (``cuda_streams.memcpy_async``). kvxfer's own
tier-to-tier copy engine, with staging for disk, is ``kvxfer.cache.copy_engine.CopyEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvxfer.cache.common import CacheTier, CudaStream, MemAddress
from kvxfer.cache.cuda_streams import memcpy_async
from kvxfer.errors import ConfigError


class CopyTask(NamedTuple):
    """One range to copy: destination and source address."""

    dst: MemAddress
    src: MemAddress


def batched_copy(dst_tier: CacheTier, src_tier: CacheTier, num_bytes: int, tasks: Sequence[CopyTask],
                 stream: CudaStream) -> None:
    """Queue ``num_bytes`` bytes from ``task.src`` to ``task.dst`` for every task on ``stream``; both
    tiers must be memory (GPU or host: the driver resolves the direction from the addresses)."""
    for what, tier in (("dst_tier", dst_tier), ("src_tier", src_tier)):
        if CacheTier(tier) not in (CacheTier.GPU_MEM, CacheTier.HOST_MEM):
            raise ConfigError(f"batched_copy: {what} must be GPU_MEM or HOST_MEM, got {CacheTier(tier).name} "
                              f"(disk copies go through kvxfer.cache.copy_engine.CopyEngine)")
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
        raise ConfigError(f"batched_copy: num_bytes must be an int > 0, got {num_bytes!r}")
    memcpy_async([t.dst for t in tasks], [t.src for t in tasks], num_bytes, stream)


__all__ = ["CopyTask", "batched_copy"]
