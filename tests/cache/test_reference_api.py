"""The cache manager API of the reference design (TensorRT-LLM KVCacheManagerV2) on kvxfer: hash
options used by the manager, streams and slot readiness, sliding-window scratch slots,
expected_prompt_length, the host-tier fallback, primary quota resizing and slot rebalancing, sink
blocks in layer grouping, config vs current_config. (Hash vectors: test_hashing.py; statistics:
test_stats.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvxfer.cache.tiers as tiers_module
from kvxfer.cache import (
    CacheConfig,
    DiskTier,
    HostTier,
    KVCacheManager,
    KVCacheStatsDelta,
    LayerSpec,
    PrimaryTier,
    ReuseScope,
    Stored,
    block_hash_for_event,
    block_keys,
)
from kvxfer.cache.hashing import HASH_ALGOS, key_width
from kvxfer.cache.streams import SlotReadiness
from kvxfer.errors import CacheStateError, ConfigError, ManagerBusyError, ScratchInUseError, TierError
from tests.support.reuse_support import TPB, check_kv, check_references, make_manager, prefill, write_kv


# --- hash options in the manager --------------------------------------------------------------------
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_manager_keys_blocks_with_the_configured_algorithm(algo: str) -> None:
    mgr = make_manager(32, hash_algo=algo)
    assert mgr.hash_algo == algo and mgr.config.hash_algo == algo
    scope = ReuseScope(lora_id=2, salt=99)
    tokens = np.arange(500, 522)
    prefill(mgr, tokens, reuse_scope=scope)
    stored = [e for e in mgr.drain_events() if isinstance(e, Stored)]
    keys = [k for e in stored for k in e.block_hashes]
    assert keys == block_keys(tokens, TPB, scope.root_key_for(algo), algo=algo, scope=scope)
    assert {len(k) for k in keys} == {key_width(algo)}
    published = [block_hash_for_event(k, mgr.resolved_hash_algo) for k in keys]
    assert all(isinstance(p, str) and len(p) == 64 for p in published) if algo in ("v2_sha256", "v2_blake3", "v2_sha256_packed") \
        else all(isinstance(p, int) and 0 <= p < 2**64 for p in published)
    assert mgr.probe_prompt_reuse(tokens, scope) == 20 and mgr.probe_prompt_reuse(tokens, ReuseScope(lora_id=2)) == 0


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_reuse_scopes_seed_distinct_chains(algo: str) -> None:
    """The reference's reuse-scope tests: None and 0 differ for each field, keys are deterministic,
    and a match (full or partial) never crosses scopes."""
    scopes = [ReuseScope(), ReuseScope(lora_id=0), ReuseScope(salt=0), ReuseScope(lora_id=0, salt=0),
              ReuseScope(lora_id=7, salt=11)]
    roots = [s.root_key_for(algo) for s in scopes]
    assert len(set(roots)) == len(scopes) and roots == [s.root_key_for(algo) for s in scopes]
    tokens = [1, 2, 3, 4]
    same = [block_keys(tokens, 2, ReuseScope(7, 11).root_key_for(algo), algo=algo, scope=ReuseScope(7, 11))
            for _ in range(2)]
    other = block_keys(tokens, 2, ReuseScope(7, 12).root_key_for(algo), algo=algo, scope=ReuseScope(7, 12))
    assert same[0] == same[1] and not set(same[0]) & set(other)
    mgr = make_manager(16, hash_algo=algo)
    prefill(mgr, np.arange(10), reuse_scope=ReuseScope(7, 11))
    assert mgr.probe_prompt_reuse(np.arange(10), ReuseScope(7, 11)) == 8         # full blocks enter the tree
    assert mgr.probe_prompt_reuse(np.arange(10), ReuseScope(7, 12)) == 0
    assert mgr.probe_prompt_reuse(np.arange(3), ReuseScope(7, 12)) == 0        # partial match stays in scope too
    assert mgr.probe_prompt_reuse(np.arange(3), ReuseScope(7, 11)) == 2


def test_config_refuses_an_unknown_algorithm() -> None:
    with pytest.raises(ConfigError, match="hash_algo must be one of auto, v1_block_key"):
        CacheConfig.for_model(1, 1, 8, TPB, "float16", 4, hash_algo="md5")


# --- streams --------------------------------------------------------------------------------------------
class FakeOps:
    """StreamOps double: events are (stream, n) tuples; every call is logged."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any, Any]] = []
        self.n = 0

    def record(self, stream: Any) -> Any:
        self.n += 1
        return (stream, self.n)

    def wait(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream, event))

    def synchronize(self, event: Any) -> None:
        self.log.append(("sync", None, event))


