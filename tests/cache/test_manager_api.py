"""The reference design's manager API on kvxfer: KVCacheManagerConfig in, the typed values and
members out (layout queries, page-index arithmetic, scope-first create/probe, the kv cache's members,
guards, planned drops, storage statistics, the event-manager hook, _introspection's pool sizing)."""

from __future__ import annotations

import array
import ctypes
import re
from typing import Any

import pytest

from kvxfer.cache import (
    BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX,
    GPU_LEVEL,
    AttentionLayerConfig,
    AttnLifeCycle,
    BufferConfig,
    BufferId,
    CacheConfig,
    CacheTier,
    DataRole,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HalfOpenRange,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatsDelta,
    KvCacheStatus,
    LayerConfig,
    LayerGroupId,
    LayerId,
    LifeCycleId,
    MemAddress,
    OutOfPagesError,
    PageIndexConverter,
    PageIndexMode,
    PlannedDropHandle,
    PoolDesc,
    PoolIndex,
    ReuseScope,
    ScratchDesc,
    SsmLayerConfig,
    SwaScratchReuseConfig,
    _introspection,
    _KVCache,
    exact_div,
    typed_range,
)
from kvxfer.cache.events import Created, Stored
from kvxfer.errors import ConfigError, IndexMathError, LogicError

TPB = 4
KEY, VALUE = DataRole("key"), DataRole("value")
LG0, LG1 = LayerGroupId(0), LayerGroupId(1)


def config(num_layers: int = 2, *, gpu_quota: int = 64 << 10, window: int | None = None, host_quota: int = 0,
           disk: tuple[int, str] | None = None, key_size: int = 256, value_size: int = 128,
           **kw: Any) -> KVCacheManagerConfig:
    tiers: list[Any] = [GpuCacheTierConfig(gpu_quota)]
    if host_quota:
        tiers.append(HostCacheTierConfig(host_quota))
    if disk:
        tiers.append(DiskCacheTierConfig(*disk))
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(KEY, key_size), BufferConfig(VALUE, value_size)],
                             sliding_window_size=window if i % 2 else None) for i in range(num_layers)]
    return KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=tiers, layers=layers, **kw)


def committed(mgr: KVCacheManager, tokens: list[int], scope: ReuseScope | None = None) -> None:
    """Commit ``tokens`` through a fresh cache and close it (its full blocks stay in the tree)."""
    kv = mgr.create_kv_cache(scope)
    assert kv.resume()
    assert kv.resize(len(tokens))
    kv.commit(tokens)
    kv.close()


# --- values -------------------------------------------------------------------------------------------
def test_buffer_id_is_a_tuple() -> None:
    bid = BufferId(LayerId(3), "key")
    assert bid == (3, "key") and hash(bid) == hash((3, "key")) and tuple(bid) == (3, "key")
    assert {(3, "key"): 1}[bid] == 1 and bid[-1] == "key"
    with pytest.raises(AttributeError):
        bid.role = "value"  # type: ignore[misc]


def test_pool_desc_takes_the_reference_fields() -> None:
    pool = PoolDesc(PoolIndex(1), MemAddress(4096), 512)
    assert (pool.pool_index, pool.base_address, pool.slot_bytes, pool.num_slots) == (1, 4096, 512, 0)


def test_half_open_range_and_integer_helpers() -> None:
    r = HalfOpenRange(2, 5)
    assert (r.beg, r.end, len(r), bool(r)) == (2, 5, 3, True) and 4 in r and 5 not in r
    beg, end = r
    assert (beg, end) == (2, 5)
    assert HalfOpenRange(4, 1) == HalfOpenRange(7, 7) and not HalfOpenRange(4, 1) and len(HalfOpenRange(4, 1)) == 0
    assert HalfOpenRange(2, 5) != HalfOpenRange(2, 6)
    assert exact_div(12, 4) == 3 and list(typed_range(LayerId(3))) == [0, 1, 2]
    with pytest.raises(IndexMathError, match="13 is not a multiple of 4"):
        exact_div(13, 4)


