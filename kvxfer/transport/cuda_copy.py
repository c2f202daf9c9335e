"""Batched device copies and CUDA IPC memory handles, for the ``cuda_ipc`` backend and copy engines.

One plan becomes ONE operation on a stream: a Triton gather/scatter kernel over the descriptor
arrays where Triton is installed, else the driver's ``cuMemcpyBatchAsync`` (CUDA >= 12.8) called
through ``cuGetProcAddress`` with the descriptor arrays passed by pointer (no Python object per
descriptor), else one ``cuMemcpyAsync`` per descriptor. GPU-only: importing this module on a
machine without CUDA raises BackendUnavailable.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.errors import BackendUnavailable, TransferFailed

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise BackendUnavailable(f"cuda-python (cuda.bindings) is not installed: {exc}") from exc

U64 = npt.NDArray[np.uint64]

_IPC_HANDLE_BYTES = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1


def check(result: Any, what: str) -> Any:
    """Unwrap a cuda-python (err, *values) tuple, raising TransferFailed with the driver's error name."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        raise TransferFailed(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def make_current(device_id: int) -> None:
    """Make the device's primary context current in the calling thread: driver-API calls
    (cuIpcOpenMemHandle, cuMemcpyBatchAsync) fail with CUDA_ERROR_INVALID_CONTEXT in threads where
    no runtime call has run yet (workers call connect and post from their own threads)."""
    torch.cuda.set_device(device_id)
    dev = check(cu.cuDeviceGet(device_id), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")


# --- CUDA IPC handles ------------------------------------------------------------------------------
@dataclass(frozen=True)
class IpcRegion:
    """What a peer needs to map one registered device region: the allocation's IPC handle, the
    region's offset inside that allocation, and its size."""

    handle: bytes
    offset: int
    nbytes: int
    device_id: int

    def to_wire(self) -> list[Any]:
        return [self.handle, self.offset, self.nbytes, self.device_id]


def export_region(base_address: int, nbytes: int, device_id: int) -> IpcRegion:
    """The IPC description of device memory ``[base_address, base_address + nbytes)``.

    torch's caching allocator may place a tensor inside a larger cudaMalloc block; the handle names
    the whole block, so the offset of the region inside it travels along.
    """
    make_current(device_id)
    alloc_base, alloc_size = check(cu.cuMemGetAddressRange(base_address), "cuMemGetAddressRange")
    alloc_base = int(alloc_base)
    if base_address + nbytes > alloc_base + int(alloc_size):
        raise TransferFailed(f"region [{base_address:#x}, +{nbytes}) spans more than one CUDA allocation")
    handle = check(cu.cuIpcGetMemHandle(alloc_base), "cuIpcGetMemHandle")
    return IpcRegion(bytes(handle.reserved), base_address - alloc_base, nbytes, device_id)


class IpcMappings:
    """Opened peer allocations, one mapping per distinct handle, closed together."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._opened: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def open(self, region: IpcRegion) -> int:
        """The local device address of the peer region's first byte."""
        if len(region.handle) != _IPC_HANDLE_BYTES:
            raise TransferFailed(f"IPC handle of {len(region.handle)} bytes, expected {_IPC_HANDLE_BYTES}")
        with self._lock:
            base = self._opened.get(region.handle)
            if base is None:
                make_current(self.device_id)
                h = cu.CUipcMemHandle()
                h.reserved = region.handle
                base = int(check(cu.cuIpcOpenMemHandle(h, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                                 "cuIpcOpenMemHandle"))
                self._opened[region.handle] = base
        return base + region.offset

    def close(self) -> None:
        with self._lock:
            if self._opened:
                make_current(self.device_id)
            for base in self._opened.values():
                cu.cuIpcCloseMemHandle(base)
            self._opened.clear()


# --- batched copies --------------------------------------------------------------------------------
class _Attrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int), ("srcLocId", ctypes.c_int),
                ("dstLocType", ctypes.c_int), ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]