def test_slot_readiness_waits_only_across_streams() -> None:
    ops = FakeOps()
    ready = SlotReadiness([8, 4], ops)
    ready.stamp(0, np.array([1, 2, -1]), "A")
    ready.stamp(0, np.array([2, 3]), "B")        # slot 2's last user is now B
    assert ready.wait_for(0, np.array([1, 2, 3, 5]), "B") == 1
    assert ops.log == [("wait", "B", ("A", 1))]
    ops.log.clear()
    assert ready.wait_for(0, np.array([1, 2]), "C") == 2
    assert sorted(e[2] for e in ops.log) == [("A", 1), ("B", 2)]
    ops.log.clear()
    assert ready.wait_for(1, np.array([1, 2]), "C") == 0          # other pool group: nothing recorded
    ready.synchronize(0, np.array([3]))
    assert ops.log == [("sync", None, ("B", 2))]


def test_slot_readiness_forgets_unreferenced_events() -> None:
    ready = SlotReadiness([4], FakeOps())
    for i in range(3000):
        ready.stamp(0, np.array([i % 4]), i % 2)
    assert len(ready._events) <= 2048
    assert ready.wait_for(0, np.arange(4), "other") == 4           # the live ones are still there


def test_cpu_caches_run_without_streams() -> None:
    mgr = make_manager(16)
    kv = mgr.create_kv_cache_for_prompt(np.arange(8))
    assert kv.cuda_stream is None
    assert kv.resume(None) and kv.cuda_stream is None
    assert kv.resize(8)
    kv.cuda_stream = None
    with pytest.raises(ConfigError, match="a CUDA stream needs a CUDA primary tier"):
        kv.cuda_stream = object()
    kv.suspend()
    with pytest.raises(ConfigError, match="a CUDA stream needs a CUDA primary tier"):
        kv.resume(object())
    kv.close()


# --- sliding-window scratch slots ----------------------------------------------------------------------
def window_manager(scratch: bool) -> KVCacheManager:
    """Layer 0 full attention, layer 1 a window of 8 tokens (2 blocks): two layer groups."""
    return make_manager(16, windows=[None, 8], swa_scratch_reuse=scratch)


def test_scratch_slots_stand_in_for_blocks_out_of_the_window() -> None:
    mgr = window_manager(True)
    assert len(mgr.layout.layer_groups) == 2
    tokens = np.arange(1000, 1032)                     # 8 blocks
    kv = mgr.create_kv_cache_for_prompt(tokens)
    assert kv.enable_swa_scratch_reuse
    assert kv.resume() and kv.resize(32)
    # at history 32 the window group needs only blocks 6 and 7 (tokens 25..31): 0..5 are scratch
    win = kv.block_ids(1)
    assert (win[:6] == -1).all() and (win[6:] >= 0).all()
    desc = kv.get_scratch_desc(1)
    assert desc is not None and desc.range == (0, 6) and len(desc.slot_ids) == 6
    assert kv.get_scratch_desc(0) is None and (kv.block_ids(0) >= 0).all()
    assert kv.has_scratch_slots
    held = set(kv.block_ids(0).tolist()) | set(win[6:].tolist()) | set(desc.slot_ids)
    assert len(held) == 8 + 2 + 6 and mgr.allocator(0).num_used == 16   # both groups share the pool group
    with pytest.raises(CacheStateError, match="cannot disable SWA scratch reuse") as refused:
        kv.enable_swa_scratch_reuse = False
    assert isinstance(refused.value, ValueError) and "scratch blocks are needed" in str(refused.value)
    write_kv(mgr, kv, tokens, 0, 32)
    kv.commit(tokens)
    assert check_kv(mgr, kv, tokens, 24, 32) == 2 * 8      # both groups hold the window's KV
    assert kv.resize(36)                               # decode: block 8 needs a page, no scratch left
    assert kv.get_scratch_desc(1) is None and not kv.has_scratch_slots
    assert kv.block_ids(1)[8] >= 0
    kv.close()
    assert mgr.allocator(0).num_used == mgr.slot_accounting(0).evictable + mgr.slot_accounting(0).shared