def test_attention_life_cycle_stale_range() -> None:
    swa = AttnLifeCycle.make(8, 5, TPB)        # 5 sink tokens: 2 sink blocks
    assert swa.window_size == 8 and swa.num_sink_blocks == 2
    assert not swa.get_stale_range(10, TPB)    # block 2 still holds position 3 of the window
    assert swa.get_stale_range(20, TPB) == HalfOpenRange(2, 3)
    assert not AttnLifeCycle.make(None, 4, TPB).get_stale_range(100, TPB)


def test_page_index_converter_modes_and_scratch() -> None:
    conv = PageIndexConverter(scale=3, expansion=1, layer_offset=1)
    assert conv([0, 2, BAD_PAGE_INDEX]) == [0, 6, BAD_PAGE_INDEX]           # SHARED: the base holds the offset
    assert conv([0, 2], PageIndexMode.PER_LAYER) == [1, 7]                   # PER_LAYER: the index does
    scratch = ScratchDesc(HalfOpenRange(1, 2), (5,))
    assert conv([0, BAD_PAGE_INDEX], PageIndexMode.PER_LAYER, scratch) == [1, 16]
    with pytest.raises(ConfigError, match="index_mode must be given"):
        conv([0, BAD_PAGE_INDEX], scratch=scratch)


# --- configuration ------------------------------------------------------------------------------------
def test_manager_takes_the_reference_config_and_keeps_a_copy() -> None:
    cfg = config(window=8)
    mgr = KVCacheManager(cfg)
    cfg.layers[0].buffers[0].size = 4      # the caller's object is theirs to change
    assert mgr.init_config.layers[0].buffers[0].size == 256
    assert mgr.tokens_per_block == TPB and mgr.num_layers == 2 and list(mgr.layer_ids) == [0, 1]
    assert mgr.layer_grouping == ((0,), (1,)) and mgr.get_layer_group_id(LayerId(1)) == 1
    assert sorted(mgr.all_buffer_ids) == [(0, "key"), (0, "value"), (1, "key"), (1, "value")]
    assert mgr.cache_tier_list == (CacheTier.GPU_MEM,)
    assert mgr.get_quota(GPU_LEVEL) == 64 << 10


def test_cache_config_builds_the_same_manager_as_its_reference_config() -> None:
    cc = CacheConfig.for_model(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB, dtype="float16",
                               num_blocks=16, windows=[None, 8])
    ref = cc.to_manager_config()
    assert [b.size for b in ref.layers[0].buffers] == [2 * 8 * 2 * TPB] * 2
    assert isinstance(ref.layers[1], AttentionLayerConfig) and ref.layers[1].window_size == 8 and isinstance(ref.cache_tiers[0], GpuCacheTierConfig)
    a, b = KVCacheManager(cc), KVCacheManager(ref)
    assert [pg.slot_desc.slot_size_list for pg in a.pool_group_descs] == \
        [pg.slot_desc.slot_size_list for pg in b.pool_group_descs]
    assert [pg.num_slots for pg in a.pool_group_descs] == [pg.num_slots for pg in b.pool_group_descs]
    assert a.init_config == ref


def test_unsupported_reference_settings_are_named() -> None:
    ssm = config()      # recurrent layers need commit_min_snapshot, even when added after construction
    ssm.layers.append(SsmLayerConfig(LayerId(9), [BufferConfig(DataRole("ssm_state"), 64)]))
    with pytest.raises(ConfigError, match="SsmLayerConfig"):
        KVCacheManager(ssm)
    with pytest.raises(ConfigError, match="cold_page_codec"):
        KVCacheManager(config(), cold_page_codec=object())
    with pytest.raises(ConfigError, match="size must be a positive int"):
        KVCacheManager(config(key_size=0))
    bad_override = config()
    bad_override.layers[0].buffers[0] = BufferConfig(KEY, 256, tokens_per_block_override=3)
    with pytest.raises(ConfigError, match="tokens_per_block_override must be a positive divisor of the manager's 4"):
        KVCacheManager(bad_override)


