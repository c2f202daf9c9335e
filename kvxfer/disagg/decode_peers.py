"""A decode worker's prefill peers (xPyD): connecting and handshaking, the reconnect loop of each, the
choice of a prefill for a request, and what a lost prefill means for the peer table. What it means for
the requests it served is the request lifecycle's (``DecodeRequests._requests_lost``). The layers of
the decode worker: docs/architecture.md, "One worker base, the decode worker split by concern"."""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg.control import PeerConnection, Secret, connect
from kvxfer.disagg.handshake import LocalIdentity
from kvxfer.disagg.messages import KvRanks
from kvxfer.disagg.router import KVRouter
from kvxfer.disagg.worker import Reconnected, WorkerBase, now, peer_templates
from kvxfer.disagg.worker_protocol import decode_layouts, encode_layouts
from kvxfer.errors import (
    ConfigError,
    ControlTimeout,
    HandshakeRefused,
    KvxferError,
    LayoutMismatch,
    PeerUnreachable,
    ProtocolError,
)
from kvxfer.extractor import TemplateCache
from kvxfer.transport import Transport

if TYPE_CHECKING:
    from kvxfer.disagg.decode_jobs import DecodeJob

log = logging.getLogger("kvxfer.disagg.decode")

#: Longest wait of one automatic reconnect attempt, and the pause between two failed ones.
RECONNECT_ATTEMPT_S = 1.0
RECONNECT_PAUSE_S = 0.2


@dataclass(eq=False)
class PrefillPeer:
    """One prefill peer of a decode worker: its address, its live connection and its reconnect loop.
    Mutated on the engine thread only (the reconnect thread reads ``alive`` and ``stop``)."""

    address: str
    conn: PeerConnection | None = None
    layouts: list[CacheLayoutDesc] = field(default_factory=list)
    templates: TemplateCache = field(default_factory=peer_templates)
    """Run templates of (the peer's layouts, this worker's), made anew with the layouts."""
    reconnecting: threading.Thread | None = None
    reconnect_error: str = ""
    """Why the last automatic reconnect attempt failed ("" before any, or while the first one runs)."""
    stop: threading.Event = field(default_factory=threading.Event)
    draining: bool = False
    """The prefill said it is stopping (a ``PREFILL_SHUTDOWN`` refusal): new requests go elsewhere."""

    @property
    def alive(self) -> bool:
        """Whether the connection is up."""
        conn = self.conn
        return conn is not None and conn.alive