def test_without_scratch_the_same_step_allocates_every_block() -> None:
    mgr = window_manager(True)
    kv = mgr.create_kv_cache_for_prompt(np.arange(1000, 1032))
    kv.enable_swa_scratch_reuse = False                # per request: nothing to write yet
    assert kv.resume() and kv.resize(32)
    assert (kv.block_ids(1) >= 0).all() and kv.get_scratch_desc(1) is None
    assert mgr.allocator(0).num_used == 16
    with pytest.raises(ScratchInUseError, match="cannot enable"):
        kv.enable_swa_scratch_reuse = True             # the step [0, 32) would have scratch blocks
    kv.history_length = 32
    kv.enable_swa_scratch_reuse = True
    assert kv.resize(44)                               # blocks 8..10: 8 is out of the window at 44
    desc = kv.get_scratch_desc(1)
    assert desc is not None and desc.range == (8, 9) and len(desc.slot_ids) == 1
    assert kv.block_ids(1)[8] == -1 and (kv.block_ids(1)[9:] >= 0).all()
    kv.close()
    check_references(mgr)


def test_scratch_slots_of_an_active_request_never_move() -> None:
    mgr = make_manager(8, windows=[None, 8], swa_scratch_reuse=True, host_blocks=8)   # 16 shared slots
    x = mgr.create_kv_cache_for_prompt(np.arange(32))
    assert x.resume() and x.resize(32)                 # 8 + 2 pages and 6 scratch slots: all 16 slots
    desc = x.get_scratch_desc(1)
    assert desc is not None and mgr.allocator(0).num_free == 0
    y = mgr.create_kv_cache()
    assert y.resume() and not y.resize(TPB)            # nothing of an ACTIVE request may be offloaded
    assert x.get_scratch_desc(1) == desc and (mgr.allocator(0).refcount[list(desc.slot_ids)] == 1).all()
    y.close()
    x.close()


# --- expected_prompt_length -------------------------------------------------------------------------------
def test_expected_prompt_length_splits_missed_from_generation() -> None:
    mgr = make_manager(16)
    kv = mgr.create_kv_cache_for_prompt(None, expected_prompt_length=10)        # 3 prompt blocks, tokens unknown
    assert kv.expected_prompt_length == 10
    assert kv.resume() and kv.resize(16)
    assert kv.pending_stats == KVCacheStatsDelta(alloc_total_blocks=4, alloc_new_blocks=4, missed_blocks=3)
    kv.commit_pending_stats()
    assert mgr.get_and_reset_iteration_stats()[0].iter_gen_alloc_blocks == 1
    kv.close()
    with pytest.raises(ConfigError, match="shorter than the 8 prompt tokens"):
        mgr.create_kv_cache_for_prompt(np.arange(8), expected_prompt_length=5)
    with pytest.raises(ConfigError, match="expected_prompt_length must be an int >= 0"):
        mgr.create_kv_cache_for_prompt(None, expected_prompt_length=-1)
    assert mgr.create_kv_cache_for_prompt(np.arange(8)).expected_prompt_length == 8


