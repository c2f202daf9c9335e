"""KV events on vLLM's wire formats (``vllm/distributed/kv_events.py``), as msgspec structs.

vLLM has put three forms on the wire, one per ``--kv-events-wire`` choice:

- ``vllm`` (the default; vLLM 0.34, the latest release): the batch is a msgpack array
  ``[ts, events, data_parallel_rank]``, each event a map tagged ``"type": "BlockStored" |
  "BlockRemoved" | "AllBlocksCleared"``;
- ``vllm-map`` (vLLM's main branch): the batch is a map ``{ts, events, data_parallel_rank}``, the events
  the same tagged maps;
- ``vllm-array`` (vLLM 0.9-0.13): everything positional, events ``[tag, field, ...]`` in
  ``[ts, events, rank]``.

How kvxfer's events map onto them is in docs/events.md; ``reference_events`` gives the reference
design's (TensorRT-LLM KVCacheManagerV2) per-layer-group event records instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvxfer.cache.events import (
    AllCleared,
    Created,
    EventsDropped,
    KVEvent,
    Removed,
    Stored,
    Updated,
)
from kvxfer.cache.hashing import (
    HASH_ALGOS,
    HASH_V2_BLAKE3,
    HASH_V2_BLAKE3_64,
    HASH_V2_SHA256,
    HASH_V2_SHA256_PACKED,
    block_hash_for_event,
    resolve_hash_algo,
)
from kvxfer.errors import ConfigError

WIRE_RELEASE = "vllm"
WIRE_MAP = "vllm-map"
WIRE_ARRAY = "vllm-array"
WIRE_REFERENCE = "reference"
WireFormat = Literal["vllm", "vllm-map", "vllm-array", "reference"]
#: Every wire choice, the default (vLLM's latest release) first.
WIRE_FORMATS: tuple[str, ...] = (WIRE_RELEASE, WIRE_MAP, WIRE_ARRAY, WIRE_REFERENCE)
#: kvxfer's tier media as vLLM names them on its wires (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``
#: of vLLM's kv_events); a medium not listed goes out as it is.
VLLM_MEDIA: dict[str, str] = {"GPU": "GPU", "CPU": "CPU", "DISK": "STORAGE"}
KIND_FULL = "full_attention"
KIND_SLIDING = "sliding_window"

ExternalBlockHash = bytes | int
#: The reference design's hash option names (``CacheConfig.hash_algo``'s). Published width: the two
#: full-width names send the whole key (msgpack bin on vLLM's wire, hex in reference records), every
#: other one the key's 64-bit hash as an unsigned int (``hashing.block_hash_for_event``).
EVENT_HASH_ALGOS: tuple[str, ...] = HASH_ALGOS
FULL_WIDTH_ALGOS: tuple[str, ...] = (HASH_V2_SHA256, HASH_V2_BLAKE3, HASH_V2_SHA256_PACKED)


def manager_hash_algo(manager: Any) -> str:
    """The hash option a manager's events are published under: the algorithm its keys are made with
    (``manager.resolved_hash_algo``; ``auto`` already resolved to ``v1_block_key``)."""
    return str(manager.resolved_hash_algo)


def same_key_chain(a: str, b: str) -> bool:
    """Whether hash options ``a`` and ``b`` make the same block keys (they may differ only in the
    published width: ``v2_blake3`` / ``v2_blake3_64``, ``v2_sha256`` / ``v2_sha256_64``, ``auto`` /
    ``v1_block_key``)."""
    return resolve_hash_algo(a).removesuffix("_64") == resolve_hash_algo(b).removesuffix("_64")


# --- vLLM's current structs (tagged maps) ----------------------------------------------------------
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event maps (tag field ``"type"``, the class name)."""


class BlockStored(_Event):
    """vLLM's BlockStored, field for field (``lora_id`` is kept by vLLM for compatibility)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event):
    """vLLM's BlockRemoved."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    """vLLM's AllBlocksCleared."""


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """vLLM main's KVEventBatch (a map): one published message's payload."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ReleaseBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM 0.34's KVEventBatch: positional ``[ts, events, data_parallel_rank]``, events tagged maps."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# --- the older positional form ---------------------------------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the positional events of vLLM 0.9-0.13."""


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class GroupSpec:
    """What vLLM calls a KV cache group, for a layer group: its id (``group_idx``) and window
    (None: full attention)."""

    group_idx: int
    window: int | None = None

    @property
    def kind(self) -> str:
        """vLLM's ``kv_cache_spec_kind`` name."""
        return KIND_FULL if self.window is None else KIND_SLIDING


