"""KV-cache events in TensorRT-LLM's v2 form: ``KVCacheEventManager`` and its records.

The manager of TensorRT-LLM's ``kv_cache_manager_v2`` reports what its prefix tree stores, drops and
moves through a ``KVCacheEventManager``; the engine drains those events once per iteration and a
router reads them as JSON (``KVCacheEventSerializer``). This module is kvxfer's implementation of that
contract, independent of kvxfer's own vLLM-facing events (``kvxfer.cache.events``).

Records (frozen, picklable): ``KVCacheEvent(event_id, data, window_size, hash_algo, attention_dp_rank,
layer_group_id)`` whose ``data`` is ``KVCacheCreatedData``, ``KVCacheStoredData`` (of
``KVCacheStoredBlockData`` with ``UniqueToken`` tokens and multimodal ``mm_keys``),
``KVCacheRemovedData`` or ``KVCacheUpdatedData`` (with ``KVCacheEventDiff`` old/new values).

Queue semantics: events wait in a pending list until ``flush_iteration_events`` publishes them to a
bounded queue of ``max_kv_event_entries`` (the oldest dropped; 0 disables events), which
``get_latest_events`` drains (``timeout_ms``: None waits for an event, <= 0 returns at once). Every event
gets the next id when it becomes pending. A stored event continuing the newest pending stored event of
the same layer group (its parent is that event's last block) is merged into it. Removals are gathered
per layer group and become one removed event when anything else is added or at the flush, so a
removal is always published before the next stored or updated event. With ``attention_dp_gather`` the
flush hands this rank's events (at most ``max_kv_event_entries``) to the gather function; rank 0
publishes what every rank sent, into a queue that many times larger, and other ranks publish nothing.

Block hashes in events follow ``hash_algo``: ``v2_sha256`` the block key as hex, ``v2_sha256_64`` its
first 8 bytes as an unsigned big-endian int (kvxfer's ``v2_blake3`` / ``v2_blake3_64`` label a BLAKE3-keyed
tree the same two ways), ``v1_block_key`` TensorRT-LLM's v1 ``BlockKeyHasher`` chain
recomputed from the block's tokens and its chain's reuse scope (a chain holding a multimodal digest
falls back to the ``v2_sha256_64`` value from that block on); ``auto`` means ``v1_block_key``.

Manager hook (what a cache manager calls; every call is cheap and never raises for an unknown key):

- at construction: ``set_layer_group_window_sizes({layer_group: window_size})`` when groups differ, then
  ``add_created_event(num_blocks_per_cache_level, layer_group_ids)``;
- a block entered the prefix tree: ``add_stored_block_event_from_block(block)``; one more life cycle
  (layer group) of an already stored block got its page: ``add_stored_life_cycle_event_from_block(block,
  life_cycle_id)``. ``block`` is read through the ``EventSourceBlock`` protocol below;
- a block left the tree: ``add_removed_event(block.key)`` (or an iterable of keys); only one life
  cycle's page of it was dropped: ``add_removed_life_cycle_event(block.key, life_cycle_id)``;
- a stored block's page moved tier or changed priority: ``add_updated_event(block.key,
  cache_level=KVCacheEventDiff(old, new), priority=..., layer_group_id=life_cycle_id)``;
- the engine ends an iteration: ``flush_iteration_events()``.

``EventSourceBlock``: ``key`` (the block's 32-byte key), ``tokens`` (its key tokens: ids, 32-byte digests,
``MmItemContext``), ``prev`` (the parent block, or the chain's root: an object with a ``reuse_scope``
(``lora_id`` and ``salt``), or any object without ``key`` and ``tokens``, e.g. None) and ``storage`` (per life cycle id: None,
a page, or a zero-argument callable returning the page or None). A page (``EventSourcePage``) has
``cache_level`` and ``priority``, and may have ``num_tokens``, how many of the block's tokens it holds
(absent or None: all). A life cycle is stored, and published, only when its page holds every token of
the block. With ``mm_token_id_offset`` set, a token id ``>= mm_token_id_offset`` is position ``id -
mm_token_id_offset`` of the multimodal item whose digest came last in the chain (in this block or an
ancestor), and each run of an item's positions in a block becomes one ``mm_keys`` entry ``(digest,
start_offset[, uuid])``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

from kvxfer.cache.hashing import (
    HASH_V2_BLAKE3,
    HASH_V2_BLAKE3_64,
    KV_CACHE_HASH_ALGO_AUTO,
    KV_CACHE_HASH_ALGO_DEFAULT,
    KV_CACHE_HASH_ALGO_V1,
    KV_CACHE_HASH_ALGO_V2,
    KV_CACHE_HASH_ALGO_V2_SHA256_64,
    MmItemContext,
    NonTextTokenHashError,
    hash_v1_block_key,
    truncate_sha256_hash_to_int64,
)
from kvxfer.errors import ConfigError

#: A block hash as events carry it: an int (64-bit modes) or a hex string (``v2_sha256``).
EventBlockHash: TypeAlias = int | str
#: What the hooks take: a block key (bytes, looked up among stored blocks) or an event hash as is.
BlockHashLike: TypeAlias = bytes | EventBlockHash
BlockHashesLike: TypeAlias = BlockHashLike | Iterable[BlockHashLike]
#: A token id in an event: an int, or a multimodal digest as hex.
EventTokenId: TypeAlias = int | str
#: A multimodal key of a stored block: ``(digest, start_offset)``, optionally with the item's uuid and a
#: producer-defined flag after it.
MmKey: TypeAlias = (tuple[bytes, int] | tuple[bytes, int, str | None]
                    | tuple[bytes, int, str | None, bool])
#: Event hash algorithms the manager accepts: TensorRT-LLM's four, and kvxfer's BLAKE3 names for a tree keyed
#: with BLAKE3 (published like their SHA-256 counterparts: hex, or the first 8 bytes).
EVENT_HASH_ALGOS: tuple[str, ...] = (KV_CACHE_HASH_ALGO_AUTO, KV_CACHE_HASH_ALGO_V1, KV_CACHE_HASH_ALGO_V2,
                                     KV_CACHE_HASH_ALGO_V2_SHA256_64, HASH_V2_BLAKE3, HASH_V2_BLAKE3_64)
_HEX_ALGOS = (KV_CACHE_HASH_ALGO_V2, HASH_V2_BLAKE3)
_TRUNCATED_ALGOS = (KV_CACHE_HASH_ALGO_V2_SHA256_64, HASH_V2_BLAKE3_64)


@dataclass(slots=True, frozen=True)
class UniqueToken:
    """One token of a stored block: its id (a digest as hex) and an extra id (0: none)."""

    token_id: EventTokenId
    token_extra_id: int = 0


@dataclass(slots=True, frozen=True)
class KVCacheCreatedData:
    """The cache came up with ``num_blocks_per_cache_level[i]`` blocks on cache level ``i``."""

    num_blocks_per_cache_level: list[int]


@dataclass(slots=True, frozen=True)
class KVCacheStoredBlockData:
    """One block that became reusable: its hash, tokens, cache level, eviction priority, multimodal keys
    and the tenant salt its chain was stored under (None: not reported)."""

    block_hash: EventBlockHash
    tokens: list[UniqueToken]
    cache_level: int
    priority: int
    mm_keys: list[MmKey] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass(slots=True, frozen=True)
class KVCacheStoredData:
    """Blocks stored in chain order after ``parent_hash`` (None: the first block of its reuse scope)."""

    parent_hash: EventBlockHash | None
    blocks: list[KVCacheStoredBlockData]


@dataclass(slots=True, frozen=True)
class KVCacheRemovedData:
    """Blocks that stopped being reusable."""

    block_hashes: list[EventBlockHash]


@dataclass(slots=True, frozen=True)
class KVCacheEventDiff:
    """A value that changed: ``old_value`` then ``new_value`` (positional order as in the v1 events)."""

    old_value: int
    new_value: int


@dataclass(slots=True, frozen=True)
class KVCacheUpdatedData:
    """A stored block changed in place: its cache level and/or priority (None: unchanged). Both are
    required arguments, so an update always says which one changed."""

    block_hash: EventBlockHash
    cache_level: KVCacheEventDiff | None
    priority: KVCacheEventDiff | None


KVCacheEventData: TypeAlias = KVCacheCreatedData | KVCacheStoredData | KVCacheRemovedData | KVCacheUpdatedData


@dataclass(slots=True, frozen=True)
class KVCacheEvent:
    """One event: its id, payload, the attention window of its layer group, the hash algorithm of its
    block hashes, the attention-DP rank that produced it and its layer group (None: not per group)."""

    event_id: int
    data: KVCacheEventData
    window_size: int
    hash_algo: str | None = None
    attention_dp_rank: int | None = None
    layer_group_id: int | None = None


#: Gathers each rank's events: called with this rank's list, returns every rank's list (rank 0 first).
AttentionDpGatherFn: TypeAlias = Callable[[list[KVCacheEvent]], Sequence[Sequence[KVCacheEvent]]]


class EventSourcePage(Protocol):
    """A page of a stored block as the event manager reads it (``num_tokens`` is optional, see module doc)."""

    @property
    def cache_level(self) -> int: ...

    @property
    def priority(self) -> int: ...


@runtime_checkable
class EventSourceBlock(Protocol):
    """A prefix-tree block as the event manager reads it (see the module docstring)."""

    @property
    def key(self) -> bytes: ...

    @property
    def tokens(self) -> Sequence[Any]: ...

    @property
    def prev(self) -> Any: ...

    @property
    def storage(self) -> Sequence[Any]: ...


@dataclass(slots=True)
class _StoredState:
    """What the manager knows of a stored block: its event hash, its published life cycles, and for the
    v1 chain whether the hash is a real v1 hash and the root scope's (lora_id, salt)."""

    block_hash: EventBlockHash
    life_cycle_ids: set[int]
    v1_compatible: bool = True
    root_attrs: tuple[int | None, int | None] = (None, None)


