"""Raw CUDA streams and events as the reference design's API passes them around (``CudaStream`` is a
``cudaStream_t`` as an int): a non-blocking stream, a temporary worker stream that records a finish
event, and that event. Driver API of ``cuda.bindings`` on the primary context (the one torch uses).

Streams and events come from process-wide pools and go back to them when closed; nothing is ever
destroyed while the process runs. A ``cudaStream_t`` int outlives the object that handed it out (a
KVCache keeps the one it was resumed with and records on it when it closes), so destroying the stream
on close would leave that int naming freed driver memory; and a destructor that only returns a handle
to a pool makes no driver call during interpreter shutdown."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

import torch

from kvxfer.cache.common import CudaStream
from kvxfer.errors import CuError, TierError

H = TypeVar("H")


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise TierError("CUDA streams need cuda-python (`pip install cuda-python`): cuda.bindings is missing") from exc
    return driver


def _check(result: Any, what: str) -> Any:
    drv = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != int(drv.CUresult.CUDA_SUCCESS):
        raise CuError(f"{what} failed: {err!r}", err)
    return rest[0] if len(rest) == 1 else tuple(rest)


@functools.cache
def init_cuda_once() -> None:
    """Make the primary CUDA context current (TierError where the machine has no CUDA device)."""
    if not torch.cuda.is_available():
        raise TierError("init_cuda_once: no CUDA device is available")
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()


class HandlePool(Generic[H]):
    """Driver handles made on demand and reused, never destroyed: ``get`` takes a free one (or makes
    one), ``put`` gives it back. A handle once made stays valid for the life of the process, so an int
    copied out of a closed holder still names a live stream or event (it may have a new holder)."""

    def __init__(self, create: Callable[[], H]) -> None:
        self._create = create
        self._free: list[H] = []   # list.pop and list.append are atomic: no lock a destructor could wait on
        self.created = 0

    def get(self) -> H:
        """A free handle, or a new one."""
        try:
            return self._free.pop()
        except IndexError:
            pass
        handle = self._create()
        self.created += 1
        return handle

    def put(self, handle: H) -> None:
        """Give ``handle`` back for a later ``get`` (no driver call)."""
        self._free.append(handle)

    @property
    def free_count(self) -> int:
        """Handles waiting in the pool."""
        return len(self._free)


def _new_event() -> Any:
    drv = _driver()
    return _check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")


def _new_stream() -> CudaStream:
    init_cuda_once()
    drv = _driver()
    return CudaStream(int(_check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")))


#: The process's timing-free events and non-blocking streams.
EVENT_POOL: HandlePool[Any] = HandlePool(_new_event)
STREAM_POOL: HandlePool[CudaStream] = HandlePool(_new_stream)


class CudaEvent:
    """A timing-free CUDA event recorded on a stream when created; closed once complete."""

    __slots__ = ("_event",)

    def __init__(self, stream: CudaStream | int) -> None:
        self._event: Any = None
        event = EVENT_POOL.get()
        try:
            _check(_driver().cuEventRecord(event, int(stream)), "cuEventRecord")
        except BaseException:
            EVENT_POOL.put(event)
            raise
        self._event = event

    def is_closed(self) -> bool:
        """Whether the event was released (it completed and was synchronized or queried)."""
        return self._event is None

    def close(self) -> None:
        """Give the event back to the pool (no driver call: a stream still waiting on it is unaffected,
        as a later record only changes what later waits see)."""
        event, self._event = self._event, None
        if event is not None:
            EVENT_POOL.put(event)

    def query_complete(self) -> bool:
        """Whether the work before the event is done (a closed event is)."""
        if self._event is None:
            return True
        drv = _driver()
        (err,) = drv.cuEventQuery(self._event)
        if int(err) == int(drv.CUresult.CUDA_ERROR_NOT_READY):
            return False
        _check(err, "cuEventQuery")
        self.close()
        return True

    def synchronize(self) -> None:
        """Block until the work before the event is done, then release it."""
        if self._event is not None:
            _check(_driver().cuEventSynchronize(self._event), "cuEventSynchronize")
            self.close()

    def wait_in_stream(self, stream: CudaStream | int) -> None:
        """Make ``stream`` wait for the event."""
        if self._event is not None:
            _check(_driver().cuStreamWaitEvent(int(stream), self._event, 0), "cuStreamWaitEvent")

    def __del__(self) -> None:
        if getattr(self, "_event", None) is not None:
            self.close()


class CachedCudaEvent(CudaEvent):
    """The reference design's event name: a ``CudaEvent`` recorded on a stream when created, with
    ``NULL``, an event that is already complete (waiting on it or synchronizing does nothing)."""

    NULL: ClassVar[CachedCudaEvent]

    @classmethod
    def completed(cls) -> CachedCudaEvent:
        """An event with nothing to wait for (what ``NULL`` is)."""
        event = cls.__new__(cls)
        event._event = None
        return event


CachedCudaEvent.NULL = CachedCudaEvent.completed()


def memcpy_async(dst: Iterable[int], src: Iterable[int], num_bytes: int, stream: CudaStream | int) -> int:
    """Queue a copy of ``num_bytes`` bytes from each ``src[i]`` to ``dst[i]`` (device or pinned/registered
    host addresses, any direction) on ``stream``; returns how many copies were queued."""
    drv = _driver()
    count = 0
    for d, s in zip(dst, src, strict=True):
        _check(drv.cuMemcpyAsync(drv.CUdeviceptr(int(d)), drv.CUdeviceptr(int(s)), int(num_bytes), int(stream)),
               f"cuMemcpyAsync({int(d):#x} <- {int(s):#x}, {num_bytes} bytes)")
        count += 1
    return count


class CachedCudaStream:
    """A non-blocking CUDA stream held from the process's pool (``close`` gives it back; it is never
    destroyed, so its ``handle`` int stays a valid stream after this object is gone)."""

    def __init__(self) -> None:
        self._handle: CudaStream | None = STREAM_POOL.get()

    @property
    def handle(self) -> CudaStream:
        """The ``cudaStream_t`` as an int."""
        if self._handle is None:
            raise TierError("CachedCudaStream: the stream was closed")
        return self._handle

    def get(self) -> CudaStream:
        """``handle``."""
        return self.handle

    def is_closed(self) -> bool:
        """Whether the stream was given back."""
        return self._handle is None

    def wait_events(self, events: Iterable[CudaEvent]) -> None:
        """Make the stream wait for every event."""
        for event in set(events):
            event.wait_in_stream(self.handle)

    def record_event(self) -> CudaEvent:
        """A new event recorded on the stream."""
        return CudaEvent(self.handle)

    def synchronize(self) -> None:
        """Block until the stream's work is done."""
        _check(_driver().cuStreamSynchronize(int(self.handle)), "cuStreamSynchronize")

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, int(self.handle)

    def close(self) -> None:
        """Give the stream back to the pool; work queued on it runs on (no driver call)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            STREAM_POOL.put(handle)

    def __del__(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self.close()


class TemporaryCudaStream(CachedCudaStream):
    """A worker stream that first waits for ``prior_events``; leaving its ``with`` block normally
    records a finish event, which ``take_finish_event()`` hands over (a warning if never taken)."""

    def __init__(self, prior_events: Iterable[CudaEvent]) -> None:
        super().__init__()
        self.wait_events(prior_events)
        self._finish_event: CudaEvent | None = None

    def take_finish_event(self) -> CudaEvent:
        """The finish event (TierError when the block did not finish normally or it was taken)."""
        if self._finish_event is None:
            raise TierError("TemporaryCudaStream: no finish event to take")
        event, self._finish_event = self._finish_event, None
        return event

    def __enter__(self) -> TemporaryCudaStream:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._finish_event = self.record_event()

    def __del__(self) -> None:
        if getattr(self, "_finish_event", None) is not None:
            warnings.warn("TemporaryCudaStream: finish event recorded but never taken", stacklevel=1)
        super().__del__()