@dataclass(frozen=True)
class WireContext:
    """How one cache's events go on the wire: hash algorithm, its layer groups and the DP rank."""

    hash_name: str = HASH_V2_BLAKE3_64
    groups: tuple[GroupSpec, ...] = (GroupSpec(0),)
    block_size: int = 0
    data_parallel_rank: int = 0
    wire: str = WIRE_RELEASE
    media: tuple[str, ...] = ("GPU", "CPU", "DISK")
    """The cache's tiers' media, hottest first (cache levels of the reference records)."""

    def __post_init__(self) -> None:
        if self.hash_name not in EVENT_HASH_ALGOS:
            raise ConfigError(f"KV events: unknown hash name {self.hash_name!r} (have {', '.join(EVENT_HASH_ALGOS)})")
        if self.wire not in WIRE_FORMATS:
            raise ConfigError(f"KV events: unknown wire format {self.wire!r} (have {', '.join(WIRE_FORMATS)})")
        if not self.groups:
            raise ConfigError("KV events: a cache has at least one layer group")
        rank = self.data_parallel_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"KV events: data_parallel_rank must be an int >= 0, got {rank!r}")

    @classmethod
    def for_layout(cls, layout: Any, **kw: Any) -> WireContext:
        """The context of a cache with ``layout`` (a CacheLayoutDesc: its layer groups' ids and windows,
        its tokens per block)."""
        groups = tuple(GroupSpec(int(lg.layer_group_id), lg.window) for lg in layout.layer_groups)
        return cls(groups=groups, block_size=int(layout.tokens_per_block), **kw)

    @classmethod
    def for_manager(cls, manager: Any, hash_name: str | None = None, **kw: Any) -> WireContext:
        """The context of a KVCacheManager: its layout, its tiers' media and its hash option. ``hash_name``
        may change only the published width (a name making the same keys, see ``same_key_chain``):
        ConfigError for one whose keys the manager does not make."""
        algo = manager_hash_algo(manager)
        if hash_name is not None and hash_name not in EVENT_HASH_ALGOS:
            raise ConfigError(f"KV events: unknown hash name {hash_name!r} (have {', '.join(EVENT_HASH_ALGOS)})")
        if hash_name is not None and not same_key_chain(hash_name, algo):
            raise ConfigError(f"KV events: hash name {hash_name!r} names other keys than the cache's {algo!r} "
                              f"(only the published width may differ)")
        return cls.for_layout(manager.layout, media=tuple(manager.tier_media), hash_name=hash_name or algo, **kw)

    def groups_of(self, layer_groups: tuple[int, ...] | None) -> tuple[GroupSpec, ...]:
        """The groups an event concerns (all of them for None)."""
        if layer_groups is None:
            return self.groups
        by_id = {g.group_idx: g for g in self.groups}
        return tuple(by_id[i] for i in layer_groups if i in by_id)

    def ext(self, key: bytes) -> ExternalBlockHash:
        """A block key as published on vLLM's wire: ``block_hash_for_event``'s 64-bit int, or (full-width
        options) the whole key as bytes (msgpack bin)."""
        value = block_hash_for_event(key, self.hash_name)
        return bytes.fromhex(value) if isinstance(value, str) else value


def _extra(keys: tuple[tuple[tuple[str, str], ...] | None, ...] | None) -> list[tuple[Any, ...] | None] | None:
    if keys is None:
        return None
    return [None if k is None else tuple(f"{kind}:{value}" for kind, value in k) for k in keys]


def vllm_medium(medium: str) -> str:
    """``medium`` as vLLM names it (``VLLM_MEDIA``)."""
    return VLLM_MEDIA.get(medium, medium)


