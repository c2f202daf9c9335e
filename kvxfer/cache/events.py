"""KV-cache events: what the prefix tree stored, updated and removed, for KV-aware routers.

Events go to a bounded queue (the oldest are dropped when full, and counted); consecutive stored
blocks of one chain coalesce into one ``Stored``, consecutive removals into one ``Removed``.
``KVEventPublisher`` sends drained events over a ZeroMQ PUB socket in the wire format of vLLM's KV
events (see docs/events.md), so a router that subscribes to vLLM can subscribe here unchanged.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvxfer.cache.hashing import HASH_NAMES, HASH_V2_BLAKE3_64, external_hash
from kvxfer.errors import ConfigError, TransportError


@dataclass(frozen=True)
class Stored:
    """Blocks entered the prefix tree: ``block_hashes`` continue the chain after ``parent_hash``
    (None: the first block of its scope); ``token_ids`` are all their tokens in order."""

    parent_hash: bytes | None
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str


@dataclass(frozen=True)
class Removed:
    """Blocks left the prefix tree (evicted)."""

    block_hashes: tuple[bytes, ...]
    medium: str


@dataclass(frozen=True)
class Updated:
    """Stored blocks changed in place: now on ``medium`` (a tier move) and/or with a new eviction
    ``priority`` (None: unchanged)."""

    block_hashes: tuple[bytes, ...]
    medium: str
    priority: int | None = None


@dataclass(frozen=True)
class AllCleared:
    """Every block left the prefix tree at once."""


KVEvent = Stored | Removed | Updated | AllCleared


class EventQueue:
    """Bounded FIFO of events; when full the oldest event is dropped and counted.

    Consecutive events merge: ``Stored`` continuing the previous chain (same LoRA, block size and
    medium), ``Removed`` of one medium, ``Updated`` with the same medium and priority.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"EventQueue capacity must be an int > 0, got {capacity!r}")
        self.capacity = capacity
        self._events: collections.deque[KVEvent] = collections.deque()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    def put(self, event: KVEvent) -> None:
        """Append ``event``, merging it into the newest queued event when it continues it."""
        if self._events:
            merged = _coalesce(self._events[-1], event)
            if merged is not None:
                self._events[-1] = merged
                return
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        """Every queued event, oldest first; the queue is left empty."""
        out = list(self._events)
        self._events.clear()
        return out


def _coalesce(last: KVEvent, new: KVEvent) -> KVEvent | None:
    if isinstance(last, Stored) and isinstance(new, Stored):
        if (new.parent_hash is not None and new.parent_hash == last.block_hashes[-1]
                and (new.block_size, new.lora_id, new.medium) == (last.block_size, last.lora_id, last.medium)):
            return Stored(last.parent_hash, last.block_hashes + new.block_hashes, last.token_ids + new.token_ids,
                          last.block_size, last.lora_id, last.medium)
        return None
    if isinstance(last, Removed) and isinstance(new, Removed) and last.medium == new.medium:
        return Removed(last.block_hashes + new.block_hashes, last.medium)
    if isinstance(last, Updated) and isinstance(new, Updated) and (last.medium, last.priority) == (
            new.medium, new.priority):
        return Updated(last.block_hashes + new.block_hashes, last.medium, last.priority)
    return None


# --- wire format -----------------------------------------------------------------------------------
def event_to_wire(event: KVEvent, hash_name: str = HASH_V2_BLAKE3_64) -> list[Any]:
    """One event as vLLM's tagged array: ``[tag, field, ...]`` (see docs/events.md).

    ``Updated`` has no counterpart in that schema and is not sent (returns an empty list).
    """
    if isinstance(event, Stored):
        parent = None if event.parent_hash is None else external_hash(event.parent_hash, hash_name)
        return ["BlockStored", [external_hash(h, hash_name) for h in event.block_hashes], parent,
                list(event.token_ids), event.block_size, event.lora_id, event.medium]
    if isinstance(event, Removed):
        return ["BlockRemoved", [external_hash(h, hash_name) for h in event.block_hashes], event.medium]
    if isinstance(event, AllCleared):
        return ["AllBlocksCleared"]
    return []


def encode_batch(events: Iterable[KVEvent], timestamp: float, hash_name: str = HASH_V2_BLAKE3_64,
                 data_parallel_rank: int | None = None) -> bytes:
    """A batch payload: msgpack ``[ts, [event, ...]]`` (plus the data-parallel rank when given)."""
    wire = [w for w in (event_to_wire(e, hash_name) for e in events) if w]
    body: list[Any] = [timestamp, wire]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


class KVEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket as ``[topic, seq (8 bytes, big-endian), payload]``."""

    def __init__(self, endpoint: str, *, topic: str = "kv-events", hash_name: str = HASH_V2_BLAKE3_64,
                 data_parallel_rank: int | None = None, context: zmq.Context[Any] | None = None) -> None:
        if hash_name not in HASH_NAMES:
            raise ConfigError(f"KVEventPublisher: unknown hash name {hash_name!r} (have {', '.join(HASH_NAMES)})")
        self.topic = topic.encode()
        self.hash_name = hash_name
        self.data_parallel_rank = data_parallel_rank
        self._seq = 0
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise TransportError(f"KVEventPublisher: cannot bind {endpoint!r}: {exc}") from exc
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def next_sequence(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def publish(self, events: Iterable[KVEvent]) -> int | None:
        """Send ``events`` as one batch; returns its sequence number (None: nothing to send)."""
        items = list(events)
        if not any(event_to_wire(e, self.hash_name) for e in items):
            return None
        payload = encode_batch(items, time.time(), self.hash_name, self.data_parallel_rank)
        seq = self._seq
        self._socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self._seq += 1
        return seq

    def close(self) -> None:
        """Close the socket (pending messages are dropped)."""
        self._socket.close()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
