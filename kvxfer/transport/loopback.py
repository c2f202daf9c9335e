"""Loopback backend: transports in one process reach each other by name and copy by address.

It is the reference for the conformance suite and the substrate for fault-injection tests of the
serving layer: ``LoopbackFaults`` makes posts fail, never complete, complete late, lose or repeat
their notification, or corrupt bytes, each deterministically (counted per transport).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError, PeerUnreachable, TransferFailed, TransportError
from kvxfer.pagetable import TransferPlan
from kvxfer.transport.base import Op, Transport
from kvxfer.transport.copy import copy_plan, host_view
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.metadata import TransportMetadata

_registry: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


@dataclass
class LoopbackFaults:
    """Deterministic faults. Counters are 1-based and count this transport's posts / notifications."""

    fail_post: int | None = None
    """The Nth post fails (TransferFailed, nothing written, no notification)."""
    never_complete: bool = False
    """Every post stays pending until cancelled (a stalled peer)."""
    delay_s: float = 0.0
    """Bytes move and the transfer completes only this long after the post."""
    drop_notification: int | None = None
    """The Nth notification sent is lost (the data still arrives)."""
    duplicate_notification: int | None = None
    """The Nth notification sent is delivered twice."""
    corrupt: tuple[int, int] | None = None
    """(offset, length) into each transfer's destination byte stream: those bytes arrive inverted."""


class LoopbackTransport(Transport):
    """In-process transport; see the module docstring."""

    backend = "loopback"

    def __init__(self, name: str, faults: LoopbackFaults | None = None) -> None:
        super().__init__(name)
        self.faults = faults or LoopbackFaults()
        self._posts = 0
        self._notifications_sent = 0
        with _registry_lock:
            if name in _registry:
                raise TransportError(f"loopback transport {name!r} already exists in this process")
            _registry[name] = self

    def _backend_connect(self, peer: str, md: TransportMetadata) -> None:
        if _lookup(peer) is None:
            raise PeerUnreachable(f"loopback {self.name!r}: no live transport named {peer!r} in this process")

    def _backend_post(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                      transfer_id: int, *, settled: bool = False) -> TransferHandle:
        self._posts += 1
        post_no = self._posts
        due = time.monotonic() + self.faults.delay_s
        stalled = self.faults.never_complete

        def poll(handle: TransferHandle) -> None:
            if not stalled and time.monotonic() >= due:
                self._execute(handle, op, peer, plan, notify)

        handle = TransferHandle(transfer_id, peer, plan.total_bytes, op, poll=poll)
        if self.faults.fail_post == post_no:
            handle._finish(TransferStatus.FAILED, f"injected fault: post #{post_no} fails", TransferFailed)
        else:
            poll(handle)
        return handle

    def _execute(self, handle: TransferHandle, op: Op, peer: str, plan: TransferPlan,
                 notify: bytes | None) -> None:
        other = _lookup(peer)
        if other is None or other._closed or self._closed or peer not in self._peers:
            handle._finish(TransferStatus.FAILED, "peer closed or disconnected before the copy",
                           PeerUnreachable)
            return
        with handle._cond:
            if handle._status.terminal:
                return
            src_regions, dst_regions = ((self._regions, other._regions) if op == "write"
                                        else (other._regions, self._regions))
            try:
                # What a NIC does with remote keys: the peer's real registration, not what it advertised.
                plan.validate(src_regions, dst_regions)
            except PageTableError as exc:
                handle._finish(TransferStatus.FAILED, f"peer refused: {exc}", TransferFailed)
                return
            try:
                copy_plan(plan, src_regions, dst_regions)
                if self.faults.corrupt is not None:
                    _corrupt(plan, dst_regions, *self.faults.corrupt)
            except TransportError as exc:
                handle._finish(TransferStatus.FAILED, str(exc), TransferFailed)
                return
            handle._finish(TransferStatus.DONE)
        if notify is not None:
            self._notifications_sent += 1
            n = self._notifications_sent
            copies = 0 if self.faults.drop_notification == n else 2 if self.faults.duplicate_notification == n else 1
            for _ in range(copies):
                other._deliver(self.name, notify)

    def _backend_close(self) -> None:
        with _registry_lock:
            if _registry.get(self.name) is self:
                del _registry[self.name]


def _lookup(name: str) -> LoopbackTransport | None:
    with _registry_lock:
        return _registry.get(name)


def _corrupt(plan: TransferPlan, regions: Sequence[MemoryRegion], offset: int, length: int) -> None:
    """Invert bytes [offset, offset+length) of the plan's destination byte stream (host memory)."""
    ends = np.cumsum(plan.dst.nbytes.astype(np.int64))
    starts = ends - plan.dst.nbytes.astype(np.int64)
    lo, hi = offset, min(offset + length, int(ends[-1]) if ends.size else 0)
    for i in np.flatnonzero((starts < hi) & (ends > lo)).tolist():
        region = regions[int(plan.dst.region[i])]
        a = max(lo, int(starts[i])) - int(starts[i]) + int(plan.dst.addr[i]) - region.base_address
        b = min(hi, int(ends[i])) - int(starts[i]) + int(plan.dst.addr[i]) - region.base_address
        view = host_view(region)
        view[a:b] ^= 0xFF
