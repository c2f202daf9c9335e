"""Lifetimes of the raw CUDA streams and events of ``kvxfer.cache.cuda_streams``: a ``cudaStream_t`` int
handed out by a stream holder stays a live stream after the holder is closed or collected (a KVCache
keeps the int it was resumed with and records on it when it closes), events go back to a pool, and no
destructor calls the driver. On the CPU a fake driver stands in for ``cuda.bindings`` and fails any
call on a destroyed handle, which on a real driver is a use after free."""

from __future__ import annotations

import gc
import itertools

import pytest

import kvxfer.cache.cuda_streams as cs
from kvxfer.cache._utils import CachedCudaEvent, CachedCudaStream, TemporaryCudaStream
from kvxfer.cache.common import CudaStream


class _Enum:
    def __init__(self, **values: int) -> None:
        self.__dict__.update(values)


class FakeDriver:
    """The driver calls ``cuda_streams`` makes, on integer handles; every call is logged."""

    CUresult = _Enum(CUDA_SUCCESS=0, CUDA_ERROR_INVALID_HANDLE=400, CUDA_ERROR_NOT_READY=600)
    CUevent_flags = _Enum(CU_EVENT_DISABLE_TIMING=2)
    CUstream_flags = _Enum(CU_STREAM_NON_BLOCKING=1)

    def __init__(self) -> None:
        self._ids = itertools.count(0x1000, 0x10)
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.destroyed: set[int] = set()
        self.calls: list[str] = []

    def _live(self, *handles: int) -> int:
        return 0 if all(h == 0 or h in self.streams | self.events for h in handles) else 400

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:
        self.calls.append("cuStreamCreate")
        h = next(self._ids)
        self.streams.add(h)
        return 0, h

    def cuStreamDestroy(self, stream: int) -> tuple[int]:
        self.calls.append("cuStreamDestroy")
        self.streams.discard(int(stream))
        self.destroyed.add(int(stream))
        return (0,)

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        self.calls.append("cuEventCreate")
        h = next(self._ids)
        self.events.add(h)
        return 0, h

    def cuEventDestroy(self, event: int) -> tuple[int]:
        self.calls.append("cuEventDestroy")
        self.events.discard(int(event))
        self.destroyed.add(int(event))
        return (0,)

    def cuEventRecord(self, event: int, stream: int) -> tuple[int]:
        self.calls.append("cuEventRecord")
        return (self._live(event, stream),)

    def cuEventQuery(self, event: int) -> tuple[int]:
        self.calls.append("cuEventQuery")
        return (self._live(event),)

    def cuEventSynchronize(self, event: int) -> tuple[int]:
        self.calls.append("cuEventSynchronize")
        return (self._live(event),)

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[int]:
        self.calls.append("cuStreamWaitEvent")
        return (self._live(stream, event),)

    def cuStreamSynchronize(self, stream: int) -> tuple[int]:
        self.calls.append("cuStreamSynchronize")
        return (self._live(stream),)


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """The fake driver, with fresh process pools (the real ones never see its handles)."""
    fake = FakeDriver()
    monkeypatch.setattr(cs, "_driver", lambda: fake)
    monkeypatch.setattr(cs, "init_cuda_once", lambda: None)
    monkeypatch.setattr(cs, "STREAM_POOL", cs.HandlePool(cs._new_stream))
    monkeypatch.setattr(cs, "EVENT_POOL", cs.HandlePool(cs._new_event))
    return fake


def test_handle_pool_reuses_what_was_given_back() -> None:
    made = itertools.count(1)
    pool: cs.HandlePool[int] = cs.HandlePool(lambda: next(made))
    a, b = pool.get(), pool.get()
    assert (a, b, pool.created, pool.free_count) == (1, 2, 2, 0)
    pool.put(a)
    assert pool.free_count == 1 and pool.get() == a and pool.created == 2
    assert pool.get() == 3 and pool.created == 3


def test_a_temporary_streams_handle_outlives_its_holder(drv: FakeDriver) -> None:
    """The reference's usage: a request resumed on ``TemporaryCudaStream().handle`` keeps that int
    after the ``with`` block, the holder is replaced by the next one, and the request closes later,
    recording on the int: it must still be a stream."""
    with TemporaryCudaStream([]) as s:
        kept = s.handle
    s.take_finish_event().synchronize()
    with TemporaryCudaStream([]) as s:        # the first holder is collected when ``s`` is rebound
        second = s.handle
    s.take_finish_event().synchronize()
    gc.collect()
    assert second != kept
    assert not drv.destroyed and "cuStreamDestroy" not in drv.calls
    closing = cs.CudaEvent(kept)               # what closing the request does on its stream
    closing.synchronize()
    assert closing.is_closed()
    with TemporaryCudaStream([]) as s:         # the pool hands the given-back stream out again
        assert s.handle in (kept, second)
    s.take_finish_event().synchronize()
    assert cs.STREAM_POOL.created == 2


def test_closing_a_stream_gives_it_back_without_a_driver_call(drv: FakeDriver) -> None:
    holder = CachedCudaStream()
    handle = holder.handle
    holder.record_event().synchronize()
    before = list(drv.calls)
    holder.close()
    holder.close()                             # idempotent
    assert holder.is_closed() and drv.calls == before
    assert cs.STREAM_POOL.free_count == 1 and CachedCudaStream().handle == handle


def test_events_go_back_to_the_pool(drv: FakeDriver) -> None:
    stream = CachedCudaStream().handle
    first = CachedCudaEvent(CudaStream(stream))
    handle = first._event
    assert first.query_complete() and first.is_closed()
    second = CachedCudaEvent(CudaStream(stream))
    assert second._event == handle and cs.EVENT_POOL.created == 1
    before = list(drv.calls)
    del second                                 # collected while recorded: back to the pool, no driver call
    gc.collect()
    assert drv.calls == before and cs.EVENT_POOL.free_count == 1
    assert not drv.destroyed


def test_an_event_whose_record_fails_goes_back_to_the_pool(drv: FakeDriver) -> None:
    with pytest.raises(cs.CuError, match="cuEventRecord"):
        cs.CudaEvent(0xdead)                   # not a stream
    assert cs.EVENT_POOL.free_count == 1 and cs.EVENT_POOL.created == 1


def test_waits_and_synchronization_use_live_handles(drv: FakeDriver) -> None:
    a, b = CachedCudaStream(), CachedCudaStream()
    ev = a.record_event()
    b.wait_events([ev, ev])
    assert drv.calls.count("cuStreamWaitEvent") == 1   # deduplicated
    a.close()
    b.synchronize()
    ev.wait_in_stream(b.handle)                # a's handle went back to the pool; b's and the event live on
    assert not drv.destroyed
