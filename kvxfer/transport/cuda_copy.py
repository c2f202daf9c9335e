"""Batched device copies and CUDA IPC memory handles, for the ``cuda_ipc`` backend.

One plan becomes ONE kernel launch on the copier's own stream, preceded by ONE host-to-device copy
of the plan's arrays (source and destination addresses, lengths, peer region ids) from a pinned
staging buffer; a plan of more than ``PIPELINE_RUNS`` runs is launched in a few parts of growing size,
each part's table uploaded on a second stream while the GPU copies the part before it. The peer's addresses are translated on the GPU through a per-peer table of
``mapped - advertised`` offsets uploaded once at connect (``RegionTable``), so the post path does no
per-descriptor work in Python: it copies the plan's arrays into the staging buffer and launches. The
same tables hold each region's bounds (the local regions' too): the kernel copies no run outside its
regions, which lets the transport check a large plan while the GPU copies it.

The kernel (Triton, ``copy_kernels``) gives every program one ``CHUNK``-byte piece of one run, the programs
of one run consecutive (``RUN_MAJOR``), so a 4 MiB run is spread over 128 programs like 128 runs of 32 KiB; runs much longer than
the rest are cut on the host first (``TransferPlan.split``), so no program gets a long run while
others idle. 16-byte aligned runs move as 16-byte vectors with ``BLOCK`` words per program in
flight; any other run moves byte by byte (correct, slower; KV runs are 16-byte multiples).
A block plan of short, aligned runs (a re-layout's head rows or token slices: 256 B - 16 KiB) goes to
``copy_block_runs_packed`` instead, which gives each program as many whole runs as fill one piece.
Triton compiles each kernel variant once; launches then go straight to ``cuLaunchKernel`` with
the arguments packed into one buffer (``_DriverLaunch``; the compiled kernel's own launcher where the
driver's parameter list is not the expected one). Without Triton the driver's ``cuMemcpyBatchAsync``
(CUDA >= 12.8) runs the plan, else one
``cuMemcpyAsync`` per run; plans of at most ``DIRECT_RUNS`` runs (one KV block: latency, not
bandwidth) always take one ``cuMemcpyAsync`` per run, which starts the GPU sooner than any launch.
GPU-only: importing this module without cuda-python raises BackendUnavailable.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.errors import BackendUnavailable, TransferFailed
from kvxfer.pagetable import BlockPlan, ops
from kvxfer.pagetable.affine import AffineGroups

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise BackendUnavailable(f"cuda-python (cuda.bindings) is not installed: {exc}") from exc

log = logging.getLogger(__name__)

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]

_IPC_HANDLE_BYTES = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
#: Bytes one kernel program copies (one piece of one run).
CHUNK_BYTES = 32 << 10
#: 4-byte words one program loads before it stores them: a whole 32 KiB piece in flight per program (faster
#: than 16 KiB steps for identical and TP plans alike; BENCHMARKS.md, "the copy kernel's constants").
BLOCK_WORDS = 8192
#: Warps per program.
NUM_WARPS = 4
#: Programs of one run are consecutive (1-D grid of runs x pieces) rather than one per (run, piece) of a
#: 2-D grid, so the programs running at once copy a few runs' contiguous bytes (``copy_kernels``). False
#: is kept to compare the two orders.
RUN_MAJOR = True
#: Plans of at most this many runs are one ``cuMemcpyAsync`` per run: a few microseconds each, where
#: the kernel path (pack, upload, Triton launch) costs ~50 us before the GPU starts (one KV block).
DIRECT_RUNS = 8
#: Plans of more runs than this are launched in parts (the first ``FIRST_PART_RUNS`` runs, then parts
#: ``PART_GROWTH`` times larger each), so the GPU copies while the host packs the rest: packing costs
#: ~1-2 ns per run on the host, copying a 32 KiB run ~16 ns on the GPU.
PIPELINE_RUNS = 16384
FIRST_PART_RUNS = 8192
PART_GROWTH = 4
_MAX_PARTS = 64   # parts of a plan of < 2**63 runs at growth 4 from 8,192 (a bound for the table's size)
#: Block plans whose runs are all at most this long and 16-byte aligned go to ``copy_block_runs_packed``:
#: several runs per program, each program still moving up to ``4 * BLOCK_WORDS`` bytes (re-layouts cut KV into
#: 256 B - 16 KiB runs, which one run per program copies at a small fraction of the device's bandwidth).
PACKED_RUN_BYTES = CHUNK_BYTES // 2
#: Packed programs take runs of one block each on a 2-D grid (template chunk x block: its template entries
#: read in order, no division per run; ``copy_block_runs_tiled``) instead of consecutive runs of the whole
#: plan (``copy_block_runs_packed``, measured in BENCHMARKS.md). False until the tiled order is measured
#: against it on a GPU (``benchmarks/bench_gpu.py --packed-tiled``).
PACKED_TILED = False
#: Packed block plans whose template cuts into affine groups (``kvxfer.pagetable.affine``) of at least
#: ``GROUP_MIN_RUNS`` runs on average go to ``copy_block_groups``: each group's addresses are formed from a
#: dozen numbers and its bounds checked once, not per run (posts; prepared copies keep the packed kernels).
#: False until measured against the packed kernels on a GPU (``benchmarks/bench_gpu.py --packed-groups``).
PACKED_GROUPS = False
GROUP_MIN_RUNS = 8
#: int64 fields of one group in ``copy_block_groups``'s table (``_GroupTable``).
GROUP_FIELDS = 16
#: Largest run the kernel takes in one row of its grid (its length travels as int32).
_MAX_RUN_BYTES = 1 << 30
_MAX_GRID_Y = 65535


def check(result: Any, what: str) -> Any:
    """Unwrap a cuda-python (err, *values) tuple, raising TransferFailed with the driver's error name."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        raise TransferFailed(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


_current = threading.local()


