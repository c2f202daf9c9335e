"""A decode worker's prefill peers (xPyD): connecting and handshaking, the reconnect loop of each, the
choice of a prefill for a request, and what a lost prefill means for the peer table. What it means for
the requests it served is the request lifecycle's (``DecodeRequests.requests_lost``), reached through
the callback the worker gives. The parts of the decode worker: docs/architecture.md, "One worker base,
the decode worker composed of its concerns"."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg.control import PeerConnection, Secret, connect
from kvxfer.disagg.handshake import LocalIdentity
from kvxfer.disagg.messages import KvRanks
from kvxfer.disagg.router import KVRouter
from kvxfer.disagg.worker import Engine, Reconnected, WorkerConfig, now, peer_templates
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


class PrefillPeers:
    """The prefill side of a decode worker: its prefill connections by address, their reconnect loops and
    the choice of a prefill for a request. The worker builds it with what it needs: the engine (to run
    attachments on its thread and post reconnect outcomes), the transport and layouts the handshake
    presents, ``load`` (a prefill connection's requests in flight) and ``on_requests_lost`` (the request
    lifecycle's answer to a lost prefill). Engine thread unless said."""

    def __init__(self, config: WorkerConfig, engine: Engine, transport: Transport, layouts: list[CacheLayoutDesc],
                 secret: Secret, *, versions: tuple[int, int], connect_timeout: float, router: KVRouter | None,
                 counts: dict[str, int], load: Callable[[PeerConnection | None], int],
                 on_requests_lost: Callable[[PeerConnection, str], None]) -> None:
        self.config = config
        self.engine = engine
        self.transport = transport
        self.layouts = layouts
        self.versions = versions
        self.connect_timeout = connect_timeout
        self.router = router
        self.counts = counts
        """The worker's counters (this part adds ``peer_losses``)."""
        self._secret = secret
        self._load_of = load
        self._requests_lost = on_requests_lost
        self._prefills: dict[str, PrefillPeer] = {}
        """By address, in the order added."""
        self._rotation = 0
        """Rotates the choice among equally loaded prefills."""
        self._reconnect_stop = threading.Event()
        self._connect_lock = threading.Lock()

    def connect(self, address: str, timeout: float | None = None) -> None:
        """Make the prefill worker at ``address`` this worker's only prefill (the single-prefill API): once
        it is connected, requests in flight with any other (or a previous connection to it) fail and the
        others are dropped. Raises AuthenticationError / HandshakeRefused (with the reason) / ControlTimeout,
        and then changes nothing. Any thread but the engine's."""
        self._handshake_and_attach(address, timeout, only=True)

    def add(self, address: str, timeout: float | None = None) -> None:
        """Connect to one more prefill worker while serving; the next request may go there. Reconnecting to
        an address already known replaces that connection only. Raises like ``connect`` (then nothing is
        added). Any thread but the engine's."""
        self._handshake_and_attach(address, timeout, only=False)

    def remove(self, address: str) -> bool:
        """Stop using the prefill at ``address``: its requests in flight fail, its connection closes and it
        is no longer reconnected. False when no such prefill is known. Any thread."""
        return bool(self.engine.call(lambda: self._remove(address, "removed by the caller"), 10.0))

    @property
    def addresses(self) -> list[str]:
        """The known prefill addresses, in the order added (connected or reconnecting). Any thread."""
        return list(self._prefills)

    def __iter__(self) -> Iterator[PrefillPeer]:
        """The known prefill peers, in the order added."""
        return iter(list(self._prefills.values()))

    def load_by_address(self) -> dict[str, int]:
        """Requests in flight (KV not yet in place) per connected prefill address. Any thread."""
        return dict(self.engine.call(lambda: {p.address: self._load(p) for p in self._prefills.values() if p.alive},
                                     10.0))

    @property
    def connected(self) -> bool:
        """Whether at least one prefill peer is connected and alive. Any thread."""
        return any(p.alive for p in list(self._prefills.values()))

    @property
    def num_connected(self) -> int:
        """Prefill peers connected and alive."""
        return sum(p.alive for p in list(self._prefills.values()))

    @property
    def closing(self) -> bool:
        """Whether the worker is closing (``stop_reconnecting`` was called): no reconnects, no failover."""
        return self._reconnect_stop.is_set()

    def can_take(self, tried: set[str]) -> bool:
        """Whether a connected prefill outside ``tried`` (addresses a request was sent to) is known."""
        return any(p.alive and p.address not in tried for p in self._prefills.values())

    def reconnect_idle(self) -> bool:
        """No prefill is connected: start the reconnect loop of every known prefill that has none (and was
        not removed); True when any loop runs (a request may wait for its outcome), False when none is
        known."""
        for peer in self._prefills.values():
            if peer.reconnecting is None and not peer.stop.is_set():
                self._start_reconnecting(peer)
        return self.reconnecting

    @property
    def reconnecting(self) -> bool:
        """Whether any reconnect loop runs."""
        return any(p.reconnecting is not None for p in self._prefills.values())

    def reconnected(self, outcome: Reconnected) -> None:
        """A reconnect attempt ended: note on its peer whether the loop ends, and why the attempt failed."""
        peer, error = outcome.peer, outcome.error
        if outcome.last:
            peer.reconnecting = None
        if error is not None:
            peer.reconnect_error = f"; reconnecting failed: {type(error).__name__}: {error}"

    def route_done(self, job: DecodeJob) -> None:
        """The request no longer waits on its prefill: it stops counting as load at the router."""
        route, job.route = job.route, None
        if route is not None and self.router is not None:
            self.router.finished(route)

    def stop_reconnecting(self) -> None:
        """The worker closes: no reconnect loop starts or goes on, and no request fails over. Any thread."""
        self._reconnect_stop.set()

    def end_reconnects(self) -> None:
        """Stop every reconnect loop and wait for each (bounded by ``connect_timeout``: a loop attaches
        through the engine, which must still run). Any thread but the engine's."""
        peers = list(self._prefills.values())
        for peer in peers:
            peer.stop.set()
        for peer in peers:
            reconnecting = peer.reconnecting
            if reconnecting is not None:
                reconnecting.join(self.connect_timeout + 15.0)

    def close_connections(self, reason: str) -> None:
        """Close the connection of every known prefill peer (the worker closes). Any thread."""
        for peer in list(self._prefills.values()):
            if peer.conn is not None:
                peer.conn.close(reason)

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

    def connect_many(self, addresses: list[str]) -> None:
        """Connect to each address; an unreachable one keeps reconnecting in the background. Raises a refusal
        at once, and the last error when none connected. Any thread but the engine's."""
        if not addresses:
            raise ConfigError("DecodeWorker.prefill: the list of prefill addresses is empty")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"DecodeWorker.prefill: duplicate addresses in {addresses}")
        errors: list[KvxferError] = []
        for address in addresses:
            try:
                self.add(address)
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
            self.lost(old, "replaced by a new prefill connection", reconnect=False)
            old.close("replaced by a new prefill connection")
        self.transport.connect(name, conn.peer.metadata)
        peer.conn, peer.layouts, peer.reconnect_error = conn, layouts, ""
        peer.templates = peer_templates(layouts, self.layouts) if self.config.planner is None \
            else peer_templates()   # of these layouts
        self.engine.read(conn)

    def _remove(self, address: str, reason: str) -> bool:
        """Drop a prefill peer: stop its reconnect loop, fail its requests, close its connection."""
        peer = self._prefills.pop(address, None)
        if peer is None:
            return False
        peer.stop.set()
        if peer.conn is not None:
            self.lost(peer.conn, reason, reconnect=False, peer=peer)
        return True

    def peer_of(self, conn: PeerConnection) -> PrefillPeer | None:
        """The prefill peer ``conn`` is the live connection of, or None (a client's, or an old one)."""
        return next((p for p in self._prefills.values() if p.conn is conn), None)

    def _load(self, peer: PrefillPeer) -> int:
        return self._load_of(peer.conn)

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
                    self.engine.post_internal(Reconnected(peer, error, started, last))
                if last:
                    return
                peer.stop.wait(RECONNECT_PAUSE_S)
            with contextlib.suppress(KvxferError):
                self.engine.post_internal(Reconnected(peer, None, now(), True))

        peer.reconnecting = threading.Thread(target=run, name=f"kvxfer-reconnect-{self.config.name}", daemon=True)
        peer.reconnecting.start()

    def pick(self, job: DecodeJob) -> PrefillPeer | None:
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

    def no_prefill_reason(self) -> str:
        """Why no prefill can take a request (each known one's last reconnect error), for its error."""
        reasons = [p.reconnect_error for p in self._prefills.values() if p.reconnect_error]
        if len(self._prefills) <= 1:
            return reasons[0] if reasons else ""
        return "".join(f"; {p.address}{p.reconnect_error or ': not connected'}" for p in self._prefills.values())

    def lost(self, conn: PeerConnection, reason: str, *, reconnect: bool = True,
             peer: PrefillPeer | None = None) -> None:
        """A prefill connection ended (or was replaced, or broke the protocol): forget it, start its
        reconnect loop (``reconnect``), and hand its requests to ``on_requests_lost``. A connection that is
        no prefill's (a client's, an old one) changes nothing."""
        peer = peer if peer is not None else self.peer_of(conn)
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

