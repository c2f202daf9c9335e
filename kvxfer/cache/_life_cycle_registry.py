"""The reference design's ``_life_cycle_registry`` module name, for code written against it:
``LifeCycleRegistry``, the life cycle of each layer group (``AttnLifeCycle`` for attention layer groups,
``SsmLifeCycle`` for the recurrent one), in layer group order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvxfer.cache.common import AttnLifeCycle, LayerGroupId, LifeCycle, SsmLifeCycle


class LifeCycleRegistry:
    """The life cycles of a manager's layer groups."""

    def __init__(self, life_cycles: Sequence[LifeCycle]) -> None:
        self._life_cycles = tuple(life_cycles)

    @classmethod
    def of(cls, manager: Any) -> LifeCycleRegistry:
        """The registry of a ``KVCacheManager`` (read through its life-cycle part)."""
        return cls(manager.lifecycle.life_cycles())

    @property
    def size(self) -> int:
        """Life cycles (one per layer group)."""
        return len(self._life_cycles)

    @property
    def ssm_life_cycle_id(self) -> LayerGroupId | None:
        """The recurrent (SSM) life cycle, None when the manager has no recurrent layers."""
        for i, lc in enumerate(self._life_cycles):
            if isinstance(lc, SsmLifeCycle):
                return LayerGroupId(i)
        return None

    def attention_life_cycles(self) -> Iterator[tuple[LayerGroupId, AttnLifeCycle]]:
        """(layer group id, life cycle) of every attention layer group."""
        return ((LayerGroupId(i), lc) for i, lc in enumerate(self._life_cycles) if isinstance(lc, AttnLifeCycle))

    def __getitem__(self, life_cycle_id: LayerGroupId) -> LifeCycle:
        return self._life_cycles[life_cycle_id]


__all__ = ["LifeCycleRegistry", "SsmLifeCycle"]
