"""One-sided UCP RMA (``ucp_put_nbx`` / ``ucp_get_nbx``) through ctypes on the context, worker and
endpoints of a ucxx transport.

ucxx's Python API has no RMA calls, but the libucp it loaded in this process has them. The ucx
backend maps each registered host region with ``ucp_mem_map``, packs its remote key
(``ucp_rkey_pack``) into the metadata it already exchanges, unpacks the peer's keys on its endpoint
(``ucp_ep_rkey_unpack``) and moves a plan's runs with one put or get per run, then one
``ucp_ep_flush_nbx`` whose completion says every run landed (remote completion for puts). The
target's application does nothing: no receive to post, no control message to answer.

The binding uses the library instance ucxx loaded (``libucx.load_library``, via ``ucp_iov``) and
the public UCP API of version 1.x >= 1.10: ``ucp_mem_map_params_t`` and ``ucp_request_param_t`` are
append-only there, and only their leading fields are set (the structures passed are padded). Calls
must come from threads the worker allows (ucxx creates its workers thread-safe,
``UCS_THREAD_MODE_MULTI``; ``worker_thread_mode`` reads it back).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

from kvxfer.errors import BackendUnavailable
from kvxfer.transport.ucp_iov import UCS_INPROGRESS, UCS_OK, ucp_iov

UCS_THREAD_MODE_MULTI = 2
#: ``ucs_status_t`` is a packed enum: one signed byte (a wider return type reads garbage above it).
UCS_STATUS_T = ctypes.c_int8
_UCS_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + _UCS_ERR_LAST
_MEM_MAP_FIELD_ADDRESS = 1 << 0
_MEM_MAP_FIELD_LENGTH = 1 << 1
_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0


class _MemMapParams(ctypes.Structure):
    """The leading fields of ``ucp_mem_map_params_t`` (only address and length are set), padded."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("length", ctypes.c_size_t),
                ("flags", ctypes.c_uint), ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int),
                ("_pad", ctypes.c_uint8 * 64)]


class _WorkerAttr(ctypes.Structure):
    """The leading fields of ``ucp_worker_attr_t`` (only the thread mode is asked for), padded."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("thread_mode", ctypes.c_int), ("address_flags", ctypes.c_uint32),
                ("_pad", ctypes.c_uint8 * 128)]


class _RequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (UCP 1.x) up to ``memh``, padded; only ``memory_type`` and ``memh`` are
    ever set (contiguous bytes, no callback)."""

    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", ctypes.c_void_p),
                ("cb", ctypes.c_void_p), ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int), ("recv_info", ctypes.c_void_p),
                ("memh", ctypes.c_void_p), ("_pad", ctypes.c_uint8 * 64)]


_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
_OP_ATTR_FIELD_MEMH = 1 << 8
_UCS_MEMORY_TYPE_HOST = 0
#: ``ucp_request_param_t.memh`` arrived in UCP 1.13; older libraries get no memory handle per run.
_MEMH_MIN_VERSION = (1, 13)


_STATUS_NAMES = {0: "OK", 1: "INPROGRESS", -3: "IO_ERROR", -4: "NO_MEMORY", -5: "INVALID_PARAM",
                 -6: "UNREACHABLE", -7: "INVALID_ADDR", -16: "CANCELED", -20: "TIMED_OUT", -22: "UNSUPPORTED",
                 -23: "REJECTED", -24: "NOT_CONNECTED", -25: "CONNECTION_RESET", -80: "ENDPOINT_TIMEOUT"}
#: UCS statuses that mean the peer is gone or unreachable: UNREACHABLE, TIMED_OUT, REJECTED,
#: NOT_CONNECTED, CONNECTION_RESET and the link and endpoint failure ranges.
PEER_LOST_STATUSES = frozenset({-6, -20, -23, -24, -25, *range(-89, -39)})


def status_name(status: int) -> str:
    """A UCS status code with its name for the common ones."""
    return f"{status} ({_STATUS_NAMES.get(status, 'UCS error')})"


