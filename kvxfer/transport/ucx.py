"""ucx backend: UCX transfers through ucxx, one-sided where both sides can, with a service thread on
every endpoint.

One-sided (the default between host regions of two sides that both advertise remote keys): each side
maps its host regions for RMA at ``register`` and puts their packed keys in its metadata blob; the
initiator unpacks the peer's keys on its endpoint at ``connect`` and posts a plan as one
``ucp_put_nbx`` (write) or ``ucp_get_nbx`` (read) per run plus one endpoint flush, from the caller's
thread (ucxx workers are thread-safe), progressing the worker itself for a moment so that a flush UCX
finishes at once completes within the post; otherwise the service thread watches it. The target's
application and service thread take no part (over tcp UCX emulates RMA with the target's progress,
which its service thread provides). The notification follows the flush as a ``note`` control
message. Posted runs cannot be withdrawn: ``cancel`` of a one-sided transfer returns False.
``ucp_rma.py`` has the binding; plans touching CUDA memory, and peers without keys, use the two-sided
protocol below.

Two-sided: a plan's data travels as one UCX scatter-gather message (host memory, >= SCATTER_GATHER_MIN_RUNS
runs, both sides capable; ``ucp_iov.py``) or as one tagged message per run, received straight into
its destination pages either way (no staging): the receiving side posts its receives before it
lets the sender send. Control
messages (msgpack, on one reserved tag) drive both directions, so ``read`` needs no help from the
remote application - its service thread answers:

- write A->B: A ``wreq`` (runs, notify) -> B checks the runs against its own regions, posts receives
  under fresh tags, ``wready`` -> A sends the runs, then ``commit`` -> B, once every receive landed
  and the commit arrived, queues the notification and answers ``wdone`` -> A's handle completes.
- read A<-B: A posts receives under fresh tags, ``rreq`` (runs, tags, notify) -> B checks and sends
  the runs -> A's handle completes when every receive landed, then A sends ``commit`` -> B queues
  the notification.
- A cancel sends ``abort`` instead of ``commit``: the peer drops the notification. Scatter-gather
  receives of a cancelled transfer are withdrawn; per-run receives already posted for a cancelled
  or refused transfer stay with UCX under tags that are never reused.

The two-sided protocol's UCX calls happen on the service thread; callers enqueue work and wake it
through a pipe. Progress is event driven (``arm`` + ``select`` on the
worker's epoll descriptor), which is far cheaper on few cores than ucxx's progress thread. Peers
connect by worker address, with UCX peer-failure handling unless ``error_handling=False``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import (
    BackendUnavailable,
    DecodeError,
    PageTableError,
    PeerUnreachable,
    TransferFailed,
    TransportError,
)
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport.base import Op, Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.metadata import MAX_NAME_CHARS, MAX_REGIONS, TransportMetadata
from kvxfer.transport.ucp_iov import UcpIov, UcpRequest, iov_array, keep_alive, ucp_iov
from kvxfer.transport.ucp_rma import (
    PEER_LOST_STATUSES,
    UCS_THREAD_MODE_MULTI,
    FlushRequest,
    UcpRma,
    UcpRmaError,
    status_name,
    ucp_rma,
)
from kvxfer.transport.ucx_env import apply_ucx_defaults

CONTROL_TAG = 0x6B76_7866_0000_0001  # "kvxf" | 1: control messages
_DATA_FLAG = 1 << 63
_RUN_BITS = 24
MAX_RUNS = 1 << _RUN_BITS  # runs per transfer (one tag each)
MAX_CONTROL_BYTES = 64 << 20
_SELECT_TIMEOUT_S = 0.05
#: Plans with at least this many runs travel as one scatter-gather message. Fewer runs go one
#: message each: their Python cost is small, and UCX's contiguous rendezvous moves big runs far
#: faster than its scatter-gather one over shared memory/CMA (figures in BENCHMARKS.md's transport
#: sections and docs/transport.md).
SCATTER_GATHER_MIN_RUNS = 32
#: While transfers are in flight the service thread keeps polling this long after the last event
#: before it blocks: a scattered plan completes thousands of requests, and one arm + select per
#: completion costs more than the data movement of a small page.
_SPIN_AFTER_EVENT_S = 0.002
#: Capability bits of the metadata blob's first byte.
_CAP_IOV = 1
_CAP_RMA = 2
#: Bounds on the remote keys a peer's blob carries (one per advertised region; UCX packs a few dozen bytes).
MAX_RKEY_BYTES = 1 << 16
#: The most remote keys one peer's blob may carry (one per registered region).
MAX_RKEYS = 1 << 12
#: A one-sided post progresses the worker from the caller's thread until its flush completes, while
#: progress finds work (over shared memory/CMA UCX moves the runs in these passes: the post then
#: takes as long as the copy, as NIXL's does) and for ``_RMA_IDLE_S`` more without any; then (over
#: tcp, waiting on the peer) it hands the flush to the service thread. The hand-off (a wake-up and a
#: condition) costs more than the transfer of a page: one page over tcp measured 850 us p50 with 0.1 ms,
#: 660 us with 0.5 ms, 125 us with 1 ms, 140 us with 2 ms (the peer's wake-up is most of the round trip).
#: ``_RMA_LIMIT_S`` bounds the caller's share.
_RMA_IDLE_S = 1e-3
_RMA_LIMIT_S = 2.0
#: The service thread's longest sleep while it watches one-sided flushes: UCX completes some (shared
#: memory/CMA) without an event on the worker's descriptor.
_RMA_SELECT_TIMEOUT_S = 0.001
#: How long the service thread stays off the worker while a caller's thread progresses it.
_RMA_BACKOFF_S = 0.0005
#: Transfers one peer may have in flight into or out of this side; its requests beyond are refused
#: (the table of them is keyed by peer input, so it is bounded).
MAX_INCOMING_PER_PEER = 4096


def ucx_unavailable_reason() -> str | None:
    """None when ucxx is installed, else why not (found without importing it)."""
    if importlib.util.find_spec("ucxx") is None:
        return "ucxx is not installed (pip install ucxx-cu12)"
    return None


class _CudaRun:
    """A device byte range exposed through ``__cuda_array_interface__`` so ucxx can send/receive it."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1",
                                         "version": 3, "strides": None}


