"""The reference design's ``_life_cycle_registry`` module name, for code written against it:
``LifeCycleRegistry``, the life cycle of each layer group (``AttnLifeCycle`` for attention layer groups,
``SsmLifeCycle`` for the recurrent one), in layer group order."""

from __future__ import annotations

from kvxfer.cache.common import LifeCycleRegistry, SsmLifeCycle

__all__ = ["LifeCycleRegistry", "SsmLifeCycle"]