def make_current(device_id: int) -> None:
    """Make the device's primary context current in the calling thread: driver-API calls
    (cuIpcOpenMemHandle, cuMemcpyBatchAsync) fail with CUDA_ERROR_INVALID_CONTEXT in threads where
    no runtime call has run yet (workers call connect and post from their own threads). Done once
    per (thread, device); later calls cost one attribute lookup."""
    if getattr(_current, "device", None) == device_id and torch.cuda.current_device() == device_id:
        return
    torch.cuda.set_device(device_id)
    dev = check(cu.cuDeviceGet(device_id), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
    _current.device = device_id


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL | None:
    """The driver library for the post path's few calls (a ctypes call costs ~1 us where a
    cuda-python call or Triton's launcher costs several; all of them release the GIL). None when it
    cannot be loaded or lacks a symbol: callers then use cuda-python and Triton's launcher."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        p, u, size = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        for name, args in (("cuLaunchKernel", [p, u, u, u, u, u, u, u, p, p, p]),
                           ("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, p, size, p]),
                           ("cuMemcpyAsync", [ctypes.c_uint64, ctypes.c_uint64, size, p]),
                           ("cuFuncGetParamInfo", [p, size, ctypes.POINTER(size), ctypes.POINTER(size)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


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


# --- the copy kernel -------------------------------------------------------------------------------
class _Pointer:
    """A device address typed for a Triton launch (Triton reads ``data_ptr()`` and ``dtype``), so a
    slice of a table needs no torch view per launch."""

    __slots__ = ("_addr", "dtype")

    def __init__(self, addr: int, dtype: torch.dtype) -> None:
        self._addr = addr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._addr


#: Struct codes of the copy kernels' non-constexpr parameters, each in an 8-byte slot. ``copy_runs``:
#: seven table pointers, the two region counts and the pieces per run (int32), two anchor pointers and the
#: anchor address (int64); ``copy_block_runs``: eleven table pointers, the runs per block, the two region
#: counts and the pieces per run.
_KERNEL_PARAMS = ("Q",) * 7 + ("i4x",) * 3 + ("Q", "Q", "q")
_BLOCK_KERNEL_PARAMS = ("Q",) * 11 + ("i4x",) * 4 + ("Q", "Q", "q")
#: ``copy_block_groups``: six table pointers, the two region counts, the anchor pointer and address.
_GROUP_KERNEL_PARAMS = ("Q",) * 6 + ("i4x",) * 2 + ("Q", "q")
#: Most programs of one launch (a 1-D grid's x dimension).
_MAX_GRID_X = (1 << 31) - 1


def _grid(runs: int, pieces: int, run_major: bool) -> tuple[int, int]:
    """The launch grid of ``runs`` runs of ``pieces`` pieces (``RUN_MAJOR``: one dimension)."""
    if not run_major:
        return runs, pieces
    if runs * pieces > _MAX_GRID_X:
        raise TransferFailed(f"a copy of {runs} runs x {pieces} pieces is more than {_MAX_GRID_X} programs")
    return runs * pieces, 1


class _DriverLaunch:
    """One compiled kernel variant launched straight through ``cuLaunchKernel``: its arguments are
    packed into one preallocated buffer (``struct``), so a launch is two C calls, fewer than Triton's
    launcher makes: every Python call counts where the host's caches are cold between transfers.
    The parameter list is the driver's (``cuFuncGetParamInfo``): ours, then Triton's hidden scratch
    pointers, passed as NULL; any other shape raises ValueError and Triton's launcher is used."""

    name = "driver"

    def __init__(self, compiled: Any, lib: ctypes.CDLL, params: tuple[str, ...] = _KERNEL_PARAMS) -> None:
        meta = compiled.metadata
        for attr, ok in (("global_scratch_size", 0), ("profile_scratch_size", 0), ("num_ctas", 1)):
            if getattr(meta, attr, ok) != ok:
                raise ValueError(f"kernel metadata {attr}={getattr(meta, attr)!r}")
        if getattr(compiled, "function", None) is None:
            compiled._init_handles()
        self._fn = ctypes.c_void_p(int(compiled.function))
        sizes: list[int] = []
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        while len(sizes) < 64 and lib.cuFuncGetParamInfo(self._fn, len(sizes), ctypes.byref(offset),
                                                         ctypes.byref(size)) == 0:
            sizes.append(int(size.value))
        mine = len(params)
        want = tuple(4 if code.startswith("i") else 8 for code in params)
        if tuple(sizes[:mine]) != want or any(s != 8 for s in sizes[mine:]):
            raise ValueError(f"kernel parameters of {sizes} bytes, expected {list(want)} + hidden pointers")
        self._buf = ctypes.create_string_buffer(8 * len(sizes))      # hidden pointers stay 0 (NULL)
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * len(sizes))(*[base + 8 * i for i in range(len(sizes))])
        self._pack = struct.Struct("<" + "".join(params)).pack_into
        self._launch = lib.cuLaunchKernel
        self._threads = 32 * int(meta.num_warps)
        self._shared = int(meta.shared)

    def __call__(self, grid_x: int, grid_y: int, stream: int, args: tuple[int, ...]) -> None:
        self._pack(self._buf, 0, *args)
        rc = self._launch(self._fn, grid_x, grid_y, 1, self._threads, 1, 1, self._shared, stream, self._params, None)
        if rc != 0:
            raise TransferFailed(f"cuLaunchKernel of the copy kernel ({grid_x} x {grid_y} programs) failed: CUresult {rc}")

    def bind(self, grid_x: int, grid_y: int, stream: int, args: tuple[int, ...]) -> _BoundLaunch:
        """This launch with ``args`` packed now into a parameter buffer of its own (a prepared copy's)."""
        buf = ctypes.create_string_buffer(len(self._buf))
        self._pack(buf, 0, *args)
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(self._params))(*[base + 8 * i for i in range(len(self._params))])
        u = ctypes.c_uint
        call = functools.partial(self._launch, self._fn, u(grid_x), u(grid_y), u(1), u(self._threads), u(1), u(1),
                                 u(self._shared), ctypes.c_void_p(stream), params, None)
        return _BoundLaunch(call, buf, f"{grid_x} x {grid_y} programs")


class _BoundLaunch:
    """A driver launch whose arguments were converted and packed once: each call is one ``cuLaunchKernel``
    (ctypes through ``functools.partial``), no Python work per argument on a prepared copy's post, where
    every Python call counts twice over when the host's caches are cold."""

    __slots__ = ("_buf", "_call", "_what")

    def __init__(self, call: Any, buf: Any, what: str) -> None:
        self._call = call
        self._buf = buf     # the parameters' memory: the pointer array holds its addresses
        self._what = what

    def __call__(self) -> None:
        rc = self._call()
        if rc != 0:
            raise TransferFailed(f"cuLaunchKernel of a prepared copy ({self._what}) failed: CUresult {rc}")


class _TritonLaunch:
    """One compiled kernel variant launched through Triton's own launcher (the compiled kernel's)."""

    name = "triton"

    def __init__(self, compiled: Any, constexprs: tuple[Any, ...]) -> None:
        self._compiled = compiled
        self._constexprs = constexprs

    def __call__(self, grid_x: int, grid_y: int, stream: int, args: tuple[int, ...]) -> None:
        self._compiled[(grid_x, grid_y, 1)](*args, *self._constexprs, stream=stream)


def _triton_kernel() -> Any:
    """The run-list kernel (``copy_kernels.copy_runs``), or None without Triton."""
    module = _kernels_module()
    return None if module is None else module.copy_runs


def _kernels_module() -> Any:
    """The kernels' module (``copy_kernels``), or None without Triton."""
    try:
        from kvxfer.transport import copy_kernels
    except ImportError:
        return None
    return copy_kernels


#: Region bounds a table holds when the caller gives none (internal callers with trusted plans).
_UNBOUNDED = (0, (1 << 63) - 1)


class RegionTable:
    """Per set of regions, on the device: ``mapped - advertised`` (mod 2**64) of each, so the kernel turns
    a peer's advertised address into the local mapping's address, and each region's advertised
    [start, end), so it copies no run outside its region (``bounded``: a table made without ``nbytes``
    lets every address through and is for callers whose plans are trusted)."""

    def __init__(self, advertised: U64, mapped: U64, device_id: int, nbytes: U64 | None = None) -> None:
        self.host = (mapped - advertised).astype(np.uint64)
        self.count = int(advertised.size)
        if nbytes is None:
            lo, hi = np.full(self.count, _UNBOUNDED[0], np.int64), np.full(self.count, _UNBOUNDED[1], np.int64)
        else:
            end = [int(a) + int(b) for a, b in zip(advertised.tolist(), nbytes.tolist(), strict=True)]
            if max(end, default=0) >= 1 << 63:
                raise TransferFailed(f"a region ends at {max(end):#x}, past the kernel's signed 64-bit bounds")
            lo, hi = advertised.astype(np.int64), np.array(end, np.int64)
        self.bounded = nbytes is not None
        #: Every region's translation keeps 16-byte alignment (what the packed block kernel assumes).
        self.aligned = bool(np.all(self.host % np.uint64(16) == 0))
        rows = np.stack([self.host.view(np.int64), lo, hi], axis=1)
        self.device = torch.from_numpy(np.ascontiguousarray(rows).reshape(-1)).to(f"cuda:{device_id}")

    def translate(self, addr: U64, region: U32) -> U64:
        """The local addresses of the peer's ``addr`` (host side, for the non-kernel methods)."""
        out: U64 = addr + self.host[region]
        return out


class _Staging:
    """Pinned host buffers the plan's arrays are packed into before their one upload; a buffer is
    reused only after the upload that last read it has completed (its event)."""

    #: Bytes of each buffer allocated up front: plans of up to ~260,000 runs never allocate pinned
    #: memory (a millisecond each) on the post path.
    INITIAL_BYTES = 4 << 20

    def __init__(self, count: int = 4) -> None:
        self._bufs = [self._alloc(self.INITIAL_BYTES) for _ in range(count)]
        self._count = count
        self._next = 0

    def take(self, nbytes: int) -> tuple[npt.NDArray[np.uint8], int, Any]:
        """(numpy view, address, event to record after the upload) of a buffer of >= nbytes."""
        i = self._next
        self._next = (self._next + 1) % self._count
        tensor, view, event = self._bufs[i]
        event.synchronize()
        if view.size < nbytes:
            self._bufs[i] = self._alloc(nbytes)
            tensor, view, event = self._bufs[i]
        return view, int(tensor.data_ptr()), event

    @staticmethod
    def _alloc(nbytes: int) -> tuple[torch.Tensor, npt.NDArray[np.uint8], Any]:
        size = max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return tensor, tensor.numpy(), torch.cuda.Event()  # type: ignore[no-untyped-call]