class _Batch:
    """The UCX requests of one transfer's runs, checked from a cursor: runs complete roughly in
    order, so each service-loop pass looks at a few requests instead of all of them."""

    __slots__ = ("cursor", "failure", "requests")

    def __init__(self, requests: list[Any] | None = None) -> None:
        self.requests: list[Any] = requests if requests is not None else []
        self.cursor = 0
        self.failure: str | None = None

    def done(self) -> bool:
        """Whether every request completed (errors are kept in ``failure``)."""
        reqs, i, n = self.requests, self.cursor, len(self.requests)
        while i < n and reqs[i].completed:
            if self.failure is None:
                try:
                    reqs[i].check_error()
                except Exception as exc:
                    self.failure = repr(exc)
            i += 1
        self.cursor = i
        return i == n

    def cancel(self, worker_handle: int) -> None:
        """Cancel the requests that support it (scatter-gather ones)."""
        for req in self.requests[self.cursor:]:
            if isinstance(req, UcpRequest):
                req.cancel(worker_handle)


@dataclass
class _Outgoing:
    """A transfer this endpoint initiated."""

    handle: TransferHandle
    op: Op
    peer: str
    plan: TransferPlan
    notify: bytes | None
    batch: _Batch = field(default_factory=_Batch)
    stage: str = "posted"  # posted -> sending -> committed (write) | receiving (read)
    cancelled: bool = False
    iov: bool = False  # one scatter-gather message instead of one per run
    flush: FlushRequest | None = None  # one-sided (stage "rma"): the flush completing its runs


@dataclass
class _RmaPeer:
    """A peer reachable one-sidedly: its endpoint and a remote key per advertised region (0: none,
    e.g. a CUDA region, which keeps the two-sided path)."""

    endpoint: Any
    rkeys: npt.NDArray[np.uint64]
    all_keyed: bool
    #: Per advertised region: (base, end, key), for the one-run path's checks in plain Python.
    bounds: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _Incoming:
    """A transfer a peer initiated towards this endpoint (its writes into us, its reads from us)."""

    key: tuple[str, int]
    notify: bytes | None
    batch: _Batch = field(default_factory=_Batch)
    committed: bool = False
    aborted: bool = False
    receiving: bool = False  # its batch holds receives (a peer's write into us)
    acked: bool = False