def _is_block(value: object) -> bool:
    """Whether a node of a ``prev`` chain is a block (not the root: a root has a ``reuse_scope`` or lacks
    ``key``/``tokens``)."""
    return hasattr(value, "key") and hasattr(value, "tokens") and not hasattr(value, "reuse_scope")


def _token_id(token: object) -> int | None:
    """``token`` as an int id (None: a digest or anything else that is not an integer id)."""
    if isinstance(token, int | np.integer) and not isinstance(token, bool):
        return int(token)
    return None


def _check_count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ConfigError(f"KVCacheEventManager: {name} must be an int >= 0, got {value!r}")
    return int(value)


class KVCacheEventManager:
    """TensorRT-LLM's v2 KV-cache event queue (see the module docstring for semantics and the manager hook).

    Thread-safe: hooks, flushes and readers may run on different threads; ``get_latest_events`` blocks on
    a condition the flush signals.
    """

    def __init__(self, max_kv_event_entries: int, *, window_size: int = 0, attention_dp_rank: int | None = None,
                 attention_dp_gather: AttentionDpGatherFn | None = None, hash_algo: str = KV_CACHE_HASH_ALGO_V2,
                 window_size_by_layer_group: dict[int, int] | None = None,
                 mm_token_id_offset: int | None = None) -> None:
        if hash_algo not in EVENT_HASH_ALGOS:
            raise ConfigError(f"KVCacheEventManager: Unsupported V2 KV cache event hash algorithm: {hash_algo!r} "
                              f"(have {', '.join(EVENT_HASH_ALGOS)})")
        self._cond = threading.Condition(threading.RLock())
        self._max_entries = _check_count(max_kv_event_entries, "max_kv_event_entries")
        self._window_size = _check_count(window_size, "window_size")
        self._window_by_group: dict[int, int] = {}
        self.set_layer_group_window_sizes(window_size_by_layer_group or {})
        if attention_dp_rank is not None:
            _check_count(attention_dp_rank, "attention_dp_rank")
        if mm_token_id_offset is not None:
            _check_count(mm_token_id_offset, "mm_token_id_offset")
        self._dp_rank = attention_dp_rank
        self._dp_gather = attention_dp_gather
        self._hash_algo = KV_CACHE_HASH_ALGO_DEFAULT if hash_algo == KV_CACHE_HASH_ALGO_AUTO else hash_algo
        self._mm_offset = mm_token_id_offset
        self._next_id = 0
        self._pending: list[KVCacheEvent] = []
        self._published: deque[KVCacheEvent] = deque()
        self._open_stored: dict[int | None, int] = {}          # layer group -> index in _pending
        self._open_removed: dict[int | None, list[EventBlockHash]] = {}
        self._stored: dict[bytes, _StoredState] = {}

    # --- configuration ------------------------------------------------------------------------------
    @property
    def hash_algo(self) -> str:
        """The algorithm event block hashes follow (``auto`` already resolved)."""
        return self._hash_algo

    @property
    def max_kv_event_entries(self) -> int:
        """Capacity of the published queue (0: events disabled)."""
        return self._max_entries

    def set_layer_group_window_sizes(self, window_sizes: dict[int, int]) -> None:
        """Attention window of each layer group, stamped on that group's events (others get ``window_size``)."""
        checked = {int(_check_count(g, "layer group id")): _check_count(w, f"window size of layer group {g}")
                   for g, w in dict(window_sizes).items()}
        with self._cond:
            self._window_by_group = checked

    # --- hooks: raw events ----------------------------------------------------------------------------
    def add_created_event(self, num_blocks_per_cache_level: Sequence[int],
                          layer_group_ids: Sequence[int] | None = None) -> None:
        """The cache came up; one event per layer group when ``layer_group_ids`` is given."""
        counts = [_check_count(n, "num_blocks_per_cache_level entry") for n in num_blocks_per_cache_level]
        groups: list[int | None] = [None] if layer_group_ids is None else [int(g) for g in layer_group_ids]
        with self._cond:
            for group in groups:
                self._append(KVCacheCreatedData(list(counts)), group)

    def add_stored_event(self, parent_hash: EventBlockHash | None, blocks: Sequence[KVCacheStoredBlockData],
                         layer_group_id: int | None = None) -> None:
        """Blocks were stored after ``parent_hash``; merged into the open stored event it continues."""
        if not blocks or not self._max_entries:
            return
        with self._cond:
            self._flush_removed(layer_group_id)
            index = self._open_stored.get(layer_group_id)
            if not self._open_removed and index is not None:
                open_event = self._pending[index]
                assert isinstance(open_event.data, KVCacheStoredData)
                if open_event.data.blocks and open_event.data.blocks[-1].block_hash == parent_hash:
                    data = dataclasses.replace(open_event.data, blocks=[*open_event.data.blocks, *blocks])
                    self._pending[index] = dataclasses.replace(open_event, data=data)
                    return
            self._append(KVCacheStoredData(parent_hash, list(blocks)), layer_group_id)
            self._open_stored[layer_group_id] = len(self._pending) - 1

    def add_removed_event(self, block_hashes: BlockHashesLike) -> None:
        """Blocks left the tree. A key (bytes) of a stored block removes it from every life cycle it was
        published on (unknown keys are ignored); an event hash (int or str) is reported as is."""
        if isinstance(block_hashes, bytes | str | int):
            block_hashes = (block_hashes,)
        by_group: dict[int | None, list[EventBlockHash]] = {}
        with self._cond:
            for item in block_hashes:
                if isinstance(item, bytes | bytearray | memoryview):
                    state = self._stored.pop(bytes(item), None)
                    if state is None:
                        continue
                    for lc in sorted(state.life_cycle_ids):
                        by_group.setdefault(lc, []).append(state.block_hash)
                else:
                    by_group.setdefault(None, []).append(item)
            for group in sorted(by_group, key=lambda g: -1 if g is None else g):
                self._queue_removed(by_group[group], group)

    def add_removed_life_cycle_event(self, block_hash: bytes, life_cycle_id: int) -> None:
        """One life cycle's page of a stored block was dropped: a removed event for that layer group (the
        block is forgotten once its last published life cycle is gone; unknown keys are ignored)."""
        lc = int(life_cycle_id)
        with self._cond:
            key = bytes(block_hash)
            state = self._stored.get(key)
            if state is None or lc not in state.life_cycle_ids:
                return
            state.life_cycle_ids.discard(lc)
            if not state.life_cycle_ids:
                del self._stored[key]
            self._queue_removed([state.block_hash], lc)

    def add_updated_event(self, block_hash: BlockHashLike, *, cache_level: KVCacheEventDiff | None = None,
                          priority: KVCacheEventDiff | None = None, layer_group_id: int | None = None) -> None:
        """A stored block moved cache level and/or changed priority (nothing when both are None or the key
        is not a stored block's)."""
        if cache_level is None and priority is None:
            return
        with self._cond:
            if isinstance(block_hash, bytes | bytearray | memoryview):
                state = self._stored.get(bytes(block_hash))
                if state is None:
                    return
                event_hash: EventBlockHash = state.block_hash
            else:
                event_hash = block_hash
            self._append(KVCacheUpdatedData(event_hash, cache_level, priority), layer_group_id)

    # --- hooks: prefix-tree blocks --------------------------------------------------------------------
    def add_stored_block_event_from_block(self, block: EventSourceBlock) -> None:
        """``block`` entered the prefix tree: one stored event per life cycle whose page holds the whole
        block (none when no page does)."""
        with self._cond:
            pages = self._covered_pages(block)
            if not pages:
                return
            state = self._state_for(block)
            state.life_cycle_ids = set(pages)
            self._stored[bytes(block.key)] = state
            parent = self._parent_hash(block)
            for lc in sorted(pages):
                self.add_stored_event(parent, [self._block_data(block, state.block_hash, pages[lc])], lc)

    def add_stored_life_cycle_event_from_block(self, block: EventSourceBlock, life_cycle_id: int) -> None:
        """Life cycle ``life_cycle_id`` of ``block`` got a page: a stored event for that layer group if the
        page holds the whole block and was not published yet (the whole block when it is not stored)."""
        lc = int(life_cycle_id)
        with self._cond:
            state = self._stored.get(bytes(block.key))
            if state is None:
                self.add_stored_block_event_from_block(block)
                return
            if lc in state.life_cycle_ids:
                return
            page = self._covered_pages(block).get(lc)
            if page is None:
                return
            state.life_cycle_ids.add(lc)
            self.add_stored_event(self._parent_hash(block), [self._block_data(block, state.block_hash, page)], lc)

    # --- draining -------------------------------------------------------------------------------------
    def flush_iteration_events(self) -> None:
        """Publish the pending events (see the module docstring for attention DP)."""
        with self._cond:
            local = self._drain_pending()
        if self._dp_gather is None:
            with self._cond:
                self._publish(local, self._max_entries)
            return
        gathered = self._dp_gather(self._tail(local, self._max_entries))
        if self._dp_rank != 0:
            return
        events = [e for rank_events in gathered for e in self._tail(rank_events, self._max_entries)]
        with self._cond:
            self._publish(events, self._max_entries * max(1, len(gathered)))

    def get_latest_events(self, timeout_ms: float | None = None) -> list[KVCacheEvent]:
        """Take every published event, oldest first. ``timeout_ms`` None waits until there is one, a
        positive value waits at most that long, zero or less does not wait."""
        with self._cond:
            if timeout_ms is None:
                self._cond.wait_for(lambda: bool(self._published))
            elif timeout_ms > 0:
                self._cond.wait_for(lambda: bool(self._published), timeout_ms / 1000.0)
            out = list(self._published)
            self._published.clear()
            return out

    # --- internals --------------------------------------------------------------------------------------
    def _window(self, group: int | None) -> int:
        return self._window_size if group is None else self._window_by_group.get(group, self._window_size)

    def _append(self, data: KVCacheEventData, group: int | None) -> None:
        if not self._max_entries:
            return
        if not isinstance(data, KVCacheRemovedData):
            for g in list(self._open_removed):
                self._flush_removed(g)
        self._pending.append(KVCacheEvent(self._next_id, data, self._window(group), self._hash_algo,
                                          self._dp_rank, group))
        self._next_id += 1
        if not isinstance(data, KVCacheStoredData):
            self._open_stored.pop(group, None)

    def _queue_removed(self, hashes: list[EventBlockHash], group: int | None) -> None:
        if hashes and self._max_entries:
            self._open_removed.setdefault(group, []).extend(hashes)
            self._open_stored.pop(group, None)

    def _flush_removed(self, group: int | None) -> None:
        hashes = self._open_removed.pop(group, None)
        if hashes:
            self._append(KVCacheRemovedData(hashes), group)

    def _drain_pending(self) -> list[KVCacheEvent]:
        for g in list(self._open_removed):
            self._flush_removed(g)
        out, self._pending = self._pending, []
        self._open_stored.clear()
        return out

    def _publish(self, events: Sequence[KVCacheEvent], capacity: int) -> None:
        if not events:
            return
        self._published.extend(events)
        while len(self._published) > capacity:
            self._published.popleft()
        self._cond.notify_all()

    @staticmethod
    def _tail(events: Sequence[KVCacheEvent], limit: int) -> list[KVCacheEvent]:
        return list(events[-limit:]) if limit > 0 else []

    @staticmethod
    def _page(ref: object) -> Any:
        return ref() if callable(ref) else ref

    def _covered_pages(self, block: EventSourceBlock) -> dict[int, Any]:
        """Life cycle id -> page, for the pages of ``block`` that hold all of its tokens."""
        n = len(block.tokens)
        out: dict[int, Any] = {}
        for lc, ref in enumerate(block.storage):
            page = None if ref is None else self._page(ref)
            if page is None:
                continue
            covered = getattr(page, "num_tokens", None)
            if covered is None or covered >= n:
                out[lc] = page
        return out

    def _block_data(self, block: EventSourceBlock, block_hash: EventBlockHash, page: Any) -> KVCacheStoredBlockData:
        return KVCacheStoredBlockData(block_hash, [self._token(t) for t in block.tokens], int(page.cache_level),
                                      int(page.priority), self._mm_keys(block))

    @staticmethod
    def _token(token: object) -> UniqueToken:
        if isinstance(token, MmItemContext):
            return UniqueToken(token.digest.hex())
        if isinstance(token, bytes):
            return UniqueToken(token.hex())
        token_id = _token_id(token)
        if token_id is None:
            raise ConfigError(f"KVCacheEventManager: a block token must be an int id, bytes or MmItemContext, "
                              f"got {token!r:.80}")
        return UniqueToken(token_id)

    def _parent_hash(self, block: EventSourceBlock) -> EventBlockHash | None:
        parent = block.prev
        return self._state_for(parent).block_hash if _is_block(parent) else None

    def _state_for(self, block: EventSourceBlock) -> _StoredState:
        """The event hash of ``block`` (a fresh state, not registered), reusing stored ancestors' v1 hashes."""
        key = bytes(block.key)
        stored = self._stored.get(key)
        if stored is not None:
            return _StoredState(stored.block_hash, set(), stored.v1_compatible, stored.root_attrs)
        if self._hash_algo in _HEX_ALGOS:
            return _StoredState(key.hex(), set())
        if self._hash_algo in _TRUNCATED_ALGOS:
            return _StoredState(truncate_sha256_hash_to_int64(key), set())
        chain: list[EventSourceBlock] = []
        node: Any = block
        parent_hash, compatible = 0, True
        while _is_block(node):
            known = self._stored.get(bytes(node.key))
            if known is not None:
                parent_hash, compatible, attrs = int(known.block_hash), known.v1_compatible, known.root_attrs
                break
            chain.append(node)
            node = node.prev
        else:
            scope = getattr(node, "reuse_scope", None)
            attrs = (None, None) if scope is None else (getattr(scope, "lora_id", None), getattr(scope, "salt", None))
        lora, salt = attrs
        for item in reversed(chain):
            if compatible:
                try:
                    parent_hash = hash_v1_block_key(list(item.tokens), parent_hash, lora, salt)
                    continue
                except NonTextTokenHashError:
                    compatible = False
            parent_hash = truncate_sha256_hash_to_int64(bytes(item.key))
        return _StoredState(parent_hash, set(), compatible, attrs)

    def _mm_keys(self, block: EventSourceBlock) -> list[MmKey]:
        """Multimodal keys of ``block``: one ``(digest, start_offset[, uuid])`` per run of an item's positions."""
        offset = self._mm_offset
        if offset is None:
            return []
        ids = [_token_id(t) for t in block.tokens]
        item: tuple[bytes, str | None] | None = None
        if any(i is not None and i >= offset for i in ids):
            item = self._item_before(block)
        out: list[MmKey] = []
        last: int | None = None          # item-local position of the previous token, when it was one
        for token, token_id in zip(block.tokens, ids, strict=True):
            if isinstance(token, MmItemContext | bytes):
                item = (token.digest, token.uuid) if isinstance(token, MmItemContext) else (token, None)
                position = 0
            elif item is not None and token_id is not None and token_id >= offset:
                position = token_id - offset
            else:
                last = None
                continue
            if last is None or position != last + 1 or position == 0:
                digest, uuid = item
                out.append((digest, position) if uuid is None else (digest, position, uuid))
            last = position
        return out

    @staticmethod
    def _item_before(block: EventSourceBlock) -> tuple[bytes, str | None] | None:
        """The multimodal item whose digest came last before ``block`` in its chain (None: no item)."""
        node: Any = block.prev
        while _is_block(node):
            for token in reversed(list(node.tokens)):
                if isinstance(token, MmItemContext):
                    return token.digest, token.uuid
                if isinstance(token, bytes):
                    return token, None
            node = node.prev
        return None

    @staticmethod
    def _hash_block_key(tokens: Sequence[int], parent_hash: int, lora_task_id: int | None,
                        cache_salt_id: int | None) -> int:
        """TensorRT-LLM's v1 hash of one block (``kvxfer.cache.hashing.hash_v1_block_key``)."""
        return hash_v1_block_key(tokens, parent_hash, lora_task_id, cache_salt_id)