def _moved_chains(event: Updated) -> list[tuple[bytes | None, list[bytes], list[int]]]:
    """A tier move's blocks as chains ``(parent, hashes, tokens)``: consecutive blocks each the parent of
    the next form one chain. Without per-block parents and tokens every block is its own chain with
    no parent and no tokens."""
    if event.parent_hashes is None or event.block_tokens is None:
        return [(None, [h], []) for h in event.block_hashes]
    chains: list[tuple[bytes | None, list[bytes], list[int]]] = []
    for h, parent, tokens in zip(event.block_hashes, event.parent_hashes, event.block_tokens, strict=True):
        if chains and parent is not None and chains[-1][1][-1] == parent:
            chains[-1][1].append(h)
            chains[-1][2].extend(tokens)
        else:
            chains.append((parent, [h], list(tokens)))
    return chains


def vllm_events(event: KVEvent, ctx: WireContext) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """One kvxfer event as vLLM events (one per layer group it concerns), media named as vLLM names them.

    A tier move (``Updated`` with ``old_medium``) becomes BlockStored at the new medium (one per chain
    of moved blocks, with its parent, tokens and block size) then BlockRemoved at the old, as vLLM
    publishes its offloads; ``EventsDropped`` becomes AllBlocksCleared (forget this cache). A priority
    change and ``Created`` have no vLLM form: none.
    """
    if isinstance(event, Stored):
        parent = None if event.parent_hash is None else ctx.ext(event.parent_hash)
        lora_name = None if event.lora_id is None else str(event.lora_id)
        return [BlockStored([ctx.ext(h) for h in event.block_hashes], parent, list(event.token_ids), event.block_size,
                            event.lora_id, vllm_medium(event.medium), lora_name, _extra(event.extra_keys), g.group_idx,
                            g.kind, g.window) for g in ctx.groups_of(event.layer_groups)]
    if isinstance(event, Removed):
        return [BlockRemoved([ctx.ext(h) for h in event.block_hashes], vllm_medium(event.medium), g.group_idx)
                for g in ctx.groups_of(event.layer_groups)]
    if isinstance(event, Updated):
        if event.old_medium is None or event.old_medium == event.medium:
            return []
        hashes = [ctx.ext(h) for h in event.block_hashes]
        chains = _moved_chains(event)
        block_size = event.block_size or ctx.block_size
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for g in ctx.groups_of(event.layer_groups):
            out.extend(BlockStored([ctx.ext(h) for h in chain], None if parent is None else ctx.ext(parent), tokens,
                                   block_size, None, vllm_medium(event.medium), None, None, g.group_idx, g.kind,
                                   g.window) for parent, chain, tokens in chains)
            out.append(BlockRemoved(hashes, vllm_medium(event.old_medium), g.group_idx))
        return out
    if isinstance(event, AllCleared | EventsDropped):
        return [AllBlocksCleared()]
    return []


def _to_array(e: BlockStored | BlockRemoved | AllBlocksCleared) -> _ArrayBlockStored | _ArrayBlockRemoved | \
        _ArrayAllBlocksCleared:
    if isinstance(e, BlockStored):
        return _ArrayBlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium)
    if isinstance(e, BlockRemoved):
        return _ArrayBlockRemoved(e.block_hashes, e.medium)
    return _ArrayAllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(events: Iterable[KVEvent], timestamp: float, ctx: WireContext) -> bytes | None:
    """A batch payload in ``ctx.wire`` form, or None when no event has a form there. The reference form
    is a msgpack map ``{ts, events: [reference records], data_parallel_rank}`` carrying every event."""
    if ctx.wire == WIRE_REFERENCE:
        records = [r for e in events for r in reference_events(e, ctx, ctx.media)]
        return _ENCODER.encode({"ts": timestamp, "events": records, "data_parallel_rank": ctx.data_parallel_rank}) \
            if records else None
    wire = [w for e in events for w in vllm_events(e, ctx)]
    if not wire:
        return None
    if ctx.wire == WIRE_ARRAY:
        return _ENCODER.encode(_ArrayBatch(timestamp, [_to_array(w) for w in wire], ctx.data_parallel_rank))
    if ctx.wire == WIRE_MAP:
        return _ENCODER.encode(KVEventBatch(timestamp, wire, ctx.data_parallel_rank))
    return _ENCODER.encode(_ReleaseBatch(timestamp, wire, ctx.data_parallel_rank))


