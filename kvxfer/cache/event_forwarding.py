"""Forwards the manager's KV events to a reference-style event manager (``KVCacheEventManager``):
the manager's one event hook, so that its prefix tree and tiers never call an event manager directly.

An event manager with the prefix-tree block hooks (``add_stored_block_event_from_block``,
``add_stored_life_cycle_event_from_block``, ``add_removed_life_cycle_event``; kvxfer's and the
reference's both have them) is fed as the reference manager feeds it: each stored block is handed over
as a block (its key, its key tokens with multimodal digests as digests, its parent, one page per layer
group that holds it), so the event manager computes the event hash, the ``UniqueToken`` ids and the
``mm_keys`` itself and knows the block when it is removed or updated (by key, per layer group). An
object with only ``add_stored_event``, ``add_removed_event`` and ``add_updated_event`` gets ready-made
records instead (digests as hex token ids, hashes per the manager's key algorithm, no ``mm_keys``).

As in the reference, the manager does not announce itself to an event manager: whoever owns the event
manager calls ``add_created_event`` (the manager's own queue still carries its ``Created``). The record
types come from ``kvxfer.cache.event_manager``, imported when the first stored event is forwarded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.cache.common import PRIORITY_DEFAULT
from kvxfer.cache.events import AllCleared, Created, EventsDropped, KVEvent, Removed, Stored, Updated
from kvxfer.cache.hashing import MmItemContext, ReuseScope, block_hash_for_event

#: Where the event-manager record types live.
EVENT_MANAGER_MODULE = "kvxfer.cache.event_manager"

#: Int64 token ids and digest codes -> key tokens (ids, 32-byte digests, ``MmItemContext``).
KeyTokenDecoder = Callable[[Sequence[int]], Sequence[Any]]


@dataclass(frozen=True, slots=True)
class _Page:
    """A stored block's page in one layer group, as the event manager reads it."""

    cache_level: int
    priority: int


@dataclass(frozen=True, slots=True)
class _Root:
    """The root of a chain: its reuse scope (the v1 event hash of a first block depends on it)."""

    reuse_scope: ReuseScope


@dataclass(slots=True)
class _Block:
    """A prefix-tree block handed to the event manager (``EventSourceBlock``). Once forwarded, the
    forwarder keeps it with ``tokens`` cut to the multimodal item in force at its end (what a child
    needs for ``mm_keys``) and ``prev`` cut to None (the event manager knows the parent by key)."""

    key: bytes
    tokens: Sequence[Any]
    prev: Any
    storage: Sequence[_Page | None] = ()
    groups: set[int] = field(default_factory=set)


def _is_item(token: object) -> bool:
    return isinstance(token, bytes | MmItemContext)


def _scope(event: Stored) -> ReuseScope:
    """The reuse scope of a chain's first block: its LoRA id, and its salt from the block's extra keys."""
    salt: int | None = None
    first = event.extra_keys[0] if event.extra_keys else None
    for name, value in first or ():
        if name == "salt" and value.isdigit():
            salt = int(value)
    return ReuseScope(event.lora_id, salt)


