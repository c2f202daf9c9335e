"""Slot allocator of one pool group: O(1) vectorised alloc/free with per-slot reference counts.

A slot is free when its count is 0. Requests and the prefix tree each hold one reference, so a page
shared by the tree and a request is only freed when both let go. Only the first ``usable`` slots are
handed out: the primary tier's quota can shrink and grow inside its registered pools.
"""

from __future__ import annotations

import numpy as np
import numpy.ma  # np.unique imports it on first use (~15-40 ms): paid at import, not by the first request
import numpy.typing as npt

from kvxfer.errors import BlockIdError, OutOfSlotsError

IntArray = npt.NDArray[np.int32]


class SlotAllocator:
    """Free stack plus reference counts over ``num_slots`` slots."""

    def __init__(self, num_slots: int, name: str = "pool group") -> None:
        self.name = name
        self.num_slots = num_slots
        # Stack of free ids; ids at the top are handed out first (lowest ids first at start).
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)
        self._top = num_slots
        self.usable = num_slots
        self.refcount = np.zeros(num_slots, dtype=np.int32)

    @property
    def num_free(self) -> int:
        """Slots with no reference."""
        return self._top

    @property
    def num_used(self) -> int:
        """Slots with at least one reference."""
        return self.usable - self._top

    def set_usable(self, n: int) -> None:
        """Hand out only slots ``[0, n)`` from now on (``n`` <= num_slots); every slot at or above ``n``
        must be free (BlockIdError otherwise). The free stack is rebuilt lowest id first."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.num_slots:
            raise BlockIdError(f"{self.name}: usable slot count must be an int in [0, {self.num_slots}], got {n!r}")
        held = np.flatnonzero(self.refcount[n:] > 0)
        if held.size:
            raise BlockIdError(f"{self.name}: slot {n + int(held[0])} is in use; cannot limit to {n} slots")
        free = np.flatnonzero(self.refcount[:n] == 0).astype(np.int32)
        self._top = int(free.size)
        self._free[:self._top] = free[::-1]
        self.usable = n

    def grow(self, n: int) -> None:
        """Extend the group to ``n`` slots (>= ``num_slots``), all usable: the new ids are free; held
        slots keep their ids and counts."""
        if isinstance(n, bool) or not isinstance(n, int) or n < self.num_slots:
            raise BlockIdError(f"{self.name}: can only grow from {self.num_slots} slots, got {n!r}")
        self.refcount = np.concatenate([self.refcount, np.zeros(n - self.num_slots, dtype=np.int32)])
        self._free = np.empty(n, dtype=np.int32)
        self.num_slots = n
        self.set_usable(n)

    def alloc(self, n: int) -> IntArray:
        """``n`` fresh slots with a reference count of 1; raises OutOfSlotsError, taking nothing."""
        if n < 0:
            raise BlockIdError(f"{self.name}: cannot allocate {n} slots")
        if n > self._top:
            raise OutOfSlotsError(f"{self.name}: {n} slots requested, {self._top} free of {self.num_slots}")
        ids = self._free[self._top - n:self._top][::-1].copy()
        self._top -= n
        self.refcount[ids] = 1
        return ids

    def take(self, ids: npt.ArrayLike) -> None:
        """Allocate these particular free slots (reference count 1), e.g. the targets of a move."""
        arr = self.check(ids)
        if not arr.size:
            return
        if np.unique(arr).size != arr.size or (self.refcount[arr] != 0).any() or int(arr.max()) >= self.usable:
            raise BlockIdError(f"{self.name}: take of slots {arr.tolist()[:8]} that are not distinct, free and usable")
        stack = self._free[:self._top]
        kept = stack[~np.isin(stack, arr)]
        self._free[:kept.size] = kept
        self._top = int(kept.size)
        self.refcount[arr] = 1

    def check(self, ids: npt.ArrayLike, what: str = "block id") -> IntArray:
        """``ids`` as int32, after checking every id is a slot of this group."""
        arr = np.asarray(ids)
        if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= self.num_slots):
            bad = arr[(arr < 0) | (arr >= self.num_slots)] if arr.dtype.kind in "iu" else arr
            raise BlockIdError(f"{self.name}: {what} {bad.flat[0]!r} outside [0, {self.num_slots})")
        return arr.astype(np.int32, copy=False)

    def incref(self, ids: npt.ArrayLike) -> None:
        """Add a reference to slots that are already held."""
        arr = self.check(ids)
        if arr.size and (self.refcount[arr] <= 0).any():
            raise BlockIdError(f"{self.name}: incref of free slot {int(arr[self.refcount[arr] <= 0][0])}")
        if arr.size > 1 and not bool((arr[1:] > arr[:-1]).all()):   # unordered, maybe repeated: count each
            uniq, counts = np.unique(arr, return_counts=True)
            self.refcount[uniq] += counts.astype(self.refcount.dtype)
        else:   # strictly ascending (a request's blocks, as usual): distinct, one increment each (~50x np.add.at)
            self.refcount[arr] += 1

    def decref(self, ids: npt.ArrayLike) -> IntArray:
        """Drop one reference per id; returns the ids that became free (and are back on the stack)."""
        arr = self.check(ids)
        if not arr.size:
            return arr
        uniq, counts = np.unique(arr, return_counts=True)
        freed: IntArray = uniq[self._release(uniq, counts)].astype(np.int32)
        self._free[self._top:self._top + freed.size] = freed[::-1]
        self._top += freed.size
        return freed

    def _release(self, uniq: IntArray, counts: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Drop ``counts`` references from the distinct slots ``uniq`` (all or none: BlockIdError when one
        would go below zero); returns which of them are now free and usable (the caller stacks them)."""
        held = self.refcount[uniq]
        if (counts > held).any():
            bad = int(uniq[counts > held][0])
            raise BlockIdError(f"{self.name}: slot {bad} released more often than it is held "
                               f"(refcount {int(self.refcount[bad])})")
        self.refcount[uniq] = held - counts.astype(np.int32)
        gone: npt.NDArray[np.bool_] = (self.refcount[uniq] == 0) & (uniq < self.usable)
        return gone

    def decref_each(self, ids: npt.ArrayLike) -> IntArray:
        """``decref([i])`` for each id in turn, in one vectorised step: slots go back on the free stack
        in the order they became free (``decref`` pushes a batch lowest id on top), so what is handed
        out later is exactly as with the one-by-one calls. Returns the freed ids in that order."""
        arr = self.check(ids)
        if not arr.size:
            return arr
        uniq, first_from_end, counts = np.unique(arr[::-1], return_index=True, return_counts=True)
        gone = self._release(uniq, counts)
        # A slot becomes free at its last occurrence in ``arr``: order the freed ones by it.
        freed: IntArray = uniq[gone][np.argsort(-first_from_end[gone], kind="stable")].astype(np.int32)
        self._free[self._top:self._top + freed.size] = freed
        self._top += freed.size
        return freed
