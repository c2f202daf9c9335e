"""cuda_ipc backend: peers on one node map each other's device pools through CUDA IPC handles and
execute a whole plan as one kernel launch on a stream (see ``cuda_copy``).

Connect maps the peer's regions once and uploads the table that translates its advertised addresses
(``cuda_copy.RegionTable``, which also bounds every run to its regions, so a large plan is checked
while it copies); a post uploads the plan's arrays in one copy and launches. Completion is
the copy's CUDA event. A copy that must tell the peer (``notify``) or someone (``add_done_callback``)
is handed to a completion thread, which synchronises on its event and finishes it (callbacks such as
a worker engine's wake-up run then); any other copy costs no thread at all: ``status``/``done`` query
its event, and ``wait`` synchronises on it in the caller's thread when nothing but copies is queued
ahead of it (the model's stream was idle at post), else hands it to the completion thread and waits,
bounded by its timeout. Whichever sees the event complete first finishes the handle (and sends the
notification). Notifications travel after the data on a plain TCP channel on 127.0.0.1
(``notify_channel``: the sending thread writes the frame itself, no I/O thread between); the peer's
receiver thread delivers them (and wakes the owner's engine) as they arrive, so nobody polls for them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import (
    BackendUnavailable,
    DecodeError,
    PageTableError,
    PeerUnreachable,
    TransferFailed,
    TransportError,
)
from kvxfer.pagetable import BlockPlan, PhasedPlan, TransferPlan
from kvxfer.transport.base import Op, Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.metadata import TransportMetadata
from kvxfer.transport.notify_channel import ENDPOINT_PREFIX, NotifyInbox, NotifyOutbox, parse_endpoint
from kvxfer.transport.prepared import PreparedTransfer

_MAX_BLOB_BYTES = 16 << 20

log = logging.getLogger(__name__)


def node_id() -> str:
    """Identifies this OS instance: peers with equal node ids can exchange CUDA IPC handles."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def cuda_ipc_unavailable_reason() -> str | None:
    """None when this machine can run the backend, else why not."""
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-python (cuda.bindings) is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


