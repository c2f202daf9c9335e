"""Recurrent (SSM) layers: one state slot per request, snapshots of it in the prefix tree, their reuse,
statistics and planned drops, and what the extractor does with them."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from kvxfer.cache import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    CacheConfig,
    DataRole,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerGroupId,
    LayerId,
    LayerSpec,
    LifeCycleId,
    PrimaryTier,
    SsmLayerConfig,
    SsmLifeCycle,
    TokenId,
    _introspection,
)
from kvxfer.cache._life_cycle_registry import LifeCycleRegistry
from kvxfer.cache.descriptors import LayerGroupDesc, LayerGroupDescWire, plain
from kvxfer.errors import ConfigError, ContractError, LayoutError
from kvxfer.extractor import extract, plan_transfer

TPB = 8
STATE = DataRole("state")


def config(*, partial: bool = False, quota: int = 1 << 20, attn_layers: int = 2, ssm_layers: int = 2,
           state_size: int = 512) -> KVCacheManagerConfig:
    layers: list[AttentionLayerConfig | SsmLayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), 256), BufferConfig(DataRole("value"), 256)])
        for i in range(attn_layers)]
    layers += [SsmLayerConfig(LayerId(attn_layers + i), [BufferConfig(STATE, state_size)]) for i in range(ssm_layers)]
    return KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(quota)], layers=layers,
                                commit_min_snapshot=True, enable_partial_reuse=partial)


_ids = itertools.count(1000)


def tokens(n: int) -> list[TokenId]:
    return [TokenId(next(_ids)) for _ in range(n)]


def ssm_group(mgr: KVCacheManager) -> LayerGroupId:
    lg = _introspection.ssm_life_cycle_id(mgr)
    assert lg is not None
    return LayerGroupId(lg)


def write_state(mgr: KVCacheManager, slot: int, value: int) -> None:
    for layer in mgr.layer_grouping[ssm_group(mgr)]:
        mgr.buffer_view(int(layer), STATE)[slot].fill_(value)


def state_values(mgr: KVCacheManager, slot: int) -> set[int]:
    return {int(v) for layer in mgr.layer_grouping[ssm_group(mgr)]
            for v in mgr.buffer_view(int(layer), STATE)[slot].flatten().tolist()}


def commit_prefix(mgr: KVCacheManager, toks: list[TokenId], *, state: int | None = None) -> None:
    """A request computing ``toks`` (its state set to ``state``), committing them, closing."""
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = len(toks)
    kv.history_length = len(toks)
    if state is not None:
        write_state(mgr, kv.get_ssm_block_base_index(ssm_group(mgr)), state)
    kv.commit(toks)
    kv.close()


# --- configuration and layout ---------------------------------------------------------------------------
def test_recurrent_layers_need_commit_min_snapshot() -> None:
    cfg = config()
    with pytest.raises(ConfigError, match="commit_min_snapshot") as err:
        KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=cfg.cache_tiers, layers=cfg.layers)
    assert isinstance(err.value, AssertionError)    # the reference design asserts it
    with pytest.raises(ConfigError, match="duplicate buffer role"):
        SsmLayerConfig(LayerId(0), [BufferConfig(STATE, 64), BufferConfig(STATE, 64)])
    with pytest.raises(ConfigError, match="tokens_per_block_override"):
        SsmLayerConfig(LayerId(0), [BufferConfig(STATE, 64, tokens_per_block_override=4)])


def test_recurrent_layers_form_one_layer_group_in_their_own_pool_group() -> None:
    mgr = KVCacheManager(config())
    groups = mgr.layout.layer_groups
    assert [lg.recurrent for lg in groups] == [False, True]
    assert mgr.layer_grouping[1] == (LayerId(2), LayerId(3))
    assert mgr.get_layer_group_id(LayerId(3)) == 1
    assert groups[0].pool_group_index != groups[1].pool_group_index
    assert _introspection.ssm_life_cycle_id(mgr) == 1
    assert _introspection.attention_life_cycle_ids(mgr) == [0]
    registry = LifeCycleRegistry.of(mgr)
    assert registry.ssm_life_cycle_id == 1 and isinstance(registry[LayerGroupId(1)], SsmLifeCycle)
    assert [lg for lg, _ in registry.attention_life_cycles()] == [0]
    # a state slot holds every recurrent layer's state: 2 layers x 512 bytes
    assert sum(mgr.get_storage_statistics()[groups[1].pool_group_index].slot_sizes) == 1024


def test_layer_group_wire_form_carries_the_recurrent_flag_only_when_set() -> None:
    attn = LayerGroupDesc(0, (0, 1), None, 0, 0)
    assert "recurrent" not in plain(attn)
    ssm = LayerGroupDesc(1, (2,), None, 0, 1, recurrent=True)
    assert plain(ssm)["recurrent"] is True
    assert msgspec.convert(plain(ssm), LayerGroupDescWire).build() == ssm
    assert msgspec.convert(plain(attn), LayerGroupDescWire).build() == attn
    with pytest.raises(LayoutError, match="no window"):
        LayerGroupDesc(1, (2,), 64, 0, 1, recurrent=True)


def test_cache_config_front_door_builds_recurrent_layers() -> None:
    cc = CacheConfig(layers=(LayerSpec(0, 2, 16), LayerSpec(1, 1, 32, roles=("state",), recurrent=True)),
                     tokens_per_block=TPB, dtype="float16", tiers=(PrimaryTier(1 << 20, "cpu"),))
    mgr = KVCacheManager(cc)
    assert isinstance(mgr.init_config.layers[1], SsmLayerConfig)
    assert mgr.init_config.commit_min_snapshot
    assert _introspection.ssm_life_cycle_id(mgr) == 1
    with pytest.raises(ConfigError, match="no window"):
        LayerSpec(2, 1, 32, window=64, recurrent=True)


# --- the state slot -------------------------------------------------------------------------------------
def test_one_state_slot_per_request_whatever_its_length() -> None:
    mgr = KVCacheManager(config())
    lg = ssm_group(mgr)
    pg = mgr.layout.layer_groups[lg].pool_group_index
    free = mgr.num_free_slots(pg)
    kv = mgr.create_kv_cache()
    assert kv.get_ssm_block_base_index(lg) == BAD_PAGE_INDEX      # taken at the first resume
    assert kv.resume()
    slot = kv.get_ssm_block_base_index(lg)
    assert slot != BAD_PAGE_INDEX and mgr.num_free_slots(pg) == free - 1
    kv.capacity = 10 * TPB
    assert kv.num_blocks == 10 and kv.block_ids(lg).tolist() == [slot]
    assert mgr.num_free_slots(pg) == free - 1
    kv.suspend()
    assert kv.resume() and kv.get_ssm_block_base_index(lg) == slot
    kv.capacity = 3
    assert kv.get_ssm_block_base_index(lg) == slot
    with pytest.raises(ConfigError, match="not a recurrent"):
        kv.get_ssm_block_base_index(LayerGroupId(0))
    kv.close()
    assert mgr.num_free_slots(pg) == free


def test_a_suspended_state_is_offloaded_and_comes_back_intact() -> None:
    layers: list[AttentionLayerConfig | SsmLayerConfig] = [SsmLayerConfig(LayerId(0), [BufferConfig(STATE, 4096)])]
    mgr = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(4 * 4096), HostCacheTierConfig(2 * 4096)],
        layers=layers, commit_min_snapshot=True, max_util_for_resume=1.0))
    caches = []
    for i in range(6):          # 4 primary slots, 2 host slots: the last two resumes offload older states
        kv = mgr.create_kv_cache()
        assert kv.resume()
        write_state(mgr, kv.get_ssm_block_base_index(LayerGroupId(0)), i + 1)
        kv.suspend()
        caches.append(kv)
    away = [i for i, kv in enumerate(caches) if kv.page_tiers(0)[0] != 0]
    assert len(away) == 2
    assert all(caches[i].get_ssm_block_base_index(LayerGroupId(0)) == BAD_PAGE_INDEX for i in away)
    assert not mgr.create_kv_cache().resume()      # no slot anywhere for a seventh state
    for kv in caches[4:]:
        kv.close()
    for i in away:
        assert caches[i].resume()
        assert state_values(mgr, caches[i].get_ssm_block_base_index(LayerGroupId(0))) == {i + 1}


def test_clamp_max_seq_len_counts_one_state_slot_per_sequence() -> None:
    cfg = config(quota=64 << 10, attn_layers=1, ssm_layers=1, state_size=4096)
    cfg.layers[0].sliding_window_size = 2 * TPB     # the window holds 3 blocks of a sequence of any length
    cfg.initial_pool_ratio = [1 / 9, 8 / 9]         # byte shares 512 : 4096, about as many slots each
    mgr = KVCacheManager(cfg)
    state_slots = mgr.get_storage_statistics()[mgr.layout.layer_groups[1].pool_group_index].total
    assert mgr.clamp_max_seq_len_for_mem(1, 1 << 20) == 1 << 20       # a state never limits a length
    assert mgr.clamp_max_seq_len_for_mem(state_slots, 1 << 20) == TPB   # one attention block each, not 3
    assert mgr.clamp_max_seq_len_for_mem(state_slots // 3, 1 << 20) == 1 << 20
    assert mgr.clamp_max_seq_len_for_mem(state_slots + 1, 1) == 0      # every sequence needs a state slot


# --- snapshots and reuse --------------------------------------------------------------------------------
def test_reuse_restores_the_snapshot_into_a_private_slot() -> None:
    mgr = KVCacheManager(config())
    lg = ssm_group(mgr)
    prompt = tokens(4 * TPB)
    commit_prefix(mgr, prompt, state=7)
    kv = mgr.create_kv_cache(input_tokens=prompt + tokens(3))
    assert kv.num_committed_tokens == len(prompt)
    assert kv.get_ssm_block_base_index(lg) == BAD_PAGE_INDEX      # still the tree's snapshot
    assert kv.resume()
    mine = kv.get_ssm_block_base_index(lg)
    assert state_values(mgr, mine) == {7}
    write_state(mgr, mine, 9)       # the request's own computation does not touch the snapshot
    kv.close()
    again = mgr.create_kv_cache(input_tokens=prompt)
    assert again.resume() and state_values(mgr, again.get_ssm_block_base_index(lg)) == {7}
    again.close()


def test_a_match_stops_at_the_last_snapshot() -> None:
    cfg = config(partial=True)
    cfg.initial_pool_ratio = [0.5, 0.5]     # equal byte shares: room for every snapshot this test keeps
    mgr = KVCacheManager(cfg)
    prompt = tokens(4 * TPB)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = 2 * TPB
    kv.commit(prompt[:TPB])                 # snapshot after block 0
    kv.commit(prompt[TPB:TPB + 4])          # ends inside block 1: a snapshot 4 tokens into it
    kv.capacity = 4 * TPB
    kv.commit(prompt[TPB + 4:3 * TPB])      # snapshot after block 2; block 1 keeps the one at 4 tokens
    kv.close()
    expect = {TPB: TPB, TPB + 4: TPB + 4, 2 * TPB: TPB + 4, 3 * TPB: 3 * TPB, 4 * TPB: 3 * TPB}
    for n, reused in expect.items():
        assert mgr.probe_reuse(input_tokens=prompt[:n]) == reused, n
    cut = mgr.create_kv_cache(input_tokens=prompt[:2 * TPB + 3])
    assert cut.num_committed_tokens == TPB + 4
    assert cut._get_num_reusable_tokens_before_hybrid_pruning() == 2 * TPB + 3   # the attention pages went further
    assert cut._get_num_reusable_tokens_before_pruning() == 2 * TPB + 3
    cut.close()
    whole = mgr.create_kv_cache(input_tokens=prompt[:3 * TPB])
    assert whole._get_num_reusable_tokens_before_hybrid_pruning() == whole.num_committed_tokens == 3 * TPB
    whole.close()
    fork = mgr.create_kv_cache(input_tokens=prompt[:2 * TPB] + tokens(2 * TPB))
    assert fork._get_num_reusable_tokens_before_pruning() == 2 * TPB     # where the content leaves the tree
    assert fork.num_committed_tokens == TPB + 4
    fork.close()


def partial_prefix(mgr: KVCacheManager, toks: list[TokenId], ends: list[int], *, state: int | None = None,
                   is_end: bool = False) -> int:
    """A request computing ``toks`` and committing up to each of ``ends`` in turn (its state set to
    ``state`` first), closing; returns its state slot."""
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = len(toks)
    slot = kv.get_ssm_block_base_index(ssm_group(mgr))
    if state is not None:
        write_state(mgr, slot, state)
    done = 0
    for end in ends:
        kv.history_length = end
        kv.commit(toks[done:end], is_end=is_end and end == ends[-1])
        done = end
    kv.close()
    return slot


@pytest.mark.parametrize("partial", [False, True])
def test_a_commit_ending_inside_a_block_snapshots_the_state_there(partial: bool) -> None:
    mgr = KVCacheManager(config(partial=partial))
    prompt = tokens(2 * TPB)
    partial_prefix(mgr, prompt, [TPB, TPB + 4], state=5)
    num, pages = _introspection.reuse_match_pages(mgr, None, prompt[:TPB + 4], ssm_group(mgr), partial)
    assert num == TPB + 4 and pages[-1] is not None and pages[-1][1] == 4
    assert mgr.probe_reuse(input_tokens=prompt[:TPB + 4]) == TPB + 4    # the tail block's own key
    # past the endpoint only a partial match reaches the snapshot inside block 1
    assert mgr.probe_reuse(input_tokens=prompt) == (TPB + 4 if partial else TPB)
    kv = mgr.create_kv_cache(input_tokens=prompt[:TPB + 4])
    assert kv.num_committed_tokens == TPB + 4
    assert kv.resume() and state_values(mgr, kv.get_ssm_block_base_index(ssm_group(mgr))) == {5}
    kv.close()


def test_the_last_commit_gives_the_tree_the_state_slot_itself() -> None:
    mgr = KVCacheManager(config(partial=True))
    lg = ssm_group(mgr)
    prompt = tokens(TPB + 4)
    slot = partial_prefix(mgr, prompt, [len(prompt)], state=6, is_end=True)
    _, pages = _introspection.reuse_match_pages(mgr, None, prompt, lg, True)
    assert pages[-1] == (slot, 4)                   # moved into the tree, not copied
    kv = mgr.create_kv_cache(input_tokens=prompt)
    assert kv.num_committed_tokens == len(prompt)
    assert kv.resume()
    mine = kv.get_ssm_block_base_index(lg)
    assert mine != slot and state_values(mgr, mine) == {6}
    kv.close()


def test_a_snapshot_inside_a_block_moves_into_the_block_that_replaces_it() -> None:
    mgr = KVCacheManager(config(partial=True))
    lg = ssm_group(mgr)
    prompt = tokens(3 * TPB)
    partial_prefix(mgr, prompt, [TPB + 4])          # no snapshot on block 0: the commit ended past it
    kv = mgr.create_kv_cache(input_tokens=prompt)
    assert kv.num_committed_tokens == TPB + 4
    assert kv.resume()
    kv.capacity = len(prompt)
    kv.history_length = len(prompt)
    kv.commit(prompt[TPB + 4:])                     # block 1 full now, its own snapshot on block 2
    kv.close()
    num, pages = _introspection.reuse_match_pages(mgr, None, prompt[:TPB + 4], lg, True)
    assert num == TPB + 4 and len(pages) == 2 and pages[-1] is not None and pages[-1][1] == 4
    assert _introspection.reuse_match_pages(mgr, None, prompt, lg, True)[0] == len(prompt)
    assert mgr.probe_reuse(input_tokens=prompt[:2 * TPB]) == TPB + 4
    assert mgr.probe_reuse(input_tokens=prompt) == len(prompt)


def test_a_block_keeps_its_latest_snapshot_and_a_fork_before_it_reuses_nothing() -> None:
    mgr = KVCacheManager(config(partial=True))
    prompt = tokens(2 * TPB)
    partial_prefix(mgr, prompt, [3, 6])
    assert mgr.probe_reuse(input_tokens=prompt[:5] + tokens(4)) == 0   # the state after 6 tokens is ahead
    assert mgr.probe_reuse(input_tokens=prompt[:7] + tokens(4)) == 6
    assert mgr.probe_reuse(input_tokens=prompt[:3] + tokens(4)) == 0   # the 3-token snapshot went
    partial_prefix(mgr, prompt, [TPB])
    assert mgr.probe_reuse(input_tokens=prompt[:TPB] + tokens(4)) == TPB
    assert mgr.probe_reuse(input_tokens=prompt[:7] + tokens(4)) == 0   # the whole block's state replaced it


def test_a_planned_drop_takes_the_window_and_the_snapshot_of_a_partial_endpoint() -> None:
    layers: list[AttentionLayerConfig | SsmLayerConfig] = [
        AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), 256)], sliding_window_size=TPB),
        SsmLayerConfig(LayerId(1), [BufferConfig(STATE, 512)])]
    mgr = KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(1 << 20)],
                                              layers=layers, commit_min_snapshot=True))
    attn = _introspection.attention_life_cycle_ids(mgr)[0]
    prompt = tokens(TPB + 4)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = len(prompt)
    kv.commit(prompt)
    kv.stop_committing()
    handle = kv.plan_committed_block_drop()
    assert handle is not None
    assert _introspection.reuse_match_planned_drop_counts(mgr, None, prompt, attn) == (len(prompt), [1, 1])
    assert _introspection.reuse_match_planned_drop_counts(mgr, None, prompt, ssm_group(mgr))[1][-1] == 1
    kv.close()
    assert mgr.probe_reuse(input_tokens=prompt) == len(prompt)
    handle.drop()
    assert mgr.probe_reuse(input_tokens=prompt) == 0


def test_no_snapshot_no_reuse_even_with_attention_pages() -> None:
    mgr = KVCacheManager(config())
    prompt = tokens(3 * TPB)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = len(prompt)
    kv.commit(prompt[:3 * TPB - 2])     # the attention blocks 0 and 1 enter the tree, no state snapshot
    kv.close()
    assert mgr.probe_reuse(input_tokens=prompt) == 0


def test_commits_must_start_or_end_at_history_length() -> None:
    mgr = KVCacheManager(config())
    prompt = tokens(2 * TPB)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = 2 * TPB
    kv.history_length = TPB + 3
    with pytest.raises(ContractError, match="history_length"):
        kv.commit(prompt[:TPB])
    assert kv.num_committed_tokens == 0
    kv.commit(prompt[:TPB + 3])            # ends there
    kv.commit(prompt[TPB + 3:])            # starts there
    assert kv.num_committed_tokens == 2 * TPB
    kv.close()


# --- statistics -----------------------------------------------------------------------------------------
def test_snapshot_lookup_statistics() -> None:
    mgr = KVCacheManager(config())
    lg = ssm_group(mgr)
    prompt = tokens(3 * TPB)
    miss = mgr.create_kv_cache(input_tokens=prompt, id="miss")
    assert mgr.get_dirty_stats_kv_cache_ids() == {"miss"}
    miss.commit_pending_stats()
    stats = mgr.get_and_reset_ssm_snapshot_iteration_stats()
    assert set(stats) == {LifeCycleId(lg)}
    s = stats[LifeCycleId(lg)]
    assert (s.iter_snapshot_lookups, s.iter_snapshot_hits, s.iter_snapshot_misses, s.iter_reused_tokens,
            s.iter_unreused_tokens) == (1, 0, 1, 0, 3 * TPB)
    assert mgr.get_and_reset_ssm_snapshot_iteration_stats() == {}
    miss.close()

    commit_prefix(mgr, prompt[:2 * TPB])
    hit = mgr.create_kv_cache(input_tokens=prompt, id="hit")
    hit.commit_pending_stats()
    s = mgr.get_and_reset_ssm_snapshot_iteration_stats()[LifeCycleId(lg)]
    assert (s.iter_snapshot_hits, s.iter_aligned_snapshot_hits, s.iter_unaligned_snapshot_hits,
            s.iter_reused_tokens, s.iter_unreused_tokens) == (1, 1, 0, 2 * TPB, TPB)
    assert s.iter_snapshot_hit_rate == 1.0
    mgr.get_and_reset_iteration_stats()
    assert hit.resume()
    copies = mgr.get_and_reset_iteration_stats()[lg]
    assert copies.iter_intra_device_copy_blocks == 1 and copies.iter_intra_device_copy_bytes == 1024
    hit.close()

    dropped = mgr.create_kv_cache(input_tokens=prompt, id="dropped")
    dropped.discard_pending_stats()
    assert mgr.get_dirty_stats_kv_cache_ids() == set()
    assert mgr.get_and_reset_ssm_snapshot_iteration_stats() == {}
    dropped.close()


# --- planned drops --------------------------------------------------------------------------------------
def test_planned_drop_takes_the_endpoint_snapshot_after_the_last_plan() -> None:
    mgr = KVCacheManager(config())
    prompt = tokens(2 * TPB)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = 2 * TPB
    kv.commit(prompt[:TPB])
    kv.commit(prompt[TPB:])
    first, second = kv.plan_committed_block_drop(), kv.plan_committed_block_drop()
    kv.close()
    assert first is not None and second is not None
    matched, counts = _introspection.reuse_match_planned_drop_counts(mgr, None, prompt, ssm_group(mgr))
    assert (matched, counts) == (2 * TPB, [0, 2])   # both plans name the endpoint snapshot only
    assert mgr.probe_reuse(input_tokens=prompt) == 2 * TPB
    first.drop()
    assert mgr.probe_reuse(input_tokens=prompt) == 2 * TPB     # the other plan still names it
    second.drop()
    assert mgr.probe_reuse(input_tokens=prompt) == TPB         # the earlier snapshot stays


def state_heavy(max_util: float) -> KVCacheManager:
    """Half the primary bytes for state slots: 8 of 4 KiB, and 64 attention slots of 512 B."""
    cfg = config(quota=64 << 10, attn_layers=1, ssm_layers=1, state_size=4096)
    cfg.max_util_for_resume = max_util
    cfg.initial_pool_ratio = [0.5, 0.5]
    mgr = KVCacheManager(cfg)
    pg = mgr.layout.layer_groups[ssm_group(mgr)].pool_group_index
    assert mgr.get_storage_statistics()[pg].total == 8
    return mgr


def test_resume_gate_counts_a_pool_group_of_state_slots() -> None:
    """The gate reads every pool group, state slots included: once more than half of them are held, a
    suspended request whose state slot is on the primary tier (it needs nothing) is refused too."""
    mgr = state_heavy(0.5)
    pg = mgr.layout.layer_groups[ssm_group(mgr)].pool_group_index
    held = []
    while True:                         # each resumed and suspended request keeps its state slot
        kv = mgr.create_kv_cache()
        if not kv.resume():
            break
        kv.suspend()
        held.append(kv)
    assert len(held) == 5               # 0/8 .. 4/8 used: at or under 0.5; at 5/8 the gate closes
    assert _introspection.storage_utilization(mgr)[pg] == 5 / 8 and mgr.num_free_slots(pg) == 3
    assert not held[0].resume()         # needs no slot, refused all the same
    held.pop().close()                  # 4/8: at the limit, not above it
    assert held[0].resume()
    for c in [*held, kv]:
        c.close()
    mgr.shutdown()


def test_active_requests_take_state_slots_up_to_the_gate() -> None:
    """With every request active the state pool group fills as the gate allows (each resume sees at most
    half of the slots used, so five of eight resume); no headroom is held back for state slots, which
    never grow."""
    mgr = state_heavy(0.5)
    active = []
    while True:
        kv = mgr.create_kv_cache()
        if not kv.resume():
            break
        active.append(kv)
    assert len(active) == 5
    active.pop().close()
    assert kv.resume()
    for c in [*active, kv]:
        c.close()
    mgr.shutdown()


# --- the extractor --------------------------------------------------------------------------------------
def test_extractor_refuses_recurrent_layers_and_extracts_the_attention_ones() -> None:
    mgr = KVCacheManager(config())
    kv = mgr.create_kv_cache()
    assert kv.resume()
    kv.capacity = 2 * TPB
    with pytest.raises(LayoutError, match="recurrent"):
        extract(mgr.layout, kv)
    with pytest.raises(LayoutError, match="recurrent"):
        extract(mgr.layout, kv, layers=[2])
    table = extract(mgr.layout, kv, layers=[0, 1])
    assert set(table.coords["layer_group"].tolist()) == {0}
    assert sorted(set(table.coords["block"].tolist())) == [0, 1]
    dst = mgr.create_kv_cache()
    assert dst.resume()
    dst.capacity = 2 * TPB
    with pytest.raises(LayoutError, match="recurrent"):
        plan_transfer(mgr.layout, kv, mgr.layout, dst)
    assert plan_transfer(mgr.layout, kv, mgr.layout, dst, layers=[0, 1]).total_bytes == 2 * (2 * 2 * 256)
    kv.close()
    dst.close()