# --- addresses --------------------------------------------------------------------------------------------
def test_page_addresses_land_on_the_buffer_views() -> None:
    mgr = KVCacheManager(config(num_layers=1))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * TPB)
    lg = mgr.get_layer_group_id(LayerId(0))
    for role, size in ((KEY, 256), (VALUE, 128)):
        assert mgr.get_page_stride(LayerId(0), role) == size
        base = mgr.get_mem_pool_base_address(LayerId(0), role)
        stride = mgr.get_page_stride(LayerId(0), role)
        scale = mgr.get_page_index_scale(LayerId(0), role)
        view = mgr.buffer_view(0, role)
        for ordinal, slot in enumerate(kv.get_base_page_indices(lg)):
            ctypes.memset(base + stride * slot * scale, 0x40 + ordinal, stride)
            assert bool((view[slot] != 0).all())
        assert mgr.get_page_index_upper_bound(LayerId(0), role) == mgr.pool_group_descs[0].num_slots * scale
        conv = mgr.get_page_index_converter(LayerId(0), role)
        pool_base = mgr.get_mem_pool_base_address(LayerId(0), role, PageIndexMode.PER_LAYER)
        assert mgr.get_mem_pool_base_address(LayerId(0), role, PageIndexMode.SHARED) == base
        for slot, page in zip(kv.get_base_page_indices(lg), conv(kv.get_base_page_indices(lg),
                                                                 PageIndexMode.PER_LAYER), strict=True):
            assert pool_base + stride * page == base + stride * slot * scale
    kv.close()


# --- create and probe -----------------------------------------------------------------------------------
def test_scope_first_create_reuses_every_input_token_and_the_prompt_form_keeps_the_last() -> None:
    mgr = KVCacheManager(config())
    tokens = list(range(100, 112))            # three full blocks
    committed(mgr, tokens)
    assert mgr.probe_reuse(None, tokens) == 12 and mgr.probe_reuse(input_tokens=tokens[:6]) == 6
    assert mgr.create_kv_cache(None, tokens).num_committed_tokens == 12
    assert mgr.probe_prompt_reuse(tokens) == 11
    assert mgr.create_kv_cache_for_prompt(tokens).num_committed_tokens == 11
    assert mgr.probe_reuse(ReuseScope(lora_id=1), tokens) == 0


def test_reuse_match_backoff_trims_every_match() -> None:
    mgr = KVCacheManager(config(reuse_match_backoff=3))
    tokens = list(range(16))
    committed(mgr, tokens)
    assert mgr.probe_reuse(None, tokens) == 13 and mgr.probe_reuse(None, tokens[:2]) == 0
    assert mgr.create_kv_cache(input_tokens=tokens).num_committed_tokens == 13


def test_probe_first_new_block_key() -> None:
    mgr = KVCacheManager(config())
    tokens = list(range(12))
    committed(mgr, tokens[:8])
    key = mgr.probe_first_new_block_key(None, tokens)
    assert key is not None and mgr.probe_first_new_block_key(None, tokens[:8]) is None
    committed(mgr, tokens)
    assert mgr.probe_first_new_block_key(None, tokens) is None


def test_any_hashable_id_and_stats_bookkeeping() -> None:
    mgr = KVCacheManager(config())
    mgr.mark_stats_dirty(11)
    assert mgr.get_dirty_stats_kv_cache_ids() == {11}
    kv = mgr.create_kv_cache(id=17, expected_prompt_length=8)
    assert kv.id == 17 and kv.commit_pending_stats() == KVCacheStatsDelta()
    assert kv.resume() and kv.resize(8)
    assert kv.commit_pending_stats().alloc_total_blocks == 2     # block positions of the request
    kv.close()


def test_custom_priority_callback_sets_each_committed_blocks_priority() -> None:
    mgr = KVCacheManager(config(window=8))
    seen: list[tuple[int, AttnLifeCycle]] = []

    def priority(ordinal: int, life_cycle: AttnLifeCycle) -> int:
        seen.append((ordinal, life_cycle))
        return 10 + ordinal if life_cycle.window_size is None else 5

    kv = mgr.create_kv_cache(custom_priority_callback=priority)
    assert kv.resume() and kv.resize(12)
    assert sorted({o for o, _ in seen}) == [0, 1, 2]        # asked as the blocks are allocated
    asked = len(seen)
    kv.commit(list(range(12)))
    assert len(seen) == asked
    assert {lc.window_size for _, lc in seen} == {None, 8}
    nodes = sorted(mgr.prefix_tree.nodes(), key=lambda n: n.depth)
    assert [n.priority for n in nodes] == [10, 11, 12]
    kv.close()