# --- JSON form --------------------------------------------------------------------------------------------
def _diff_json(diff: KVCacheEventDiff | None) -> dict[str, Any] | None:
    return None if diff is None else {"type": "event_diff", "new_value": diff.new_value, "old_value": diff.old_value}


def _mm_key_json(key: MmKey) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "mm_key", "hash": bytes(key[0]).hex(), "start_offset": int(key[1])}
    if len(key) > 2 and key[2] is not None:
        out["uuid"] = key[2]
    return out


def _block_json(block: KVCacheStoredBlockData) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "stored_block",
        "block_hash": block.block_hash,
        "tokens": [{"type": "unique_token", "token_id": t.token_id, "token_extra_id": t.token_extra_id}
                   for t in block.tokens],
        "cache_level": block.cache_level,
        "priority": block.priority,
        "mm_keys": [_mm_key_json(k) for k in block.mm_keys],
    }
    if block.cache_salt is not None:
        out["cache_salt"] = block.cache_salt
    return out


def _data_json(data: KVCacheEventData) -> dict[str, Any]:
    if isinstance(data, KVCacheCreatedData):
        return {"type": "created", "num_blocks_per_cache_level": list(data.num_blocks_per_cache_level)}
    if isinstance(data, KVCacheStoredData):
        return {"type": "stored", "parent_hash": data.parent_hash, "blocks": [_block_json(b) for b in data.blocks]}
    if isinstance(data, KVCacheRemovedData):
        return {"type": "removed", "block_hashes": list(data.block_hashes)}
    if isinstance(data, KVCacheUpdatedData):
        return {"type": "updated", "block_hash": data.block_hash, "cache_level": _diff_json(data.cache_level),
                "priority": _diff_json(data.priority)}
    raise ConfigError(f"event_to_json: unknown KV cache event data type {type(data).__name__}")


def event_to_json(event: KVCacheEvent) -> dict[str, Any]:
    """One event as TensorRT-LLM's JSON event dict (``hash_algo``, ``attention_dp_rank`` and
    ``layer_group_id`` appear only when set)."""
    out: dict[str, Any] = {"event_id": event.event_id, "data": _data_json(event.data),
                           "window_size": event.window_size}
    for name in ("hash_algo", "attention_dp_rank", "layer_group_id"):
        value = getattr(event, name)
        if value is not None:
            out[name] = value
    return out


class KVCacheEventSerializer:
    """Events to JSON-ready dicts, as TensorRT-LLM's ``KVCacheEventSerializer`` lays them out."""

    @classmethod
    def serialize(cls, events: KVCacheEvent | Sequence[KVCacheEvent] | None
                  ) -> dict[str, Any] | list[dict[str, Any]] | None:
        """A list of events as a list of dicts, one event as one dict, None as None."""
        if events is None:
            return None
        if isinstance(events, KVCacheEvent):
            return event_to_json(events)
        return [event_to_json(e) for e in events]
