"""Sliding-window pages in the prefix tree of a ``KVCacheManagerConfig`` manager: kept after a request
moves past them (dropped with ``commit_min_snapshot``), planned drops of a conversation's endpoint window,
and ``reuse_match_backoff`` trimming the raw match before the window check."""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.cache import (
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    PlannedDropHandle,
)
from kvxfer.errors import ConfigError, LogicError

TPB = 8
WINDOW = 8


def swa_manager(**kw: Any) -> KVCacheManager:
    """Layer 0 sliding window (8 tokens), layer 1 full attention."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), 256)], sliding_window_size=WINDOW,
                             num_sink_tokens=0),
        AttentionLayerConfig(LayerId(1), [BufferConfig(DataRole("key"), 256)])]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(256 << 10)],
                                               layers=layers, **kw))


def commit_closed(mgr: KVCacheManager, tokens: list[int], plan: bool = False) -> PlannedDropHandle | None:
    kv = mgr.create_kv_cache(None, tokens)
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens[kv.num_committed_tokens:])
    kv.stop_committing()
    handle = kv.plan_committed_block_drop() if plan else None
    kv.close()
    return handle


def test_window_pages_stay_reusable_unless_commit_min_snapshot() -> None:
    prompt = list(range(4 * TPB))
    keep = swa_manager()
    commit_closed(keep, prompt)
    assert keep.probe_reuse(None, prompt[:2 * TPB]) == 2 * TPB      # block 1's window page is still there
    drop = swa_manager(commit_min_snapshot=True)
    commit_closed(drop, prompt)
    assert drop.probe_reuse(None, prompt) == len(prompt)
    assert drop.probe_reuse(None, prompt[:2 * TPB]) == 0             # only the endpoint window was kept


@pytest.mark.parametrize("backoff", [0, 1])
def test_planned_drop_takes_the_endpoint_window_only(backoff: int) -> None:
    mgr = swa_manager(reuse_match_backoff=backoff)
    long = list(range(100, 100 + 3 * TPB))
    short = long[:TPB]
    long_handle = commit_closed(mgr, long, plan=True)
    short_handle = commit_closed(mgr, short, plan=True)
    assert long_handle is not None and short_handle is not None
    assert mgr.probe_reuse(None, short) == TPB - backoff
    short_handle.drop()
    assert mgr.probe_reuse(None, short) == 0                          # block 0's window page is gone
    assert mgr.probe_reuse(None, long) == len(long) - backoff         # the long endpoint does not need it
    long_handle.drop()
    assert mgr.probe_reuse(None, long) == len(long) - WINDOW          # full attention and block 1 remain
    with pytest.raises(LogicError, match="already been dropped"):
        long_handle.drop()


def test_planned_drop_is_none_without_committed_blocks() -> None:
    mgr = swa_manager()
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.stop_committing()
    assert kv.plan_committed_block_drop() is None
    kv.close()


@pytest.mark.parametrize(("ratio", "error"), [([1.0], "length 1 does not match the 2 layer groups"),
                                               ([0.0, 1.0], "must be positive"),
                                               ([0.4, 0.5], "must sum to 1.0")])
def test_initial_pool_ratio_is_one_positive_share_per_layer_group(ratio: list[float], error: str) -> None:
    assert len(swa_manager(initial_pool_ratio=[0.25, 0.75]).layer_grouping) == 2
    with pytest.raises(ConfigError, match=error):
        swa_manager(initial_pool_ratio=ratio)


def test_reused_stale_window_blocks_hold_no_colder_page(tmp_path: Any) -> None:
    """A request reusing a chain whose pages went to colder tiers takes no page for the window blocks it
    does not need: after resume every block id is readable (primary tier) and block ids stay -1 there."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), 1024)],
                             sliding_window_size=16 if i % 2 == 0 else None, num_sink_tokens=1 if i % 2 == 0 else None)
        for i in range(4)]
    tiers: list[Any] = [GpuCacheTierConfig(64 << 10), HostCacheTierConfig(64 << 10),
                        DiskCacheTierConfig(1 << 20, str(tmp_path))]
    mgr = KVCacheManager(KVCacheManagerConfig(tokens_per_block=4, cache_tiers=tiers, layers=layers))
    first: list[int] = []
    for r in range(3):
        kv = mgr.create_kv_cache()
        assert kv.resume()
        tokens = list(range(1000 * r, 1000 * r + 80))
        for i in range(0, 80, 4):       # decode-like growth: the window's stale pages go as it moves
            assert kv.resize(i + 4)
            kv.commit(tokens[i:i + 4])
        first = first or tokens
        kv.close()
    assert {int(t) for n in mgr.prefix_tree.nodes() for t in n.tiers.tolist()} > {0}
    kv = mgr.create_kv_cache(None, first[:37])
    assert kv.num_committed_tokens == 37        # partial reuse into block 9
    swa = next(g for g, lc in enumerate(mgr.lifecycle.life_cycles()) if lc.window_size is not None)
    assert kv.resume() and kv.resize(48)
    ids = kv.block_ids(swa)
    assert (kv.page_tiers(swa) == 0).all() and (ids[1:5] == -1).all() and (ids[5:] >= 0).all()
    kv.close()
