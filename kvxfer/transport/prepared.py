"""PreparedTransfer: a checked plan bound to one peer connection and direction, posted any number of times.

``Transport.prepare(op, peer, plan)`` does once what every post of a plan would repeat: the plan's full
check against both sides' registered regions and the backend's per-plan work (cuda_ipc packs the kernel's
table and uploads it into a device buffer of the plan's own). ``post()`` then only starts the copy, as
NIXL's prepared descriptor lists and reposted transfer requests do. A serving engine prepares a request's
plan while the model computes its pages and posts it when they are written.

A prepared transfer is bound to the peer's connection it was prepared on: after a disconnect or a
reconnect (whose regions may differ), ``post`` raises PeerUnreachable and the plan must be prepared again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from kvxfer.errors import TransportError
from kvxfer.pagetable import BlockPlan, PhasedPlan, TransferPlan
from kvxfer.transport.handle import TransferHandle
from kvxfer.transport.metadata import TransportMetadata

if TYPE_CHECKING:
    from kvxfer.transport.base import Transport


class PreparedTransfer:
    """One plan checked and made ready by ``Transport.prepare``; ``post`` starts it (any number of times,
    also while an earlier post of it is in flight: the plan's memory is only read)."""

    def __init__(self, transport: Transport, op: Literal["write", "read"], peer: str, metadata: TransportMetadata,
                 plan: TransferPlan | BlockPlan | PhasedPlan, backend_state: Any) -> None:
        self._transport = transport
        self.op = op
        self.peer = peer
        self.plan = plan
        self.metadata = metadata
        #: What the backend made of the plan (None: the backend posts the checked plan itself).
        self.backend_state = backend_state
        self.released = False
        self._expanded: TransferPlan | None = None

    def __repr__(self) -> str:
        return (f"PreparedTransfer(op={self.op}, peer={self.peer!r}, plan={self.plan!r}, "
                f"released={self.released})")

    @property
    def transport(self) -> Transport:
        """The transport that prepared this transfer (only it can post it)."""
        return self._transport

    @property
    def nbytes(self) -> int:
        """Bytes one post moves."""
        return self.plan.total_bytes

    def expanded(self) -> TransferPlan:
        """The plan as a TransferPlan (a BlockPlan or PhasedPlan expanded once, on first use)."""
        if isinstance(self.plan, TransferPlan):
            return self.plan
        if self._expanded is None:
            self._expanded = self.plan.expand()
        return self._expanded

    def post(self, notify: bytes | None = None, *, settled: bool = False) -> TransferHandle:
        """Start the transfer: what ``Transport.write``/``read`` of the plan would start, without checking or
        packing it again (``notify`` and ``settled`` as there; ``settled`` applies to writes only)."""
        if self.released:
            raise TransportError(f"prepared {self.op} to peer {self.peer!r} was released; prepare the plan again")
        return self._transport._post_prepared(self, notify, settled)

    def release(self) -> None:
        """Drop the backend's per-plan resources (cuda_ipc: its device table, once the copies queued are
        done; nixl: its requests, once their post finished); later posts raise TransportError. Idempotent."""
        self.released = True
        self.backend_state = None
        self._expanded = None

    def __enter__(self) -> PreparedTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["PreparedTransfer"]