# --- host tier fallback --------------------------------------------------------------------------------
def test_manager_runs_without_a_host_tier_it_cannot_allocate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pool(nbytes: int, device: str, *, pinned: bool = False) -> torch.Tensor:
        raise RuntimeError(f"CUDA error: out of memory (page-locked allocation of {nbytes} bytes)")

    monkeypatch.setattr(tiers_module, "allocate_pool", failing_pool)
    mgr = make_manager(8, host_blocks=8, disk_blocks=8, disk_path=str(tmp_path))
    assert mgr.num_tiers == 2 and mgr.host_tier_error is not None and "out of memory" in mgr.host_tier_error
    assert [type(t) for t in mgr.config.tiers] == [PrimaryTier, HostTier, DiskTier]      # as configured
    assert [type(t) for t in mgr.current_config.tiers] == [PrimaryTier, DiskTier]       # as running
    assert mgr.tier_index(DiskTier) == 1
    with pytest.raises(TierError, match=r"has no HostTier.*set-up failed: RuntimeError"):
        mgr.tier_index(HostTier)
    tokens = np.arange(100, 120)
    a = mgr.create_kv_cache_for_prompt(tokens)
    assert a.resume() and a.resize(20)
    write_kv(mgr, a, tokens, 0, 20)
    a.commit(tokens)
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8 * TPB)            # pushes a's pages to the disk tier
    assert a.page_tiers(0).tolist() == [1] * 5
    b.close()
    assert a.resume() and check_kv(mgr, a, tokens, 0, 20) == 20
    a.close()
    mgr.shutdown()


def test_a_bad_host_tier_config_still_fails() -> None:
    if torch.cuda.is_available():
        pytest.skip("pinned=True is valid where CUDA exists")
    with pytest.raises(TierError, match="pinned=True needs CUDA"):
        KVCacheManager(CacheConfig(layers=(LayerSpec(0, 1, 8),), tokens_per_block=TPB, dtype="float16",
                                   tiers=(PrimaryTier(1 << 16), HostTier(1 << 16, pinned=True))))


