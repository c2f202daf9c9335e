"""Minimal decoders for vLLM's three KV-event wires (test data), kvxfer's own definitions written from
reading ``vllm/distributed/kv_events.py`` of each version. Only what decides decoding is mirrored: each
struct's options (``array_like`` batch or map batch, ``tag=True`` events as maps or arrays), the
field order of positional structs and the fields these tests read. Nothing here imports kvxfer, so it
checks kvxfer's encoder independently.

- ``Release*``: vLLM 0.34 (the latest release): batch ``[ts, events, dp_rank]``, events tagged maps.
- ``Main*``: vLLM's main branch: batch ``{ts, events, data_parallel_rank}``, events tagged maps.
- ``Legacy*``: vLLM 0.9-0.13: batch ``[ts, events, dp_rank]``, events ``[tag, field, ...]``.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int


# --- tagged map events (0.34 and main) -------------------------------------------------------------
class MapEvent(msgspec.Struct, tag=True):
    pass


class BlockStored(MapEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(MapEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(MapEvent):
    pass


class ReleaseKVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class MainKVEventBatch(msgspec.Struct):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# --- positional events (0.9-0.13) ------------------------------------------------------------------
class LegacyEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


#: Each ``--kv-events-wire`` choice's batch type.
BATCH_OF_WIRE: dict[str, type] = {"vllm": ReleaseKVEventBatch, "vllm-map": MainKVEventBatch,
                                  "vllm-array": LegacyKVEventBatch}
STORED = (BlockStored, LegacyBlockStored)
REMOVED = (BlockRemoved, LegacyBlockRemoved)
CLEARED = (AllBlocksCleared, LegacyAllBlocksCleared)
