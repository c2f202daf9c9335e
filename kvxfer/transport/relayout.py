"""A pull between two layouts whose completion includes the re-layout: ``read_relayout`` reads a landing
plan's large pieces into this transport's landing region and, once they are in, re-lays them out into the
destination pages on the host; the handle is done only then, so a caller that publishes the KV on
completion never shows it half placed. A failed or cancelled read leaves the destination pages untouched
(the landing region alone holds what arrived)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.errors import BackendUnavailable, TransportError
from kvxfer.pagetable import BlockPlan, TransferPlan
from kvxfer.pagetable.relayout import LandingPlan, relayout_host, relayout_torch
from kvxfer.transport.base import Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus


class RelayoutHandle(TransferHandle):
    """The read of a landing plan, then its re-layout: terminal when both are (polled: ``wait``/``done``
    look at the read and run the re-layout in the thread that sees it complete, once)."""

    def __init__(self, transport: Transport, read: TransferHandle, landing: LandingPlan) -> None:
        super().__init__(read.id, read.peer, landing.total_bytes, "read",
                         poll=RelayoutHandle._advance, abort=RelayoutHandle._stop)   # type: ignore[arg-type]
        self._transport, self._read, self._landing = transport, read, landing
        self._placing = threading.Lock()

    def _advance(self) -> None:
        status = self._read.status
        if status is TransferStatus.PENDING:
            return
        with self._placing:
            if self._status.terminal:
                return
            if status is not TransferStatus.DONE:
                self._finish(status, f"the landing read ended {status.value}: {self._read.reason}",
                             self._read._error_type)
                return
            try:
                relayout_landed(self._transport, self._landing.relayout)
            except Exception as exc:
                self._finish(TransferStatus.FAILED, f"the re-layout failed: {exc!r}")
                return
            self._finish(TransferStatus.DONE)

    def _stop(self) -> bool:
        return self._read.cancel()

    def wait(self, timeout: float | None = None) -> None:
        with contextlib.suppress(TransportError):   # the read's end is reported below, as this handle's
            self._read.wait(timeout)
        self._advance()
        self._raise_unless_done(timeout)


def relayout_landed(transport: Transport, plans: Sequence[BlockPlan]) -> None:
    """Run re-layout ``plans`` on ``transport``'s registered memory (landing region -> the pages): by the GPU
    for device pools, done once it has (the block copy kernels of ``cuda_copy`` where they run: O(blocks +
    template) host work, one launch per plan; else ``relayout_torch``), else on the host (``relayout_host``)."""
    regions = transport.regions
    devices = {regions[int(r)].device_id for p in plans for r in p.dst_region if regions[int(r)].memory_kind == "cuda"}
    if not devices:
        relayout_host(plans, regions, regions)
        return
    import torch
    if len(devices) == 1:
        copier = _device_copier(next(iter(devices)))
        if copier is not None:
            for p in plans:          # checked here: the copier's local table does not bound the runs
                p.validate(regions, regions)
            # Its one region stands for every registered one: the plans' region ids are for the check above.
            local = [dataclasses.replace(p, src_region=np.zeros_like(p.src_region),
                                         dst_region=np.zeros_like(p.dst_region)) for p in plans]
            copier.copy_phases(local, copier.local_table, False).synchronize()
            return
    relayout_torch(plans, regions, regions)
    for d in devices:
        torch.cuda.synchronize(d)


def _device_copier(device_id: int) -> Any:
    """The process's local block copier of ``device_id`` (``cuda_copy.local_copier``), or None where the block
    kernels do not run (no cuda-python or Triton, or their check copy failed)."""
    try:
        from kvxfer.transport import cuda_copy
    except BackendUnavailable:
        return None
    copier = cuda_copy.local_copier(device_id)
    return copier if copier.block_kernel_ready() else None


class PipelinedRelayoutHandle(TransferHandle):
    """The landing read cut into pieces (``LandingPlan.pieces``), each re-laid out as soon as it is in while
    the next one moves: the thread that advances the handle (``wait``, ``done``, ``status``) posts piece
    ``i + 1``'s read before it re-lays out piece ``i``, so a transport that moves bytes on its own (a NIC's
    RDMA, a progress thread, a GPU's copy engine) moves the next piece during the re-layout; one whose
    poster copies the bytes itself (shared memory on one host) gains nothing and loses little (a read and
    a re-layout call per piece). Terminal only when every piece is placed, or on a failure or a cancel
    (no re-layout runs then: it runs under the handle's lock); the peer's ``notify`` follows the last
    read."""

    def __init__(self, transport: Transport, peer: str, landing: LandingPlan, max_bytes: int,
                 notify: bytes | None) -> None:
        self._transport, self._notify = transport, notify
        self._pieces = landing.pieces(max_bytes)
        self._placing = threading.Lock()
        self._stopped = False
        self._read: TransferHandle | None = transport.read(peer, self._pieces[0][0])
        self._next = 1   # pieces whose read was posted
        super().__init__(self._read.id, peer, landing.total_bytes, "read",
                         poll=PipelinedRelayoutHandle._advance, abort=PipelinedRelayoutHandle._stop)   # type: ignore[arg-type]

    @property
    def pieces(self) -> int:
        """How many pieces the landing read was cut into."""
        return len(self._pieces)

    def _advance(self) -> None:
        with self._placing:
            if self._status.terminal or self._stopped:
                return
            while self._read is not None:
                read = self._read
                status = read.status
                if status is TransferStatus.PENDING:
                    return
                if status is not TransferStatus.DONE:
                    self._finish(status, f"the landing read of piece {self._next} of {len(self._pieces)} ended "
                                         f"{status.value}: {read.reason}", read._error_type)
                    return
                placed = self._pieces[self._next - 1][1]
                self._read = None
                if self._next < len(self._pieces):   # the next piece moves while this one is placed
                    try:
                        self._read = self._transport.read(self.peer, self._pieces[self._next][0])
                    except TransportError as exc:
                        self._finish(TransferStatus.FAILED, f"the landing read of piece {self._next + 1} of "
                                     f"{len(self._pieces)} was refused: {exc}", type(exc))
                        return
                    self._next += 1
                try:
                    relayout_landed(self._transport, placed)
                except Exception as exc:
                    if self._read is not None:
                        self._read.cancel()
                    self._finish(TransferStatus.FAILED, f"the re-layout failed: {exc!r}")
                    return
            if self._notify is not None:   # after every read: the peer may release its pages then
                try:
                    self._transport.write(self.peer, TransferPlan.empty(), self._notify).wait(10.0)
                except TransportError as exc:
                    self._finish(TransferStatus.FAILED, f"the notice after the landing read failed: {exc}",
                                 type(exc))
                    return
            self._finish(TransferStatus.DONE)

    def _stop(self) -> bool:
        with self._placing:   # a re-layout in progress ends first
            self._stopped = True
            if self._read is not None:
                self._read.cancel()
        return True

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            self._advance()
            if self._status.terminal:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            read = self._read
            if self._stopped or read is None:   # a cancel is finishing the handle
                time.sleep(0.001)
                continue
            with contextlib.suppress(TransportError):   # its end is reported by ``_advance``
                read.wait(left)
        self._raise_unless_done(timeout)


def read_relayout(transport: Transport, peer: str, landing: LandingPlan, notify: bytes | None = None, *,
                  piece_bytes: int | None = None) -> RelayoutHandle | PipelinedRelayoutHandle:
    """Pull ``landing.transfer`` from ``peer`` into this transport's landing region, then (as part of the
    completion) run ``landing.relayout`` on this host's registered memory (by the GPU for device pools,
``relayout_torch``, else ``relayout_host``): source = the landing region,
    destination = the request's pages, both among ``transport.regions``. ``notify`` reaches the peer after
    the read (it may release its pages then: the re-layout reads only the landing region).

    ``piece_bytes``: the read moves in pieces of about that many bytes, each re-laid out while the next
    moves (``PipelinedRelayoutHandle``); a failed or cancelled pipelined read may then leave the pieces
    placed before it in the pages (never published: the handle is not done). None: one read, then the
    re-layout, and a failed read leaves the pages untouched."""
    if piece_bytes is not None and landing.transfer.num_blocks:
        return PipelinedRelayoutHandle(transport, peer, landing, piece_bytes, notify)
    return RelayoutHandle(transport, transport.read(peer, landing.transfer, notify), landing)


__all__ = ["PipelinedRelayoutHandle", "RelayoutHandle", "read_relayout", "relayout_landed"]