# --- primary quota and slot rebalancing ------------------------------------------------------------------
def test_primary_quota_shrinks_and_grows_inside_the_registered_pools() -> None:
    mgr = make_manager(16)
    bases = [p.base_address for pg in mgr.layout.pool_groups for p in pg.pools]
    quota = mgr.config.primary.quota_bytes
    prompts = [np.arange(i * 100, i * 100 + 16) for i in range(4)]
    for p in prompts:
        prefill(mgr, p)                                  # 16 tree pages, slots 0..15
    active = mgr.create_kv_cache()
    assert active.resume()
    with pytest.raises(ManagerBusyError, match="active"):
        mgr.resize_quota(0, quota // 2)
    active.close()
    mgr.resize_quota(PrimaryTier, quota // 2)            # 8 usable slots: 8 pages evicted (LRU first)
    assert mgr.allocator(0).usable == 8 and mgr.allocator(0).num_used == 8
    assert mgr.storage_stats(0).slots_total == (8,) and mgr.slot_accounting(0).total == 8
    assert mgr.current_config.primary.quota_bytes == quota // 2 and mgr.config.primary.quota_bytes == quota
    assert [p.base_address for pg in mgr.layout.pool_groups for p in pg.pools] == bases    # nothing moved
    assert mgr.layout.pool_groups[0].num_slots == 16                                      # still registered
    check_references(mgr)
    assert [mgr.probe_prompt_reuse(p) for p in prompts] == [0, 0, 15, 15]   # the most recent prompts survived
    kv = mgr.create_kv_cache_for_prompt(prompts[3])
    assert kv.num_reused_tokens == 15
    assert kv.resume() and check_kv(mgr, kv, prompts[3], 0, 15) == 15     # bytes intact where they moved
    assert (kv.block_ids(0) < 8).all()
    kv.close()
    hog = mgr.create_kv_cache()
    assert hog.resume() and not hog.resize(9 * TPB)      # 8 usable slots, not 16
    hog.close()
    with pytest.raises(TierError, match=r"primary quota must be an int in \(0, "):
        mgr.resize_quota(0, quota + 1)
    mgr.resize_quota(0, quota)
    assert mgr.allocator(0).usable == 16
    big = mgr.create_kv_cache()
    assert big.resume() and big.resize(16 * TPB)
    big.close()


def test_rebalance_slots_between_pool_groups() -> None:
    layers = (LayerSpec(0, 2, 8), LayerSpec(1, 2, 16, window=8))     # two slot sizes: two pool groups
    probe = CacheConfig(layers=layers, tokens_per_block=TPB, dtype="float16", tiers=(PrimaryTier(1 << 20),))
    mgr = KVCacheManager(probe)
    assert len(mgr.layout.pool_groups) == 2
    n0, n1 = (pg.num_slots for pg in mgr.layout.pool_groups)
    page0, page1 = (sum(p.slot_bytes for p in pg.pools) for pg in mgr.layout.pool_groups)
    quota = mgr.config.primary.quota_bytes
    mgr.resize_quota(0, quota // 2)                                   # both groups shrink alike
    assert [mgr.allocator(0).usable, mgr.allocator(1).usable] == [n0 // 2, n1 // 2]
    with pytest.raises(TierError, match="more than the primary quota"):
        mgr.rebalance_slots([n0, n1])
    # give pool group 0 all its registered slots, pool group 1 what is left of the quota
    target1 = (quota // 2 - n0 * page0) // page1
    mgr.rebalance_slots([n0, target1])
    assert [mgr.allocator(0).usable, mgr.allocator(1).usable] == [n0, target1]
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(target1 * TPB) and not kv.resize((target1 + 1) * TPB)
    kv.close()
    with pytest.raises(TierError, match="one int in"):
        mgr.rebalance_slots([n0 + 1, 0])


# --- minor ---------------------------------------------------------------------------------------------------
def test_sink_tokens_group_by_whole_blocks() -> None:
    layers = (LayerSpec(0, 1, 8, window=16, sink_tokens=1), LayerSpec(1, 1, 8, window=16, sink_tokens=3),
              LayerSpec(2, 1, 8, window=16, sink_tokens=5))
    cfg = CacheConfig(layers=layers, tokens_per_block=TPB, dtype="float16", tiers=(PrimaryTier(1 << 16),))
    groups = KVCacheManager(cfg).layout.layer_groups
    assert [(g.layer_ids, g.sink_tokens) for g in groups] == [((0, 1), 3), ((2,), 5)]   # 1 and 2 sink blocks


def test_reuse_scope_salt_is_an_integer() -> None:
    assert ReuseScope(salt=7).salt == 7
    assert ReuseScope.for_tenant("acme").salt == ReuseScope.for_tenant("acme").salt != ReuseScope.for_tenant("b").salt
    with pytest.raises(ConfigError, match="salt must be None or an int"):
        ReuseScope(salt=b"acme")  # type: ignore[arg-type]


# --- GPU: streams ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_slot_reused_on_another_stream_waits_for_its_previous_user() -> None:
    """Request A writes its pages on stream A behind a long sleep and closes without synchronising;
    request B takes the same slots on stream B and reads them: B must see A's bytes (its stream
    waited on A's ready event), not the zeros still there while A sleeps."""
    mgr = make_manager(8, device="cuda:0")
    stream_a, stream_b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    a = mgr.create_kv_cache()
    assert a.resume(stream_a) and a.torch_stream is stream_a and a.cuda_stream == stream_a.cuda_stream
    assert type(a.cuda_stream) is int                     # a torch stream is reported as its cudaStream_t
    assert a.resize(4 * TPB)
    ids_a = a.block_ids(0)
    view = mgr.buffer_view(0, "key")
    with torch.cuda.stream(stream_a):
        torch.cuda._sleep(200_000_000)                    # ~0.1 s of GPU time before the write lands
        view[torch.from_numpy(ids_a.astype(np.int64)).to(view.device)] = 1.0
    a.close()                                             # no host synchronisation
    b = mgr.create_kv_cache()
    assert b.resume(stream_b) and b.resize(4 * TPB)
    ids_b = b.block_ids(0)
    assert sorted(ids_b.tolist()) == sorted(ids_a.tolist())
    with torch.cuda.stream(stream_b):
        got = view[torch.from_numpy(ids_b.astype(np.int64)).to(view.device)].clone()
    stream_b.synchronize()
    assert bool((got == 1.0).all())
    b.close()
    with pytest.raises(ConfigError, match=r"expected a torch\.cuda\.Stream or a cudaStream_t handle"):
        mgr.create_kv_cache().resume("stream")
    raw = mgr.create_kv_cache()                           # the reference passes raw cudaStream_t ints
    assert raw.resume(stream_b.cuda_stream)
    assert type(raw.cuda_stream) is int and raw.cuda_stream == stream_b.cuda_stream   # the int it was given
    assert raw.torch_stream.cuda_stream == stream_b.cuda_stream
    raw.close()


def slot_rows(mgr: KVCacheManager, slot: int) -> list[bytes]:
    """The bytes of one slot of pool group 0 in every pool (copied to the host)."""
    pg = mgr.layout.pool_groups[0]
    return [bytes(mgr.pool_tensor(0, p.pool_index).view(p.num_slots, p.slot_bytes)[slot].cpu().numpy())
            for p in pg.pools]


@pytest.mark.gpu
def test_copy_on_write_runs_on_the_request_stream() -> None:
    mgr = make_manager(16, device="cuda:0")
    tokens = np.arange(300, 318)
    a = mgr.create_kv_cache_for_prompt(tokens)
    assert a.resume() and a.resize(18)
    gen = torch.Generator().manual_seed(5)
    for p in mgr.layout.pool_groups[0].pools:
        t = mgr.pool_tensor(0, p.pool_index)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen).to(t.device))
    a.commit(tokens)
    a.close()
    kv = mgr.create_kv_cache_for_prompt(np.concatenate([tokens[:14], np.arange(900, 906)]))
    assert kv.num_reused_tokens == 14                     # 3 full blocks + 2 tokens of the 4th
    shared = int(kv.page_locations(0)[0][3])
    stream = torch.cuda.Stream()
    assert kv.resume(stream)
    private = int(kv.block_ids(0)[3])
    assert private != shared
    stream.synchronize()
    assert slot_rows(mgr, private) == slot_rows(mgr, shared)
    kv.close()


def test_manager_stamps_released_slots_and_waits_across_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's stream logic on the CPU, with named streams and a StreamOps double."""
    mgr = make_manager(8)
    ops = FakeOps()
    monkeypatch.setattr(mgr._state, "readiness", SlotReadiness([pg.num_slots for pg in mgr.layout.pool_groups], ops))
    monkeypatch.setattr(mgr._parts.streams, "check_stream", lambda stream, what: stream)
    monkeypatch.setattr(mgr._parts.streams, "stream_of", lambda stream: "default" if stream is None else stream)
    a = mgr.create_kv_cache_for_prompt(np.arange(8))
    assert a.resume("A") and a.resize(8)
    assert ops.log == []                                  # fresh slots: nobody to wait for
    a.commit(np.arange(8))                                # committed pages stamped on A
    a.close()
    b = mgr.create_kv_cache_for_prompt(np.arange(8))                 # reuses A's committed block 0 (4 of 7 tokens)
    assert b.resume("B")
    waits = [e for e in ops.log if e[0] == "wait"]
    assert waits and all(stream == "B" and event[0] == "A" for _, stream, event in waits)
    ops.log.clear()
    c = mgr.create_kv_cache()
    assert c.resume("A") and c.resize(4 * TPB)            # only A's slots: same stream, no wait
    assert [e for e in ops.log if e[0] == "wait" and e[2][0] != "B"] == []
    b.close()
    c.close()