class ReferenceEventForwarder:
    """An ``EventSink`` turning kvxfer events into calls on a reference-style event manager.

    ``media()`` gives the manager's tier media in level order (an event's medium becomes its cache
    level); ``hash_algo`` is the algorithm of the manager's block keys; ``decode`` turns a Stored
    event's token ids (digests as the manager's negative codes) into key tokens (default: ids as they
    are); ``num_layer_groups`` is how many layer groups an event without ``layer_groups`` covers.
    """

    def __init__(self, event_manager: Any, hash_algo: str, media: Callable[[], Sequence[str]], *,
                 decode: KeyTokenDecoder | None = None, num_layer_groups: int = 1) -> None:
        self.event_manager = event_manager
        self._hash_algo = hash_algo
        self._media = media
        self._decode: KeyTokenDecoder = decode if decode is not None else (lambda ids: [int(t) for t in ids])
        self._num_groups = int(num_layer_groups)
        self._records: Any = None
        self._by_block = all(callable(getattr(event_manager, name, None)) for name in (
            "add_stored_block_event_from_block", "add_stored_life_cycle_event_from_block",
            "add_removed_life_cycle_event"))
        self._blocks: dict[bytes, _Block] = {}        # forwarded blocks still in the tree (block hooks only)

    def _level(self, medium: str | None) -> int:
        media = list(self._media())
        return media.index(medium) if medium in media else 0

    def _types(self) -> Any:
        if self._records is None:
            self._records = importlib.import_module(EVENT_MANAGER_MODULE)
        return self._records

    def _groups(self, layer_groups: Sequence[int] | None) -> Sequence[int]:
        return range(self._num_groups) if layer_groups is None else layer_groups

    def publish(self, event: KVEvent) -> None:
        """Forward one event (``Created`` is the event manager owner's to announce; ``EventsDropped`` has
        no reference counterpart; ``AllCleared`` removes every block forwarded so far)."""
        if isinstance(event, Stored):
            if self._by_block:
                self._stored_blocks(event)
            else:
                self._stored(event)
        elif isinstance(event, Removed):
            self._removed(event)
        elif isinstance(event, Updated):
            self._updated(event)
        elif isinstance(event, AllCleared):
            if self._blocks:
                self.event_manager.add_removed_event(list(self._blocks))
                self._blocks.clear()
        elif isinstance(event, Created | EventsDropped):
            return

    # --- block hooks --------------------------------------------------------------------------------
    def _stored_blocks(self, event: Stored) -> None:
        em = self.event_manager
        groups = self._groups(event.layer_groups)
        page = _Page(self._level(event.medium), int(PRIORITY_DEFAULT))
        storage = [page if lc in groups else None for lc in range(max(self._num_groups, max(groups, default=-1) + 1))]
        tokens = self._decode(event.token_ids)
        bs = event.block_size
        if event.parent_hash is None:
            prev: Any = _Root(_scope(event))
        else:
            prev = self._blocks.get(bytes(event.parent_hash)) or _Block(bytes(event.parent_hash), (), None)
        for i, raw_key in enumerate(event.block_hashes):
            key = bytes(raw_key)
            block = _Block(key, list(tokens[i * bs:(i + 1) * bs]), prev, storage, set(groups))
            known = self._blocks.get(key)
            if known is None:
                em.add_stored_block_event_from_block(block)
            else:
                for lc in groups:
                    em.add_stored_life_cycle_event_from_block(block, lc)
            items = [t for t in block.tokens if _is_item(t)]
            inherited = prev.tokens if isinstance(prev, _Block) else ()
            kept = _Block(key, items[-1:] or list(inherited), None, (), set(groups))
            if known is not None:
                kept.groups |= known.groups
            self._blocks[key] = kept
            prev = kept

    def _removed(self, event: Removed) -> None:
        em = self.event_manager
        keys = [bytes(h) for h in event.block_hashes]
        if not self._by_block:
            em.add_removed_event(keys)
            return
        if event.layer_groups is None:
            em.add_removed_event(keys)
            for key in keys:
                self._blocks.pop(key, None)
            return
        for key in keys:
            for lc in event.layer_groups:
                em.add_removed_life_cycle_event(key, lc)
            known = self._blocks.get(key)
            if known is not None:
                known.groups -= set(event.layer_groups)
                if not known.groups:
                    del self._blocks[key]

    # --- ready-made records -------------------------------------------------------------------------
    def _stored(self, event: Stored) -> None:
        records = self._types()
        level = self._level(event.medium)
        bs = event.block_size
        tokens = [records.UniqueToken(t.digest.hex() if isinstance(t, MmItemContext) else
                                      t.hex() if isinstance(t, bytes) else int(t))
                  for t in self._decode(event.token_ids)]
        blocks = [records.KVCacheStoredBlockData(
            block_hash=block_hash_for_event(key, self._hash_algo), tokens=tokens[i * bs:(i + 1) * bs],
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
        groups: Sequence[int | None]
        if self._by_block:
            groups = list(self._groups(event.layer_groups))
        else:
            groups = [None] if event.layer_groups is None else event.layer_groups
        for key in event.block_hashes:
            for group in groups:
                self.event_manager.add_updated_event(bytes(key), cache_level=level, priority=priority,
                                                     layer_group_id=group)

