# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's KV-event wire schema, as a router built on vLLM's classes decodes it (test data).

Transcribed from the msgspec struct definitions of vLLM's ``vllm/distributed/kv_events.py`` (the
newest version in the reference index: vllm-project/vllm commit 0181ea3173e53eea8cf04a86891488e3dc89bb34,
Apache-2.0, Copyright contributors to the vLLM project) and ``ExternalBlockHash`` of
``vllm/v1/core/kv_cache_utils.py``: same class names, struct options (``tag=True`` maps for events, a
plain map for the batch, ``omit_defaults``), field names, order, types and defaults. Only the struct
definitions; nothing here imports kvxfer, so it checks kvxfer's encoder independently.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


MEDIUM_GPU = "GPU"


class BlockStored(KVCacheEvent):
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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The positional form of vLLM 0.9-0.13 (array_like=True everywhere), for the fallback flag.
class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None
