"""The reference manager API on CUDA memory: a KVCacheManagerConfig with a GPU level puts the pools on
the device, raw cudaStream_t handles order the work, and bytes written at the published page addresses
are what the buffer views read, through a suspend that offloads them to host memory and a resume.

Run with ``pytest -m gpu`` on a machine with a CUDA GPU and cuda-python; skipped with a reason elsewhere.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvxfer.cache import (
    GPU_LEVEL,
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerGroupId,
    LayerId,
    PageIndexMode,
)
from kvxfer.cache._utils import CachedCudaStream, TemporaryCudaStream
from kvxfer.cache.cuda_utils import cuda_usable

pytestmark = pytest.mark.gpu
TPB = 8
KEY = DataRole("key")
BLOCK = 4096


@pytest.fixture
def manager() -> KVCacheManager:
    if not cuda_usable():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False or cuda-python (cuda.bindings) is missing")
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB,
        cache_tiers=[GpuCacheTierConfig(8 * BLOCK), HostCacheTierConfig(16 * BLOCK)],
        layers=[AttentionLayerConfig(LayerId(0), [BufferConfig(KEY, BLOCK)])])
    return KVCacheManager(cfg)


def _fill_page(mgr: KVCacheManager, slot: int, value: int, stream: int) -> None:
    base = mgr.get_mem_pool_base_address(LayerId(0), KEY)
    stride = mgr.get_page_stride(LayerId(0), KEY)
    scale = mgr.get_page_index_scale(LayerId(0), KEY)
    address = base + stride * slot * scale
    pages = mgr.buffer_view(0, "key").view(-1)
    offset = address - pages.data_ptr()
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):  # type: ignore[no-untyped-call]
        pages[offset:offset + stride].fill_(value)


def test_pages_written_at_published_addresses_survive_offload_and_resume(manager: KVCacheManager) -> None:
    mgr = manager
    assert mgr.buffer_view(0, "key").is_cuda and mgr.get_quota(GPU_LEVEL) == 8 * BLOCK
    lg = LayerGroupId(0)
    with TemporaryCudaStream([]) as worker:
        stream = worker.handle
        kv = mgr.create_kv_cache()
        assert kv.resume(stream) and kv.cuda_stream == stream and kv.resize(4 * TPB)
        slots = list(kv.get_base_page_indices(lg))
        for i, slot in enumerate(slots):
            _fill_page(mgr, slot, 11 + i, stream)
        kv.commit(list(range(4 * TPB)))
        kv.suspend()
        other = mgr.create_kv_cache()
        assert other.resume(stream) and other.resize(8 * TPB)     # all primary slots: kv's pages go to host
        assert all(int(t) == 1 for t in kv.page_tiers(0))
        other.close()
        assert kv.resume(stream)
    worker.take_finish_event().synchronize()
    view = mgr.buffer_view(0, "key")
    for i, slot in enumerate(kv.get_base_page_indices(lg)):
        assert bool((view[slot] == 11 + i).all())
    pool_base = mgr.get_mem_pool_base_address(LayerId(0), KEY, PageIndexMode.PER_LAYER)
    conv = mgr.get_page_index_converter(LayerId(0), KEY)
    stride = mgr.get_page_stride(LayerId(0), KEY)
    assert [pool_base + stride * p for p in conv(kv.get_base_page_indices(lg), PageIndexMode.PER_LAYER)] == \
        [mgr.get_mem_pool_base_address(LayerId(0), KEY) + stride * s * mgr.get_page_index_scale(LayerId(0), KEY)
         for s in kv.get_base_page_indices(lg)]
    kv.close()
    mgr.shutdown()


def test_an_active_caches_new_stream_waits_for_its_old_one(manager: KVCacheManager) -> None:
    old, new = torch.cuda.Stream(), torch.cuda.Stream()
    kv = manager.create_kv_cache()
    assert kv.resume(old.cuda_stream) and kv.resize(TPB)
    with torch.cuda.stream(old):
        torch.cuda._sleep(2_000_000_000)           # the old stream's work: about a second of spinning
    kv.cuda_stream = new.cuda_stream
    after = torch.cuda.Event()
    after.record(new)
    assert not after.query()                       # queued behind the old stream's work
    after.synchronize()
    assert old.query()
    kv.close()


def test_a_request_closes_on_its_stream_after_the_streams_holder_is_gone(manager: KVCacheManager) -> None:
    """The reference's usage: a request resumed on ``TemporaryCudaStream([]).handle`` outlives that
    ``with`` block and the holder (rebound to the next temporary stream), then closes, recording its
    ready event on the int it was given: the int must still be a live stream."""
    from cuda.bindings import driver

    kv = manager.create_kv_cache()
    with TemporaryCudaStream([]) as s:
        first = s.handle
        assert kv.resume(first) and kv.resize(2 * TPB) and kv.cuda_stream == first
        _fill_page(manager, kv.get_base_page_indices(LayerGroupId(0))[0], 3, first)
    s.take_finish_event().synchronize()
    with TemporaryCudaStream([]) as s:                   # the first holder is collected when ``s`` is rebound
        second = s.handle
        other = manager.create_kv_cache()
        assert other.resume(second) and other.resize(2 * TPB)
        other.close()
    s.take_finish_event().synchronize()
    del s
    gc.collect()
    (err,) = driver.cuStreamQuery(first)
    assert int(err) == int(driver.CUresult.CUDA_SUCCESS)
    kv.close()                                           # records on ``first``
    torch.cuda.synchronize()
    reused = {CachedCudaStream().handle, CachedCudaStream().handle}
    assert first in reused or second in reused           # given back to the pool, not destroyed


def _config() -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=TPB,
        cache_tiers=[GpuCacheTierConfig(8 * BLOCK), HostCacheTierConfig(16 * BLOCK)],
        layers=[AttentionLayerConfig(LayerId(0), [BufferConfig(KEY, BLOCK)])])


def test_a_new_managers_pools_are_zeroed_before_a_requests_stream_writes_them() -> None:
    """The pools' zero fill runs on the creating thread's stream; a request's (non-blocking) stream is not
    ordered after it, so the manager waits for it: a page written right after creation keeps its bytes
    even when that stream was busy (about 0.1 s of GPU time queued ahead of the fill)."""
    if not cuda_usable():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False or cuda-python (cuda.bindings) is missing")
    torch.cuda._sleep(200_000_000)   # type: ignore[no-untyped-call]
    mgr = KVCacheManager(_config())
    with TemporaryCudaStream([]) as s:
        kv = mgr.create_kv_cache()
        assert kv.resume(s.handle) and kv.resize(2 * TPB)
        slots = list(kv.get_base_page_indices(LayerGroupId(0)))
        for i, slot in enumerate(slots):
            _fill_page(mgr, slot, 40 + i, s.handle)
    s.take_finish_event().synchronize()
    torch.cuda.synchronize()
    view = mgr.buffer_view(0, "key")
    assert [bool((view[slot] == 40 + i).all()) for i, slot in enumerate(slots)] == [True] * len(slots)
    kv.close()
    mgr.shutdown()


def test_pages_moved_below_a_smaller_slot_count_land_before_their_request_writes_them(
        manager: KVCacheManager) -> None:
    """``rebalance_slots`` copies live pages above the new count to free slots below it on the calling
    thread's stream; the request resuming on its own stream afterwards must find them there and its later
    writes must not be overwritten by a copy still in flight (the current stream busy for ~0.1 s first)."""
    mgr, lg = manager, LayerGroupId(0)
    with TemporaryCudaStream([]) as s:
        low, high = mgr.create_kv_cache(), mgr.create_kv_cache()
        assert low.resume(s.handle) and low.resize(6 * TPB)
        assert high.resume(s.handle) and high.resize(2 * TPB)
        before = [int(x) for x in high.get_base_page_indices(lg)]
        assert min(before) >= 4, f"the second request's pages should sit above slot 4, got {before}"
        for i, slot in enumerate(before):
            _fill_page(mgr, slot, 21 + i, s.handle)
        low.close()
        high.suspend()
    s.take_finish_event().synchronize()
    torch.cuda._sleep(200_000_000)   # type: ignore[no-untyped-call]
    mgr.rebalance_slots([4])
    with TemporaryCudaStream([]) as s:
        assert high.resume(s.handle)
        after = [int(x) for x in high.get_base_page_indices(lg)]
        assert max(after) < 4 and all(int(t) == 0 for t in high.page_tiers(0))
        _fill_page(mgr, after[0], 99, s.handle)
    s.take_finish_event().synchronize()
    torch.cuda.synchronize()
    view = mgr.buffer_view(0, "key")
    assert bool((view[after[0]] == 99).all()) and bool((view[after[1]] == 22).all())
    high.close()
    mgr.shutdown()
