"""A pull between two layouts whose completion includes the re-layout: ``read_relayout`` reads a landing
plan's large pieces into this transport's landing region and, once they are in, re-lays them out into the
destination pages on the host; the handle is done only then, so a caller that publishes the KV on
completion never shows it half placed. A failed or cancelled read leaves the destination pages untouched
(the landing region alone holds what arrived)."""

from __future__ import annotations

import contextlib
import threading

from kvxfer.errors import TransportError
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
                regions = self._transport.regions
                devices = {regions[int(r)].device_id for p in self._landing.relayout for r in p.dst_region
                           if regions[int(r)].memory_kind == "cuda"}
                if devices:   # device pools: the GPU re-lays them out; done once it has
                    import torch
                    relayout_torch(self._landing.relayout, regions, regions)
                    for d in devices:
                        torch.cuda.synchronize(d)
                else:
                    relayout_host(self._landing.relayout, regions, regions)
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


def read_relayout(transport: Transport, peer: str, landing: LandingPlan, notify: bytes | None = None) -> RelayoutHandle:
    """Pull ``landing.transfer`` from ``peer`` into this transport's landing region, then (as part of the
    completion) run ``landing.relayout`` on this host's registered memory (by the GPU for device pools,
``relayout_torch``, else ``relayout_host``): source = the landing region,
    destination = the request's pages, both among ``transport.regions``. ``notify`` reaches the peer after
    the read (it may release its pages then: the re-layout reads only the landing region)."""
    return RelayoutHandle(transport, transport.read(peer, landing.transfer, notify), landing)


__all__ = ["RelayoutHandle", "read_relayout"]
