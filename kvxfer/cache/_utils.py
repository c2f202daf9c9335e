"""The reference design's ``_utils`` module name, for code written against it: kvxfer's integer and
range helpers (``kvxfer.cache.common``) and raw CUDA streams (``kvxfer.cache.cuda_streams``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvxfer.cache.common import (
    HalfOpenRange,
    div_up,
    exact_div,
    get_uniform_attribute,
    intersect,
    overlap,
    remove_if,
    round_up,
    typed_range,
    value_or,
)
from kvxfer.cache.cuda_streams import (
    CachedCudaEvent,
    CachedCudaStream,
    CudaEvent,
    TemporaryCudaStream,
    init_cuda_once,
)


@contextmanager
def temporary_sys_path(path: str) -> Iterator[None]:
    """``path`` at the front of ``sys.path`` inside the block (unless it already was there)."""
    added = path not in sys.path
    if added:
        sys.path.insert(0, path)
    try:
        yield
    finally:
        if added:
            sys.path.remove(path)


__all__ = [
    "CachedCudaEvent",
    "CachedCudaStream",
    "CudaEvent",
    "HalfOpenRange",
    "TemporaryCudaStream",
    "div_up",
    "exact_div",
    "get_uniform_attribute",
    "init_cuda_once",
    "intersect",
    "overlap",
    "remove_if",
    "round_up",
    "temporary_sys_path",
    "typed_range",
    "value_or",
]