class _DeviceTable:
    """The device copy of the packed plan arrays; one buffer, grown on demand. Uploads and kernels
    run in order on the copier's stream, so an upload never overwrites a table a kernel still reads."""

    def __init__(self, device_id: int, stream: torch.cuda.Stream) -> None:
        self._device = f"cuda:{device_id}"
        self._stream = stream
        self._buf = self._alloc(1 << 16)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        # Used on the copier's stream: when replaced, torch's allocator must not hand it out again
        # before the kernels queued there that read it have run.
        buf.record_stream(self._stream)
        return buf

    def address(self, nbytes: int) -> int:
        if self._buf.numel() < nbytes:
            self._buf = self._alloc(1 << (nbytes - 1).bit_length())
        return int(self._buf.data_ptr())


# --- packed plan tables ----------------------------------------------------------------------------
def _cut_long_runs(dst: U64, src: U64, nbytes: U64, region: U32, local_region: U32
                   ) -> tuple[U64, U64, U64, U32, U32, int]:
    """The runs as the kernel's grid takes them, and its pieces per run: long runs are cut on the host when
    the grid would be mostly idle programs (a few long runs among many short ones) or too tall; then every
    program has one full piece. ``local_region`` of one entry stands for every run and stays so."""
    n = int(dst.size)
    longest = int(nbytes.max())
    pieces = -(-longest // CHUNK_BYTES)
    if longest > _MAX_RUN_BYTES or pieces > _MAX_GRID_Y or \
            (pieces > 1 and n * pieces > 2 * (int(nbytes.sum()) // CHUNK_BYTES + n) + 4096):
        entry, offset, length = ops.split_pieces(nbytes, CHUNK_BYTES)
        dst, src, nbytes, region = dst[entry] + offset, src[entry] + offset, length, region[entry]
        if local_region.size > 1:
            local_region = local_region[entry]
        pieces = 1
    return dst, src, nbytes, region, local_region, pieces


class _RunTable:
    """One run-list kernel table: sources and destinations (8 B per run), then the lengths, peer regions and
    local regions (4 B per run, or one value when every run shares it, as in a KV plan: 16 B per run in
    all), each section 16-byte aligned (the compiled kernel assumes aligned pointer arguments)."""

    __slots__ = ("at_dst", "at_len", "at_loc", "at_reg", "dst", "local_region", "n", "nbytes", "region", "size", "src")

    def __init__(self, dst: U64, src: U64, nbytes: U64, region: U32, local_region: U32, n: int) -> None:
        self.dst, self.src, self.nbytes, self.region, self.local_region, self.n = dst, src, nbytes, region, local_region, n
        self.at_dst, self.at_len, self.at_reg, self.at_loc, self.size = self.layout(
            n, nbytes.size, region.size, local_region.size)

    @staticmethod
    def layout(n: int, k_len: int, k_reg: int, k_loc: int) -> tuple[int, int, int, int, int]:
        """Byte offsets of the destinations, lengths, peer regions and local regions, and the table's size,
        for ``n`` runs whose three 4-byte columns hold ``k_len``, ``k_reg`` and ``k_loc`` values."""
        at_dst, at_len = 8 * (n + (n & 1)), 16 * (n + (n & 1))
        at_reg = at_len + 16 * (-(-k_len // 4))
        at_loc = at_reg + 16 * (-(-k_reg // 4))
        return at_dst, at_len, at_reg, at_loc, at_loc + 4 * k_loc

    @classmethod
    def of(cls, dst: U64, src: U64, nbytes: U64, region: U32, local_region: U32, peer_count: int,
           local_count: int) -> _RunTable:
        """The table of ``n`` runs, a column of one shared value kept as one entry."""
        n = int(dst.size)
        uniform = int(nbytes.min()) == int(nbytes.max())
        one_region = peer_count == 1 or (bool(region.size) and int(region.min()) == int(region.max()))
        one_local = local_region.size == 1 or local_count == 1 or int(local_region.min()) == int(local_region.max())
        return cls(dst, src, nbytes[:1] if uniform else nbytes, region[:1] if one_region else region,
                   local_region[:1] if one_local else local_region, n)

    @property
    def per_run(self) -> tuple[int, int, int]:
        """Whether the lengths, peer regions and local regions are per run (the kernel's constexprs)."""
        return int(self.nbytes.size > 1), int(self.region.size > 1), int(self.local_region.size > 1)

    def write(self, out: npt.NDArray[np.uint8]) -> None:
        """Pack the table into ``out`` (at least ``size`` bytes)."""
        n = self.n
        np.copyto(out[: 8 * n].view(np.uint64), self.src)
        np.copyto(out[self.at_dst: self.at_dst + 8 * n].view(np.uint64), self.dst)
        np.copyto(out[self.at_len: self.at_len + 4 * self.nbytes.size].view(np.uint32), self.nbytes, casting="unsafe")
        np.copyto(out[self.at_reg: self.at_reg + 4 * self.region.size].view(np.uint32), self.region)
        np.copyto(out[self.at_loc: self.size].view(np.uint32), self.local_region)


class _BlockTable:
    """One ``copy_block_runs`` table: both sides' slots (8 B per block), the template's steps and offsets
    (8 B per run, four columns), lengths and both sides' regions (4 B per run), each section 16-byte
    aligned; a template of runs of very different lengths (or too long for one grid row) is cut into
    ``CHUNK_BYTES`` pieces first, O(T), so every program has one full piece."""

    __slots__ = ("at", "blocks", "columns", "pieces", "rows", "runs", "size", "tiled", "words")

    def __init__(self, columns: list[npt.NDArray[Any]], blocks: int, runs: int, pieces: int, words: int = 0) -> None:
        #: Packed: words per row (a power of two) and rows per program (tiled: at most the template's runs,
        #: rounded up to a power of two); else 0.
        self.words = words
        self.tiled = bool(words) and PACKED_TILED and blocks <= _MAX_GRID_Y
        self.rows = (min(BLOCK_WORDS // words, 1 << (runs - 1).bit_length()) if self.tiled else BLOCK_WORDS // words) \
            if words else 0
        if words and blocks * runs >= 1 << 31:
            raise TransferFailed(f"a block plan of {blocks} blocks x {runs} runs is more runs than the packed "
                                 f"kernel counts (2**31)")
        if blocks * runs * pieces > _MAX_GRID_X:
            raise TransferFailed(f"a block plan of {blocks} blocks x {runs} runs x {pieces} pieces exceeds the "
                                 f"kernel's grid ({_MAX_GRID_X} programs)")
        blk, run8, run4 = 16 * (-(-8 * blocks // 16)), 16 * (-(-8 * runs // 16)), 16 * (-(-4 * runs // 16))
        at = [0]
        for width in (blk, blk, run8, run8, run8, run8, run4, run4, run4):
            at.append(at[-1] + width)
        self.columns, self.blocks, self.runs, self.pieces, self.at, self.size = columns, blocks, runs, pieces, at, at[-1]

    @classmethod
    def of(cls, plan: BlockPlan, remote_src: bool, local_regions: bool, aligned: bool = False) -> _BlockTable | None:
        """The table of ``plan`` (None when it moves no byte); ``local_regions`` False: every local run is in
        region 0 of a one-region local table. ``aligned``: the peer's translations keep 16-byte alignment, so
        a template of short runs whose steps, offsets and lengths are 16-byte multiples goes packed."""
        src_step, src_offset, dst_step, dst_offset, nbytes = (plan.src_step, plan.src_offset, plan.dst_step,
                                                              plan.dst_offset, plan.nbytes)
        remote_region, local_region = (plan.src_region, plan.dst_region) if remote_src else (plan.dst_region, plan.src_region)
        if not local_regions:
            local_region = np.zeros(nbytes.size, np.uint32)
        longest = int(nbytes.max())
        if not longest:
            return None
        pieces = -(-longest // CHUNK_BYTES)
        t = int(nbytes.size)
        if aligned and longest <= PACKED_RUN_BYTES and not any(
                int(np.bitwise_or.reduce(a)) & 15 for a in (src_step, src_offset, dst_step, dst_offset, nbytes)):
            words = max(4, 1 << (-(-longest // 4) - 1).bit_length())
            return cls([plan.src_slots, plan.dst_slots, src_step, src_offset, dst_step, dst_offset, nbytes,
                        remote_region, local_region], plan.num_blocks, t, 1, words)
        if longest > _MAX_RUN_BYTES or pieces > _MAX_GRID_Y or \
                (pieces > 1 and t * pieces > 2 * (int(nbytes.sum()) // CHUNK_BYTES + t) + 64):
            entry, offset, nbytes = ops.split_pieces(nbytes, CHUNK_BYTES)
            src_step, dst_step, remote_region, local_region = (src_step[entry], dst_step[entry], remote_region[entry],
                                                               local_region[entry])
            src_offset, dst_offset = src_offset[entry] + offset, dst_offset[entry] + offset
            t, pieces = int(nbytes.size), 1
        return cls([plan.src_slots, plan.dst_slots, src_step, src_offset, dst_step, dst_offset, nbytes, remote_region,
                    local_region], plan.num_blocks, t, pieces)

    def write(self, out: npt.NDArray[np.uint8]) -> None:
        """Pack the table into ``out`` (at least ``size`` bytes)."""
        for k, col in enumerate(self.columns):
            dtype, width = (np.uint64, 8) if k < 6 else (np.uint32, 4)
            np.copyto(out[self.at[k]: self.at[k] + width * col.size].view(dtype), col, casting="unsafe")


class _GroupCache:
    """The affine groups of the last ``size`` templates: a request's plan carries its own copy of a template
    that earlier requests between the same layouts had, so grouping (``O(T)``, ~1 ms for 8,192 runs) is paid
    once per template. A template is looked up by its length and a few sampled runs, and a hit is compared
    column by column (~5 us per column of 8,192 runs), so a lookup never returns another template's groups."""

    SAMPLES = 8

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._entries: dict[tuple[int, ...], list[tuple[list[npt.NDArray[Any]], AffineGroups]]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def get(self, plan: BlockPlan) -> AffineGroups:
        columns: list[npt.NDArray[Any]] = [plan.src_step, plan.src_offset, plan.dst_step, plan.dst_offset, plan.nbytes,
                                           plan.src_region, plan.dst_region]
        t = plan.runs_per_block
        at = np.linspace(0, max(t - 1, 0), self.SAMPLES).astype(np.int64) if t else np.zeros(0, np.int64)
        key = (t, *plan.src_offset[at].tolist(), *plan.dst_offset[at].tolist(), *plan.nbytes[at].tolist())
        with self._lock:
            bucket = list(self._entries.get(key, ()))
        for kept, groups in bucket:
            if all(np.array_equal(a, b) for a, b in zip(kept, columns, strict=True)):
                return groups
        groups = AffineGroups.of(plan)
        with self._lock:
            if self._count >= self._size:       # forget the oldest key's templates
                oldest = next(iter(self._entries))
                self._count -= len(self._entries.pop(oldest))
            self._entries.setdefault(key, []).append((columns, groups))
            self._count += 1
        return groups


_group_cache = _GroupCache()


class _GroupTable:
    """One ``copy_block_groups`` table: both sides' slots (8 B per block), the groups (``GROUP_FIELDS`` int64
    each) and the programs ((group, first run) int64 pairs), each section 16-byte aligned."""

    __slots__ = ("at", "blocks", "columns", "programs", "rows", "size", "words")

    def __init__(self, src_slots: U64, dst_slots: U64, groups: npt.NDArray[np.int64], programs: npt.NDArray[np.int64],
                 rows: int, words: int) -> None:
        self.blocks, self.programs, self.rows, self.words = int(src_slots.size), int(programs.shape[0]), rows, words
        self.columns = [src_slots, dst_slots, groups.reshape(-1), programs.reshape(-1)]
        self.at = [0]
        for col in self.columns:
            self.at.append(self.at[-1] + 16 * (-(-8 * col.size // 16)))
        self.size = self.at[-1]

    @classmethod
    def of(cls, plan: BlockPlan, remote_src: bool, local_regions: bool, words: int,
           min_runs: int = GROUP_MIN_RUNS) -> _GroupTable | None:
        """The table of ``plan`` (a packed one of ``words``-word rows: short, 16-byte aligned runs), or None
        when its template does not cut into groups of ``min_runs`` runs on average or its blocks do not fit
        the grid's second dimension."""
        if plan.num_blocks > _MAX_GRID_Y:
            return None
        groups = _group_cache.get(plan)
        count = len(groups)
        if not count or plan.runs_per_block < min_runs * count:
            return None
        start = groups.start
        outer = groups.rows // groups.inner
        nbytes = plan.nbytes[start].astype(np.int64)
        remote, local = (plan.src_region, plan.dst_region) if remote_src else (plan.dst_region, plan.src_region)
        table = np.zeros((count, GROUP_FIELDS), np.int64)
        table[:, 0] = plan.src_offset[start].astype(np.int64)
        table[:, 1] = plan.dst_offset[start].astype(np.int64)
        table[:, 2] = plan.src_step[start].astype(np.int64)
        table[:, 3] = plan.dst_step[start].astype(np.int64)
        table[:, 4], table[:, 5] = groups.src_inner, groups.dst_inner
        table[:, 6], table[:, 7] = groups.src_outer, groups.dst_outer
        table[:, 8], table[:, 9], table[:, 10] = nbytes, groups.rows, groups.inner
        table[:, 11] = remote[start]
        table[:, 12] = local[start] if local_regions else 0
        table[:, 13] = (outer - 1) * groups.src_outer + (groups.inner - 1) * groups.src_inner + nbytes
        table[:, 14] = (outer - 1) * groups.dst_outer + (groups.inner - 1) * groups.dst_inner + nbytes
        rows = min(BLOCK_WORDS // words, 1 << (int(groups.rows.max()) - 1).bit_length())
        chunks = -(-groups.rows // rows)
        programs = np.empty((int(chunks.sum()), 2), np.int64)
        programs[:, 0] = np.repeat(np.arange(count), chunks)
        programs[:, 1] = (np.arange(programs.shape[0]) - np.repeat(np.cumsum(chunks) - chunks, chunks)) * rows
        if programs.shape[0] > _MAX_GRID_X:
            return None
        return cls(plan.src_slots, plan.dst_slots, table, programs, rows, words)

    def write(self, out: npt.NDArray[np.uint8]) -> None:
        """Pack the table into ``out`` (at least ``size`` bytes)."""
        for k, col in enumerate(self.columns):
            np.copyto(out[self.at[k]: self.at[k] + 8 * col.size].view(col.dtype), col)


class PreparedCopy:
    """A plan made ready to launch once (``BatchedCopier.prepare_copy`` / ``prepare_blocks``): its kernel
    table packed and uploaded into a device buffer of its own, or, for the direct copies, its addresses
    translated; ``BatchedCopier.launch_prepared`` then only enqueues it, with no per-run host work."""

    __slots__ = ("enqueue", "kind", "nbytes", "runs", "table")

    def __init__(self, kind: str, nbytes: int, runs: int, enqueue: Any, table: torch.Tensor | None = None) -> None:
        self.kind = kind            # "kernel", "blocks", "batch" or "memcpy"
        self.nbytes = nbytes
        self.runs = runs
        self.enqueue = enqueue      # called with the copier's lock held
        self.table = table          # the device table the kernel reads (kept alive with this object)


def run_variant_key(remote_src: bool, per_run: tuple[int, int, int]) -> tuple[Any, ...]:
    """The run-list kernel variant a table needs: direction, which columns are per run (``_RunTable.per_run``),
    and the constants."""
    return (bool(remote_src), *per_run, CHUNK_BYTES, BLOCK_WORDS, RUN_MAJOR, NUM_WARPS)


def run_variant_keys() -> list[tuple[Any, ...]]:
    """Every run-list kernel variant a plan can need (2 directions x per-run lengths, peer regions and local
    regions, each shared or per run): what a copier compiles before its first transfer."""
    return [run_variant_key(remote_src, (per_len, per_reg, per_loc))
            for remote_src in (False, True) for per_len in (0, 1) for per_reg in (0, 1) for per_loc in (0, 1)]


# --- batched copies --------------------------------------------------------------------------------
class _Attrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int), ("srcLocId", ctypes.c_int),
                ("dstLocType", ctypes.c_int), ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]


def _batch_fn() -> Any:
    """``cuMemcpyBatchAsync`` (CUDA 13 ABI, no failIdx) as a ctypes function, or None (the reason logged).
    The symbol is bytes: given a str, cuda.bindings raises TypeError, which once hid the function here."""
    try:
        result = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", 13000,
                                     cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
        err, ptr = result[0], result[1]
    except (AttributeError, TypeError) as exc:
        log.info("cuda copy: no cuMemcpyBatchAsync (cuGetProcAddress: %s)", exc)
        return None
    if int(err) != 0 or not int(ptr):
        log.info("cuda copy: no cuMemcpyBatchAsync (cuGetProcAddress: CUresult %s, pointer %#x)", int(err), int(ptr))
        return None
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.POINTER(_Attrs), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return proto(int(ptr))


class BatchedCopier:
    """Runs a plan's device copies as one operation on its own stream (see the module docstring)."""

    def __init__(self, device_id: int, method: str = "auto") -> None:
        self.device_id = device_id
        make_current(device_id)
        self.stream = torch.cuda.Stream(device_id)  # type: ignore[no-untyped-call]
        self._stream_handle = int(self.stream.cuda_stream)
        self._kernel = _triton_kernel() if method in ("auto", "kernel") else None
        #: The block-plan kernel: None until first asked for (``block_kernel_ready``), then its module, or
        #: False when it could not be compiled or its check copy came back wrong.
        self._kernels: Any = None
        self._batch = _batch_fn() if method in ("auto", "batch") else None
        if method == "kernel" and self._kernel is None:
            raise BackendUnavailable("method='kernel' needs Triton, which is not installed")
        if method == "batch" and self._batch is None:
            raise BackendUnavailable("method='batch' needs cuMemcpyBatchAsync (CUDA driver >= 12.8)")
        self.method = "kernel" if self._kernel is not None else ("batch" if self._batch is not None else "loop")
        self._lock = threading.Lock()          # one post at a time owns the staging ring and table
        self._staging = _Staging()
        self._table = _DeviceTable(device_id, self.stream)
        self._upload_stream = torch.cuda.Stream(device_id)  # type: ignore[no-untyped-call]
        self._upload_handle = int(self._upload_stream.cuda_stream)
        self._prior = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._model_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._anchor = torch.empty(16, dtype=torch.int32, device=f"cuda:{device_id}")
        self._anchor8 = _Pointer(int(self._anchor.data_ptr()), torch.uint8)
        self._anchor32 = _Pointer(int(self._anchor.data_ptr()), torch.int32)
        self._anchor_addr = int(self._anchor.data_ptr())
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._lib = _libcuda()
        #: How kernels are launched: "driver" (cuLaunchKernel, packed arguments), "triton" (the compiled
        #: kernel's launcher) or "jit" (Triton's JIT, when its compiled-kernel launcher differs). Once a
        #: variant cannot take the driver launch, later variants use Triton's launcher too (variants
        #: compiled before keep theirs).
        self.launcher = "driver" if self._lib is not None else "triton"
        self._default_stream = torch.cuda.default_stream(device_id)
        self._local = RegionTable(np.zeros(1, np.uint64), np.zeros(1, np.uint64), device_id)
        if self.method == "kernel":
            self._warm_up()

    @property
    def local_table(self) -> RegionTable:
        """The one-region, unbounded table of this process's own memory: copies whose plans were checked
        against the registered regions already (a re-layout inside this process)."""
        return self._local

    def _warm_up(self) -> None:
        """Compile the kernel variants now (Triton compiles on first launch: ~0.5 s that would otherwise
        land on the first transfer of a request) and check their copies; a driver launch that copies
        wrong falls back to Triton's launcher before any transfer uses it."""
        try:
            self._warm_up_variants()
        except TransferFailed as exc:
            if self.launcher != "driver":
                raise
            log.warning("cuda copy kernel: the driver launch failed its warm-up copy (%s); using Triton's launcher", exc)
            self.launcher = "triton"
            self._compiled.clear()
            self._warm_up_variants()

    def _warm_up_variants(self) -> None:
        """Check four variants' copies (the direction, one length or one per run), then compile the rest of
        ``run_variant_keys()``: plans over several regions on either side use variants of their own, and
        Triton's first compile of one (tens of ms or more with a cold cache) would land in a request's TTFT."""
        buf = torch.arange(64, dtype=torch.int32, device=f"cuda:{self.device_id}")
        addr = int(buf.data_ptr())
        for remote_src in (False, True):
            for lengths in ([48], [32, 16]):     # one shared length, then one length per run
                count = len(lengths)
                buf.copy_(torch.arange(64, dtype=torch.int32, device=buf.device))
                torch.cuda.synchronize(self.device_id)
                src = np.array([addr, addr + 32][:count], np.uint64)
                with self._lock:   # the kernel itself, though plans this small go to cuMemcpyAsync
                    self._run_kernel(src + np.uint64(128), src, np.array(lengths, np.uint64),
                                     np.zeros(count, np.uint32), self._local, remote_src,
                                     np.zeros(count, np.uint32), self._local)
                self.stream.synchronize()
                want = torch.arange(64, dtype=torch.int32, device=buf.device)
                want[32:44] = want[:12].clone()   # words 0-11 copied to 32-43, nothing else changed
                if not torch.equal(buf, want):
                    raise TransferFailed("the copy kernel's warm-up copy came back wrong")
        with self._lock:
            for key in run_variant_keys():
                if key not in self._compiled:
                    self._compile(key)

    def copy(self, dst: U64, src: U64, nbytes: U64, remote_region: U32, peer: RegionTable,
             remote_src: bool, local_region: U32 | None = None, local: RegionTable | None = None, *,
             after_model: bool = True) -> torch.cuda.Event:
        """Enqueue the copies (the ``remote_src`` side's addresses are translated through ``peer``);
        returns an event recorded after them on the copier's stream. The kernel copies no run outside
        its regions of ``peer`` and ``local`` (``local_region``; without them local addresses are not
        bounded); the other methods copy whatever they are given (``bounds_on_device`` says which).
        ``after_model``: the copies wait for all work queued on the default stream so far (pages the
        model writes there); False when the caller already synchronized with what wrote the pages."""
        make_current(self.device_id)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with self._lock:
            if after_model:   # pages written by the model on the default stream must be complete first
                self._model_done.record(self._default_stream)
                self.stream.wait_event(self._model_done)  # type: ignore[no-untyped-call]
            if dst.size:
                if self.bounds_on_device(int(dst.size)):
                    if local is None or local_region is None:
                        local, local_region = self._local, np.zeros(1, np.uint32)
                    self._run_kernel(dst, src, nbytes, remote_region, peer, remote_src, local_region, local)
                else:
                    if remote_src:
                        src = peer.translate(src, remote_region)
                    else:
                        dst = peer.translate(dst, remote_region)
                    if self.method == "batch" and dst.size > DIRECT_RUNS:
                        self._run_batch(dst, src, nbytes)
                    else:
                        self._run_memcpy(dst, src, nbytes)
            event.record(self.stream)
        return event

    def block_kernel_ready(self) -> bool:
        """Whether block plans can go to the GPU as such: on first call compile ``copy_block_runs`` (both
        directions) and check one copy of 2 blocks x 2 runs. Any failure is logged and the answer stays
        False, so callers post the expansion through the run-list kernel (the block kernel is newer than
        the last GPU run that validated this copier: it must not be able to break it)."""
        if self._kernels is None:
            if self.method != "kernel":
                self._kernels = False
                return False
            try:
                self._kernels = _kernels_module() or False
                if self._kernels:
                    self._check_block_kernel()
            except Exception as exc:
                log.warning("cuda copy: block plans will be expanded (the block kernel failed its check: %s)", exc)
                self._kernels = False
        return bool(self._kernels)

    def _check_block_kernel(self) -> None:
        """2 blocks (slots 0 and 1, 32 bytes apart) x 2 template runs of 16 bytes, the destination 128 bytes
        on, each direction, through the block kernels (one run per program, packed, and grouped when
        ``PACKED_GROUPS``): words 0-15 land on 32-47, nothing else changes."""
        buf = torch.arange(64, dtype=torch.int32, device=f"cuda:{self.device_id}")
        addr = int(buf.data_ptr())
        step, offset = np.full(2, 32, np.uint64), np.array([addr, addr + 16], np.uint64)
        plan = BlockPlan(np.arange(2, dtype=np.uint64), np.arange(2, dtype=np.uint64), step, offset, step,
                         offset + np.uint64(128), np.full(2, 16, np.uint64), np.zeros(2, np.uint32),
                         np.zeros(2, np.uint32))
        cases = [(False, False, False), (True, False, False), (False, True, False), (True, True, False)]
        if PACKED_GROUPS:
            cases += [(False, True, True), (True, True, True)]
        for remote_src, allow_packed, groups in cases:
            buf.copy_(torch.arange(64, dtype=torch.int32, device=buf.device))
            torch.cuda.synchronize(self.device_id)
            with self._lock:
                self._run_block_kernel(plan, self._local, remote_src, self._local, local_regions=False,
                                       allow_packed=allow_packed, force_groups=groups)
            self.stream.synchronize()
            want = torch.arange(64, dtype=torch.int32, device=buf.device)
            want[32:48] = want[:16].clone()
            if not torch.equal(buf, want):
                raise TransferFailed("the block copy kernel's check copy came back wrong")

    def copy_blocks(self, plan: BlockPlan, peer: RegionTable, remote_src: bool, local: RegionTable | None = None,
                    *, after_model: bool = True) -> torch.cuda.Event:
        """Enqueue a block plan's copies as one upload of its slots and template (``O(B + T)`` bytes) and
        one launch of ``copy_block_runs``, which forms every run's addresses on the GPU; otherwise as
        ``copy`` (the ``remote_src`` side translated through ``peer``, every run bounded to its regions of
        ``peer`` and ``local``, the event recorded after the copies). Method "kernel" only."""
        return self.copy_phases([plan], peer, remote_src, local, after_model=after_model)

    def copy_phases(self, plans: list[BlockPlan], peer: RegionTable, remote_src: bool, local: RegionTable | None = None,
                    *, after_model: bool = True) -> torch.cuda.Event:
        """``copy_blocks`` of several block plans (a ``PhasedPlan``'s phases) as one copy: their launches queued
        back to back on the copier's stream under one lock, one event recorded after the last."""
        if not self.block_kernel_ready():
            raise TransferFailed(f"block plans need the block copy kernel (Triton), which is not available here "
                                 f"(method {self.method!r}; see the log)")
        def enqueue() -> None:
            for plan in plans:
                if len(plan):
                    self._run_block_kernel(plan, peer, remote_src, local if local is not None else self._local,
                                           local_regions=local is not None)
        return self._ordered(enqueue, after_model)

    def _ordered(self, enqueue: Any, after_model: bool) -> torch.cuda.Event:
        """Call ``enqueue`` (it queues copies on the copier's stream) holding the copier's lock, after the
        model's stream's work when ``after_model`` (as in ``copy``); the event recorded after the copies."""
        make_current(self.device_id)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with self._lock:
            if after_model:
                self._model_done.record(self._default_stream)
                self.stream.wait_event(self._model_done)  # type: ignore[no-untyped-call]
            enqueue()
            event.record(self.stream)
        return event

    # --- prepared plans: packed and uploaded once, launched any number of times -----------------------
    def prepare_copy(self, dst: U64, src: U64, nbytes: U64, remote_region: U32, peer: RegionTable, remote_src: bool,
                     local_region: U32 | None = None, local: RegionTable | None = None) -> PreparedCopy:
        """What ``copy`` does before its launch, done once: the kernel's table packed and uploaded into a
        device buffer of the plan's own (on the copier's stream, so later launches follow it), or, for a plan
        of a few runs (or without the kernel), the remote side's addresses translated. The plan must stay
        valid for ``peer`` (the caller checks the connection at each launch)."""
        make_current(self.device_id)
        n, total = int(dst.size), int(nbytes.sum())
        if not n:
            return PreparedCopy("memcpy", 0, 0, lambda: None)
        if not self.bounds_on_device(n):
            if remote_src:
                src = peer.translate(src, remote_region)
            else:
                dst = peer.translate(dst, remote_region)
            d, s, b = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, nbytes))
            if self.method == "batch" and n > DIRECT_RUNS:
                return PreparedCopy("batch", total, n, lambda: self._run_batch(d, s, b))
            runs = (d.tolist(), s.tolist(), b.tolist())
            return PreparedCopy("memcpy", total, n, lambda: self._memcpy_runs(*runs))
        if local is None or local_region is None:
            local, local_region = self._local, np.zeros(1, np.uint32)
        dst, src, nbytes, remote_region, local_region, pieces = _cut_long_runs(dst, src, nbytes, remote_region,
                                                                               local_region)
        packed = _RunTable.of(dst, src, nbytes, remote_region, local_region, peer.count, local.count)
        table = self._upload_owned(packed)
        addr, local_table = int(table.data_ptr()), local
        with self._lock:   # compiles the variant on first use, on the copier's stream
            launch, grid, args, _ = self._runs_launch(packed, addr, peer, local_table, remote_src, pieces)
        return PreparedCopy("kernel", total, n, self._bound(
            launch, grid, args, lambda: self._launch_runs(packed, addr, peer, local_table, remote_src, pieces)), table)

    def prepare_blocks(self, plan: BlockPlan, peer: RegionTable, remote_src: bool,
                       local: RegionTable | None = None) -> PreparedCopy:
        """``prepare_copy`` for a block plan: its slots and template uploaded once (``copy_blocks``'s table)."""
        if not self.block_kernel_ready():
            raise TransferFailed(f"block plans need the block copy kernel (Triton), which is not available here "
                                 f"(method {self.method!r}; see the log)")
        make_current(self.device_id)
        packed = _BlockTable.of(plan, remote_src, local is not None, peer.aligned)
        if packed is None:
            return PreparedCopy("blocks", 0, 0, lambda: None)
        table = self._upload_owned(packed)
        addr, local_table = int(table.data_ptr()), local if local is not None else self._local
        with self._lock:
            launch, grid, args, _ = self._blocks_launch(packed, addr, peer, local_table, remote_src)
        return PreparedCopy("blocks", plan.total_bytes, len(plan), self._bound(
            launch, grid, args, lambda: self._launch_blocks(packed, addr, peer, local_table, remote_src)), table)

    def prepare_phases(self, plans: list[BlockPlan], peer: RegionTable, remote_src: bool,
                       local: RegionTable | None = None) -> PreparedCopy:
        """``prepare_blocks`` of each plan (a ``PhasedPlan``'s phases), launched back to back as one copy."""
        parts = [self.prepare_blocks(p, peer, remote_src, local) for p in plans]

        def enqueue() -> None:
            for part in parts:   # the parts hold their device tables
                part.enqueue()
        return PreparedCopy("blocks", sum(p.nbytes for p in parts), sum(p.runs for p in parts), enqueue)

    def _bound(self, launch: Any, grid: tuple[int, int], args: tuple[int, ...], fallback: Any) -> Any:
        """A prepared copy's launch: the driver launch with its arguments bound now (``_BoundLaunch``), or
        ``fallback`` (the launch of every post) where the variant takes Triton's launcher."""
        if isinstance(launch, _DriverLaunch) and self.launcher == "driver":
            return launch.bind(*grid, self._stream_handle, args)
        return fallback

    def launch_prepared(self, prepared: PreparedCopy, *, after_model: bool = True) -> torch.cuda.Event:
        """Enqueue a prepared plan's copies (one launch, or its direct copies); the event recorded after
        them, ``after_model`` as in ``copy``."""
        return self._ordered(prepared.enqueue, after_model)

    def _upload_owned(self, packed: _RunTable | _BlockTable) -> torch.Tensor:
        """A device buffer of its own holding ``packed``, copied on the copier's stream (launches there
        follow the copy; the buffer's memory is not reused before the copier's queued work is done)."""
        host = np.zeros(max(packed.size, 16), np.uint8)
        packed.write(host)
        with torch.cuda.stream(self.stream):
            return torch.from_numpy(host).to(f"cuda:{self.device_id}")

    def _run_block_kernel(self, plan: BlockPlan, peer: RegionTable, remote_src: bool, local: RegionTable, *,
                          local_regions: bool, allow_packed: bool = True, force_groups: bool = False) -> None:
        """Pack, upload and launch one block plan (the caller holds the lock). ``local_regions``: the local
        side's template regions index ``local``; else ``local`` has one region, 0. ``allow_packed`` False:
        never the packed kernels (the start-up check of the other one); ``force_groups``: the group kernel
        where the template groups, ``PACKED_GROUPS`` or not (its check)."""
        packed = _BlockTable.of(plan, remote_src, local_regions, peer.aligned and allow_packed)
        if packed is None:
            return
        grouped = _GroupTable.of(plan, remote_src, local_regions, packed.words, 1 if force_groups else GROUP_MIN_RUNS) \
            if packed.words and (PACKED_GROUPS or force_groups) else None
        chosen: _BlockTable | _GroupTable = grouped if grouped is not None else packed
        stage, stage_addr, uploaded = self._staging.take(chosen.size)
        chosen.write(stage)
        table = self._table.address(chosen.size)
        self._upload(table, stage_addr, chosen.size, self._stream_handle)
        uploaded.record(self.stream)
        if grouped is not None:
            self._launch_groups(grouped, table, peer, local, remote_src)
        else:
            self._launch_blocks(packed, table, peer, local, remote_src)

    def _launched(self, launch: Any, grid: tuple[int, int], args: tuple[int, ...]) -> bool:
        """Launch through the compiled variant's launcher (the driver's or Triton's); False when this Triton's
        compiled-kernel launcher differs (``launcher`` becomes "jit" and the caller launches through the JIT)."""
        if self.launcher == "jit":
            return False
        try:
            launch(*grid, self._stream_handle, args)
            return True
        except (TypeError, ValueError, AttributeError):
            self.launcher = "jit"
            return False

    def _launch_groups(self, grouped: _GroupTable, table: int, peer: RegionTable, local: RegionTable,
                       remote_src: bool) -> None:
        """Launch ``copy_block_groups`` over a group table already at device address ``table`` (the caller
        holds the lock; the upload is ordered before the launch on the copier's stream)."""
        key = ("groups", bool(remote_src), grouped.rows, grouped.words, NUM_WARPS)
        launch = self._compiled.get(key)
        if launch is None:
            launch = self._compile_blocks(key)
        args = (*(table + a for a in grouped.at[:4]), int(peer.device.data_ptr()), int(local.device.data_ptr()),
                peer.count, local.count, self._anchor_addr, self._anchor_addr)
        grid = (grouped.programs, grouped.blocks)
        if self._launched(launch, grid, args):
            return
        with torch.cuda.stream(self.stream):
            self._kernels.copy_block_groups[grid](  # type: ignore[union-attr]
                *(_Pointer(a, torch.int64) for a in args[:4]), peer.device, local.device, peer.count, local.count,
                self._anchor32, self._anchor_addr, REMOTE_SRC=key[1], ROWS=key[2], WORDS=key[3], num_warps=key[4])

    def _blocks_launch(self, packed: _BlockTable, table: int, peer: RegionTable, local: RegionTable,
                       remote_src: bool) -> tuple[Any, tuple[int, int], tuple[int, ...], tuple[Any, ...]]:
        """``_runs_launch`` for ``copy_block_runs`` (``copy_block_runs_packed`` for a packed table) over a block
        table at device address ``table``."""
        total = packed.blocks * packed.runs
        args = (*(table + a for a in packed.at[:9]), int(peer.device.data_ptr()), int(local.device.data_ptr()),
                packed.runs, peer.count, local.count, total if packed.words else packed.pieces, self._anchor_addr,
                self._anchor_addr, self._anchor_addr)
        if packed.words:
            key: tuple[Any, ...] = ("packed", bool(remote_src), packed.rows, packed.words, NUM_WARPS, packed.tiled)
            grid = (-(-packed.runs // packed.rows), packed.blocks) if packed.tiled else (-(-total // packed.rows), 1)
        else:
            key = ("blocks", bool(remote_src), CHUNK_BYTES, BLOCK_WORDS, RUN_MAJOR, NUM_WARPS)
            grid = _grid(total, packed.pieces, RUN_MAJOR)
        launch = self._compiled.get(key)
        if launch is None:
            launch = self._compile_blocks(key)
        return launch, grid, args, key

    def _launch_blocks(self, packed: _BlockTable, table: int, peer: RegionTable, local: RegionTable,
                       remote_src: bool) -> None:
        """Launch ``copy_block_runs`` over a block table already at device address ``table`` (the caller
        holds the lock; the table's upload is ordered before the launch on the copier's stream)."""
        launch, grid, args, key = self._blocks_launch(packed, table, peer, local, remote_src)
        if self._launched(launch, grid, args):
            return
        ptrs = [_Pointer(a, torch.int64 if k < 6 else torch.int32) for k, a in enumerate(args[:9])]
        if key[0] == "packed":
            kernel = self._kernels.copy_block_runs_tiled if key[5] else self._kernels.copy_block_runs_packed  # type: ignore[union-attr]
            with torch.cuda.stream(self.stream):
                kernel[grid](
                    *ptrs, peer.device, local.device, packed.runs, peer.count, local.count, args[14], self._anchor8,
                    self._anchor32, self._anchor_addr, REMOTE_SRC=key[1], ROWS=key[2], WORDS=key[3], num_warps=key[4])
            return
        with torch.cuda.stream(self.stream):
            self._kernels.copy_block_runs[grid](  # type: ignore[union-attr]
                *ptrs, peer.device, local.device, packed.runs, peer.count, local.count, packed.pieces, self._anchor8,
                self._anchor32, self._anchor_addr, REMOTE_SRC=key[1], CHUNK=key[2], BLOCK=key[3], RUN_MAJOR=key[4],
                num_warps=key[5])

    def _upload(self, table: int, stage_addr: int, size: int, stream_handle: int) -> None:
        """Copy ``size`` staged bytes to the device table on the given stream."""
        if self._lib is not None:
            rc = self._lib.cuMemcpyHtoDAsync_v2(table, stage_addr, size, stream_handle)
            if rc != 0:
                raise TransferFailed(f"cuMemcpyHtoDAsync of a {size}-byte plan table failed: CUresult {rc}")
        else:
            check(cu.cuMemcpyHtoDAsync(table, stage_addr, size, stream_handle), "cuMemcpyHtoDAsync")

    def _compile_blocks(self, key: tuple[Any, ...]) -> Any:
        """Compile ``copy_block_runs`` (key "blocks") or ``copy_block_runs_packed`` (key "packed") for one
        direction and shape once (a 1-program launch that copies nothing, as ``_compile``) and keep a
        launcher for it."""
        zero = torch.zeros(GROUP_FIELDS, dtype=torch.int64, device=f"cuda:{self.device_id}")
        z64, z32 = _Pointer(int(zero.data_ptr()), torch.int64), _Pointer(int(zero.data_ptr()), torch.int32)
        assert self._kernels is not None
        pointers = (z64, z64, z64, z64, z64, z64, z32, z32, z32, z64, z64)
        anchors = (self._anchor8, self._anchor32, self._anchor_addr)
        with torch.cuda.stream(self.stream):
            if key[0] == "groups":
                _, remote_src, rows, words, warps = key
                # program 0 takes group 0, which has no runs: nothing is read or written
                compiled = self._kernels.copy_block_groups[(1, 1)](
                    z64, z64, z64, z64, z64, z64, 2, 2, self._anchor32, self._anchor_addr, REMOTE_SRC=remote_src,
                    ROWS=rows, WORDS=words, num_warps=warps)
                constexprs: tuple[Any, ...] = key[1:4]
            elif key[0] == "packed":
                _, remote_src, rows, words, warps, tiled = key
                # no run is live (total_runs 0; tiled: a template of 0 runs): nothing is read or written
                kernel = self._kernels.copy_block_runs_tiled if tiled else self._kernels.copy_block_runs_packed
                compiled = kernel[(1, 1)](*pointers, 0 if tiled else 2, 2, 2, 0, *anchors, REMOTE_SRC=remote_src,
                                          ROWS=rows, WORDS=words, num_warps=warps)
                constexprs = key[1:4]
            else:
                _, remote_src, chunk, block, run_major, warps = key
                compiled = self._kernels.copy_block_runs[(1, 1)](
                    *pointers, 2, 2, 2, 2, *anchors, REMOTE_SRC=remote_src, CHUNK=chunk, BLOCK=block,
                    RUN_MAJOR=run_major, num_warps=warps)
                constexprs = key[1:5]
        self.stream.synchronize()
        launch: Any = _TritonLaunch(compiled, constexprs)
        if self.launcher == "driver":
            assert self._lib is not None
            try:
                launch = _DriverLaunch(compiled, self._lib,
                                       _GROUP_KERNEL_PARAMS if key[0] == "groups" else _BLOCK_KERNEL_PARAMS)
            except (ValueError, AttributeError, TypeError):
                self.launcher = "triton"
        self._compiled[key] = launch
        return launch

    def bounds_on_device(self, runs: int) -> bool:
        """Whether a plan of ``runs`` runs goes through the kernel, which checks every run's bounds."""
        return self.method == "kernel" and runs > DIRECT_RUNS

    def _run_kernel(self, dst: U64, src: U64, nbytes: U64, region: U32, peer: RegionTable, remote_src: bool,
                    local_region: U32, local: RegionTable) -> None:
        dst, src, nbytes, region, local_region, pieces = _cut_long_runs(dst, src, nbytes, region, local_region)
        n = int(dst.size)
        per_run_local = local_region.size > 1
        # A large plan goes in parts of growing size (PIPELINE_RUNS): the GPU copies the first part
        # while the host packs and uploads the next, so packing 131,072 runs (~0.1-0.3 ms) is not
        # spent before the copy starts. Parts after the first upload on their own stream into their own
        # section of the device table, so no upload waits behind the kernel before it.
        start, size, table_at = 0, min(n, FIRST_PART_RUNS) if n > PIPELINE_RUNS else n, 0
        # Each part's sections are padded to 16 bytes: 64 bytes per part beyond one table of n runs.
        table_base = self._table.address(-(-_RunTable.layout(n, n, n, n)[4] // 16) * 16 + 64 * _MAX_PARTS)
        if size < n:
            self._prior.record(self.stream)   # earlier kernels, which read the table, are done
            self._upload_stream.wait_event(self._prior)  # type: ignore[no-untyped-call]
        while start < n:
            stop = start + size
            part = slice(start, stop)
            used = self._launch_part(dst[part], src[part], nbytes[part], region[part], peer, remote_src,
                                     local_region[part] if per_run_local else local_region, local, pieces,
                                     table_base + table_at, on_upload_stream=start > 0)
            table_at += used
            start, size = stop, min(n - stop, size * PART_GROWTH)

    def _launch_part(self, dst: U64, src: U64, nbytes: U64, region: U32, peer: RegionTable, remote_src: bool,
                     local_region: U32, local: RegionTable, pieces: int, table: int, *,
                     on_upload_stream: bool) -> int:
        """Pack, upload and launch the kernel over one part of a plan; the bytes of table it used."""
        packed = _RunTable.of(dst, src, nbytes, region, local_region, peer.count, local.count)
        stage, stage_addr, uploaded = self._staging.take(packed.size)
        packed.write(stage)
        upload_stream = self._upload_stream if on_upload_stream else self.stream
        self._upload(table, stage_addr, packed.size, self._upload_handle if on_upload_stream else self._stream_handle)
        uploaded.record(upload_stream)
        if on_upload_stream:
            self.stream.wait_event(uploaded)  # type: ignore[no-untyped-call]
        self._launch_runs(packed, table, peer, local, remote_src, pieces)
        return -(-packed.size // 16) * 16

    def _runs_launch(self, packed: _RunTable, table: int, peer: RegionTable, local: RegionTable, remote_src: bool,
                     pieces: int) -> tuple[Any, tuple[int, int], tuple[int, ...], tuple[Any, ...]]:
        """The run-list kernel's launcher (compiled at warm-up, or on first use), grid, arguments and variant key
        for a run table at device address ``table``."""
        args = (table, table + packed.at_dst, table + packed.at_len, table + packed.at_reg, table + packed.at_loc,
                int(peer.device.data_ptr()), int(local.device.data_ptr()), peer.count, local.count, pieces,
                self._anchor_addr, self._anchor_addr, self._anchor_addr)
        key = run_variant_key(remote_src, packed.per_run)
        launch = self._compiled.get(key)
        if launch is None:
            launch = self._compile(key)
        return launch, _grid(packed.n, pieces, key[6]), args, key

    def _launch_runs(self, packed: _RunTable, table: int, peer: RegionTable, local: RegionTable, remote_src: bool,
                     pieces: int) -> None:
        """Launch the run-list kernel over a run table already at device address ``table`` (the caller holds
        the lock; the table's upload is ordered before the launch on the copier's stream)."""
        launch, grid, args, key = self._runs_launch(packed, table, peer, local, remote_src, pieces)
        if self._launched(launch, grid, args):
            return
        with torch.cuda.stream(self.stream):
            self._kernel[grid](  # type: ignore[index]
                _Pointer(args[0], torch.int64), _Pointer(args[1], torch.int64), _Pointer(args[2], torch.int32),
                _Pointer(args[3], torch.int32), _Pointer(args[4], torch.int32), peer.device, local.device,
                peer.count, local.count, pieces, self._anchor8, self._anchor32, self._anchor_addr,
                REMOTE_SRC=key[0], PER_RUN_LENGTH=key[1], PER_RUN_REGION=key[2], PER_RUN_LOCAL=key[3],
                CHUNK=key[4], BLOCK=key[5], RUN_MAJOR=key[6], num_warps=key[7])

    def _compile(self, key: tuple[Any, ...]) -> Any:
        """Compile one kernel variant through Triton's JIT once (on the copier's stream, a 1-program
        launch that copies nothing) and keep a launcher for it: ``cuLaunchKernel`` with packed
        arguments where the driver's parameter list is the expected one, else the compiled kernel's
        own launcher; neither pays the JIT's per-launch argument binding."""
        remote_src, per_len, per_reg, per_loc, chunk, block, run_major, warps = key
        zero = torch.zeros(4, dtype=torch.int64, device=f"cuda:{self.device_id}")
        z64, z32 = _Pointer(int(zero.data_ptr()), torch.int64), _Pointer(int(zero.data_ptr()), torch.int32)
        assert self._kernel is not None
        with torch.cuda.stream(self.stream):
            compiled = self._kernel[(1, 1)](
                z64, z64, z32, z32, z32, z64, z64, 2, 2, 2, self._anchor8, self._anchor32, self._anchor_addr,
                REMOTE_SRC=remote_src, PER_RUN_LENGTH=per_len, PER_RUN_REGION=per_reg, PER_RUN_LOCAL=per_loc,
                CHUNK=chunk, BLOCK=block, RUN_MAJOR=run_major, num_warps=warps)
        self.stream.synchronize()
        launch: Any = _TritonLaunch(compiled, key[:7])
        if self.launcher == "driver":
            assert self._lib is not None
            try:
                launch = _DriverLaunch(compiled, self._lib)
            except (ValueError, AttributeError, TypeError):
                self.launcher = "triton"
        self._compiled[key] = launch
        return launch

    def _run_memcpy(self, dst: U64, src: U64, nbytes: U64) -> None:
        """One ``cuMemcpyAsync`` per run (plans of few runs, or no kernel and no batch API)."""
        self._memcpy_runs(dst.tolist(), src.tolist(), nbytes.tolist())

    def _memcpy_runs(self, dst: list[int], src: list[int], nbytes: list[int]) -> None:
        lib, stream = self._lib, self._stream_handle
        for d, s, b in zip(dst, src, nbytes, strict=True):
            if lib is not None:
                rc = lib.cuMemcpyAsync(d, s, b, stream)
                if rc != 0:
                    raise TransferFailed(f"cuMemcpyAsync({d:#x} <- {s:#x}, {b} bytes) failed: CUresult {rc}")
            else:
                check(cu.cuMemcpyAsync(d, s, b, stream), "cuMemcpyAsync")

    def _run_batch(self, dst: U64, src: U64, nbytes: U64) -> None:
        d = np.ascontiguousarray(dst, dtype=np.uint64)
        s = np.ascontiguousarray(src, dtype=np.uint64)
        b = np.ascontiguousarray(nbytes, dtype=np.uint64)
        attrs = _Attrs(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _CU_MEM_LOCATION_TYPE_DEVICE, self.device_id,
                       _CU_MEM_LOCATION_TYPE_DEVICE, self.device_id, 0)
        idx = np.zeros(1, dtype=np.uint64)
        assert self._batch is not None
        rc = self._batch(d.ctypes.data, s.ctypes.data, b.ctypes.data, d.size, ctypes.byref(attrs),
                         idx.ctypes.data, 1, self._stream_handle)
        if rc != 0:
            raise TransferFailed(f"cuMemcpyBatchAsync of {d.size} copies failed with CUresult {rc}")


_local_copiers: dict[int, BatchedCopier] = {}
_local_copiers_lock = threading.Lock()


def local_copier(device_id: int) -> BatchedCopier:
    """One ``BatchedCopier`` per device for copies inside this process (re-layouts of landed bytes), made on
    first use (its kernels compiled then) and kept for the process's life, as its streams are."""
    with _local_copiers_lock:
        copier = _local_copiers.get(device_id)
        if copier is None:
            copier = _local_copiers[device_id] = BatchedCopier(device_id)
        return copier