class UcpRmaError(RuntimeError):
    """A UCP RMA call failed (the message names the call and the UCS status)."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"UCX {what} failed: status {status_name(status)}")
        self.status = status


class FlushRequest:
    """The completion of one transfer's runs: an outstanding ``ucp_ep_flush_nbx`` (or none when UCX
    finished it within the call). ``completed`` polls and releases it once; see ``status``."""

    __slots__ = ("_handle", "_lib", "status")

    def __init__(self, lib: Any, handle: int | None, status: int = UCS_OK) -> None:
        self._lib = lib
        self._handle = handle
        self.status = UCS_INPROGRESS if handle is not None else status

    @property
    def completed(self) -> bool:
        if self._handle is None:
            return True
        status = self._lib.ucp_request_check_status(self._handle)
        if status == UCS_INPROGRESS:
            return False
        self._lib.ucp_request_free(self._handle)
        self._handle = None
        self.status = status
        return True

    def check_error(self) -> None:
        """Raise UcpRmaError if the flush completed with an error status (a lost peer, a failed run)."""
        if self.completed and self.status != UCS_OK:
            raise UcpRmaError("RMA flush", self.status)


class UcpRma:
    """ctypes view of the UCP calls the one-sided path needs."""

    def __init__(self, lib: Any) -> None:
        vp, sz, u64, status_t = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, UCS_STATUS_T
        param_p = ctypes.POINTER(_RequestParam)
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "ucp_mem_map": (status_t, [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)]),
            "ucp_mem_unmap": (status_t, [vp, vp]),
            "ucp_rkey_pack": (status_t, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
            "ucp_rkey_buffer_release": (None, [vp]),
            "ucp_ep_rkey_unpack": (status_t, [vp, vp, ctypes.POINTER(vp)]),
            "ucp_rkey_destroy": (None, [vp]),
            "ucp_put_nbx": (vp, [vp, vp, sz, u64, vp, param_p]),
            "ucp_get_nbx": (vp, [vp, vp, sz, u64, vp, param_p]),
            "ucp_ep_flush_nbx": (vp, [vp, param_p]),
            "ucp_worker_query": (status_t, [vp, ctypes.POINTER(_WorkerAttr)]),
            "ucp_request_check_status": (status_t, [vp]),
            "ucp_worker_progress": (ctypes.c_uint, [vp]),
            "ucp_request_free": (None, [vp]),
        }
        try:
            for name, (restype, argtypes) in sigs.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except AttributeError as exc:
            raise BackendUnavailable(f"libucp lacks an RMA call: {exc}") from exc
        self.lib = lib
        self._param = _RequestParam()
        self._param_ref = ctypes.byref(self._param)
        self._keep: list[_RequestParam] = []
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        self.takes_memh = (major.value, minor.value) >= _MEMH_MIN_VERSION

    def local_param(self, memh: int) -> Any:
        """Request parameters for runs of one locally mapped host region: its memory handle and memory type
        given, so UCX neither looks the buffer up in its registration cache nor detects its type per run.
        (The plain parameters where the library predates the field.)"""
        if not self.takes_memh:
            return self._param_ref
        param = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_MEMORY_TYPE | _OP_ATTR_FIELD_MEMH,
                              memory_type=_UCS_MEMORY_TYPE_HOST, memh=memh)
        self._keep.append(param)   # lives as long as the binding (one per mapped region)
        return ctypes.byref(param)

    def worker_thread_mode(self, worker_handle: int) -> int:
        """The worker's UCS thread mode (2: multi-threaded access allowed)."""
        attr = _WorkerAttr(field_mask=_WORKER_ATTR_FIELD_THREAD_MODE)
        status = self.lib.ucp_worker_query(worker_handle, ctypes.byref(attr))
        if status != UCS_OK:
            raise UcpRmaError("ucp_worker_query", status)
        return int(attr.thread_mode)

    def mem_map(self, context_handle: int, address: int, length: int) -> tuple[int, bytes]:
        """Register ``length`` bytes at ``address`` for RMA; returns (memory handle, packed remote key)."""
        params = _MemMapParams(field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH, address=address,
                               length=length)
        memh = ctypes.c_void_p()
        status = self.lib.ucp_mem_map(context_handle, ctypes.byref(params), ctypes.byref(memh))
        if status != UCS_OK or not memh.value:
            raise UcpRmaError(f"ucp_mem_map of {length} bytes at {address:#x}", status)
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        status = self.lib.ucp_rkey_pack(context_handle, memh, ctypes.byref(buf), ctypes.byref(size))
        if status != UCS_OK:
            self.lib.ucp_mem_unmap(context_handle, memh)
            raise UcpRmaError("ucp_rkey_pack", status)
        try:
            packed = ctypes.string_at(buf.value or 0, size.value)
        finally:
            self.lib.ucp_rkey_buffer_release(buf)
        return int(memh.value), packed

    def mem_unmap(self, context_handle: int, memh: int) -> None:
        self.lib.ucp_mem_unmap(context_handle, memh)

    def rkey_unpack(self, endpoint_handle: int, packed: bytes) -> int:
        """A remote key handle for ``endpoint_handle`` from a peer's packed key."""
        rkey = ctypes.c_void_p()
        status = self.lib.ucp_ep_rkey_unpack(endpoint_handle, packed, ctypes.byref(rkey))
        if status != UCS_OK or not rkey.value:
            raise UcpRmaError("ucp_ep_rkey_unpack", status)
        return int(rkey.value)

    def rkey_destroy(self, rkey: int) -> None:
        self.lib.ucp_rkey_destroy(rkey)

    def post(self, endpoint_handle: int, op: str, local: list[int], remote: list[int], nbytes: list[int],
             rkeys: list[int], params: list[Any] | None = None) -> FlushRequest:
        """One put (``op="write"``) or get per run, then one endpoint flush. Requests of the runs are
        released at once (the flush reports their completion and any error); the returned
        ``FlushRequest`` completes when every run landed. ``params``: per run, ``local_param`` of the
        local region it lies in (default: plain parameters)."""
        lib, ref = self.lib, self._param_ref
        fn = lib.ucp_put_nbx if op == "write" else lib.ucp_get_nbx
        free = lib.ucp_request_free
        ep = endpoint_handle
        for la, ra, n, rk, pr in zip(local, remote, nbytes, rkeys, params or [ref] * len(local), strict=True):
            ptr = fn(ep, la, n, ra, rk, pr)
            if ptr is not None:
                if ptr >= _PTR_ERR_MIN:
                    raise UcpRmaError(f"ucp_{'put' if op == 'write' else 'get'}_nbx of {n} bytes", ptr - (1 << 64))
                free(ptr)
        return self.flush(endpoint_handle)

    def progress_until(self, worker_handle: int, flush: FlushRequest, idle_s: float, limit_s: float) -> bool:
        """Progress the worker from this thread until ``flush`` completes; give up once a pass has found
        nothing to do for ``idle_s`` (the rest waits on the peer) or after ``limit_s``. Whether it completed.
        (Thread-safe workers only: UCX serializes this with the service thread's progress.)"""
        progress, now = self.lib.ucp_worker_progress, time.perf_counter
        start = active = now()
        while True:
            events = progress(worker_handle)
            if flush.completed:
                return True
            t = now()
            if events:
                active = t
            elif t - active >= idle_s or t - start >= limit_s:
                return False

    def flush(self, endpoint_handle: int) -> FlushRequest:
        """An endpoint flush: completes once every RMA posted on it before completed."""
        ptr = self.lib.ucp_ep_flush_nbx(endpoint_handle, self._param_ref)
        if ptr is not None and ptr >= _PTR_ERR_MIN:
            return FlushRequest(self.lib, None, ptr - (1 << 64))
        return FlushRequest(self.lib, ptr)


_lock = threading.Lock()
_binding: UcpRma | None = None


def ucp_rma() -> UcpRma:
    """The process-wide RMA binding on the UCP library ucxx uses (import ucxx first)."""
    global _binding
    with _lock:
        if _binding is None:
            _binding = UcpRma(ucp_iov().lib)
        return _binding
