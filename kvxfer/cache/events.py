"""KV-cache events: what the prefix tree stored, moved, updated and removed, for KV-aware routers.

The manager puts events on a bounded ``EventQueue``: each queued event gets the next ``event_id``;
when the queue is full the oldest event is dropped, so the drained ids skip, and the next drain starts
with an ``EventsDropped`` marker counting them. Consecutive stored blocks of one chain coalesce into
one ``Stored``, consecutive removals into one ``Removed``. ``layer_groups`` names the layer groups an
event concerns (None: every layer group of the layout): a sliding-window group that lets go of a
block's pages gets its own ``Removed``, so a router is never told that block is still reusable there.

``kvxfer.cache.event_wire`` turns these into vLLM's wire format (docs/events.md).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvxfer.errors import ConfigError

#: Event ``medium`` names of kvxfer's tiers (``"GPU"``, ``"CPU"``, ``"DISK"``); vLLM's wires name the disk
#: tier ``"STORAGE"``, as vLLM's offloading connectors do (``event_wire.VLLM_MEDIA``).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
_NO_ID = -1


@dataclass(frozen=True)
class Created:
    """A cache manager came up: ``num_blocks_per_medium[i]`` slots of the layer groups' pool group on
    ``media[i]`` (the primary tier first)."""

    media: tuple[str, ...]
    num_blocks_per_medium: tuple[int, ...]
    layer_groups: tuple[int, ...] | None = None
    event_id: int = field(default=_NO_ID, compare=False)


@dataclass(frozen=True)
class Stored:
    """Blocks entered the prefix tree: ``block_hashes`` continue the chain after ``parent_hash``
    (None: the first block of its scope); ``token_ids`` are all their tokens in order.

    ``extra_keys`` has one entry per block (None: the block's hash has no extra input), each a tuple
    of what went into the hash besides the tokens: ``("salt", hex)`` on a scope's first block and
    ``("mm", hex)`` for a block's extra key (a multimodal digest).
    """

    parent_hash: bytes | None
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str
    extra_keys: tuple[tuple[tuple[str, str], ...] | None, ...] | None = None
    layer_groups: tuple[int, ...] | None = None
    event_id: int = field(default=_NO_ID, compare=False)


@dataclass(frozen=True)
class Removed:
    """Blocks left the prefix tree (evicted), or only the listed layer groups' pages of them
    (a sliding-window group letting go of pages no request can attend to any more)."""

    block_hashes: tuple[bytes, ...]
    medium: str
    layer_groups: tuple[int, ...] | None = None
    event_id: int = field(default=_NO_ID, compare=False)


@dataclass(frozen=True)
class Updated:
    """Stored blocks changed in place: now on ``medium`` (moved from ``old_medium`` when that is not
    None: a tier move) and/or with eviction ``priority`` changed from ``old_priority`` (None: unchanged).

    A tier move also carries what a router needs to store the blocks anew on ``medium``: each block's
    parent (``parent_hashes``, None for a scope's first block), its tokens (``block_tokens``) and the
    tokens per block (``block_size``); None / 0 when unknown."""

    block_hashes: tuple[bytes, ...]
    medium: str
    priority: int | None = None
    old_medium: str | None = None
    old_priority: int | None = None
    layer_groups: tuple[int, ...] | None = None
    parent_hashes: tuple[bytes | None, ...] | None = None
    block_tokens: tuple[tuple[int, ...], ...] | None = None
    block_size: int = 0
    event_id: int = field(default=_NO_ID, compare=False)


@dataclass(frozen=True)
class AllCleared:
    """Every block left the prefix tree at once."""

    event_id: int = field(default=_NO_ID, compare=False)


@dataclass(frozen=True)
class EventsDropped:
    """``count`` events were dropped (the bounded queue was full) just before this marker: a
    subscriber must forget what it knows of this cache (vLLM's wire carries it as AllBlocksCleared)."""

    count: int
    event_id: int = field(default=_NO_ID, compare=False)


KVEvent = Created | Stored | Removed | Updated | AllCleared | EventsDropped


class EventSink(Protocol):
    """Receives every event the manager puts, as it is put (before queue merging or dropping)."""

    def publish(self, event: KVEvent) -> None: ...


class EventQueue:
    """Bounded FIFO of events; when full the oldest event is dropped and counted.

    Every event put gets the next ``event_id`` (a merged event keeps the id of the one it extends),
    so the ids a consumer drains skip exactly where events were dropped. Consecutive events merge:
    ``Stored`` continuing the previous chain (same LoRA, block size, medium, layer groups),
    ``Removed`` of one medium and layer groups, ``Updated`` with the same change.

    The newest event's continuations are kept aside and folded into it once (when another event
    follows, or at drain), so merging a long run costs linear time, not quadratic.
    """

    def __init__(self, capacity: int, sink: EventSink | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"EventQueue capacity must be an int > 0, got {capacity!r}")
        self.capacity = capacity
        self._sink = sink
        self._events: collections.deque[KVEvent] = collections.deque()
        self._tail: list[KVEvent] = []   # events continuing self._events[-1], not yet folded into it
        self.dropped = 0
        self._dropped_since_drain = 0
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._events)

    @property
    def next_event_id(self) -> int:
        """The id the next new event will get."""
        return self._next_id

    def put(self, event: KVEvent) -> None:
        """Append ``event``, merging it into the newest queued event when it continues it (the sink, if
        any, gets it first)."""
        if self._sink is not None:
            self._sink.publish(event)
        if self._events:
            last = self._events[-1]
            if _continues(last, self._tail[-1] if self._tail else last, event):
                self._tail.append(event)
                return
            self._fold_tail()
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self.dropped += 1
            self._dropped_since_drain += 1
        self._events.append(dataclasses.replace(event, event_id=self._next_id))
        self._next_id += 1

    def _fold_tail(self) -> None:
        if self._tail:
            self._events[-1] = _merged(self._events[-1], self._tail)
            self._tail = []

    def drain(self) -> list[KVEvent]:
        """Every queued event, oldest first, after an ``EventsDropped`` marker when events were
        dropped since the last drain; the queue is left empty."""
        self._fold_tail()
        out: list[KVEvent] = []
        if self._dropped_since_drain:
            first = self._events[0].event_id if self._events else self._next_id
            out.append(EventsDropped(self._dropped_since_drain, event_id=first - 1))
            self._dropped_since_drain = 0
        out.extend(self._events)
        self._events.clear()
        return out


def _continues(head: KVEvent, last: KVEvent, new: KVEvent) -> bool:
    """Whether ``new`` merges into the queued event ``head`` whose newest continuation is ``last``
    (``head`` itself when it has none)."""
    if isinstance(head, Stored) and isinstance(new, Stored) and isinstance(last, Stored):
        return (new.parent_hash is not None and new.parent_hash == last.block_hashes[-1]
                and (new.block_size, new.lora_id, new.medium, new.layer_groups)
                == (head.block_size, head.lora_id, head.medium, head.layer_groups))
    if isinstance(head, Removed) and isinstance(new, Removed):
        return (head.medium, head.layer_groups) == (new.medium, new.layer_groups)
    if isinstance(head, Updated) and isinstance(new, Updated):
        return (head.medium, head.priority, head.old_medium, head.old_priority, head.layer_groups, head.block_size,
                head.block_tokens is None, head.parent_hashes is None) == (
            new.medium, new.priority, new.old_medium, new.old_priority, new.layer_groups, new.block_size,
            new.block_tokens is None, new.parent_hashes is None)
    return False


def _merged(head: KVEvent, tail: Sequence[KVEvent]) -> KVEvent:
    """``head`` with the blocks of its continuations ``tail`` (events of its type) appended; its id and
    other fields kept."""
    if isinstance(head, Stored):
        stored = [head, *(e for e in tail if isinstance(e, Stored))]
        extra = None
        if any(e.extra_keys is not None for e in stored):
            extra = tuple(itertools.chain.from_iterable(e.extra_keys or (None,) * len(e.block_hashes)
                                                        for e in stored))
        return dataclasses.replace(head, block_hashes=tuple(itertools.chain.from_iterable(
            e.block_hashes for e in stored)), token_ids=tuple(itertools.chain.from_iterable(
                e.token_ids for e in stored)), extra_keys=extra)
    if isinstance(head, Updated):
        updated = [head, *(e for e in tail if isinstance(e, Updated))]
        return dataclasses.replace(
            head, block_hashes=tuple(itertools.chain.from_iterable(e.block_hashes for e in updated)),
            parent_hashes=None if head.parent_hashes is None else tuple(itertools.chain.from_iterable(
                e.parent_hashes or () for e in updated)),
            block_tokens=None if head.block_tokens is None else tuple(itertools.chain.from_iterable(
                e.block_tokens or () for e in updated)))
    if isinstance(head, Removed):
        return dataclasses.replace(head, block_hashes=tuple(itertools.chain.from_iterable(
            e.block_hashes for e in (head, *tail) if isinstance(e, Removed))))
    return head


def layer_group_subset(present: Sequence[bool]) -> tuple[int, ...] | None:
    """The ``layer_groups`` of an event about the layer groups where ``present`` is true (None: all)."""
    ids = tuple(i for i, p in enumerate(present) if p)
    return None if len(ids) == len(present) else ids


def salt_text(salt: bytes | str | int | None) -> str | None:
    """A reuse scope's salt as events show it: a string as is, bytes as hex, an integer in decimal."""
    if salt is None:
        return None
    if isinstance(salt, bytes):
        return salt.hex()
    return str(salt)


def stored_extra_keys(first_block: int, n_blocks: int, salt: bytes | str | int | None,
                      block_extra: Mapping[int, bytes]) -> tuple[tuple[tuple[str, str], ...] | None, ...] | None:
    """``Stored.extra_keys`` for blocks [first_block, first_block + n_blocks) of a request: the salt on
    block 0 (as vLLM puts ``cache_salt`` in the first block's extra keys), each block's extra key as
    hex (None when no block has any)."""
    salt_str = salt_text(salt)
    if not block_extra and not (salt_str and first_block == 0 < n_blocks):
        return None                     # no block of the range has an extra key
    out: list[tuple[tuple[str, str], ...] | None] = []
    for b in range(first_block, first_block + n_blocks):
        keys = ((("salt", salt_str),) if b == 0 and salt_str else ()) + (
            (("mm", block_extra[b].hex()),) if b in block_extra else ())
        out.append(keys or None)
    return None if all(k is None for k in out) else tuple(out)
