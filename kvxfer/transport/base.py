"""The Transport interface and the checks every backend shares (docs/architecture.md, "Decisions").

A backend implements the ``_backend_*`` hooks; this class owns naming, registration, metadata,
peer bookkeeping, plan validation against local and advertised regions, and the notification inbox,
so that every backend refuses the same bad input with the same errors before a byte moves.
"""

from __future__ import annotations

import itertools
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import ClassVar, Literal

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError, PeerUnreachable, TransportError
from kvxfer.pagetable import BlockPlan, PageTable, PhasedPlan, TransferPlan
from kvxfer.transport.handle import TransferHandle
from kvxfer.transport.metadata import MAX_NAME_CHARS, TransportMetadata, check_regions
from kvxfer.transport.prepared import PreparedTransfer

Op = Literal["write", "read"]
MAX_NOTIFY_BYTES = 4096
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:@/-]+$")


class Transport(ABC):
    """Moves the bytes of TransferPlans between registered memory of this endpoint and its peers."""

    backend: ClassVar[str]
    #: The backend forms a BlockPlan's or PhasedPlan's runs on the device, so its host work per post is
    #: O(blocks + template) however finely two layouts cut the bytes: planners give it templated plans at
    #: any size (other backends pay per descriptor, and get them only where the expansion is large).
    posts_templates: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not _NAME_RE.match(name):
            raise TransportError(f"transport name must be 1-{MAX_NAME_CHARS} chars of [A-Za-z0-9_.:@/-], "
                                 f"got {name!r:.80}")
        self.name = name
        self._regions: tuple[MemoryRegion, ...] = ()
        self._registered = False
        self._peers: dict[str, TransportMetadata] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()   # one connect at a time: concurrent callers connect a peer once
        self._ids = itertools.count(1)
        self._closed = False
        self._on_notification: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, regions={len(self._regions)}, "
                f"peers={sorted(self._peers)})")

    # --- public API ---------------------------------------------------------------------------------
    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """The registered local regions; ``PageTable.region`` of local entries indexes this tuple."""
        return self._regions

    def peer_regions(self, peer: str) -> tuple[MemoryRegion, ...]:
        """The regions ``peer`` advertised; ``PageTable.region`` of remote entries indexes this tuple."""
        return self._peer(peer).regions

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register local memory once, before ``metadata()``; regions are advertised to peers."""
        self._check_open()
        if self._registered:
            raise TransportError(f"transport {self.name!r}: regions are already registered "
                                 f"({len(self._regions)}); create a new transport to change them")
        regs = check_regions(regions, f"transport {self.name!r}.register")
        self._backend_register(regs)
        self._regions = regs
        self._registered = True

    def metadata(self) -> bytes:
        """What a peer passes to ``connect``: backend, name, advertised regions and backend info."""
        self._check_open()
        return TransportMetadata(self.backend, self.name, self._regions, self._backend_blob()).encode()

    def connect(self, peer: str, metadata: bytes) -> None:
        """Make ``peer`` reachable using the bytes its ``metadata()`` returned. Connecting a connected peer
        with the same metadata changes nothing (its transfers in flight go on); new metadata (a restarted
        peer) replaces the old connection. Concurrent calls for one peer connect it once: the first
        connects, the others find it connected (two at once both adding a NIXL agent re-registered it
        under the first one's transfers)."""
        self._check_open()
        md = TransportMetadata.decode(metadata)
        if md.backend != self.backend:
            raise TransportError(f"transport {self.name!r}: peer {peer!r} metadata is for backend "
                                 f"{md.backend!r}, this transport is {self.backend!r}")
        if md.name != peer:
            raise TransportError(f"transport {self.name!r}: metadata names peer {md.name!r}, "
                                 f"connect was asked for {peer!r}")
        if peer == self.name:
            raise TransportError(f"transport {self.name!r}: cannot connect to itself")
        with self._connect_lock:
            if peer in self._peers:
                if self._peers[peer] == md:
                    return   # the same endpoint again: its transfers in flight stay valid
                self.disconnect(peer)
            self._backend_connect(peer, md)
            self._peers[peer] = md

    def write(self, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan, notify: bytes | None = None, *,
              settled: bool = False) -> TransferHandle:
        """Push: ``plan.src`` (local) -> ``plan.dst`` (peer); ``notify`` reaches the peer after the data.
        A BlockPlan is checked in O(blocks + template) and moved as such by a backend that can (cuda_ipc's
        kernel, nixl's cells from the template), else as its expansion; a PhasedPlan (several BlockPlans,
        one transfer) likewise, its notification after all of it.
        ``settled``: the caller synchronized with the work that wrote the source pages, so a device
        backend need not order the copy after the model's stream (where later work may be queued by
        then, such as the next prompt's prefill), and may finish such a write with a notification
        before returning (cuda_ipc: the copy's own duration, sparing a thread hand-off)."""
        return self._post("write", peer, plan, notify, settled)

    def read(self, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan, notify: bytes | None = None) -> TransferHandle:
        """Pull: ``plan.src`` (peer) -> ``plan.dst`` (local); ``notify`` reaches the peer after the data."""
        return self._post("read", peer, plan, notify)

    def prepare(self, op: Op, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan) -> PreparedTransfer:
        """Check ``plan`` for ``op`` ("write": local -> peer, "read": peer -> local) with ``peer`` once and do the
        backend's per-plan work once (cuda_ipc: its kernel table packed and uploaded), so that each
        ``PreparedTransfer.post`` only starts the copy. A bad plan is refused here, as ``write``/``read``
        would refuse it."""
        self._check_open()
        if op not in ("write", "read"):
            raise TransportError(f"prepare for peer {peer!r}: op must be 'write' or 'read', got {op!r:.40}")
        md = self._peer(peer)
        self._check_plan_type(op, peer, plan)
        if isinstance(plan, BlockPlan | PhasedPlan):
            self._check_block_plan(op, peer, plan, md)
        else:
            self._check_plan(op, peer, plan, md)
        # A PhasedPlan is prepared as its expansion, except by a backend that forms its runs on the device.
        return PreparedTransfer(self, op, peer, md, plan, self._backend_prepare(
            op, peer, plan.expand() if isinstance(plan, PhasedPlan) and not self.posts_templates else plan))

    def notifications(self) -> dict[str, list[bytes]]:
        """Messages received since the last call, per sending peer, each delivered exactly once."""
        self._backend_poll_notifications()
        with self._lock:
            out, self._inbox = self._inbox, {}
        return out

    def disconnect(self, peer: str) -> None:
        """Forget ``peer``; later transfers to it raise PeerUnreachable."""
        if self._peers.pop(peer, None) is not None:
            self._backend_disconnect(peer)

    def close(self) -> None:
        """Disconnect every peer and release backend resources (idempotent)."""
        if self._closed:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        self._closed = True
        self._backend_close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- shared helpers -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")

    def _peer(self, peer: str) -> TransportMetadata:
        md = self._peers.get(peer)
        if md is None:
            raise PeerUnreachable(f"transport {self.name!r}: peer {peer!r} is not connected "
                                  f"(connected: {sorted(self._peers)})")
        return md

    def on_notification(self, wake: Callable[[], None] | None) -> None:
        """Call ``wake()`` whenever a notification reaches the inbox on its own (loopback, cuda_ipc, ucx).
        A backend whose notifications arrive only when polled (``notifications_need_polling``) calls it
        from ``notifications()`` instead; ``wake`` must be quick and must not raise."""
        self._on_notification = wake

    @property
    def notifications_need_polling(self) -> bool:
        """True when notifications reach the inbox only through ``notifications()`` (the backend holds
        them until asked, as NIXL does): a caller waiting for one must poll."""
        return type(self)._backend_poll_notifications is not Transport._backend_poll_notifications

    def _deliver(self, peer: str, message: bytes) -> None:
        """Queue a notification from ``peer`` for ``notifications()`` and wake whoever waits for one; one
        from a peer this transport is not connected to is dropped (the inbox is keyed by peer input)."""
        with self._lock:
            if peer not in self._peers:
                return
            self._inbox.setdefault(peer, []).append(bytes(message))
        wake = self._on_notification
        if wake is not None:
            wake()

    def _post(self, op: Op, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan, notify: bytes | None,
              settled: bool = False) -> TransferHandle:
        # The checks are inline where they pass (a one-page post pays each call's frame).
        if self._closed:
            self._check_open()
        md = self._peers.get(peer)
        if md is None:
            md = self._peer(peer)
        if type(plan) is not TransferPlan:
            self._check_plan_type(op, peer, plan)
        if notify is not None:
            self._check_notify(op, peer, notify)
        transfer_id = next(self._ids)
        if isinstance(plan, PhasedPlan | BlockPlan):
            templated = plan

            def check() -> None:
                self._check_block_plan(op, peer, templated, md)

            started = (self._backend_post_phases(op, peer, templated, notify, transfer_id, check, settled=settled)
                       if isinstance(templated, PhasedPlan) else
                       self._backend_post_blocks(op, peer, templated, notify, transfer_id, check, settled=settled))
            if started is not None:
                return started
            check()
            return self._backend_post(op, peer, templated.expand(), notify, transfer_id, settled=settled)
        handle = self._backend_post_checking(op, peer, plan, notify, transfer_id,
                                             lambda: self._check_plan(op, peer, plan, md), settled=settled)
        if handle is not None:
            return handle
        self._check_plan(op, peer, plan, md)
        return self._backend_post(op, peer, plan, notify, transfer_id, settled=settled)

    def _post_prepared(self, prepared: PreparedTransfer, notify: bytes | None, settled: bool) -> TransferHandle:
        """``PreparedTransfer.post``: the plan was checked by ``prepare`` against the connection it names (the
        checks here are inline: this path runs before every prepared copy starts)."""
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")
        op, peer = prepared.op, prepared.peer
        if prepared.transport is not self:
            raise TransportError(f"transport {self.name!r}: prepared {op} to peer {peer!r} belongs to another transport")
        md = self._peers.get(peer)
        if md is not prepared.metadata:
            state = "is not connected" if md is None else "reconnected (its regions may differ)"
            raise PeerUnreachable(f"transport {self.name!r}: peer {peer!r} {state} since this {op} was prepared; "
                                  f"prepare the plan again")
        if notify is not None:
            self._check_notify(op, peer, notify)
        if settled and op != "write":
            raise TransportError(f"prepared read from peer {peer!r}: settled applies to writes only")
        transfer_id = next(self._ids)
        if prepared.backend_state is not None:
            return self._backend_post_prepared(prepared, notify, transfer_id, settled=settled)
        if isinstance(prepared.plan, BlockPlan):
            blocks = self._backend_post_blocks(op, peer, prepared.plan, notify, transfer_id, lambda: None,
                                               settled=settled)
            if blocks is not None:
                return blocks
        return self._backend_post(op, peer, prepared.expanded(), notify, transfer_id, settled=settled)

    @staticmethod
    def _check_plan_type(op: Op, peer: str, plan: object) -> None:
        if not isinstance(plan, TransferPlan | BlockPlan | PhasedPlan):
            raise PageTableError(f"{op} to peer {peer!r}: expected a TransferPlan, BlockPlan or PhasedPlan, got "
                                 f"{type(plan).__name__}")

    @staticmethod
    def _check_notify(op: Op, peer: str, notify: object) -> None:
        if notify is not None and (not isinstance(notify, bytes) or len(notify) > MAX_NOTIFY_BYTES):
            raise TransportError(f"{op} to peer {peer!r}: notify must be bytes of <= {MAX_NOTIFY_BYTES}, "
                                 f"got {type(notify).__name__} of {len(notify) if isinstance(notify, bytes) else '?'}")

    def _check_plan(self, op: Op, peer: str, plan: TransferPlan, md: TransportMetadata) -> None:
        """Both sides inside their registered regions, no destination byte written twice, or a
        PageTableError naming the side (local/remote) and the entry."""
        src_regions, dst_regions = (self._regions, md.regions) if op == "write" else (md.regions, self._regions)
        try:   # one pass each side
            plan.validate(src_regions, dst_regions)
        except PageTableError as exc:
            # Name the side that is wrong (local/remote); an overlap keeps the plan's own message.
            local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
            self._validate(local, self._regions, f"{op} with peer {peer!r}: local {'source' if op == 'write' else 'destination'}")
            self._validate(remote, md.regions, f"{op} with peer {peer!r}: remote {'destination' if op == 'write' else 'source'}")
            raise PageTableError(f"{op} with peer {peer!r}: {exc}") from None

    def _check_block_plan(self, op: Op, peer: str, plan: BlockPlan | PhasedPlan, md: TransportMetadata) -> None:
        """``_check_plan`` for a BlockPlan or a PhasedPlan, its error naming the side (local/remote)."""
        src_regions, dst_regions = (self._regions, md.regions) if op == "write" else (md.regions, self._regions)
        try:
            plan.validate(src_regions, dst_regions)
        except PageTableError as exc:
            text = str(exc)   # "BlockPlan source ..." / "TransferPlan destination ...": the side named second
            words = text.split(" ", 2)
            local = (len(words) > 1 and words[1] == "source") == (op == "write")
            raise PageTableError(f"{op} with peer {peer!r}: {'local' if local else 'remote'} {text}") from None

    @staticmethod
    def _validate(table: PageTable, regions: Sequence[MemoryRegion], where: str) -> None:
        try:
            table.validate(regions)
        except PageTableError as exc:
            raise PageTableError(f"{where}: {exc}") from None

    # --- backend hooks ------------------------------------------------------------------------------
    def _backend_register(self, regions: tuple[MemoryRegion, ...]) -> None:  # noqa: B027
        """Register ``regions`` with the backend (called once, before they become visible)."""

    def _backend_blob(self) -> bytes:
        """Backend-specific connection info carried in the metadata."""
        return b""

    @abstractmethod
    def _backend_connect(self, peer: str, md: TransportMetadata) -> None:
        """Make ``peer`` reachable (raise PeerUnreachable if it is not)."""

    @abstractmethod
    def _backend_post(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                      transfer_id: int, *, settled: bool = False) -> TransferHandle:
        """Start a validated transfer and return its handle (``settled``: see ``write``)."""

    def _backend_post_checking(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                               transfer_id: int, check: Callable[[], None], *,
                               settled: bool = False) -> TransferHandle | None:
        """Start a transfer whose every run the backend's device copy confines to its registered regions,
        and run ``check`` (the host's full check, raising PageTableError) while it moves; on a refusal,
        return only once the copy has stopped, send no notification, and re-raise. None (the default):
        this backend cannot, and ``check`` runs before ``_backend_post``."""
        return None

    def _backend_post_blocks(self, op: Op, peer: str, plan: BlockPlan, notify: bytes | None, transfer_id: int,
                             check: Callable[[], None], *, settled: bool = False) -> TransferHandle | None:
        """Start a BlockPlan as such (without expanding it), running ``check`` (the host's check, raising
        PageTableError) before the copy starts or, where the device confines every run to its registered
        regions, while it moves (then a refusal returns once the copy has stopped, with no notification, as
        ``_backend_post_checking``). None (the default): this backend cannot, nothing was started, and the
        caller checks the plan and posts its expansion to ``_backend_post``."""
        return None

    def _backend_post_phases(self, op: Op, peer: str, plan: PhasedPlan, notify: bytes | None, transfer_id: int,
                             check: Callable[[], None], *, settled: bool = False) -> TransferHandle | None:
        """``_backend_post_blocks`` for a PhasedPlan: start all its phases as one transfer (the notification
        after every phase), or None (the default): the caller checks the plan and posts its expansion."""
        return None

    def _backend_prepare(self, op: Op, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan) -> object | None:
        """The backend's per-plan work for ``prepare`` on a checked plan (kept as the PreparedTransfer's
        ``backend_state`` and given back to ``_backend_post_prepared``); None (the default): posts go
        through ``_backend_post_blocks``/``_backend_post`` without checking the plan again."""
        return None

    def _backend_post_prepared(self, prepared: PreparedTransfer, notify: bytes | None, transfer_id: int, *,
                               settled: bool = False) -> TransferHandle:
        """Start a prepared transfer whose ``backend_state`` this backend made (``_backend_prepare``)."""
        raise TransportError(f"transport {self.name!r} ({self.backend}) made no prepared state to post")

    def _backend_poll_notifications(self) -> None:  # noqa: B027
        """Move notifications the backend holds into the inbox (``_deliver``)."""

    def _backend_disconnect(self, peer: str) -> None:  # noqa: B027
        """Release backend state for ``peer``."""

    def _backend_close(self) -> None:  # noqa: B027
        """Release every backend resource."""