# --- the kv cache -----------------------------------------------------------------------------------------------
def test_kv_cache_members() -> None:
    mgr = KVCacheManager(config())
    kv = mgr.create_kv_cache()
    assert isinstance(kv, _KVCache) and kv.manager is mgr and kv.Status is KvCacheStatus
    assert kv.status is KvCacheStatus.SUSPENDED and not kv.is_active and kv.tokens_per_block == TPB
    assert kv.beam_width == 1 and kv.supports_index_mode(PageIndexMode.SHARED)
    with pytest.raises(ConfigError, match="beam width 1"):
        kv.beam_width = 2  # type: ignore[assignment]
    assert kv.resume() and kv.is_active
    assert kv.resize(10, 3) and (kv.capacity, kv.history_length, kv.num_blocks) == (10, 3, 3)
    kv.capacity = 12
    assert kv.num_blocks == 3 and len(kv.get_base_page_indices(LG0, DEFAULT_BEAM_INDEX)) == 3
    with pytest.raises(OutOfPagesError):
        kv.capacity = 10 ** 6
    assert kv.capacity == 12
    kv.commit([1, 2, 3, 4], is_end=True)
    with pytest.raises(LogicError, match="stopped"):
        kv.commit([5])
    assert kv.committed_tokens == [1, 2, 3, 4]
    kv.close()
    kv.close()
    assert kv.status is KvCacheStatus.CLOSED


def test_external_base_page_index_buffer_follows_the_cache() -> None:
    mgr = KVCacheManager(config())
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    with pytest.raises(ValueError, match="shorter than the 2 blocks"):
        kv.set_base_page_index_buf(DEFAULT_BEAM_INDEX, LG0, memoryview(array.array("i", [7])))
    buf = array.array("i", [123]) * 5
    kv.set_base_page_index_buf(DEFAULT_BEAM_INDEX, LG0, memoryview(buf))
    assert list(buf[:2]) == list(kv.get_base_page_indices(LG0)) and list(buf[2:]) == [BAD_PAGE_INDEX] * 3
    assert kv.resize(16)
    assert list(buf[:4]) == list(kv.get_base_page_indices(LG0)) and buf[4] == BAD_PAGE_INDEX
    assert list(kv.get_aggregated_page_indices(LG0, valid_only=True)) == list(buf[:4])
    kv.close()
    assert list(buf) == [BAD_PAGE_INDEX] * 5


def test_scratch_desc_range_is_a_half_open_range() -> None:
    mgr = KVCacheManager(config(window=4, swa_scratch_reuse=SwaScratchReuseConfig()))
    kv = mgr.create_kv_cache()
    assert kv.enable_swa_scratch_reuse
    assert kv.resume() and kv.resize(12, 0)
    desc = kv.get_scratch_desc(1)
    assert desc is not None and isinstance(desc.range, HalfOpenRange) and desc.range.beg == 0
    assert len(desc.slot_ids) == len(desc.range)
    kv.close()


def test_a_request_cannot_turn_on_scratch_reuse_the_manager_has_off() -> None:
    mgr = KVCacheManager(config(window=4))
    kv = mgr.create_kv_cache()
    assert not kv.enable_swa_scratch_reuse
    with pytest.raises(ConfigError, match="disabled in the manager's configuration"):
        kv.enable_swa_scratch_reuse = True
    kv.close()


