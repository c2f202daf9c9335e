"""The reference design's ``_storage_manager`` module name, for code written against it:
``StorageManager``, a manager's cache levels (kvxfer's ``TierStorage`` per tier, primary first) and their
pool groups under the reference's interface, read through the manager's life-cycle part."""

from __future__ import annotations

from typing import Any

from kvxfer.cache._storage._core import CacheLevelStorage
from kvxfer.cache.common import GPU_LEVEL, CacheLevel, PoolGroupIndex, SlotId
from kvxfer.errors import ConfigError


class StorageManager:
    """The storage of one ``KVCacheManager``: a ``CacheLevelStorage`` per cache level (0: the GPU level)."""

    def __init__(self, manager: Any) -> None:
        self._state = manager.lifecycle.state

    @property
    def num_cache_levels(self) -> int:
        """Cache levels (tiers) of the manager."""
        return len(self._state.tiers)

    def cache_level(self, level: CacheLevel) -> CacheLevelStorage:
        """The storage of one cache level."""
        if not 0 <= int(level) < len(self._state.tiers):
            raise ConfigError(f"StorageManager: cache level {level} outside [0, {len(self._state.tiers)})")
        return CacheLevelStorage(self._state.tiers[int(level)])

    def num_slots(self, pool_group: PoolGroupIndex, level: CacheLevel = GPU_LEVEL) -> int:
        """Usable slots of ``pool_group`` at ``level``."""
        return self.cache_level(level).num_slots(pool_group)

    def get_num_free_slots(self, pool_group: PoolGroupIndex, level: CacheLevel = GPU_LEVEL) -> int:
        """Free slots of ``pool_group`` at ``level``."""
        return self.cache_level(level).get_num_free_slots(pool_group)

    def new_slots_for_pool_group(self, pool_group: PoolGroupIndex, num_slots: int,
                                 level: CacheLevel = GPU_LEVEL) -> list[SlotId]:
        """``num_slots`` free slots of ``pool_group`` at ``level`` (reference count 1, all or none); the
        caller releases them with ``cache_level(level).pool_group(pool_group).release``."""
        return self.cache_level(level).allocate_multiple(pool_group, num_slots)


__all__ = ["StorageManager"]
