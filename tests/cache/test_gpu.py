"""CUDA paths of the tiers and the copy engine: pinned host tier, cuda-python streams, batched copies.

Run with ``pytest -m gpu`` on a machine with a CUDA GPU and cuda-python; skipped with a reason elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.cache.copy_engine import CopyEngine
from kvxfer.cache.cuda_utils import cuda_usable
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.tiers import DiskTierStorage, open_host_tier, primary_tier_of
from tests.support.tier_helpers import fill_random, multi_pool_config, slot_bytes_of, whole_pool

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu_tiers(tmp_path):  # type: ignore[no-untyped-def]
    if not cuda_usable():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False or cuda-python (cuda.bindings) is missing")
    cfg = multi_pool_config(str(tmp_path), primary_slots=64, host_slots=48, disk_slots=40, device="cuda:0")
    manager = KVCacheManager(cfg)
    primary, host, disk = primary_tier_of(manager), open_host_tier(cfg), DiskTierStorage(cfg)
    for i, tier in enumerate((primary, host, disk)):
        fill_random(tier, 200 + i)
    yield {"primary": primary, "host": host, "disk": disk}
    host.close()
    disk.close()


def _copy_and_check(engine: CopyEngine, src, dst, seed: int, count: int = 12) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    for pg in src.layout.pool_groups:
        g = pg.pool_group_index
        s = rng.choice(pg.num_slots, count, replace=False)
        d = rng.choice(dst.layout.pool_groups[g].num_slots, count, replace=False)
        before = [whole_pool(dst, g, p.pool_index) for p in pg.pools]
        expect = [slot_bytes_of(src, g, p.pool_index, s) for p in pg.pools]
        engine.copy_slots(src, dst, g, s, d).wait(30)
        for p, old, exp in zip(pg.pools, before, expect, strict=True):
            old[d] = exp
            assert np.array_equal(whole_pool(dst, g, p.pool_index), old), f"{src.name}->{dst.name} {g}.{p.pool_index}"


def test_host_tier_is_pinned_on_cuda_machines(gpu_tiers) -> None:  # type: ignore[no-untyped-def]
    host = gpu_tiers["host"]
    assert host.memory_kind == "pinned"
    assert all(host.pool_tensor(pg.pool_group_index, p.pool_index).is_pinned()
               for pg in host.layout.pool_groups for p in pg.pools)
    assert gpu_tiers["primary"].memory_kind == "cuda"


@pytest.mark.parametrize("batch", [None, False])
def test_device_pinned_round_trip_exact_bytes(gpu_tiers, batch) -> None:  # type: ignore[no-untyped-def]
    primary, host = gpu_tiers["primary"], gpu_tiers["host"]
    with CopyEngine(cuda_batch=batch) as engine:
        _copy_and_check(engine, primary, host, seed=1)
        _copy_and_check(engine, host, primary, seed=2)
        stats = engine.stats
    assert stats.cuda_batch_supported is not None
    if batch is False:
        assert stats.cuda_batch_calls == 0 and stats.cuda_single_calls > 0
    elif stats.cuda_batch_supported:
        # the driver offers cuMemcpyBatchAsync: it must really be used, not silently replaced
        assert stats.cuda_fallback_reason is None, stats.cuda_fallback_reason
        assert stats.cuda_batch_calls == 4 and stats.cuda_single_calls == 0


def test_device_disk_round_trip_through_the_pinned_ring(gpu_tiers) -> None:  # type: ignore[no-untyped-def]
    primary, disk = gpu_tiers["primary"], gpu_tiers["disk"]
    with CopyEngine(staging_bytes=3 * 4096 * 8) as engine:
        _copy_and_check(engine, primary, disk, seed=3)
        _copy_and_check(engine, disk, primary, seed=4)
        assert engine.ring is not None and engine.ring.pinned
        assert engine.stats.ring_wraps > 0


def test_unaligned_byte_ranges_device_to_host(gpu_tiers) -> None:  # type: ignore[no-untyped-def]
    primary, host = gpu_tiers["primary"], gpu_tiers["host"]
    src_pool = primary.layout.pool_groups[0].pools[1]  # the small fp32 "scale" pool
    dst_pool = host.layout.pool_groups[0].pools[1]
    sizes = np.array([1, 7, 300, 65, 4097 % src_pool.slot_bytes + 1], dtype=np.uint64)
    src_off = np.array([3, 50, 1000, 2001, 4000], dtype=np.uint64)
    dst_off = np.array([0, 10, 500, 900, 1200], dtype=np.uint64)
    before = whole_pool(host, 0, 1).reshape(-1)
    src_bytes = whole_pool(primary, 0, 1).reshape(-1)
    with CopyEngine() as engine:
        engine.submit(primary, host, src_off + np.uint64(src_pool.base_address),
                      dst_off + np.uint64(dst_pool.base_address), sizes).wait(30)
    for so, do, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist(), strict=True):
        before[do:do + n] = src_bytes[so:so + n]
    assert np.array_equal(whole_pool(host, 0, 1).reshape(-1), before)