def _from_array(e: _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared) -> BlockStored | BlockRemoved | \
        AllBlocksCleared:
    if isinstance(e, _ArrayBlockStored):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium, None)
    if isinstance(e, _ArrayBlockRemoved):
        return BlockRemoved(e.block_hashes, e.medium)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload in any of vLLM's three forms back into structs (msgspec.ValidationError / DecodeError
    on bad bytes). A map is main's form; an array is the release's when its events are maps, else the
    0.9-0.13 positional form."""
    first = payload[:1]
    if first and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF)):
        return msgspec.msgpack.decode(payload, type=KVEventBatch)
    try:
        rel = msgspec.msgpack.decode(payload, type=_ReleaseBatch)
        return KVEventBatch(rel.ts, rel.events, rel.data_parallel_rank)
    except msgspec.ValidationError:
        old = msgspec.msgpack.decode(payload, type=_ArrayBatch)
        return KVEventBatch(old.ts, [_from_array(e) for e in old.events], old.data_parallel_rank)


# --- the reference design's event records ------------------------------------------------------------
def _ref_hash(key: bytes, ctx: WireContext) -> int | str:
    """The reference publishes 64-bit hashes as ints and full-width ones as hex strings."""
    return block_hash_for_event(key, ctx.hash_name)


def reference_events(event: KVEvent, ctx: WireContext, media: Sequence[str]) -> list[dict[str, Any]]:
    """``event`` as the reference's KVCacheEvent records (``event_id``, ``data``, ``window_size``,
    ``hash_algo``, ``attention_dp_rank``, ``layer_group_id``), one per layer group it concerns.
    ``media`` lists the cache's tiers hottest first: a medium's cache level is its first index there
    (a CPU primary and a host tier are both ``"CPU"``: level 0)."""
    level = {m: media.index(m) for m in media}
    data: dict[str, Any]
    if isinstance(event, Created):
        data = {"type": "created", "num_blocks_per_cache_level": list(event.num_blocks_per_medium)}
        groups = ctx.groups_of(event.layer_groups)
    elif isinstance(event, Stored):
        parent = None if event.parent_hash is None else _ref_hash(event.parent_hash, ctx)
        tpb = event.block_size
        data = {"type": "stored", "parent_hash": parent, "blocks": [
            {"block_hash": _ref_hash(h, ctx), "tokens": list(event.token_ids[i * tpb:(i + 1) * tpb]),
             "cache_level": level[event.medium]} for i, h in enumerate(event.block_hashes)]}
        groups = ctx.groups_of(event.layer_groups)
    elif isinstance(event, Removed):
        data = {"type": "removed", "block_hashes": [_ref_hash(h, ctx) for h in event.block_hashes]}
        groups = ctx.groups_of(event.layer_groups)
    elif isinstance(event, Updated):
        cache = None if event.old_medium is None else {"old_value": level[event.old_medium],
                                                       "new_value": level[event.medium]}
        prio = None if event.priority is None else {"old_value": event.old_priority, "new_value": event.priority}
        groups = ctx.groups_of(event.layer_groups)
        return [{"event_id": event.event_id, "data": {"type": "updated", "block_hash": _ref_hash(h, ctx),
                                                      "cache_level": cache, "priority": prio},
                 "window_size": g.window or 0, "hash_algo": ctx.hash_name,
                 "attention_dp_rank": ctx.data_parallel_rank, "layer_group_id": g.group_idx}
                for g in groups for h in event.block_hashes]
    elif isinstance(event, EventsDropped):
        data = {"type": "dropped", "count": event.count}
        groups = (None,)  # type: ignore[assignment]
    else:
        data = {"type": "cleared"}
        groups = (None,)  # type: ignore[assignment]
    return [{"event_id": event.event_id, "data": data, "window_size": 0 if g is None else g.window or 0,
             "hash_algo": ctx.hash_name, "attention_dp_rank": ctx.data_parallel_rank,
             "layer_group_id": None if g is None else g.group_idx} for g in groups]


__all__ = [
    "EVENT_HASH_ALGOS",
    "HASH_V2_BLAKE3",
    "VLLM_MEDIA",
    "WIRE_ARRAY",
    "WIRE_FORMATS",
    "WIRE_MAP",
    "WIRE_REFERENCE",
    "WIRE_RELEASE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "GroupSpec",
    "KVEventBatch",
    "WireContext",
    "decode_batch",
    "encode_batch",
    "manager_hash_algo",
    "reference_events",
    "same_key_chain",
    "vllm_events",
    "vllm_medium",
]
