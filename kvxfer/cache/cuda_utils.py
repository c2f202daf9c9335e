"""cuda-python pieces of the copy engine: one non-blocking stream, one event, batched async memcpy.

Uses the driver API of ``cuda.bindings`` on the CUDA primary context (the one torch uses), so
pointers from torch tensors and pinned host tensors are valid here. ``cuMemcpyBatchAsync`` turns a
whole batch of scattered runs into one driver call where the driver offers it (CUDA 12.8+; the
CUDA 13 bindings bind only the 13.0 revision); otherwise each coalesced run is one ``cuMemcpyAsync``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.errors import TierError

U64Array = npt.NDArray[np.uint64]

#: Runs per cuMemcpyBatchAsync call (bounds the argument lists built in Python).
MAX_RUNS_PER_BATCH = 8192


def cuda_usable() -> bool:
    """Whether torch sees a CUDA device and cuda-python's driver bindings import."""
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise TierError("CUDA copies need cuda-python (`pip install cuda-python`): cuda.bindings is missing") from exc
    return driver


def _check(result: Any, what: str) -> Any:
    """The call's outputs after the CUresult, or TierError naming the call and the CUDA error."""
    driver = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TierError(f"{what} failed: {_error_name(err)}")
    rest = result[1:] if isinstance(result, tuple) else ()
    return rest[0] if len(rest) == 1 else rest


def _error_name(err: Any) -> str:
    driver = _driver()
    try:
        res = driver.cuGetErrorName(err)
        if res[0] == driver.CUresult.CUDA_SUCCESS:
            return bytes(res[1]).decode()
    except (TypeError, ValueError):
        pass
    return str(err)


def bindings_major() -> int:
    """Major version of the installed cuda-python bindings."""
    import cuda.bindings

    return int(str(getattr(cuda.bindings, "__version__", "12")).split(".")[0])


class CudaCopier:
    """Stream-ordered copies between CUDA device and host pointers (any direction, UVA addressing).

    Not thread-safe: one owner thread calls ``make_current`` once and then issues every call.
    ``batch``: None = use cuMemcpyBatchAsync when the driver offers it; False = one cuMemcpyAsync per
    run; True = require the batched API (TierError when absent).
    """

    def __init__(self, device_id: int, *, batch: bool | None = None) -> None:
        driver = _driver()
        self.device_id = device_id
        _check(driver.cuInit(0), "cuInit")
        self._device = _check(driver.cuDeviceGet(device_id), f"cuDeviceGet({device_id})")
        self._context = _check(driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self._stream = _check(driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        self._event = _check(driver.cuEventCreate(int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        self.driver_version = int(_check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
        needed = 13000 if bindings_major() >= 13 else 12080
        self.batch_supported = hasattr(driver, "cuMemcpyBatchAsync") and self.driver_version >= needed
        if batch and not self.batch_supported:
            raise TierError(f"cuMemcpyBatchAsync requested but not offered (driver {self.driver_version}, "
                            f"cuda-python {bindings_major()}.x needs a driver >= {needed})")
        self.use_batch = self.batch_supported if batch is None else bool(batch)
        self.fallback_reason: str | None = None
        self.batch_calls = 0
        self.single_calls = 0
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attrs = [attr]
        self._closed = False

    def make_current(self) -> None:
        """Bind the primary context to the calling thread."""
        _check(_driver().cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def enqueue(self, dst: U64Array, src: U64Array, nbytes: U64Array) -> None:
        """Queue ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]`` on the stream (no ordering inside a call)."""
        driver = _driver()
        count = len(nbytes)
        for start in range(0, count, MAX_RUNS_PER_BATCH):
            sl = slice(start, min(count, start + MAX_RUNS_PER_BATCH))
            if self.use_batch and self._enqueue_batch(driver, dst[sl], src[sl], nbytes[sl]):
                continue
            for d, s, n in zip(dst[sl].tolist(), src[sl].tolist(), nbytes[sl].tolist(), strict=True):
                _check(driver.cuMemcpyAsync(driver.CUdeviceptr(d), driver.CUdeviceptr(s), n,
                                                 self._stream), f"cuMemcpyAsync({d:#x} <- {s:#x}, {n} bytes)")
                self.single_calls += 1

    def _enqueue_batch(self, driver: Any, dst: U64Array, src: U64Array, nbytes: U64Array) -> bool:
        """One cuMemcpyBatchAsync call; False (and batching switched off, reason kept) when the driver
        refuses it, so the caller copies the same runs one by one."""
        dsts = [driver.CUdeviceptr(x) for x in dst.tolist()]
        srcs = [driver.CUdeviceptr(x) for x in src.tolist()]
        try:
            result = driver.cuMemcpyBatchAsync(dsts, srcs, nbytes.tolist(), len(dsts), self._attrs, [0], 1,
                                               self._stream)
        except (TypeError, AttributeError) as exc:
            self.use_batch = False
            self.fallback_reason = f"cuMemcpyBatchAsync binding: {exc}"
            return False
        err = result[0] if isinstance(result, tuple) else result
        if err != driver.CUresult.CUDA_SUCCESS:
            self.use_batch = False
            self.fallback_reason = f"cuMemcpyBatchAsync returned {_error_name(err)}"
            return False
        self.batch_calls += 1
        return True

    def synchronize(self) -> None:
        """Wait until everything queued so far has completed (event recorded on the stream)."""
        driver = _driver()
        _check(driver.cuEventRecord(self._event, self._stream), "cuEventRecord")
        _check(driver.cuEventSynchronize(self._event), "cuEventSynchronize")

    def close(self) -> None:
        """Destroy the stream and event and release the primary context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        driver = _driver()
        driver.cuEventDestroy(self._event)
        driver.cuStreamDestroy(self._stream)
        driver.cuDevicePrimaryCtxRelease(self._device)
