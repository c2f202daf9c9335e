"""Scatter-gather tagged messages: ``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx`` with UCX's IOV datatype,
called through ctypes on the worker and endpoints of a ucxx transport.

ucxx's Python API sends one contiguous buffer per call, so a plan of N scattered pages costs N
Python calls and N UCX messages on each side. UCX itself takes a list of (address, length) pairs for
one message: the sender gathers, the receiver scatters straight into its pages (shared-memory
rendezvous does it with one CMA call over the whole list). The list is built by numpy from the
plan's arrays, so no Python code runs per page. Only host memory takes this path: the library
detects one memory type per message.

The binding uses the library instance ucxx loaded (``libucx.load_library``, the same choice rule)
and the public UCP API of version 1.x >= 1.10 (``ucp_request_param_t`` is append-only there and only
its first fields are set). Every call must happen on the thread that owns the worker.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import BackendUnavailable

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_UCP_DATATYPE_IOV = 2
_UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
_TAG_MASK_FULL = (1 << 64) - 1
_MIN_VERSION = (1, 10)


class _RequestParam(ctypes.Structure):
    """The leading fields of ``ucp_request_param_t`` (UCP 1.x), up to and including ``memh``."""

    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", ctypes.c_void_p),
                ("cb", ctypes.c_void_p), ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int),
                ("recv_info", ctypes.c_void_p), ("memh", ctypes.c_void_p)]


_lock = threading.Lock()
_binding: UcpIov | None = None


def iov_array(addr: npt.NDArray[np.uint64], nbytes: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """A ``ucp_dt_iov_t[]`` (pointer, length) array for the given runs, C-contiguous."""
    out = np.empty((addr.size, 2), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = nbytes
    return out


class UcpRequest:
    """One outstanding scatter-gather message; keeps its iov array alive until UCX is done with it."""

    __slots__ = ("_binding", "_handle", "_iov", "status")

    def __init__(self, binding: UcpIov, handle: int | None, iov: npt.NDArray[np.uint64]) -> None:
        self._binding = binding
        self._handle = handle
        self._iov = iov
        self.status = UCS_INPROGRESS if handle is not None else UCS_OK

    @property
    def completed(self) -> bool:
        """Whether UCX finished the message (its request is released then); see ``status``."""
        if self._handle is None:
            return True
        status = self._binding.lib.ucp_request_check_status(self._handle)
        if status == UCS_INPROGRESS:
            return False
        self._binding.lib.ucp_request_free(self._handle)
        self._handle = None
        self.status = status
        return True

    def check_error(self) -> None:
        """Raise if the message completed with an error status (e.g. cancelled)."""
        if self.completed and self.status != UCS_OK:
            raise RuntimeError(f"UCX scatter-gather message completed with status {self.status}")

    def cancel(self, worker_handle: int) -> None:
        """Ask UCX to cancel the message; it then completes with a cancelled status."""
        if self._handle is not None:
            self._binding.lib.ucp_request_cancel(worker_handle, self._handle)


class UcpIov:
    """ctypes view of the four UCP calls the scatter-gather path needs."""

    def __init__(self, lib: Any) -> None:
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        self.version = (major.value, minor.value, release.value)
        if major.value != 1 or (major.value, minor.value) < _MIN_VERSION:
            raise BackendUnavailable(f"UCP {self.version} is not a 1.x >= 1.10 library (scatter-gather tag calls)")
        param_p = ctypes.POINTER(_RequestParam)
        lib.ucp_tag_send_nbx.restype = ctypes.c_void_p
        lib.ucp_tag_send_nbx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, param_p]
        lib.ucp_tag_recv_nbx.restype = ctypes.c_void_p
        lib.ucp_tag_recv_nbx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64,
                                         ctypes.c_uint64, param_p]
        lib.ucp_request_check_status.restype = ctypes.c_int8   # ucs_status_t: a packed (one-byte) enum
        lib.ucp_request_check_status.argtypes = [ctypes.c_void_p]
        lib.ucp_request_free.restype = None
        lib.ucp_request_free.argtypes = [ctypes.c_void_p]
        lib.ucp_request_cancel.restype = None
        lib.ucp_request_cancel.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib = lib
        self._param = _RequestParam(op_attr_mask=_UCP_OP_ATTR_FIELD_DATATYPE, datatype=_UCP_DATATYPE_IOV)

    def _request(self, ptr: int | None, iov: npt.NDArray[np.uint64], what: str) -> UcpRequest:
        if ptr is not None and ptr >= (1 << 64) + _UCS_ERR_LAST:  # UCS_PTR_IS_ERR
            raise RuntimeError(f"UCX {what} of {len(iov)} runs failed to post: status {ptr - (1 << 64)}")
        return UcpRequest(self, ptr, iov)

    def send(self, endpoint_handle: int, iov: npt.NDArray[np.uint64], tag: int) -> UcpRequest:
        """Post one message gathered from ``iov`` to the endpoint."""
        ptr = self.lib.ucp_tag_send_nbx(endpoint_handle, iov.ctypes.data, len(iov), tag, ctypes.byref(self._param))
        return self._request(ptr, iov, "tag send")

    def recv(self, worker_handle: int, iov: npt.NDArray[np.uint64], tag: int) -> UcpRequest:
        """Post one receive scattering the message tagged ``tag`` into ``iov``."""
        ptr = self.lib.ucp_tag_recv_nbx(worker_handle, iov.ctypes.data, len(iov), tag, _TAG_MASK_FULL,
                                        ctypes.byref(self._param))
        return self._request(ptr, iov, "tag receive")


_orphans: list[Any] = []


def keep_alive(requests: list[Any]) -> None:
    """Keep the requests (and their iov arrays) of a closing transport alive for the life of the
    process: UCX may still read an iov array while it tears an unfinished message down."""
    with _lock:
        _orphans.extend(r for r in requests if isinstance(r, UcpRequest) and r._handle is not None)


def ucp_iov() -> UcpIov:
    """The process-wide binding on the UCP library ucxx uses (import ucxx first)."""
    global _binding
    with _lock:
        if _binding is None:
            try:
                import libucx
            except ImportError as exc:
                raise BackendUnavailable(f"libucx (the UCX libraries of ucxx) is not importable: {exc}") from exc
            libs = libucx.load_library()
            ucp = next((lib for lib in libs if lib is not None and "libucp" in str(lib._name)), None)
            if ucp is None:
                raise BackendUnavailable("libucx.load_library() returned no libucp")
            _binding = UcpIov(ucp)
        return _binding
