"""Forwards the manager's KV events to a reference-style event manager (``KVCacheEventManager``):
the manager's one event hook, so that its prefix tree and tiers never call an event manager directly.

The forwarder speaks the event manager's public hooks only (``add_stored_event``,
``add_removed_event``, ``add_updated_event``), so any object with those methods works. As in the
reference, the manager does not announce itself to an event manager: whoever owns the event manager
calls ``add_created_event`` (the manager's own queue still carries its ``Created``). The record types
come from ``kvxfer.cache.event_manager``, imported when the first
stored event is forwarded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer.cache.common import PRIORITY_DEFAULT
from kvxfer.cache.events import AllCleared, Created, EventsDropped, KVEvent, Removed, Stored, Updated
from kvxfer.cache.hashing import block_hash_for_event

#: Where the event-manager record types live.
EVENT_MANAGER_MODULE = "kvxfer.cache.event_manager"


class ReferenceEventForwarder:
    """An ``EventSink`` turning kvxfer events into calls on a reference-style event manager.

    ``media()`` gives the manager's tier media in level order (an event's medium becomes its cache
    level); ``hash_algo`` is the algorithm of the manager's block keys (a stored block's event hash).
    """

    def __init__(self, event_manager: Any, hash_algo: str, media: Callable[[], Sequence[str]]) -> None:
        self.event_manager = event_manager
        self._hash_algo = hash_algo
        self._media = media
        self._records: Any = None

    def _level(self, medium: str | None) -> int:
        media = list(self._media())
        return media.index(medium) if medium in media else 0

    def _types(self) -> Any:
        if self._records is None:
            self._records = importlib.import_module(EVENT_MANAGER_MODULE)
        return self._records

    def publish(self, event: KVEvent) -> None:
        """Forward one event (``Created`` is the event manager owner's to announce; an ``AllCleared`` or
        ``EventsDropped`` has no reference counterpart)."""
        em = self.event_manager
        if isinstance(event, Stored):
            self._stored(event)
        elif isinstance(event, Removed):
            em.add_removed_event([bytes(h) for h in event.block_hashes])
        elif isinstance(event, Updated):
            self._updated(event)
        elif isinstance(event, Created | AllCleared | EventsDropped):
            return

    def _stored(self, event: Stored) -> None:
        records = self._types()
        level = self._level(event.medium)
        bs = event.block_size
        blocks = [records.KVCacheStoredBlockData(
            block_hash=block_hash_for_event(key, self._hash_algo),
            tokens=[records.UniqueToken(int(t)) for t in event.token_ids[i * bs:(i + 1) * bs]],
            cache_level=level, priority=int(PRIORITY_DEFAULT)) for i, key in enumerate(event.block_hashes)]
        parent = None if event.parent_hash is None else block_hash_for_event(event.parent_hash, self._hash_algo)
        groups: Sequence[int | None] = [None] if event.layer_groups is None else event.layer_groups
        for group in groups:
            self.event_manager.add_stored_event(parent, blocks, group)

    def _updated(self, event: Updated) -> None:
        records = self._types()
        level = None if event.old_medium is None else records.KVCacheEventDiff(
            self._level(event.old_medium), self._level(event.medium))
        priority = None if event.priority is None or event.old_priority is None else records.KVCacheEventDiff(
            int(event.old_priority), int(event.priority))
        groups: Sequence[int | None] = [None] if event.layer_groups is None else event.layer_groups
        for key in event.block_hashes:
            for group in groups:
                self.event_manager.add_updated_event(bytes(key), cache_level=level, priority=priority,
                                                     layer_group_id=group)