def _batch_fn() -> Any:
    """``cuMemcpyBatchAsync`` (CUDA 13 ABI, no failIdx) as a ctypes function, or None."""
    try:
        result = cu.cuGetProcAddress("cuMemcpyBatchAsync", 13000, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
        err, ptr = result[0], result[1]
        if int(err) != 0 or not int(ptr):
            return None
    except (AttributeError, TypeError):
        return None
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.POINTER(_Attrs), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return proto(int(ptr))


def _triton_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # Triton resolves annotations as kernel globals: only constexpr parameters may be annotated.
    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def copy_runs(src_ptrs, dst_ptrs, sizes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.program_id(0)
        start = tl.program_id(1) * CHUNK
        n = tl.load(sizes + i) // 4
        if start < n:
            src = tl.load(src_ptrs + i).to(tl.pointer_type(tl.int32))
            dst = tl.load(dst_ptrs + i).to(tl.pointer_type(tl.int32))
            for off in range(0, CHUNK, BLOCK):
                idx = start + off + tl.arange(0, BLOCK)
                mask = idx < n
                tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return copy_runs


class BatchedCopier:
    """Runs many (dst, src, nbytes) device copies as one operation on its own stream."""

    CHUNK_WORDS = 4096   # 16 KiB of int32 words per kernel program
    BLOCK_WORDS = 1024

    def __init__(self, device_id: int, method: str = "auto") -> None:
        self.device_id = device_id
        torch.cuda.set_device(device_id)
        self.stream = torch.cuda.Stream(device_id)  # type: ignore[no-untyped-call]
        self._kernel = _triton_kernel() if method in ("auto", "kernel") else None
        self._batch = _batch_fn() if method in ("auto", "batch") else None
        if method == "kernel" and self._kernel is None:
            raise BackendUnavailable("method='kernel' needs Triton, which is not installed")
        if method == "batch" and self._batch is None:
            raise BackendUnavailable("method='batch' needs cuMemcpyBatchAsync (CUDA driver >= 12.8)")
        self.method = "kernel" if self._kernel is not None else ("batch" if self._batch is not None else "loop")
        if self.method == "kernel":
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile the kernel now (Triton compiles on first launch: ~0.5 s that would otherwise
        land on the first transfer of a request)."""
        buf = torch.zeros(64, dtype=torch.uint8, device=f"cuda:{self.device_id}")
        addr = int(buf.data_ptr())
        self.copy(np.array([addr + 32], np.uint64), np.array([addr], np.uint64), np.array([32], np.uint64)).synchronize()

    def copy(self, dst: U64, src: U64, nbytes: U64) -> torch.cuda.Event:
        """Enqueue the copies; returns an event recorded after them on the copier's stream."""
        n = int(dst.size)
        make_current(self.device_id)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.device(self.device_id), torch.cuda.stream(self.stream):
            # Pages written by the model on the default stream must be complete before we read them.
            self.stream.wait_stream(torch.cuda.default_stream(self.device_id))
            if n:
                method = self.method
                if method == "kernel" and (int(np.bitwise_or.reduce(dst | src | nbytes)) & 3):
                    method = "batch" if self._batch is not None else "loop"  # the kernel moves 4-byte words
                if method == "kernel":
                    self._run_kernel(dst, src, nbytes)
                elif method == "batch":
                    self._run_batch(dst, src, nbytes)
                else:
                    handle = self.stream.cuda_stream
                    for d, s, b in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
                        check(cu.cuMemcpyAsync(d, s, b, handle), "cuMemcpyAsync")
            event.record(self.stream)
        return event

    def _run_kernel(self, dst: U64, src: U64, nbytes: U64) -> None:
        table = torch.from_numpy(np.stack([src, dst, nbytes]).view(np.int64)).to(f"cuda:{self.device_id}",
                                                                                 non_blocking=False)
        max_words = int(nbytes.max()) // 4
        grid = (int(dst.size), -(-max_words // self.CHUNK_WORDS))
        assert self._kernel is not None
        self._kernel[grid](table[0], table[1], table[2], CHUNK=self.CHUNK_WORDS, BLOCK=self.BLOCK_WORDS)

    def _run_batch(self, dst: U64, src: U64, nbytes: U64) -> None:
        d = np.ascontiguousarray(dst, dtype=np.uint64)
        s = np.ascontiguousarray(src, dtype=np.uint64)
        b = np.ascontiguousarray(nbytes, dtype=np.uint64)
        attrs = _Attrs(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _CU_MEM_LOCATION_TYPE_DEVICE, self.device_id,
                       _CU_MEM_LOCATION_TYPE_DEVICE, self.device_id, 0)
        idx = np.zeros(1, dtype=np.uint64)
        assert self._batch is not None
        rc = self._batch(d.ctypes.data, s.ctypes.data, b.ctypes.data, d.size, ctypes.byref(attrs),
                         idx.ctypes.data, 1, self.stream.cuda_stream)
        if rc != 0:
            raise TransferFailed(f"cuMemcpyBatchAsync of {d.size} copies failed with CUresult {rc}")