# --- guards and drops -------------------------------------------------------------------------------------------
def test_clear_and_shutdown_refuse_open_caches() -> None:
    mgr = KVCacheManager(config())
    tokens = list(range(8))
    committed(mgr, tokens)
    caches = [mgr.create_kv_cache() for _ in range(2)]
    with pytest.raises(LogicError, match=re.escape("clear_reusable_blocks(): 2 KV cache(s) still open")):
        mgr.clear_reusable_blocks()
    assert mgr.probe_reuse(None, tokens) == 8
    with pytest.raises(RuntimeError, match=re.escape("shutdown(): 2 KV cache(s) still open")):
        mgr.shutdown()
    for kv in caches:
        kv.close()
    mgr.clear_reusable_blocks()
    assert mgr.probe_reuse(None, tokens) == 0
    mgr.shutdown()


def test_planned_drop_removes_the_unshared_end_of_the_chain_once() -> None:
    mgr = KVCacheManager(config())
    long, short = list(range(12)), list(range(4))
    handles: list[PlannedDropHandle] = []
    for tokens in (long, short):
        kv = mgr.create_kv_cache(None, tokens)
        assert kv.resume() and kv.resize(len(tokens))
        if kv.num_committed_tokens < len(tokens):
            kv.commit(tokens[kv.num_committed_tokens:])
        handle = kv.plan_committed_block_drop()
        assert handle is not None
        handles.append(handle)
        kv.close()
    handles[1].drop()                          # the short chain's block continues into the long one: kept
    assert mgr.probe_reuse(None, long) == 12
    handles[0].drop()
    assert mgr.probe_reuse(None, long) == 0
    with pytest.raises(LogicError, match="already been dropped"):
        handles[0].drop()
    empty = mgr.create_kv_cache()
    assert empty.plan_committed_block_drop() is None
    empty.close()


# --- tiers and statistics ------------------------------------------------------------------------------------------
def test_storage_statistics_quota_resize_and_prefetch(tmp_path: Any) -> None:
    block = 2 * 384                             # both full-attention layers share one layer group's slot
    mgr = KVCacheManager(config(gpu_quota=8 * block, host_quota=8 * block, disk=(8 * block, str(tmp_path))))
    assert mgr.cache_tier_list == (CacheTier.GPU_MEM, CacheTier.HOST_MEM, CacheTier.DISK)
    stats = mgr.get_storage_statistics(GPU_LEVEL)
    assert len(stats) == 1 and stats[0].total == 8 and stats[0].free == 8 and stats[0].unavailable == 0
    assert stats[0].slot_sizes == [512, 256]
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(4 * TPB)
    assert mgr.get_storage_statistics()[0].unavailable == 4
    assert not mgr.resize(GPU_LEVEL, 4 * block)          # an active request: refused, nothing changes
    kv.suspend()
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(8 * TPB)      # pushes the suspended request's pages down
    counts, unscheduled = _introspection.active_page_stats(kv)
    assert counts[0] == 0 and sum(counts) == 4
    assert unscheduled == [0, 0, 0]                      # a suspended request's pages are all eviction candidates
    other.close()
    assert kv.prefetch(GPU_LEVEL)
    assert _introspection.active_page_stats(kv)[0] == [4, 0, 0]
    assert kv.resume()
    kv.close()
    assert mgr.resize(GPU_LEVEL, 4 * block) and mgr.get_quota(GPU_LEVEL) == 4 * block
    assert mgr.get_life_cycle_pool_group_indices() == [0]


def test_cached_tokens_and_reused_blocks_by_level() -> None:
    mgr = KVCacheManager(config())
    tokens = list(range(8))
    committed(mgr, tokens)
    mgr.get_and_reset_iteration_cached_tokens_by_level()
    kv = mgr.create_kv_cache(None, tokens)
    assert kv.cached_tokens_by_level == [8] and kv._get_last_cached_token_level() == 0
    assert mgr.get_and_reset_iteration_cached_tokens_by_level() == [8]
    by_level = mgr.get_and_reset_iteration_reused_blocks_by_level()
    assert by_level[LifeCycleId(0)].full == [2] and by_level[LifeCycleId(0)].partial == [0]
    assert mgr.get_and_reset_iteration_reused_blocks_by_level() == {}
    mgr.record_request_suspended()
    mgr.record_request_resumed()
    mgr.record_request_resumed()
    assert mgr.get_and_reset_iteration_suspend_resume_stats() == (1, 2)
    assert mgr.get_and_reset_iteration_suspend_resume_stats() == (0, 0)
    kv.close()


