"""The reference design's ``_storage._core`` module name, for code written against it: kvxfer's slot
allocator (``allocator.SlotAllocator``) and tier storage (``tiers.TierStorage``) under the reference's
class names and members.

- ``SlotAllocator``: one pool group's slots with the reference's interface: ids are issued lowest first
  and recycled, ``num_active_slots`` is the high-water mark of issued ids, and a pool shrinks in two steps
  (``prepare_for_shrink`` marks the ids at or above the new capacity; ``finish_shrink`` completes once all
  of them are free).
- ``PoolGroupBase`` / ``CacheLevelStorage``: one pool group of a cache level, and a cache level, over a
  ``TierStorage``.
"""

from __future__ import annotations

from kvxfer.cache.allocator import SlotAllocator as _Slots
from kvxfer.cache.common import PoolGroupIndex, SlotId
from kvxfer.cache.tiers import TierStorage
from kvxfer.errors import BlockIdError, ConfigError


class SlotAllocator:
    """The reference's slot allocator over kvxfer's reference-counted ``allocator.SlotAllocator``."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"SlotAllocator: capacity must be an int >= 0, got {capacity!r}")
        self._slots = _Slots(capacity, "SlotAllocator")
        self._capacity = capacity
        self._num_active_slots = 0
        self._target_capacity: int | None = None
        self._overflow_slots: list[SlotId] = []

    @property
    def num_slots(self) -> int:
        """Slots of the pool (its capacity)."""
        return self._capacity

    @property
    def num_free_slots(self) -> int:
        """Slots that can be handed out now."""
        return self._slots.num_free

    @property
    def num_occupied_slots(self) -> int:
        """Slots handed out and not released."""
        return self._slots.num_used

    @property
    def num_active_slots(self) -> int:
        """The high-water mark: ids below it were issued at least once."""
        return self._num_active_slots

    @property
    def shrink_in_progress(self) -> bool:
        """Whether ``prepare_for_shrink`` was called and ``finish_shrink`` has not completed yet."""
        return self._target_capacity is not None

    def allocate(self) -> SlotId:
        """One free slot (the lowest recycled id first); OutOfSlotsError when none is free."""
        return self.allocate_multiple(1)[0]

    def allocate_multiple(self, num_slots: int) -> list[SlotId]:
        """``num_slots`` free slots, all or none (OutOfSlotsError)."""
        ids = [SlotId(int(i)) for i in self._slots.alloc(num_slots).tolist()]
        if ids:
            self._num_active_slots = max(self._num_active_slots, max(ids) + 1)
        return ids

    def release(self, slot: SlotId) -> None:
        """Give ``slot`` back (BlockIdError when it is not held)."""
        if not self._slots.refcount[self._slots.check([slot])].all():
            raise BlockIdError(f"SlotAllocator: release of slot {slot}, which is free")
        self._slots.decref([slot])

    def prepare_for_shrink(self, new_capacity: int) -> None:
        """Start shrinking to ``new_capacity`` slots: ids at or above it (the overflow slots) are no longer
        handed out; those still held must be released or moved before ``finish_shrink`` completes."""
        if isinstance(new_capacity, bool) or not isinstance(new_capacity, int) or not 0 <= new_capacity <= self._capacity:
            raise ConfigError(f"SlotAllocator.prepare_for_shrink: new capacity must be an int in "
                              f"[0, {self._capacity}], got {new_capacity!r}")
        self._target_capacity = new_capacity
        self._overflow_slots = [SlotId(i) for i in range(new_capacity, self._num_active_slots)]

    def finish_shrink(self) -> bool:
        """Complete the shrink once every overflow slot is free; False (nothing changes) while one is held."""
        if self._target_capacity is None:
            raise ConfigError("SlotAllocator.finish_shrink: no shrink in progress (call prepare_for_shrink)")
        target = self._target_capacity
        if self._overflow_slots and self._slots.refcount[self._overflow_slots].any():
            return False
        self._slots.set_usable(target)
        self._capacity = target
        self._num_active_slots = min(self._num_active_slots, target)
        self._overflow_slots = []
        self._target_capacity = None
        return True


class PoolGroupBase:
    """One pool group of a cache level: its slots in a ``TierStorage``."""

    def __init__(self, storage: TierStorage, pool_group: PoolGroupIndex) -> None:
        self._storage = storage
        self._pool_group = pool_group

    @property
    def num_slots(self) -> int:
        """Usable slots of the pool group."""
        return int(self._storage.allocator(self._pool_group).usable)

    @property
    def num_free_slots(self) -> int:
        """Free slots of the pool group."""
        return self._storage.allocator(self._pool_group).num_free

    def allocate_multiple(self, num_slots: int) -> list[SlotId]:
        """``num_slots`` free slots (reference count 1), all or none (OutOfSlotsError)."""
        return [SlotId(int(i)) for i in self._storage.allocator(self._pool_group).alloc(num_slots).tolist()]

    def release(self, slots: list[SlotId]) -> None:
        """Drop the reference ``allocate_multiple`` took on each slot."""
        self._storage.allocator(self._pool_group).decref(slots)


class CacheLevelStorage:
    """One cache level: its pool groups in a ``TierStorage``."""

    def __init__(self, storage: TierStorage) -> None:
        self._storage = storage

    @property
    def num_pool_groups(self) -> int:
        """Pool groups of the level."""
        return len(self._storage.layout.pool_groups)

    def pool_group(self, pool_group: PoolGroupIndex) -> PoolGroupBase:
        """One pool group of the level."""
        return PoolGroupBase(self._storage, pool_group)

    def num_slots(self, pool_group: PoolGroupIndex) -> int:
        """Usable slots of ``pool_group``."""
        return self.pool_group(pool_group).num_slots

    def get_num_free_slots(self, pool_group: PoolGroupIndex) -> int:
        """Free slots of ``pool_group``."""
        return self.pool_group(pool_group).num_free_slots

    def allocate_multiple(self, pool_group: PoolGroupIndex, num_slots: int) -> list[SlotId]:
        """``num_slots`` free slots of ``pool_group``, all or none (OutOfSlotsError)."""
        return self.pool_group(pool_group).allocate_multiple(num_slots)


__all__ = ["CacheLevelStorage", "PoolGroupBase", "SlotAllocator"]
