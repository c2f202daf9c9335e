"""Pinned pages: extra references that keep a request's pages allocated while a transfer reads them.

A transfer reads a request's pages by slot id. The request may let a page go meanwhile: a commit that
finds the block already in the prefix tree adopts the tree's copy and frees its own, a sliding window
moving on releases old blocks. A pin holds one more reference on each page, so none is freed or handed
to another request until the pin is released (after the transfer completed or was stopped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]


class PinnedPages:
    """One pin: pool group -> the slots it holds a reference on (``KVCacheManager.pin_pages``)."""

    def __init__(self, slots: Mapping[int, IntArray], release: Callable[[Mapping[int, IntArray]], None]) -> None:
        self.slots = {pg: np.array(ids, dtype=np.int32) for pg, ids in slots.items()}
        self._release = release
        self.released = False

    @property
    def num_pages(self) -> int:
        """References this pin holds."""
        return sum(int(ids.size) for ids in self.slots.values())

    def release(self) -> None:
        """Drop the references (a page nobody else holds becomes free); a second call does nothing."""
        if not self.released:
            self.released = True
            self._release(self.slots)

    def __enter__(self) -> PinnedPages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
