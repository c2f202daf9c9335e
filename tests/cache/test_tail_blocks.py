"""A closing request's partial last block enters the prefix tree as a tail block (reference-API managers).

TPB tokens per block; a request committing ``k * TPB + r`` tokens (0 < r < TPB) leaves, on close, a
leaf holding its last ``r`` tokens under the chain key of those tokens, announced by a Stored event.
"""

from __future__ import annotations

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
    LayerSpec,
    PrimaryTier,
    ReuseScope,
    _introspection,
    sequence_to_blockchain_keys,
)
from kvxfer.cache.events import AllCleared, Removed, Stored
from kvxfer.cache.radix_tree import PrefixTree
from kvxfer.errors import KVCacheError

TPB = 4


def ref_manager(*, partial_reuse: bool = True, quota: int = 64 << 10) -> KVCacheManager:
    layers: list[LayerConfig] = [AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), 256)])
                                 for i in range(2)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(quota)],
                                               layers=layers, enable_partial_reuse=partial_reuse))


def run(mgr: KVCacheManager, tokens: list[int], *, reuse: bool = True) -> int:
    """Create (reusing what the tree has of ``tokens``), commit the rest, close; returns tokens reused."""
    kv = mgr.create_kv_cache(None, tokens if reuse else None)
    reused = kv.num_committed_tokens
    assert kv.resume()
    assert kv.resize(len(tokens))
    if reused < len(tokens):
        kv.commit(tokens[reused:])
    kv.close()
    return reused


def stored(mgr: KVCacheManager) -> list[Stored]:
    return [e for e in mgr.drain_events() if isinstance(e, Stored)]


def test_close_stores_the_partial_last_block_under_its_chain_key() -> None:
    mgr = ref_manager()
    tokens = list(range(100, 110))                      # 2 full blocks + 2 tokens
    run(mgr, tokens)
    events = stored(mgr)
    keys = [k for e in events for k in e.block_hashes]
    chain = [key for chunk, key in sequence_to_blockchain_keys(TPB, ReuseScope(), tokens) if chunk]
    assert keys == chain and len(keys) == 3
    assert [t for e in events for t in e.token_ids] == tokens
    # the whole prompt, tail included, is reusable now (it was 8 tokens without the tail block)
    assert mgr.probe_reuse(None, [*tokens, 7, 7]) == 10
    assert mgr.probe_reuse(None, tokens) == 10


def test_a_sibling_that_begins_with_the_same_tokens_covers_the_tail() -> None:
    mgr = ref_manager()
    run(mgr, list(range(12)))                           # 3 full blocks
    stored(mgr)
    run(mgr, list(range(10)))                           # its tail [8, 9] begins the full block [8..11]
    assert stored(mgr) == []
    run(mgr, [*list(range(8)), 50, 51])                 # a different tail is a new sibling
    events = stored(mgr)
    assert [list(e.token_ids) for e in events] == [[50, 51]]
    run(mgr, [*list(range(8)), 50])                     # covered by the longer tail [50, 51]
    assert stored(mgr) == []


def test_a_request_reusing_the_tail_writes_into_a_copy() -> None:
    mgr = ref_manager()
    tokens = list(range(20, 30))
    run(mgr, tokens)
    lg = mgr.get_layer_group_id(LayerId(0))
    _, pages = _introspection.reuse_match_pages(mgr, ReuseScope(), tokens, lg, True)
    tail_page = pages[-1]
    assert tail_page is not None and tail_page[1] == 2
    kv = mgr.create_kv_cache(None, [*tokens, 1, 2])
    assert kv.num_committed_tokens == 10
    assert kv.resume()
    assert kv.resize(12)
    own = int(kv.get_base_page_indices(lg)[2])
    assert own != tail_page[0]                          # the request writes into its own copy
    mgr.drain_events()
    kv.commit([1, 2])                                   # block 2 full now: it takes the tail block's place
    kv.close()
    removed = [k for e in mgr.drain_events() if isinstance(e, Removed) for k in e.block_hashes]
    assert len(removed) == 1
    _, pages = _introspection.reuse_match_pages(mgr, ReuseScope(), tokens, lg, True)
    assert pages[-1] == (own, TPB)                      # the full block's page covers the old endpoint
    probe = mgr.create_kv_cache(None, tokens)
    assert probe.num_committed_tokens == 10
    probe.close()


