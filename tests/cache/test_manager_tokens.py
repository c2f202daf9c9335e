"""Token ids as the reference's v2 manager takes them (``TokenIdExt``): a manager built from a
``KVCacheManagerConfig`` keys blocks with the packed 4-byte chain of ``sequence_to_blockchain_keys`` and
accepts 32-byte multimodal digests among the token ids; a ``CacheConfig`` manager keeps its own algorithm."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest

from kvxfer.cache import (
    AttentionLayerConfig,
    BufferConfig,
    CacheConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    ReuseScope,
    _introspection,
    sequence_to_blockchain_keys,
)
from kvxfer.cache.events import Stored
from kvxfer.cache.hashing import HASH_V2_SHA256_PACKED, DigestTable, TokenIdExt, block_keys
from kvxfer.errors import CapacityError

TPB = 4
D1 = hashlib.sha256(b"image one").digest()
D2 = hashlib.sha256(b"image two").digest()


def ref_manager() -> KVCacheManager:
    layers: list[LayerConfig] = [AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), 256)])
                                 for i in range(2)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(64 << 10)],
                                               layers=layers))


def commit_all(mgr: KVCacheManager, tokens: Sequence[TokenIdExt], scope: ReuseScope | None = None) -> list[bytes]:
    """Commit ``tokens`` through a fresh cache, close it, and return the keys its Stored events carried."""
    mgr.drain_events()
    kv = mgr.create_kv_cache(scope)
    assert kv.resume()
    assert kv.resize(len(tokens))
    kv.commit(tokens)
    assert kv.committed_tokens == list(tokens)
    kv.close()
    return [k for e in mgr.drain_events() if isinstance(e, Stored) for k in e.block_hashes]


def test_reference_config_keys_blocks_with_the_packed_chain() -> None:
    mgr = ref_manager()
    assert mgr.resolved_hash_algo == HASH_V2_SHA256_PACKED
    tokens: list[TokenIdExt] = [5, 6, D1, 7, 8, 9, 10, 11, 12]
    scope = ReuseScope(lora_id=3, salt=9)
    keys = commit_all(mgr, tokens, scope)
    chain = [key for chunk, key in sequence_to_blockchain_keys(TPB, scope, tokens) if chunk]
    # two full blocks, then the closing request's partial last block (1 token) under its chain key
    assert keys == chain and len(keys) == len(tokens) // TPB + 1
    # the first block's key by hand: SHA-256(root || 5, 6 as 4-byte LE || digest || 7)
    root = hashlib.sha256(b"\x03" + (3).to_bytes(8, "little") + (9).to_bytes(8, "little")).digest()
    assert keys[0] == hashlib.sha256(root + (5).to_bytes(4, "little") + (6).to_bytes(4, "little") + D1
                                     + (7).to_bytes(4, "little")).digest()


def test_digest_tokens_are_reused_only_by_the_same_digest() -> None:
    mgr = ref_manager()
    prompt: list[TokenIdExt] = [1, 2, D1, 3, 4, 5, 6, 7]
    commit_all(mgr, prompt)
    assert mgr.probe_reuse(None, prompt) == 8
    other: list[TokenIdExt] = [1, 2, D2, 3, 4, 5, 6, 7]
    fork: list[TokenIdExt] = [1, 2, D1, 3, 9, 9, 9, 9]
    assert mgr.probe_reuse(None, other) == 2   # partial reuse stops at the other digest
    assert mgr.probe_reuse(None, fork) == 4
    kv = mgr.create_kv_cache(None, [*prompt, D2])
    assert kv.num_committed_tokens == 8 and kv.committed_tokens == prompt
    assert kv.resume() and kv.resize(12)
    tail: list[TokenIdExt] = [D2, 40, 41, 42]
    kv.commit(tail)
    assert kv.committed_tokens == [*prompt, D2, 40, 41, 42]
    kv.close()
    assert mgr.probe_reuse(None, [*prompt, D2, 40, 41, 42]) == 12


def test_int32_arrays_key_like_lists() -> None:
    mgr = ref_manager()
    tokens = list(range(100, 112))
    commit_all(mgr, np.asarray(tokens, dtype=np.int32).tolist())
    assert mgr.probe_reuse(None, np.asarray(tokens, dtype=np.int32)) == 12
    assert mgr.probe_reuse(None, tokens) == 12


def test_reuse_match_pages_reads_digest_prompts() -> None:
    mgr = ref_manager()
    prompt: list[TokenIdExt] = [D1, 1, 2, 3, 4, 5, 6, 7]
    commit_all(mgr, prompt)
    num_tokens, pages = _introspection.reuse_match_pages(mgr, ReuseScope(), prompt, 0)
    assert num_tokens == 8 and len(pages) == 2 and all(p is not None for p in pages)


def test_packed_ids_must_stay_below_2_pow_31() -> None:
    mgr = ref_manager()
    with pytest.raises(CapacityError, match="below 2\\*\\*31"):
        mgr.probe_reuse(None, [1 << 31, 1, 2, 3])
    with pytest.raises(CapacityError, match="32 bytes"):
        short: list[TokenIdExt] = [1, b"short", 2, 3]
        mgr.probe_reuse(None, short)


def test_cache_config_managers_keep_their_algorithm_and_refuse_digests() -> None:
    cfg = CacheConfig.for_model(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=TPB, dtype="float16",
                                num_blocks=16, hash_algo="v2_blake3")
    mgr = KVCacheManager(cfg)
    assert mgr.resolved_hash_algo == "v2_blake3"
    tokens = list(range(8))
    keys = commit_all(mgr, tokens)
    assert keys == block_keys(tokens, TPB, ReuseScope().root_key_for("v2_blake3"), algo="v2_blake3")
    with pytest.raises(CapacityError, match="v2_sha256_packed"):
        with_digest: list[TokenIdExt] = [1, D1, 2, 3]
        mgr.create_kv_cache(None, with_digest)


def test_digest_table_codes_round_trip_and_never_collide() -> None:
    table = DigestTable()
    twin = D1[:8] + bytes(24)                       # same low 62 bits as D1: needs the next code
    arr = table.encode([7, D1, twin, D1], "test")
    assert arr.dtype == np.int64 and arr[0] == 7 and arr[1] < 0 and arr[1] == arr[3] and arr[2] == arr[1] - 1
    assert table.decode(arr) == [7, D1, twin, D1] and len(table) == 2
    with pytest.raises(CapacityError, match="not a digest code"):
        table.digest(-5)
    with pytest.raises(CapacityError, match="token 1 must be"):
        table.encode([1, 2.5, D1], "test")