class UcxTransport(Transport):
    """Transport over a ucxx worker, one-sided where both sides can; see the module docstring."""

    backend = "ucx"

    def __init__(self, name: str, scatter_gather: bool = True, error_handling: bool = True, rma: bool = True) -> None:
        """``rma`` (default True): plans between host regions of two RMA-capable sides move one-sidedly
        (``ucp_put_nbx`` / ``ucp_get_nbx`` and one flush, ``ucp_rma.py``); ``rma=False`` keeps every
        transfer on the two-sided tag protocol, for comparison and tests.

        ``scatter_gather=False`` sends one message per run even between host regions (the path
        CUDA memory always takes), for comparison and tests.

        ``error_handling`` (default True) opens endpoints with UCX peer-failure handling, so a peer
        that dies mid-transfer fails its transfers instead of aborting this process (seen: UCX
        ``abort()`` inside ``progress`` after a SIGKILLed peer with handling off). On one host UCX
        then avoids shared-memory/CMA paths; ``error_handling=False`` is faster there but a dead
        peer may take this process down — only for trusted, supervised deployments and benchmarks."""
        super().__init__(name)
        self.error_handling = bool(error_handling)
        reason = ucx_unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(reason)
        apply_ucx_defaults()
        try:
            from ucxx._lib import libucxx as ucx_api
            from ucxx._lib.arr import Array
        except Exception as exc:
            raise BackendUnavailable(f"ucxx is not importable: {exc}") from exc
        self._api = ucx_api
        self._array = Array
        self._iov: UcpIov | None = None
        self.iov_unavailable_reason: str | None = "turned off (scatter_gather=False)"
        if scatter_gather:
            try:
                self._iov, self.iov_unavailable_reason = ucp_iov(), None
            except BackendUnavailable as exc:  # per-run messages still work
                self.iov_unavailable_reason = str(exc)
        self._peer_iov: dict[str, bool] = {}
        self._draining: list[_Batch] = []
        self._rma: UcpRma | None = None
        self.rma_unavailable_reason: str | None = "turned off (rma=False)"
        if rma:
            try:
                self._rma, self.rma_unavailable_reason = ucp_rma(), None
            except BackendUnavailable as exc:  # two-sided messages still work
                self.rma_unavailable_reason = str(exc)
        features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP) + ((ucx_api.Feature.RMA,) if self._rma else ())
        self._ctx = ucx_api.UCXContext(feature_flags=features)
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._worker_handle = int(self._worker.handle)
        if self._rma is not None and self._rma.worker_thread_mode(self._worker.handle) != UCS_THREAD_MODE_MULTI:
            # One-sided posts run on the caller's thread beside the service thread's progress.
            self._rma, self.rma_unavailable_reason = None, "the ucxx worker is not thread-safe (UCS_THREAD_MODE_MULTI)"
        #: Guards the one-sided state the caller's thread reads while posting (peers' keys, endpoints).
        self._rma_lock = threading.Lock()
        self._rma_peers: dict[str, _RmaPeer] = {}
        self._memhs: list[int] = []
        #: Per local host region index: the request parameters naming its memory handle (``local_param``).
        self._region_params: dict[int, Any] = {}
        self._packed_rkeys: list[bytes] = []
        self._host_mask = np.zeros(0, dtype=bool)
        self._all_host = True
        self._local_bounds: list[tuple[int, int, bool]] = []
        self._stale_rkeys: list[int] = []
        #: Callers' threads now posting one-sided runs and progressing the worker (the service thread
        #: keeps off it meanwhile).
        self._rma_callers = 0
        self._rma_callers_lock = threading.Lock()
        self._endpoint_addrs: dict[str, bytes] = {}
        self._address = bytes(self._worker.address.tobytes())
        self._views: list[memoryview | None] = []
        self._region_bases = np.zeros(0, dtype=np.uint64)
        self._endpoints: dict[str, Any] = {}
        self._outgoing: dict[int, _Outgoing] = {}
        self._incoming: dict[tuple[str, int], _Incoming] = {}
        self._control_recvs: list[tuple[Any, npt.NDArray[np.uint8]]] = []
        self._control_sends: list[tuple[Any, npt.NDArray[np.uint8]]] = []
        self._tags = itertools.count(1)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = threading.Event()
        self._service_error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"kvxfer-ucx-{name}", daemon=True)
        self._thread.start()

    # --- thread plumbing ----------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        if self._service_error is not None:
            raise TransportError(f"ucx {self.name!r}: service thread died: {self._service_error!r}")
        self._commands.put(fn)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the service thread and return its result (or raise its exception)."""
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))
            done.set()

        self._submit(run)
        if not done.wait(30.0):
            raise TransportError(f"ucx {self.name!r}: {what} got no answer from the service thread in 30 s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _serve(self) -> None:
        epoll_fd = self._worker.epoll_file_descriptor
        last_event = time.monotonic()
        try:
            while not self._stop.is_set():
                busy = False
                while True:
                    try:
                        fn = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    fn()
                    busy = True
                if self._rma_callers:
                    # A caller's thread is progressing the worker for its one-sided post: keep off the
                    # worker's lock meanwhile (contending for it took a third of a transfer's time).
                    ready, _, _ = select.select([self._wake_r], [], [], _RMA_BACKOFF_S)
                    if ready:
                        self._drain_wake()
                    continue
                while self._worker.progress_once():
                    busy = True
                busy |= self._poll_control()
                busy |= self._poll_transfers()
                if busy:
                    last_event = time.monotonic()
                    continue
                if (self._outgoing or self._incoming) and time.monotonic() - last_event < _SPIN_AFTER_EVENT_S:
                    continue
                if self._worker.arm():
                    watched = any(o.flush is not None for o in self._outgoing.values())
                    timeout = _RMA_SELECT_TIMEOUT_S if watched else _SELECT_TIMEOUT_S
                    ready, _, _ = select.select([epoll_fd, self._wake_r], [], [], timeout)
                    if self._wake_r in ready:
                        self._drain_wake()
        except BaseException as exc:
            self._service_error = exc
            for out in list(self._outgoing.values()):
                out.handle._finish(TransferStatus.FAILED, f"ucx service thread died: {exc!r}", TransferFailed)

    # --- registration and peers ---------------------------------------------------------------------
    def _backend_register(self, regions: tuple[MemoryRegion, ...]) -> None:
        from kvxfer.transport.copy import host_view

        self._views = [None if r.memory_kind == "cuda" else host_view(r).data for r in regions]
        self._region_bases = np.array([r.base_address for r in regions], dtype=np.uint64)
        self._host_mask = np.array([r.memory_kind != "cuda" for r in regions], dtype=bool)
        self._all_host = bool(self._host_mask.all())
        self._local_bounds = [(r.base_address, r.end_address, r.memory_kind != "cuda") for r in regions]
        rma = self._rma
        if rma is None:
            return

        def map_all() -> None:
            # Host regions only: CUDA regions keep the two-sided path (an empty key says so to peers).
            for r in regions:
                if r.memory_kind == "cuda" or r.nbytes == 0:
                    self._packed_rkeys.append(b"")
                    continue
                memh, packed = rma.mem_map(self._ctx.handle, r.base_address, r.nbytes)
                self._memhs.append(memh)
                self._packed_rkeys.append(packed)
                self._region_params[len(self._packed_rkeys) - 1] = rma.local_param(memh)

        try:
            self._call(map_all, "map regions for RMA")
        except UcpRmaError as exc:   # two-sided messages still work
            self._unmap_all()
            self._rma, self.rma_unavailable_reason = None, str(exc)
        if any(len(k) > MAX_RKEY_BYTES for k in self._packed_rkeys):
            self._unmap_all()
            self._rma, self.rma_unavailable_reason = None, f"a packed remote key exceeds {MAX_RKEY_BYTES} bytes"

    def _unmap_all(self) -> None:
        if self._rma is not None:
            for memh in self._memhs:
                self._rma.mem_unmap(self._ctx.handle, memh)
        self._memhs, self._packed_rkeys, self._region_params = [], [], {}

    def _backend_blob(self) -> bytes:
        """One capability byte (bit 0: takes scatter-gather messages; bit 1: one-sided, its keys follow as
        a u32 count, then per region the u64 base and u64 length it was mapped with and the u32-length-
        prefixed packed key), then the worker address. A peer reaches a region one-sidedly only where
        the metadata's region is exactly the extent a key was made for: UCX's shared-memory transport
        does not check addresses against the key, so forged regions must not widen what a key opens."""
        flags = _CAP_IOV * (self._iov is not None) | _CAP_RMA * (self._rma is not None)
        out = bytearray([flags])
        if flags & _CAP_RMA:
            out += len(self._packed_rkeys).to_bytes(4, "little")
            for (base, end, _), key in zip(self._local_bounds, self._packed_rkeys, strict=True):
                out += base.to_bytes(8, "little") + (end - base).to_bytes(8, "little")
                out += len(key).to_bytes(4, "little") + key
        return bytes(out) + self._address

    def _parse_blob(self, peer: str, md: TransportMetadata) -> tuple[int, list[tuple[int, int, bytes]] | None, bytes]:
        """(capability flags, the peer's (base, end, packed key) per mapped region or None, worker
        address) from its blob, bounded."""
        blob = md.backend_blob

        def bad(why: str) -> DecodeError:
            return DecodeError(f"ucx {self.name!r}: peer {peer!r} metadata blob is not a ucx one "
                               f"({len(blob)} bytes, first {blob[:1]!r}): {why}")

        if len(blob) < 2 or blob[0] > (_CAP_IOV | _CAP_RMA):
            raise bad("unknown capability byte or no address")
        flags, pos, keys = blob[0], 1, None
        if flags & _CAP_RMA:
            if len(blob) < pos + 4:
                raise bad("truncated key count")
            count = int.from_bytes(blob[pos:pos + 4], "little")
            pos += 4
            if count > MAX_RKEYS:
                raise bad(f"{count} remote keys (at most {MAX_RKEYS})")
            keys = []
            for _ in range(count):
                if len(blob) < pos + 20:
                    raise bad("truncated key extent or length")
                base = int.from_bytes(blob[pos:pos + 8], "little")
                length = int.from_bytes(blob[pos + 8:pos + 16], "little")
                n = int.from_bytes(blob[pos + 16:pos + 20], "little")
                if n > MAX_RKEY_BYTES or len(blob) < pos + 20 + n:
                    raise bad(f"remote key of {n} bytes")
                keys.append((base, base + length, bytes(blob[pos + 20:pos + 20 + n])))
                pos += 20 + n
        if len(blob) - pos < 1:
            raise bad("no worker address")
        return flags, keys, bytes(blob[pos:])

    def _backend_connect(self, peer: str, md: TransportMetadata) -> None:
        flags, keys, address = self._parse_blob(peer, md)
        self._peer_iov[peer] = bool(flags & _CAP_IOV)
        rma = self._rma

        def make() -> None:
            ep = self._endpoint_for(peer, address, replace=True)
            if rma is None or keys is None:
                return
            # A region reaches one-sided only through a key made for exactly its extent; the rest (CUDA
            # regions, whose key is empty, and regions no key was made for) stay 0: the two-sided path,
            # where the owner checks every range against what it registered.
            extents = {(base, end): key for base, end, key in keys if key}
            rkeys = np.zeros(len(md.regions), dtype=np.uint64)
            try:
                for i, r in enumerate(md.regions):
                    key = extents.get((r.base_address, r.end_address))
                    if key:
                        rkeys[i] = rma.rkey_unpack(ep.handle, key)
            except UcpRmaError:
                self._stale_rkeys.extend(int(k) for k in rkeys if k)
                return   # this peer is served two-sided
            bounds = [(r.base_address, r.end_address, int(k)) for r, k in zip(md.regions, rkeys, strict=True)]
            with self._rma_lock:
                self._rma_peers[peer] = _RmaPeer(ep, rkeys, bool((rkeys != 0).all()), bounds)

        try:
            self._call(make, f"connect {peer!r}")
        except TransportError:
            raise
        except Exception as exc:
            raise PeerUnreachable(f"ucx {self.name!r}: cannot reach peer {peer!r} by worker address: {exc}") from exc

    def _endpoint_for(self, peer: str, address: bytes, replace: bool = False) -> Any:
        """The endpoint to ``peer``; ``replace``: a new one if ``address`` is not the one it was made for
        (a restarted peer)."""
        ep = self._endpoints.get(peer)
        if ep is None or (replace and self._endpoint_addrs.get(peer) != address):
            addr = self._api.UCXAddress.create_from_buffer(address)
            ep = self._worker.create_endpoint_from_worker_address(addr, self.error_handling)
            self._endpoints[peer] = ep
            self._endpoint_addrs[peer] = address
        return ep

    def _drop_rma_peer(self, peer: str) -> None:
        """Forget a peer's keys (service thread); they are destroyed at close, after UCX is done with them."""
        with self._rma_lock:
            rp = self._rma_peers.pop(peer, None)
        if rp is not None:
            self._stale_rkeys.extend(int(k) for k in rp.rkeys if k)

    def _backend_disconnect(self, peer: str) -> None:
        def drop() -> None:
            self._drop_rma_peer(peer)
            for out in [o for o in self._outgoing.values() if o.peer == peer]:
                out.handle._finish(TransferStatus.FAILED, "peer disconnected", PeerUnreachable)
                self._outgoing.pop(out.handle.id, None)
                self._retire(out.batch, out.stage == "receiving")
            # Its transfers into or out of this side end too (its later messages are dropped, so they
            # would never commit): receives withdrawn, sends kept until UCX is done.
            for key in [k for k in self._incoming if k[0] == peer]:
                inc = self._incoming.pop(key)
                self._retire(inc.batch, inc.receiving)

        self._call(drop, f"disconnect {peer!r}")

    def _backend_close(self) -> None:
        def fail_all() -> None:
            for out in self._outgoing.values():
                out.handle._finish(TransferStatus.FAILED, "transport closed", TransferFailed)
                self._retire(out.batch, out.stage == "receiving")
            for inc in self._incoming.values():
                self._retire(inc.batch, inc.receiving)
            rma_in_flight = any(o.flush is not None and not o.flush.completed for o in self._outgoing.values())
            self._outgoing.clear()
            self._incoming.clear()
            for peer in list(self._rma_peers):
                self._drop_rma_peer(peer)
            self._worker.progress()
            keep_alive([r for b in self._draining if not b.done() for r in b.requests])
            if self._rma is not None and not rma_in_flight:   # else UCX may still use them: left to the process
                for rkey in self._stale_rkeys:
                    self._rma.rkey_destroy(rkey)
                self._stale_rkeys.clear()
                self._unmap_all()

        if self._thread.is_alive():
            self._call(fail_all, "close")
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._endpoints.clear()

    # --- memory -------------------------------------------------------------------------------------
    def _buffers(self, table: PageTable) -> list[Any]:
        """One ucxx Array per entry of a local table: memoryview slices of the region (host) or CUDA
        range wrappers. Offsets come out of numpy in one pass; the loop only builds the Arrays."""
        base = self._region_bases[table.region]
        offsets = (table.addr - base).tolist()
        lengths = table.nbytes.tolist()
        array, views = self._array, self._views
        if len(views) == 1 and views[0] is not None:  # the common case: one host region
            view = views[0]
            return [array(view[o:o + n]) for o, n in zip(offsets, lengths, strict=True)]
        out = []
        for r, o, n, a in zip(table.region.tolist(), offsets, lengths, table.addr.tolist(), strict=True):
            v = views[r]
            out.append(array(v[o:o + n] if v is not None else _CudaRun(a, n)))
        return out

    def _host_only(self, table: PageTable, regions: tuple[MemoryRegion, ...]) -> bool:
        """Whether every entry of ``table`` lies in host memory of ``regions``."""
        kinds = np.array([r.memory_kind != "cuda" for r in regions], dtype=bool)
        return bool(kinds[np.unique(table.region)].all()) if len(table) else True

    def _post_receives(self, table: PageTable, tag_base: int, iov: bool) -> _Batch:
        """Receive straight into the pages of ``table``: one scatter message (``iov``) under ``tag_base``,
        else one message per page under ``tag_base | i``."""
        if iov:
            assert self._iov is not None
            return _Batch([self._iov.recv(self._worker.handle, iov_array(table.addr, table.nbytes), tag_base)])
        recv, tag = self._worker.tag_recv, self._api.UCXXTag
        return _Batch([recv(b, tag(tag_base | i)) for i, b in enumerate(self._buffers(table))])

    def _post_sends(self, ep: Any, table: PageTable, tag_base: int, iov: bool) -> _Batch:
        """Send the pages of ``table``: one gather message (``iov``) or one message per page."""
        if iov:
            assert self._iov is not None
            return _Batch([self._iov.send(ep.handle, iov_array(table.addr, table.nbytes), tag_base)])
        send, tag = ep.tag_send, self._api.UCXXTag
        return _Batch([send(b, tag(tag_base | i)) for i, b in enumerate(self._buffers(table))])

    def _retire(self, batch: _Batch, receives: bool) -> None:
        """Let go of a dropped transfer's requests: withdraw posted receives (scatter-gather ones can
        be cancelled; per-run ucxx receives cannot) and keep everything until UCX releases it."""
        if receives:
            batch.cancel(self._worker.handle)
        if not batch.done():
            self._draining.append(batch)

    # --- posting (caller thread) --------------------------------------------------------------------
    def _backend_post(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                      transfer_id: int, *, settled: bool = False) -> TransferHandle:
        rp = self._rma_peers.get(peer)
        if rp is not None:
            local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
            if (rp.all_keyed or bool(rp.rkeys[remote.region].all())) and \
                    (self._all_host or bool(self._host_mask[local.region].all())):
                return self._post_rma(op, peer, plan, notify, transfer_id, local, remote)
        if len(plan) >= MAX_RUNS:
            raise TransportError(f"ucx {op} with peer {peer!r}: {len(plan)} runs exceeds {MAX_RUNS - 1}; "
                                 f"coalesce or split the plan")
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        iov = (self._iov is not None and len(plan) >= SCATTER_GATHER_MIN_RUNS and self._peer_iov.get(peer, False)
               and self._host_only(local, self._regions)
               and self._host_only(remote, self.peer_regions(peer)))
        out = _Outgoing(TransferHandle(transfer_id, peer, plan.total_bytes, op, abort=self._abort_from_caller),
                        op, peer, plan, notify, iov=iov)
        self._submit(lambda: self._start(out))
        return out.handle

    def _backend_post_checking(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                               transfer_id: int, check: Callable[[], None], *,
                               settled: bool = False) -> TransferHandle | None:
        """The one-run one-sided post (a page, a coalesced layer): its checks in straight-line Python
        over bounds kept at register/connect (the same ones ``Transport._check_plan`` makes), then the
        post. Anything else (more runs, a run outside its region, no keys): None, and the general path
        checks the plan (naming the fault) and posts it."""
        rp = self._rma_peers.get(peer)
        src, dst = plan.src, plan.dst
        if rp is None or len(src.addr) != 1:
            return None
        local, remote = (src, dst) if op == "write" else (dst, src)
        (la,), (ra,), (n,) = local.addr.tolist(), remote.addr.tolist(), local.nbytes.tolist()
        (li,), (ri,) = local.region.tolist(), remote.region.tolist()
        lbounds, rbounds = self._local_bounds, rp.bounds
        if li >= len(lbounds) or ri >= len(rbounds):
            return None
        lbase, lend, host = lbounds[li]
        rbase, rend, rkey = rbounds[ri]
        if not (host and rkey and lbase <= la and la + n <= lend and rbase <= ra and ra + n <= rend):
            return None
        return self._post_rma(op, peer, plan, notify, transfer_id, local, remote,
                              ([la], [ra], [n], [rkey], [self._region_params[li]]), rp)

    def _post_rma(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None, transfer_id: int,
                  local: PageTable, remote: PageTable,
                  runs: tuple[list[int], list[int], list[int], list[int], list[Any]] | None = None,
                  checked_with: _RmaPeer | None = None) -> TransferHandle:
        """One-sided: one put (write) or get (read) per run and one endpoint flush, posted from this thread
        (the worker is thread-safe). A flush UCX finishes within the call (shared memory/CMA does) completes
        the handle here; otherwise the service thread watches it. The notification follows the data as a
        control message. Posted runs cannot be withdrawn, so ``cancel`` returns False (too late)."""
        rma = self._rma
        assert rma is not None
        with self._rma_callers_lock:
            self._rma_callers += 1
        try:
            return self._post_rma_counted(op, peer, plan, notify, local, remote, runs, checked_with, transfer_id, rma)
        finally:
            with self._rma_callers_lock:
                self._rma_callers -= 1

    def _post_rma_counted(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None, local: PageTable,
                          remote: PageTable,
                          runs: tuple[list[int], list[int], list[int], list[int], list[Any]] | None,
                          checked_with: _RmaPeer | None, transfer_id: int, rma: UcpRma) -> TransferHandle:
        with self._rma_lock:
            rp = self._rma_peers.get(peer)
            if rp is None or (checked_with is not None and rp is not checked_with):
                why = "peer is not connected" if rp is None else "peer reconnected while this transfer was posted"
                handle = TransferHandle(transfer_id, peer, plan.total_bytes, op)
                handle._finish(TransferStatus.FAILED, why, PeerUnreachable)
                return handle
            if len(local) == 0:
                flush = FlushRequest(rma.lib, None)
            else:
                if runs is None:
                    regions = local.region.tolist()
                    params = self._region_params
                    first = params[regions[0]] if regions else None
                    per_run = [first] * len(regions) if len(self._region_params) == 1 else \
                        [params[r] for r in regions]
                    runs = (local.addr.tolist(), remote.addr.tolist(), local.nbytes.tolist(),
                            rp.rkeys[remote.region].tolist(), per_run)
                try:
                    flush = rma.post(rp.endpoint.handle, op, *runs)
                except UcpRmaError as exc:
                    handle = TransferHandle(transfer_id, peer, plan.total_bytes, op)
                    _fail_rma(handle, exc.status, str(exc))
                    return handle
        if flush.completed or rma.progress_until(self._worker_handle, flush, _RMA_IDLE_S, _RMA_LIMIT_S):
            if flush.status == 0:   # done within the post: a handle without a condition (nobody waits on it)
                handle = TransferHandle.completed(transfer_id, peer, plan.total_bytes, op)
                if notify is not None:
                    self._send_note(peer, transfer_id, notify)
                return handle
            handle = TransferHandle(transfer_id, peer, plan.total_bytes, op)
            self._rma_finished(handle, flush, notify)
            return handle
        handle = TransferHandle(transfer_id, peer, plan.total_bytes, op, abort=_too_late)
        out = _Outgoing(handle, op, peer, plan, notify, stage="rma", flush=flush)
        self._submit(lambda: self._watch_rma(out))
        return handle

    def _rma_finished(self, handle: TransferHandle, flush: FlushRequest, notify: bytes | None) -> None:
        """Complete a one-sided transfer whose flush completed (any thread); its notification goes out after."""
        if flush.status != 0:
            _fail_rma(handle, flush.status, f"UCX RMA flush failed: status {status_name(flush.status)}")
            return
        if handle._finish(TransferStatus.DONE) and notify is not None:
            self._send_note(handle.peer, handle.id, notify)

    def _send_note(self, peer: str, tid: int, notify: bytes) -> None:
        """Send a one-sided transfer's notification (its data landed) from the service thread."""
        self._submit(lambda: self._send_control(peer, {"k": "note", "id": tid, "from": self.name, "notify": notify}))

    def _watch_rma(self, out: _Outgoing) -> None:
        """Service thread: watch a one-sided transfer's flush (polled in ``_poll_transfers``)."""
        if out.peer not in self._endpoints or out.peer not in self._rma_peers:
            out.handle._finish(TransferStatus.FAILED, "peer disconnected", PeerUnreachable)
            return
        self._outgoing[out.handle.id] = out

    def _abort_from_caller(self, handle: TransferHandle) -> bool:
        aborted: bool = self._call(lambda: self._abort(handle.id), f"cancel transfer {handle.id}")
        return aborted

    # --- service-thread protocol --------------------------------------------------------------------
    def _send_control(self, peer: str, message: dict[str, Any]) -> None:
        ep = self._endpoints.get(peer)
        if ep is None:
            return
        payload = np.frombuffer(msgpack.packb(message, use_bin_type=True), dtype=np.uint8).copy()
        req = ep.tag_send(self._array(payload), self._api.UCXXTag(CONTROL_TAG))
        self._control_sends.append((req, payload))

    def _fresh_tag_base(self) -> int:
        return _DATA_FLAG | ((next(self._tags) & ((1 << (63 - _RUN_BITS)) - 1)) << _RUN_BITS)

    def _start(self, out: _Outgoing) -> None:
        if out.handle._status.terminal:
            return
        ep = self._endpoints.get(out.peer)
        if ep is None:
            out.handle._finish(TransferStatus.FAILED, "peer is not connected", PeerUnreachable)
            return
        self._outgoing[out.handle.id] = out
        header: dict[str, Any] = {"id": out.handle.id, "from": self.name, "addr": self._address,
                                  "notify": out.notify, "iov": out.iov}
        if out.op == "write":
            header.update(k="wreq", runs=_pack_runs(out.plan.dst))
        else:
            base = self._fresh_tag_base()
            out.batch = self._post_receives(out.plan.dst, base, out.iov)
            out.stage = "receiving"
            header.update(k="rreq", runs=_pack_runs(out.plan.src), tag=base)
        self._send_control(out.peer, header)

    def _abort(self, transfer_id: int) -> bool:
        """Stop a transfer unless its commit already went out (then it completes normally)."""
        out = self._outgoing.get(transfer_id)
        if out is None:
            return True
        if out.stage == "committed":
            return False
        del self._outgoing[transfer_id]
        out.cancelled = True
        # Its receives are withdrawn; its sends cannot be, so they (and the scatter-gather iov arrays UCX
        # reads) are kept until UCX is done with them.
        self._retire(out.batch, out.stage == "receiving")
        self._send_control(out.peer, {"k": "abort", "id": transfer_id, "from": self.name})
        return True

    def _poll_control(self) -> bool:
        busy = False
        self._control_sends[:] = [(r, p) for r, p in self._control_sends if not r.completed]
        while True:
            probe = self._worker.tag_probe(self._api.UCXXTag(CONTROL_TAG), remove=True)
            if not probe.matched:
                break
            busy = True
            buf = np.empty(probe.length, dtype=np.uint8)  # drained from UCX even when it is dropped
            self._control_recvs.append((self._worker.tag_recv_with_handle(self._array(buf), probe), buf))
        pending = []
        for req, buf in self._control_recvs:
            if not req.completed:
                pending.append((req, buf))
                continue
            busy = True
            if buf.size > MAX_CONTROL_BYTES:
                continue
            try:
                req.check_error()
                self._on_control(msgpack.unpackb(buf.tobytes(), raw=False, max_bin_len=MAX_CONTROL_BYTES,
                                                 max_str_len=MAX_NAME_CHARS * 4, max_array_len=MAX_REGIONS,
                                                 max_map_len=16))
            except (ValueError, TypeError, KeyError, msgpack.UnpackException, self._api.UCXError):
                continue  # a malformed control message is dropped; its sender's deadline reports it
        self._control_recvs = pending
        return busy

    def _on_control(self, msg: dict[str, Any]) -> None:
        kind, tid, sender = msg["k"], int(msg["id"]), str(msg["from"])
        if sender not in self._peers:
            return   # only connected peers (their metadata came through the workers' authenticated handshake)
        if kind in ("wreq", "rreq"):
            self._on_request(kind, tid, sender, msg)
        elif kind in ("commit", "abort"):
            inc = self._incoming.get((sender, tid))
            if inc is not None:
                inc.committed |= kind == "commit"
                inc.aborted |= kind == "abort"
        elif kind == "note":   # a one-sided transfer's notification: its data landed before it was sent
            notify = msg.get("notify")
            if isinstance(notify, bytes):
                self._deliver(sender, notify)
        elif kind == "wready":
            out = self._outgoing.get(tid)
            if out is not None and out.peer == sender and out.stage == "posted":
                out.batch = self._post_sends(self._endpoints[out.peer], out.plan.src, int(msg["tag"]), out.iov)
                out.stage = "sending"
        elif kind == "wdone":
            out = self._outgoing.pop(tid, None)
            if out is not None:
                out.handle._finish(TransferStatus.DONE)
        elif kind == "err":
            out = self._outgoing.pop(tid, None)
            if out is not None:
                out.handle._finish(TransferStatus.FAILED, f"peer refused: {msg.get('why')}", TransferFailed)
                self._retire(out.batch, out.stage == "receiving")   # a read's posted receives

    def _on_request(self, kind: str, tid: int, sender: str, msg: dict[str, Any]) -> None:
        ep = self._endpoint_for(sender, bytes(msg["addr"]))
        notify = msg.get("notify")
        inc = _Incoming((sender, tid), bytes(notify) if notify is not None else None)
        iov = msg.get("iov", False) is True
        try:
            if inc.key in self._incoming:   # replacing it would drop requests UCX still works on
                raise TransportError(f"transfer {tid} of {sender!r} is already in flight")
            if len(self._incoming) >= MAX_INCOMING_PER_PEER and \
                    sum(key[0] == sender for key in self._incoming) >= MAX_INCOMING_PER_PEER:
                raise TransportError(f"{sender!r} has {MAX_INCOMING_PER_PEER} transfers in flight here already")
            runs = _unpack_runs(msg["runs"])
            runs.validate(self._regions)
            if iov and (self._iov is None or not self._host_only(runs, self._regions)):
                why = self.iov_unavailable_reason or "the runs touch CUDA memory"
                raise PageTableError(f"scatter-gather message asked for, but {why}")
        except (PageTableError, TransportError, ValueError) as exc:
            self._send_control(sender, {"k": "err", "id": tid, "from": self.name, "why": str(exc)[:500]})
            return
        if kind == "wreq":
            base = self._fresh_tag_base()
            inc.batch = self._post_receives(runs, base, iov)
            inc.receiving = True
            self._send_control(sender, {"k": "wready", "id": tid, "from": self.name, "tag": base})
        else:
            inc.batch = self._post_sends(ep, runs, int(msg["tag"]), iov)
            inc.acked = True  # a read needs no answer beyond its data
        self._incoming[inc.key] = inc

    def _poll_transfers(self) -> bool:
        busy = False
        if self._draining:
            self._draining = [b for b in self._draining if not b.done()]
        for out in list(self._outgoing.values()):
            if out.flush is not None:
                if out.flush.completed:
                    busy = True
                    self._outgoing.pop(out.handle.id, None)
                    self._rma_finished(out.handle, out.flush, out.notify)
                continue
            if out.stage in ("sending", "receiving") and out.batch.done():
                busy = True
                failure = out.batch.failure
                if failure is not None:
                    self._outgoing.pop(out.handle.id, None)
                    out.handle._finish(TransferStatus.FAILED, f"UCX error: {failure}", TransferFailed)
                    continue
                out.batch = _Batch()
                self._send_control(out.peer, {"k": "commit", "id": out.handle.id, "from": self.name})
                if out.stage == "receiving":
                    self._outgoing.pop(out.handle.id, None)
                    out.handle._finish(TransferStatus.DONE)
                else:
                    out.stage = "committed"
        for key, inc in list(self._incoming.items()):
            if inc.aborted:
                del self._incoming[key]
                busy = True
                self._retire(inc.batch, inc.receiving)   # a read's sends are kept until UCX is done
            elif inc.committed and inc.batch.done():
                del self._incoming[key]
                busy = True
                if inc.notify is not None:
                    self._deliver(key[0], inc.notify)
                if not inc.acked:
                    self._send_control(key[0], {"k": "wdone", "id": key[1], "from": self.name})
        return busy