def test_without_partial_reuse_a_tail_matches_by_its_key_only() -> None:
    mgr = ref_manager(partial_reuse=False)
    tokens = list(range(40, 50))
    run(mgr, tokens)
    assert [len(e.token_ids) for e in stored(mgr)] == [10]    # the tail is stored all the same
    assert mgr.probe_reuse(None, tokens) == 10                # the same 2 tokens: the tail's chain key
    assert mgr.probe_reuse(None, [*tokens, 7]) == 8           # 3 tokens there: no partial match
    assert mgr.probe_reuse(None, tokens[:9]) == 8             # 1 token of the tail: no partial match


def test_cache_config_managers_keep_full_blocks_only() -> None:
    mgr = KVCacheManager(CacheConfig(layers=(LayerSpec(0, 1, 8),), tokens_per_block=TPB, dtype="float16",
                                     tiers=(PrimaryTier(64 << 10, "cpu"),)))
    run(mgr, list(range(10)))
    assert [len(e.token_ids) for e in stored(mgr)] == [8]
    assert mgr.probe_reuse(None, list(range(10))) == 8


def test_clearing_the_tree_takes_tail_blocks_with_it() -> None:
    mgr = ref_manager()
    run(mgr, list(range(10)))
    mgr.drain_events()
    mgr.clear_reusable_blocks()
    assert any(isinstance(e, AllCleared) for e in mgr.drain_events())
    assert mgr.probe_reuse(None, list(range(10))) == 0
    run(mgr, list(range(10)))                           # and the tail can be stored again
    assert [len(e.token_ids) for e in stored(mgr)] == [10]


def test_tail_blocks_are_evicted_under_pressure() -> None:
    mgr = ref_manager(quota=8 * 2 * 256)                # 8 slots of 2 x 256 bytes (one layer group)
    for i in range(6):
        run(mgr, [1000 * i + t for t in range(6)])      # 1 full block + a 2-token tail each
    assert mgr.probe_reuse(None, [5000 + t for t in range(6)]) == 6
    assert mgr.probe_reuse(None, [t for t in range(6)]) == 0


def test_the_tree_refuses_to_continue_a_tail_block() -> None:
    tree = PrefixTree(1, TPB)
    pages = np.zeros(1, dtype=np.int32)
    tail = tree.insert(b"r" * 32, None, b"t" * 32, np.array([1, 2], dtype=np.int64), pages)
    assert tail.num_tokens == 2
    with pytest.raises(KVCacheError, match="tail block"):
        tree.insert(b"r" * 32, tail, b"u" * 32, np.arange(TPB, dtype=np.int64), pages)
    with pytest.raises(KVCacheError, match="1 to 4 tokens"):
        tree.insert(b"r" * 32, None, b"v" * 32, np.arange(TPB + 1, dtype=np.int64), pages)
    # a partial match never reads past a tail block's tokens
    match = tree.match(b"r" * 32, [], np.array([1, 2, 3, 4], dtype=np.int64))
    assert match.partial is tail and match.partial_tokens == 2


@pytest.mark.parametrize("how", ["stop_committing", "is_end"])
def test_ending_the_commits_stores_the_tail_with_the_requests_own_page(how: str) -> None:
    mgr = ref_manager()
    tokens = list(range(60, 66))                        # 1 full block + 2 tokens
    kv = mgr.create_kv_cache()
    assert kv.resume()
    assert kv.resize(8)
    lg = mgr.get_layer_group_id(LayerId(0))
    tail_page = int(kv.get_base_page_indices(lg)[1])
    if how == "is_end":
        kv.commit(tokens, is_end=True)
    else:
        kv.commit(tokens)
        assert mgr.probe_reuse(None, tokens) == 4       # only the full block before the commits end
        kv.stop_committing()
    assert [list(e.token_ids) for e in stored(mgr)][-1][-2:] == [64, 65]
    assert mgr.probe_reuse(None, tokens) == 6           # while the request is still open
    kv.stop_committing()                                # a second end stores nothing more
    kv.close()
    assert stored(mgr) == []
    reuser = mgr.create_kv_cache(None, tokens)
    assert int(reuser.get_base_page_indices(lg)[1]) == tail_page   # the tree holds the request's page
    reuser.close()