class PrefillPeers(WorkerBase):
    """The prefill side of a decode worker (``DecodeWorker`` builds it; engine thread unless said)."""

    transport: Transport
    layouts: list[CacheLayoutDesc]
    versions: tuple[int, int]
    connect_timeout: float
    router: KVRouter | None
    counts: dict[str, int]
    _secret: Secret
    _prefills: dict[str, PrefillPeer]
    """By address, in the order added."""
    _rotation: int
    """Rotates the choice among equally loaded prefills."""
    _reconnect_stop: threading.Event
    _connect_lock: threading.Lock
    _jobs: dict[str, DecodeJob]
    """Requests sent to a prefill (REQUESTED): a prefill's load."""

    def connect(self, address: str, timeout: float | None = None) -> None:
        """Make the prefill worker at ``address`` this worker's only prefill (the single-prefill API): once
        it is connected, requests in flight with any other (or a previous connection to it) fail and the
        others are dropped. Raises AuthenticationError / HandshakeRefused (with the reason) / ControlTimeout,
        and then changes nothing."""
        self._handshake_and_attach(address, timeout, only=True)

    def add_prefill(self, address: str, timeout: float | None = None) -> None:
        """Connect to one more prefill worker while serving; the next request may go there. Reconnecting to
        an address already known replaces that connection only. Raises like ``connect`` (then nothing is
        added)."""
        self._handshake_and_attach(address, timeout, only=False)

    def remove_prefill(self, address: str) -> bool:
        """Stop using the prefill at ``address``: its requests in flight fail, its connection closes and it
        is no longer reconnected. False when no such prefill is known."""
        return bool(self.engine.call(lambda: self._remove(address, "removed by the caller"), 10.0))

    @property
    def prefills(self) -> list[str]:
        """The known prefill addresses, in the order added (connected or reconnecting)."""
        return list(self._prefills)

    @property
    def prefill_address(self) -> str | None:
        """The first known prefill address (the one prefill of the single-prefill API), or None."""
        return next(iter(self._prefills), None)

    def prefill_load(self) -> dict[str, int]:
        """This worker's requests in flight (KV not yet in place) per connected prefill address."""
        return dict(self.engine.call(lambda: {p.address: self._load(p) for p in self._prefills.values() if p.alive},
                                     10.0))

    @property
    def connected(self) -> bool:
        """Whether at least one prefill peer is connected and alive."""
        return any(p.alive for p in list(self._prefills.values()))

    def _handshake(self, address: str, wait: float) -> tuple[PeerConnection, list[CacheLayoutDesc]]:
        """Open and authenticate a control connection to a prefill and exchange rank layouts."""
        identity = LocalIdentity("decode", self.config.name, self.layouts[0], self.config.backend,
                                 self.transport.metadata(), self.config.heartbeat_interval)
        conn = connect(address, identity, self._secret, timeout=wait, expect_role="prefill", versions=self.versions)
        try:
            conn.send(KvRanks(layouts=encode_layouts(self.layouts)))
            reply = conn.recv(wait)
            if not isinstance(reply, KvRanks):
                raise ProtocolError(f"prefill answered kv_ranks with {reply.kind!r}")
            return conn, decode_layouts(reply.layouts)
        except BaseException:
            conn.close("decode could not finish connecting")
            raise

    def _handshake_and_attach(self, address: str, timeout: float | None, *, only: bool,
                              reconnecting: bool = False) -> None:
        wait = self.connect_timeout if timeout is None else timeout
        # One handshake at a time (reconnect loops run on threads of their own): two handshakes with the same
        # prefill in flight present this transport's metadata twice, which the prefill's NIXL refuses.
        if not self._connect_lock.acquire(timeout=wait + 15.0):
            raise ControlTimeout(f"decode {self.config.name}: another connect to a prefill did not finish within "
                                 f"{wait + 15.0:.1f} s")
        try:
            peer = self._prefills.get(address)
            if peer is not None and peer.alive and (reconnecting or not only or list(self._prefills) == [address]):
                return   # connected meanwhile (a reconnect loop or another caller got there first)
            self._handshake_and_attach_locked(address, wait, only=only, reconnecting=reconnecting)
        finally:
            self._connect_lock.release()

    def _handshake_and_attach_locked(self, address: str, wait: float, *, only: bool, reconnecting: bool) -> None:
        conn, layouts = self._handshake(address, wait)
        try:
            self.engine.call(lambda: self._attach(address, conn, layouts, only=only, reconnecting=reconnecting),
                             wait + 10.0)
        except BaseException:
            conn.close("decode could not finish connecting")
            raise

    def _connect_many(self, addresses: list[str]) -> None:
        """Connect to each address; an unreachable one keeps reconnecting in the background. Raises a refusal
        at once, and the last error when none connected."""
        if not addresses:
            raise ConfigError("DecodeWorker.prefill: the list of prefill addresses is empty")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"DecodeWorker.prefill: duplicate addresses in {addresses}")
        errors: list[KvxferError] = []
        for address in addresses:
            try:
                self.add_prefill(address)
            except HandshakeRefused:
                raise
            except KvxferError as exc:
                log.warning("%s: prefill %s unreachable at start (%s); reconnecting in the background",
                            self.config.name, address, exc)
                errors.append(exc)
                self.engine.call(functools.partial(self._keep_reconnecting, address, exc), 10.0)
        if len(errors) == len(addresses):
            raise errors[-1]

    def _attach(self, address: str, conn: PeerConnection, layouts: list[CacheLayoutDesc], *, only: bool,
                reconnecting: bool) -> None:
        """Use a freshly handshaken connection for the prefill at ``address`` (engine thread)."""
        windowed = any(lg.window is not None for lg in self.layouts[0].layer_groups)
        src_tpb, dst_tpb = layouts[0].tokens_per_block, self.layouts[0].tokens_per_block
        if windowed and src_tpb % dst_tpb:
            raise LayoutMismatch(f"sliding-window layers need prefill's tokens_per_block ({src_tpb}) to be a multiple "
                                 f"of decode's ({dst_tpb}): otherwise decode keeps window blocks prefill has freed")
        peer = self._prefills.get(address)
        if reconnecting and (peer is None or peer.stop.is_set()):
            raise PeerUnreachable(f"prefill {address} was removed while decode reconnected to it")
        name = conn.peer.name
        for other in self._prefills.values():
            if other.address != address and other.alive and not only and other.conn is not None \
                    and other.conn.peer.name == name:
                raise ConfigError(f"prefill at {address} calls itself {name!r} like the one at {other.address}: "
                                  f"prefill workers of one decode need distinct names")
        if only:
            for other in [p for p in self._prefills.values() if p.address != address]:
                self._remove(other.address, "replaced by a new prefill connection")
        if peer is None:
            peer = self._prefills[address] = PrefillPeer(address)
        peer.stop.clear()
        peer.draining = False
        old = peer.conn
        if old is not None:
            self._on_prefill_lost(old, "replaced by a new prefill connection", reconnect=False)
            old.close("replaced by a new prefill connection")
        self.transport.connect(name, conn.peer.metadata)
        peer.conn, peer.layouts, peer.reconnect_error = conn, layouts, ""
        peer.templates = peer_templates()   # of these layouts
        self.engine.read(conn)

    def _remove(self, address: str, reason: str) -> bool:
        """Drop a prefill peer: stop its reconnect loop, fail its requests, close its connection."""
        peer = self._prefills.pop(address, None)
        if peer is None:
            return False
        peer.stop.set()
        if peer.conn is not None:
            self._on_prefill_lost(peer.conn, reason, reconnect=False, peer=peer)
        return True

    def _peer_of(self, conn: PeerConnection) -> PrefillPeer | None:
        return next((p for p in self._prefills.values() if p.conn is conn), None)

    def _load(self, peer: PrefillPeer) -> int:
        conn = peer.conn
        return sum(1 for j in self._jobs.values() if j.conn is conn)

    def _keep_reconnecting(self, address: str, error: KvxferError) -> None:
        """Know ``address`` as a prefill that could not be reached, and retry it in the background."""
        if address not in self._prefills:
            self._prefills[address] = PrefillPeer(address)
        peer = self._prefills[address]
        peer.reconnect_error = f"; reconnecting failed: {type(error).__name__}: {error}"
        if peer.reconnecting is None and not self._reconnect_stop.is_set():
            self._start_reconnecting(peer, first_failed=True)

    def _start_reconnecting(self, peer: PrefillPeer, *, first_failed: bool = False) -> None:
        """Reconnect to the known prefill address (a restarted prefill) on a thread of its own, so the
        engine keeps serving ``cancel``, ``status`` and other requests, until it succeeds or the worker
        closes. Each attempt ends with a ``reconnected`` event. After a failed attempt the next follows
        in ``RECONNECT_PAUSE_S``, and ZeroMQ retries the TCP connection every 0.1 s within an attempt, so
        a prefill listening again is found within a fraction of a second (requests arriving meanwhile
        fail at once with the last attempt's reason). A refusal (wrong secret, incompatible layout) ends
        the loop: the next request starts it again. Each prefill peer has its own loop."""
        if not first_failed:
            peer.reconnect_error = ""
        address = peer.address

        def stopped() -> bool:
            return self._reconnect_stop.is_set() or peer.stop.is_set()

        def run() -> None:
            while not stopped() and not peer.alive:
                error: KvxferError | None = None
                started = now()
                try:
                    self._handshake_and_attach(address, min(self.connect_timeout, RECONNECT_ATTEMPT_S), only=False,
                                               reconnecting=True)
                except KvxferError as exc:
                    error = exc
                except Exception as exc:   # reported to the waiting requests, not lost
                    error = PeerUnreachable(f"{type(exc).__name__}: {exc}")
                last = error is None or isinstance(error, HandshakeRefused) or stopped()
                with contextlib.suppress(KvxferError):
                    self.engine._post_internal(Reconnected(peer, error, started, last))
                if last:
                    return
                peer.stop.wait(RECONNECT_PAUSE_S)
            with contextlib.suppress(KvxferError):
                self.engine._post_internal(Reconnected(peer, None, now(), True))

        peer.reconnecting = threading.Thread(target=run, name=f"kvxfer-reconnect-{self.config.name}", daemon=True)
        peer.reconnecting.start()

    def _pick(self, job: DecodeJob) -> PrefillPeer | None:
        """The prefill for a request: the caller's choice when connected, else the least loaded (rotating
        among equals); never one the request was sent to before, nor a stopping one while another is
        connected; None when none is connected."""
        live = [p for p in self._prefills.values() if p.alive and p.address not in job.tried]
        live = [p for p in live if not p.draining] or live
        if not live:
            return None
        prefer = job.prefer
        if prefer is None and self.router is not None and self.router.workers:
            job.route = self.router.route(job.tokens)
            prefer = job.route.address
        if prefer is not None:
            chosen = self._prefills.get(prefer)
            if chosen is not None and chosen in live:
                return chosen
        self._rotation += 1
        n = len(live)
        order = {id(p): (i - self._rotation) % n for i, p in enumerate(live)}
        return min(live, key=lambda p: (self._load(p), order[id(p)]))

    def _no_prefill_reason(self) -> str:
        reasons = [p.reconnect_error for p in self._prefills.values() if p.reconnect_error]
        if len(self._prefills) <= 1:
            return reasons[0] if reasons else ""
        return "".join(f"; {p.address}{p.reconnect_error or ': not connected'}" for p in self._prefills.values())

    def _on_prefill_lost(self, conn: PeerConnection, reason: str, *, reconnect: bool = True,
                         peer: PrefillPeer | None = None) -> None:
        """Fail the lost prefill's requests. Pushed-to blocks are quarantined, not freed: a prefill that is
        only frozen or cut off may still write until its lease runs out (it checks before each write, but a
        write posted just before the loss can land later), so they stay held until the lease plus one more
        lease period (for writes already posted) has passed. Pull destinations are ours to free once our
        read is stopped."""
        peer = peer if peer is not None else self._peer_of(conn)
        if peer is None or peer.conn is not conn:
            return
        peer.conn = None
        self.counts["peer_losses"] += 1
        conn.close(f"prefill lost: {reason}"[:1000])   # ends the client endpoint and its I/O thread
        if reconnect and peer.reconnecting is None and not peer.stop.is_set() and not self._reconnect_stop.is_set():
            self._start_reconnecting(peer)
        name = conn.peer.name
        what = reason if reason.startswith(f"prefill {name!r}") else f"prefill {name!r} lost: {reason}"
        self._requests_lost(conn, what)
        if not any(p.alive and p.conn is not None and p.conn.peer.name == name for p in self._prefills.values()):
            self.transport.disconnect(name)

    @abc.abstractmethod
    def _requests_lost(self, conn: PeerConnection, what: str) -> None:
        """Fail over, or fail, the requests sent over ``conn`` (its prefill is lost: ``what``)."""