def _too_late(handle: TransferHandle) -> bool:
    """``cancel`` of a one-sided transfer: its runs are posted and cannot be withdrawn."""
    return False


def _fail_rma(handle: TransferHandle, status: int, why: str) -> None:
    """Fail a one-sided transfer: a lost or unreachable peer as PeerUnreachable, the rest TransferFailed."""
    handle._finish(TransferStatus.FAILED, why, PeerUnreachable if status in PEER_LOST_STATUSES else TransferFailed)


def _pack_runs(table: PageTable) -> list[bytes]:
    return [table.addr.tobytes(), table.nbytes.tobytes(), table.region.tobytes()]


def _unpack_runs(v: Any) -> PageTable:
    """Runs from a peer's control message; lengths are checked before any array is built."""
    if not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, bytes) for x in v):
        raise PageTableError("control message runs: expected [addr, nbytes, region] byte strings")
    addr, nbytes, region = v
    n = len(addr) // 8
    if len(addr) != 8 * n or len(nbytes) != 8 * n or len(region) != 4 * n or n >= MAX_RUNS:
        raise PageTableError(f"control message runs: inconsistent lengths {len(addr)}, {len(nbytes)}, {len(region)}")
    return PageTable(np.frombuffer(addr, dtype=np.uint64), np.frombuffer(nbytes, dtype=np.uint64),
                     np.frombuffer(region, dtype=np.uint32))