def test_clamp_max_seq_len_for_mem() -> None:
    mgr = KVCacheManager(config(num_layers=1, gpu_quota=10 * 384))   # 10 slots of one layer group
    assert mgr.clamp_max_seq_len_for_mem(1, 1000) == 10 * TPB
    assert mgr.clamp_max_seq_len_for_mem(2, 1000) == 5 * TPB
    assert mgr.clamp_max_seq_len_for_mem(2, 7) == 7


# --- events ------------------------------------------------------------------------------------------------------
class RecordingEventManager:
    """Records the hook calls a reference-style event manager receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def add_created_event(self, counts: Any, layer_group_ids: Any = None) -> None:
        self.calls.append(("created", (list(counts), layer_group_ids)))

    def add_stored_event(self, parent: Any, blocks: Any, layer_group_id: Any = None) -> None:
        self.calls.append(("stored", (parent, [b.block_hash for b in blocks], layer_group_id)))

    def add_removed_event(self, hashes: Any) -> None:
        self.calls.append(("removed", (list(hashes),)))

    def add_updated_event(self, block_hash: Any, **kw: Any) -> None:
        self.calls.append(("updated", (block_hash, kw)))


def test_events_reach_the_event_manager_and_the_queue_alike() -> None:
    pytest.importorskip("kvxfer.cache.event_manager", reason="the reference event records are not in this tree")
    em = RecordingEventManager()
    mgr = KVCacheManager(config(), event_manager=em)
    assert mgr.event_manager is em
    committed(mgr, list(range(8)))
    queued = mgr.drain_events()
    assert any(isinstance(e, Created) for e in queued) and any(isinstance(e, Stored) for e in queued)
    kinds = [kind for kind, _ in em.calls]
    assert "created" not in kinds and kinds[0] == "stored"     # the event manager's owner announces the cache
    stored_hashes = [h for kind, args in em.calls if kind == "stored" for h in args[1]]
    assert len(stored_hashes) == 2


# --- _introspection ---------------------------------------------------------------------------------------------
def test_grains_and_ratio_split_keep_minimums() -> None:
    g = 16 << 20
    sizes = [16_252_928, 4_063_232]
    grains = _introspection.grains_for_slots(157, sizes, g)
    slots, used = _introspection.grains_to_slots(grains, sizes, g)
    assert slots >= 157 and used <= grains
    assert _introspection.grains_for_slots(slots + 1, sizes, g) > grains
    lists = [sizes, [491_520, 126_720, 15_872], [31_457_280, 7_864_320]]
    mins = [157, 3907, 157]
    total = sum(_introspection.grains_for_slots(m, s, g) for m, s in zip(mins, lists, strict=True))
    counts = _introspection.ratio_to_slot_count_list(total * g, lists, [0.2, 0.5, 0.3], g, mins)
    assert all(c >= m for c, m in zip(counts, mins, strict=True))
    with pytest.raises(ConfigError, match="minimums need"):
        _introspection.ratio_to_slot_count_list(g, lists, [0.2, 0.5, 0.3], g, mins)


def test_introspection_views() -> None:
    mgr = KVCacheManager(config(window=8))
    assert _introspection.swa_life_cycle_ids(mgr) == [1] and _introspection.attention_life_cycle_ids(mgr) == [0, 1]
    assert _introspection.ssm_life_cycle_id(mgr) is None
    tokens = list(range(8))
    committed(mgr, tokens)
    assert _introspection.all_tree_pages_droppable(mgr)
    num, pages = _introspection.reuse_match_pages(mgr, ReuseScope(), tokens, 0)
    assert num == 8 and len(pages) == 2 and all(p is not None and p[1] == TPB for p in pages)
    kv = mgr.create_kv_cache(None, tokens)
    assert not _introspection.all_tree_pages_droppable(mgr)
    assert _introspection.is_commit_allowed(kv)
    kv.stop_committing()
    assert not _introspection.is_commit_allowed(kv)
    assert _introspection.storage_utilization(mgr)[0] > 0
    kv.close()