class CudaIpcTransport(Transport):
    """Intra-node transport over CUDA IPC; every registered region must be device memory."""

    backend = "cuda_ipc"
    posts_templates = True

    def __init__(self, name: str, *, device_id: int | None = None, method: str = "auto") -> None:
        super().__init__(name)
        reason = cuda_ipc_unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(reason)
        import torch

        from kvxfer.transport import cuda_copy

        self._cuda = cuda_copy
        self._device_id = torch.cuda.current_device() if device_id is None else device_id
        self._copier = cuda_copy.BatchedCopier(self._device_id, method)
        self._default_stream = torch.cuda.default_stream(self._device_id)
        self._mappings = cuda_copy.IpcMappings(self._device_id)
        self._exports: list[list[Any]] = []
        self._peer_tables: dict[str, Any] = {}   # peer -> cuda_copy.RegionTable
        self._local_table: Any = None            # cuda_copy.RegionTable of the registered regions
        self._push: dict[str, NotifyOutbox] = {}
        self._push_lock = threading.Lock()
        self._completions: queue.Queue[_CopyHandle | None] = queue.Queue()
        self._notify_inbox = NotifyInbox(name, self._deliver)   # frames of unconnected senders are dropped there
        try:
            self._completer = threading.Thread(target=self._complete_loop, name=f"cuda-ipc-{name}", daemon=True)
            self._completer.start()
        except BaseException:
            self._notify_inbox.close()
            raise

    @property
    def method(self) -> str:
        """How plans are executed: "kernel" (Triton), "batch" (cuMemcpyBatchAsync) or "loop"."""
        return str(self._copier.method)

    # --- registration and peers ---------------------------------------------------------------
    def _backend_register(self, regions: tuple[MemoryRegion, ...]) -> None:
        for i, r in enumerate(regions):
            if r.memory_kind != "cuda":
                raise TransportError(f"cuda_ipc {self.name!r}: region {i} is {r.memory_kind!r} memory; "
                                     f"this backend moves device memory only")
        self._exports = [self._cuda.export_region(r.base_address, r.nbytes, r.device_id).to_wire() for r in regions]
        base = np.array([r.base_address for r in regions], dtype=np.uint64)
        self._local_table = self._cuda.RegionTable(base, base, self._device_id,
                                                  np.array([r.nbytes for r in regions], dtype=np.uint64))

    def _backend_blob(self) -> bytes:
        return bytes(msgpack.packb({"node": node_id(), "notify": self._notify_inbox.endpoint, "regions": self._exports},
                                   use_bin_type=True))

    def _backend_connect(self, peer: str, md: TransportMetadata) -> None:
        blob = _decode_blob(md, peer)
        if blob["node"] != node_id():
            raise PeerUnreachable(f"cuda_ipc {self.name!r}: peer {peer!r} runs on another node "
                                  f"({blob['node']!r}); CUDA IPC works within one node only")
        push = NotifyOutbox(blob["notify"], self.name)   # first: a peer that is gone maps nothing
        try:
            table = self._map_peer(peer, md, blob)
        except BaseException:
            push.close()
            raise
        self._peer_tables[peer] = table
        with self._push_lock:
            old, self._push[peer] = self._push.get(peer), push
        if old is not None:
            old.close()

    def _map_peer(self, peer: str, md: TransportMetadata, blob: dict[str, Any]) -> Any:
        """Map the peer's regions through their IPC handles: the table translating its addresses."""
        mapped = []
        for i, (region, wire) in enumerate(zip(md.regions, blob["regions"], strict=True)):
            handle, offset, nbytes, device = wire
            if nbytes != region.nbytes or region.memory_kind != "cuda":
                raise DecodeError(f"cuda_ipc peer {peer!r}: region {i} IPC size {nbytes} does not match the "
                                  f"advertised {region.nbytes} bytes of {region.memory_kind} memory")
            try:
                mapped.append(self._mappings.open(self._cuda.IpcRegion(handle, offset, nbytes, device)))
            except TransferFailed as exc:
                raise PeerUnreachable(f"cuda_ipc {self.name!r}: cannot map region {i} of peer {peer!r}: {exc}") from exc
        advertised = np.array([r.base_address for r in md.regions], dtype=np.uint64)
        return self._cuda.RegionTable(advertised, np.array(mapped, dtype=np.uint64), self._device_id,
                                      np.array([r.nbytes for r in md.regions], dtype=np.uint64))

    def _backend_disconnect(self, peer: str) -> None:
        if self._peer_tables.pop(peer, None) is not None:
            self._copier.stream.synchronize()   # copies queued to it still read its address table
        with self._push_lock:
            sock = self._push.pop(peer, None)
        if sock is not None:
            sock.close()

    def _backend_close(self) -> None:
        self._completions.put(None)
        self._completer.join(10)
        self._notify_inbox.close()
        with self._push_lock:
            pushes, self._push = list(self._push.values()), {}
        for push in pushes:
            push.close()
        self._copier.stream.synchronize()
        self._mappings.close()

    # --- transfers ----------------------------------------------------------------------------
    def _backend_post(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                      transfer_id: int, *, settled: bool = False) -> TransferHandle:
        return self._notifying(self._launch(op, peer, plan, notify, transfer_id, settled), notify, settled)

    def _backend_post_checking(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                               transfer_id: int, check: Callable[[], None], *,
                               settled: bool = False) -> TransferHandle | None:
        """The kernel copies no run outside its regions (both sides' bounds are on the device), so a
        large plan starts at once and the host checks it while the GPU copies (the check of a 131,072-run
        plan costs about as long as its 4 GiB copy). A refused plan: wait for the copy, no notification."""
        if not self._bounded_on_device(peer, len(plan)):
            return None
        handle = self._launch(op, peer, plan, notify, transfer_id, settled)
        return self._notifying(self._checked(handle, check), notify, settled)

    def _backend_post_blocks(self, op: Op, peer: str, plan: BlockPlan, notify: bytes | None, transfer_id: int,
                             check: Callable[[], None], *, settled: bool = False) -> TransferHandle | None:
        """A block plan goes to the GPU as its slots and template (a few KiB for 131,072 runs): the kernel
        forms every run's addresses and confines each to its regions, so it starts at once and ``check``
        runs while it copies, as for a run list; the post's host work is O(blocks + template). Without the
        kernel, or for a plan of a few runs (one block: ``cuMemcpyAsync`` per run starts sooner than any
        launch): None (its expansion is checked and posted)."""
        return self._post_templates(op, peer, [plan], notify, transfer_id, check, settled)

    def _backend_post_phases(self, op: Op, peer: str, plan: PhasedPlan, notify: bytes | None, transfer_id: int,
                             check: Callable[[], None], *, settled: bool = False) -> TransferHandle | None:
        """A PhasedPlan as one copy: each phase's slots and template uploaded and its kernel launched, back to
        back on the copier's stream, one event after the last (``_backend_post_blocks`` per phase, one handle
        and notification for all)."""
        return self._post_templates(op, peer, [p for p in plan.phases if len(p)], notify, transfer_id, check,
                                    settled)

    def _post_templates(self, op: Op, peer: str, plans: list[BlockPlan], notify: bytes | None, transfer_id: int,
                        check: Callable[[], None], settled: bool) -> TransferHandle | None:
        """Block plans through the block kernels, ``check`` run while they copy; None where the kernel does not
        take them (no bounds on the device, a plan of a few runs, no Triton)."""
        if not self._bounded_on_device(peer, sum(len(p) for p in plans)) or not self._copier.block_kernel_ready():
            return None
        local_table = self._local_table

        def enqueue(table: Any, after_model: bool) -> Any:
            return self._copier.copy_phases(plans, table, op == "read", local_table, after_model=after_model)
        handle = self._enqueue(op, peer, sum(p.total_bytes for p in plans), enqueue, notify, transfer_id, settled)
        return self._notifying(self._checked(handle, check), notify, settled)

    def _bounded_on_device(self, peer: str, runs: int) -> bool:
        """Whether a plan of ``runs`` runs to ``peer`` goes through the kernel with both sides' bounds."""
        table = self._peer_tables.get(peer)
        return self._local_table is not None and table is not None and table.bounded and \
            self._local_table.bounded and self._copier.bounds_on_device(runs)

    @staticmethod
    def _checked(handle: TransferHandle, check: Callable[[], None]) -> TransferHandle:
        """Run the host's ``check`` while the launched copy moves; on a refusal wait for the copy, fail the
        handle (nobody gets it, no notification is sent) and re-raise."""
        try:
            check()
        except PageTableError as exc:
            if isinstance(handle, _CopyHandle):
                with contextlib.suppress(RuntimeError):
                    handle.event.synchronize()
            handle._finish(TransferStatus.FAILED, str(exc), TransferFailed)
            raise
        return handle

    def _backend_prepare(self, op: Op, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan) -> Any:
        """The plan's kernel table packed and uploaded once into a device buffer of its own (a block plan's
        slots and template where the block kernel runs, each phase's for a phased plan), or its direct
        copies' addresses translated."""
        table = self._peer_tables.get(peer)
        if table is None:
            raise PeerUnreachable(f"cuda_ipc {self.name!r}: peer {peer!r} is not mapped")
        if isinstance(plan, PhasedPlan):
            phases = [p for p in plan.phases if len(p)]
            if self._bounded_on_device(peer, len(plan)) and self._copier.block_kernel_ready():
                return _Prepared(table, self._copier.prepare_phases(phases, table, op == "read", self._local_table))
            plan = plan.expand()
        if isinstance(plan, BlockPlan):
            if self._bounded_on_device(peer, len(plan)) and self._copier.block_kernel_ready():
                return _Prepared(table, self._copier.prepare_blocks(plan, table, op == "read", self._local_table))
            plan = plan.expand()
        remote, local = (plan.dst, plan.src) if op == "write" else (plan.src, plan.dst)
        return _Prepared(table, self._copier.prepare_copy(plan.dst.addr, plan.src.addr, plan.src.nbytes, remote.region,
                                                          table, op == "read", local.region, self._local_table))

    def _backend_post_prepared(self, prepared: PreparedTransfer, notify: bytes | None, transfer_id: int, *,
                               settled: bool = False) -> TransferHandle:
        """One launch of the prepared table (no per-run host work); the copy's handle as ``write``'s."""
        state, peer = prepared.backend_state, prepared.peer
        if not isinstance(state, _Prepared):   # released by another thread since the post began
            raise TransportError(f"cuda_ipc {self.name!r}: prepared {prepared.op} to peer {peer!r} was released")
        if self._peer_tables.get(peer) is not state.peer_table:
            raise PeerUnreachable(f"cuda_ipc {self.name!r}: peer {peer!r} was remapped since the transfer was "
                                  f"prepared; prepare it again")

        def enqueue(table: Any, after_model: bool) -> Any:
            return self._copier.launch_prepared(state.copy, after_model=after_model)
        handle = self._enqueue(prepared.op, peer, state.copy.nbytes, enqueue, notify, transfer_id, settled)
        return self._notifying(handle, notify, settled)

    @staticmethod
    def _notifying(handle: TransferHandle, notify: bytes | None, settled: bool) -> TransferHandle:
        """A copy with a notification is finished by the completion thread, as the peer learns of the data
        only through it; a settled one by the posting thread, which waits on its event (the GIL released)
        and sends the notification itself. Nothing but copies is queued ahead of a settled copy, so the
        wait is its own duration (0.07 ms for 128 MiB, 2 ms for 4 GiB on the H200), against ~0.2 ms of
        hand-off to the completion thread on the time to first token."""
        if notify is None or not isinstance(handle, _CopyHandle):
            return handle
        if settled:
            handle.finish_here()
        else:
            handle.watch()
        return handle

    def _launch(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                transfer_id: int, settled: bool = False) -> TransferHandle:
        """Enqueue the plan's copies; the handle is finished by whoever looks (not watched yet)."""
        remote, local = (plan.dst, plan.src) if op == "write" else (plan.src, plan.dst)

        def enqueue(table: Any, after_model: bool) -> Any:
            return self._copier.copy(plan.dst.addr, plan.src.addr, plan.src.nbytes, remote.region, table,
                                     op == "read", local.region, self._local_table, after_model=after_model)
        return self._enqueue(op, peer, plan.total_bytes, enqueue, notify, transfer_id, settled)

    def _enqueue(self, op: Op, peer: str, nbytes: int, enqueue: Callable[[Any, bool], Any], notify: bytes | None,
                 transfer_id: int, settled: bool) -> TransferHandle:
        """``enqueue(peer's region table, after_model)`` queues the copies (after the model's stream's work
        when ``after_model``) and returns their event; the handle of them (a failed one when the copier
        refused)."""
        table = self._peer_tables.get(peer)
        if table is None:
            raise PeerUnreachable(f"cuda_ipc {self.name!r}: peer {peer!r} is not mapped")
        # Only copies (bounded) are queued ahead of this one when it does not wait for the model's stream
        # or that stream is idle now. Idle, it has nothing for the copy to wait for (work queued there from
        # now on is later than this post): the copy is launched without the event record and stream wait,
        # two CUDA calls fewer before the GPU starts.
        bounded = settled or bool(self._default_stream.query())
        try:
            event = enqueue(table, not bounded)
        except TransferFailed as exc:
            failed = TransferHandle(transfer_id, peer, nbytes, op, abort=lambda h: False)
            failed._finish(TransferStatus.FAILED, str(exc), TransferFailed)
            return failed
        return _CopyHandle(transfer_id, peer, nbytes, op, event, bounded,
                           lambda h: self._complete(h, peer, notify), self._completions.put)

    def _complete(self, handle: _CopyHandle, peer: str, notify: bytes | None) -> None:
        """Finish ``handle`` once its event completed. The notification goes first (the first caller sends
        it): the handle's callbacks (an engine's wake-up, which then runs Python) would otherwise hold
        the GIL ahead of it, and the peer waits for it. The handle's ``finished_at`` is taken first: the
        send may give the GIL away (to a compute thread, for up to its switch interval)."""
        done_at = time.monotonic()
        if notify is not None and handle.claim_notification():
            with self._push_lock:
                push = self._push.get(peer)
            try:
                if push is None:
                    raise PeerUnreachable(f"peer {peer!r} was disconnected")
                push.send(notify)
            except PeerUnreachable as exc:   # the data is there, but the peer will never learn of it
                handle._finish(TransferStatus.FAILED, f"cuda_ipc {self.name!r}: copy done, its notification to "
                               f"{peer!r} not sent: {exc}", TransferFailed)
                return
        handle._finish(TransferStatus.DONE, at=done_at)

    def _complete_loop(self) -> None:
        """Finish every posted copy once its event completed, in posting order (a caller blocked in
        ``wait`` on a bounded copy may finish it first: ``_finish`` lets one win)."""
        while True:
            handle = self._completions.get()
            if handle is None:
                return
            if handle._status.terminal:
                continue
            try:
                handle.event.synchronize()
            except RuntimeError as exc:
                handle._finish(TransferStatus.FAILED, f"CUDA copy failed: {exc}", TransferFailed)
                continue
            try:
                handle.complete(handle)
            except Exception as exc:   # a callback or the notification failed: the handle is still finished
                log.error("cuda_ipc %r: completing transfer %d failed: %s", self.name, handle.id, exc, exc_info=exc)


