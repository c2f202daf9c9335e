"""ucx backend: two-sided UCX tag transfers through ucxx, with a service thread on every endpoint.

Every run of a plan travels as one tagged message, received straight into its destination pages
(no staging): the receiving side posts its receives before it lets the sender send. Control
messages (msgpack, on one reserved tag) drive both directions, so ``read`` needs no help from the
remote application - its service thread answers:

- write A->B: A ``wreq`` (runs, notify) -> B checks the runs against its own regions, posts receives
  under fresh tags, ``wready`` -> A sends the runs, then ``commit`` -> B, once every receive landed
  and the commit arrived, queues the notification and answers ``wdone`` -> A's handle completes.
- read A<-B: A posts receives under fresh tags, ``rreq`` (runs, tags, notify) -> B checks and sends
  the runs -> A's handle completes when every receive landed, then A sends ``commit`` -> B queues
  the notification.
- A cancel sends ``abort`` instead of ``commit``: the peer drops the notification. Receives already
  posted for a cancelled or refused transfer stay with UCX under tags that are never reused.

All UCX calls happen on the service thread (ucxx workers are not shared between threads); callers
enqueue work and wake it through a pipe. Progress is event driven (``arm`` + ``select`` on the
worker's epoll descriptor), which is far cheaper on few cores than ucxx's progress thread. Peers
connect by worker address with endpoint error handling off (a listener would force it on, and with
it UCX restricts itself to tcp): a dead peer is detected by the caller's deadline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import queue
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import BackendUnavailable, PageTableError, PeerUnreachable, TransferFailed, TransportError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport.base import Op, Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.metadata import MAX_NAME_CHARS, MAX_REGIONS, TransportMetadata
from kvxfer.transport.ucx_env import apply_ucx_defaults

CONTROL_TAG = 0x6B76_7866_0000_0001  # "kvxf" | 1: control messages
_DATA_FLAG = 1 << 63
_RUN_BITS = 24
MAX_RUNS = 1 << _RUN_BITS  # runs per transfer (one tag each)
MAX_CONTROL_BYTES = 64 << 20
_SELECT_TIMEOUT_S = 0.05


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


@dataclass
class _Outgoing:
    """A transfer this endpoint initiated."""

    handle: TransferHandle
    op: Op
    peer: str
    plan: TransferPlan
    notify: bytes | None
    requests: list[Any] = field(default_factory=list)
    stage: str = "posted"  # posted -> sending -> committed (write) | receiving (read)
    cancelled: bool = False


@dataclass
class _Incoming:
    """A transfer a peer initiated towards this endpoint (its writes into us, its reads from us)."""

    key: tuple[str, int]
    notify: bytes | None
    requests: list[Any] = field(default_factory=list)
    committed: bool = False
    aborted: bool = False
    acked: bool = False


class UcxTransport(Transport):
    """Two-sided transport over a ucxx worker; see the module docstring for the protocol."""

    backend = "ucx"

    def __init__(self, name: str) -> None:
        super().__init__(name)
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
        self._ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = bytes(self._worker.address.tobytes())
        self._views: list[npt.NDArray[np.uint8] | None] = []
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

    def _serve(self) -> None:
        epoll_fd = self._worker.epoll_file_descriptor
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
                while self._worker.progress_once():
                    busy = True
                busy |= self._poll_control()
                busy |= self._poll_transfers()
                if not busy and self._worker.arm():
                    ready, _, _ = select.select([epoll_fd, self._wake_r], [], [], _SELECT_TIMEOUT_S)
                    if self._wake_r in ready:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self._wake_r, 4096):
                                pass
        except BaseException as exc:
            self._service_error = exc
            for out in list(self._outgoing.values()):
                out.handle._finish(TransferStatus.FAILED, f"ucx service thread died: {exc!r}", TransferFailed)

    # --- registration and peers ---------------------------------------------------------------------
    def _backend_register(self, regions: tuple[MemoryRegion, ...]) -> None:
        from kvxfer.transport.copy import host_view

        self._views = [None if r.memory_kind == "cuda" else host_view(r) for r in regions]

    def _backend_blob(self) -> bytes:
        return self._address

    def _backend_connect(self, peer: str, md: TransportMetadata) -> None:
        def make() -> None:
            self._endpoint_for(peer, md.backend_blob)

        try:
            self._call(make, f"connect {peer!r}")
        except TransportError:
            raise
        except Exception as exc:
            raise PeerUnreachable(f"ucx {self.name!r}: cannot reach peer {peer!r} by worker address: {exc}") from exc

    def _endpoint_for(self, peer: str, address: bytes) -> Any:
        ep = self._endpoints.get(peer)
        if ep is None:
            addr = self._api.UCXAddress.create_from_buffer(address)
            ep = self._worker.create_endpoint_from_worker_address(addr, False)
            self._endpoints[peer] = ep
        return ep

    def _backend_disconnect(self, peer: str) -> None:
        def drop() -> None:
            for out in [o for o in self._outgoing.values() if o.peer == peer]:
                out.handle._finish(TransferStatus.FAILED, "peer disconnected", PeerUnreachable)
                self._outgoing.pop(out.handle.id, None)

        self._call(drop, f"disconnect {peer!r}")

    def _backend_close(self) -> None:
        def fail_all() -> None:
            for out in self._outgoing.values():
                out.handle._finish(TransferStatus.FAILED, "transport closed", TransferFailed)
            self._outgoing.clear()

        if self._thread.is_alive():
            self._call(fail_all, "close")
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._endpoints.clear()

    # --- memory -------------------------------------------------------------------------------------
    def _buffers(self, table: PageTable, regions: tuple[MemoryRegion, ...],
                 views: list[npt.NDArray[np.uint8] | None]) -> list[Any]:
        """One ucxx Array per entry: numpy slices of region views (host) or CUDA range wrappers."""
        base = np.array([r.base_address for r in regions], dtype=np.uint64)[table.region]
        offs = (table.addr - base).tolist()
        ends = (table.addr - base + table.nbytes).tolist()
        out = []
        for r, o, e, a in zip(table.region.tolist(), offs, ends, table.addr.tolist(), strict=True):
            view = views[r]
            out.append(self._array(view[o:e] if view is not None else _CudaRun(a, e - o)))
        return out

    # --- posting (caller thread) --------------------------------------------------------------------
    def _backend_post(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                      transfer_id: int) -> TransferHandle:
        if len(plan) >= MAX_RUNS:
            raise TransportError(f"ucx {op} with peer {peer!r}: {len(plan)} runs exceeds {MAX_RUNS - 1}; "
                                 f"coalesce or split the plan")
        out = _Outgoing(TransferHandle(transfer_id, peer, plan.total_bytes, op, abort=self._abort_from_caller),
                        op, peer, plan, notify)
        self._submit(lambda: self._start(out))
        return out.handle

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
                                  "notify": out.notify}
        if out.op == "write":
            header.update(k="wreq", runs=_pack_runs(out.plan.dst))
        else:
            base = self._fresh_tag_base()
            bufs = self._buffers(out.plan.dst, self._regions, self._views)
            out.requests = [self._worker.tag_recv(b, self._api.UCXXTag(base | i)) for i, b in enumerate(bufs)]
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
        if kind in ("wreq", "rreq"):
            self._on_request(kind, tid, sender, msg)
        elif kind in ("commit", "abort"):
            inc = self._incoming.get((sender, tid))
            if inc is not None:
                inc.committed |= kind == "commit"
                inc.aborted |= kind == "abort"
        elif kind == "wready":
            out = self._outgoing.get(tid)
            if out is not None and out.peer == sender and out.stage == "posted":
                base = int(msg["tag"])
                ep = self._endpoints[out.peer]
                bufs = self._buffers(out.plan.src, self._regions, self._views)
                out.requests = [ep.tag_send(b, self._api.UCXXTag(base | i)) for i, b in enumerate(bufs)]
                out.stage = "sending"
        elif kind == "wdone":
            out = self._outgoing.pop(tid, None)
            if out is not None:
                out.handle._finish(TransferStatus.DONE)
        elif kind == "err":
            out = self._outgoing.pop(tid, None)
            if out is not None:
                out.handle._finish(TransferStatus.FAILED, f"peer refused: {msg.get('why')}", TransferFailed)

    def _on_request(self, kind: str, tid: int, sender: str, msg: dict[str, Any]) -> None:
        ep = self._endpoint_for(sender, bytes(msg["addr"]))
        notify = msg.get("notify")
        inc = _Incoming((sender, tid), bytes(notify) if notify is not None else None)
        try:
            runs = _unpack_runs(msg["runs"])
            runs.validate(self._regions)
        except (PageTableError, ValueError) as exc:
            self._send_control(sender, {"k": "err", "id": tid, "from": self.name, "why": str(exc)[:500]})
            return
        bufs = self._buffers(runs, self._regions, self._views)
        if kind == "wreq":
            base = self._fresh_tag_base()
            inc.requests = [self._worker.tag_recv(b, self._api.UCXXTag(base | i)) for i, b in enumerate(bufs)]
            self._send_control(sender, {"k": "wready", "id": tid, "from": self.name, "tag": base})
        else:
            base = int(msg["tag"])
            inc.requests = [ep.tag_send(b, self._api.UCXXTag(base | i)) for i, b in enumerate(bufs)]
            inc.acked = True  # a read needs no answer beyond its data
        self._incoming[inc.key] = inc

    def _poll_transfers(self) -> bool:
        busy = False
        for out in list(self._outgoing.values()):
            if out.stage in ("sending", "receiving") and _all_done(out.requests):
                busy = True
                failure = _first_error(out.requests)
                if failure is not None:
                    self._outgoing.pop(out.handle.id, None)
                    out.handle._finish(TransferStatus.FAILED, f"UCX error: {failure}", TransferFailed)
                    continue
                out.requests = []
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
            elif inc.committed and _all_done(inc.requests):
                del self._incoming[key]
                busy = True
                if inc.notify is not None:
                    self._deliver(key[0], inc.notify)
                if not inc.acked:
                    self._send_control(key[0], {"k": "wdone", "id": key[1], "from": self.name})
        return busy


def _all_done(requests: list[Any]) -> bool:
    return all(r.completed for r in requests)


def _first_error(requests: list[Any]) -> str | None:
    for r in requests:
        try:
            r.check_error()
        except Exception as exc:
            return repr(exc)
    return None


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