class _Prepared:
    """cuda_ipc's state of a prepared transfer: the copier's prepared copy and the peer's region table it
    was made against (a reconnect maps the peer anew: the copy must not run against the old mapping)."""

    __slots__ = ("copy", "peer_table")

    def __init__(self, peer_table: Any, copy: Any) -> None:
        self.peer_table = peer_table
        self.copy = copy


class _CopyHandle(TransferHandle):
    """A posted copy (see the module docstring): finished by the completion thread once ``watch``ed,
    else by whoever asks (``status``, ``done``, ``wait``), so a caller that posts and waits pays no
    thread hand-off."""

    def __init__(self, transfer_id: int, peer: str, nbytes: int, op: str, event: Any, bounded: bool,
                 complete: Callable[[_CopyHandle], None], hand_off: Callable[[_CopyHandle], None]) -> None:
        super().__init__(transfer_id, peer, nbytes, op, abort=lambda h: False)
        self.event = event
        self.bounded = bounded
        self.complete = complete
        self._hand_off = hand_off
        self._watched = False
        self._notified = False

    def claim_notification(self) -> bool:
        """True for the one caller that sends this copy's notification (none once the copy failed)."""
        with self._cond:
            if self._notified or self._status.terminal:
                return False
            self._notified = True
            return True

    def finish_here(self) -> None:
        """Wait for the copy's event in this thread and finish the copy (its notification included)."""
        try:
            self.event.synchronize()
        except RuntimeError as exc:
            self._finish(TransferStatus.FAILED, f"CUDA copy failed: {exc}", TransferFailed)
        else:
            self.complete(self)

    def watch(self) -> None:
        """Have the completion thread finish this copy (once; no-op when finished)."""
        with self._cond:
            if self._watched or self._status.terminal:
                return
            self._watched = True
        self._hand_off(self)

    @property
    def status(self) -> TransferStatus:
        """Current state; an unwatched copy is finished here when its event has completed."""
        if not self._status.terminal and not self._watched:
            try:
                ready = bool(self.event.query())
            except RuntimeError as exc:
                self._finish(TransferStatus.FAILED, f"CUDA copy failed: {exc}", TransferFailed)
            else:
                if ready:
                    self.complete(self)
        return self._status

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """As ``TransferHandle.add_done_callback``: the completion thread then finishes the copy."""
        super().add_done_callback(fn)
        self.watch()

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise TransferTimeout (still pending), or the failure."""
        if self.bounded and not self._status.terminal:
            self.finish_here()
        elif not self._status.terminal:
            self.watch()
        super().wait(timeout)


def _decode_blob(md: TransportMetadata, peer: str) -> dict[str, Any]:
    """Check the backend blob of a cuda_ipc peer: bounded, typed, one IPC entry per region."""
    where = f"cuda_ipc metadata of peer {peer!r}"
    if len(md.backend_blob) > _MAX_BLOB_BYTES:
        raise DecodeError(f"{where}: blob of {len(md.backend_blob)} bytes")
    try:
        blob = msgpack.unpackb(md.backend_blob, raw=False, strict_map_key=True, max_array_len=1 << 16,
                               max_map_len=8, max_str_len=1024, max_bin_len=256)
    except Exception as exc:
        raise DecodeError(f"{where}: not valid msgpack ({exc})") from exc
    if not isinstance(blob, dict) or not isinstance(blob.get("node"), str) or \
            not isinstance(blob.get("notify"), str) or not isinstance(blob.get("regions"), list):
        raise DecodeError(f"{where}: expected node, notify ({ENDPOINT_PREFIX}<port>) and regions")
    try:
        parse_endpoint(blob["notify"])
    except DecodeError as exc:
        raise DecodeError(f"{where}: {exc}") from exc
    if len(blob["regions"]) != len(md.regions):
        raise DecodeError(f"{where}: {len(blob['regions'])} IPC entries for {len(md.regions)} regions")
    for i, w in enumerate(blob["regions"]):
        ok = (isinstance(w, list) and len(w) == 4 and isinstance(w[0], bytes) and len(w[0]) == 64
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in w[1:]))
        if not ok:
            raise DecodeError(f"{where}: IPC entry {i} is malformed")
    return blob


__all__ = ["CudaIpcTransport", "cuda_ipc_unavailable_reason", "node_id"]
