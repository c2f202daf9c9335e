"""ZeroMQ control plane: authenticated connections, bounded receives, heartbeats and peer loss.

One I/O thread per endpoint owns its ZeroMQ socket: it drives server-side handshakes, sends queued
messages, answers and checks heartbeats, and hands application messages to each connection's inbox.
User threads only enqueue sends and wait on inboxes with a deadline, so no call blocks unbounded.
A server (ROUTER socket) accepts many peers; ``connect`` (DEALER socket) makes one connection.

Every message after the handshake is sealed (``seal.SealedChannel``: encrypted, authenticated, and
numbered per direction), so a frame altered, forged, replayed or reordered on the path ends the
connection with that reason. Queues are bounded: a peer's unread inbox (``inbox_limit``; the peer is
told "inbox overflow" and disconnected), the frames waiting to be sent (``outbox_limit``; ``send``
raises), and handshakes in progress (``max_pending``; a new stranger evicts the oldest, so a flood of
half-open hellos cannot lock correct clients out). A consumer that does not want a thread blocked in
``recv`` per connection calls ``watch(wake)`` and takes messages with ``poll()`` when woken.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvxfer.disagg.auth import AuthKey
from kvxfer.disagg.handshake import (
    ClientHandshake,
    LayoutCheck,
    LocalIdentity,
    NonceCache,
    PeerInfo,
    Refusal,
    ServerHandshake,
    check_compatible,
)
from kvxfer.disagg.handshake import refusal as refusal_frame
from kvxfer.disagg.messages import (
    MAX_MESSAGE_BYTES,
    ROLES,
    SUPPORTED_VERSIONS,
    Accept,
    Auth,
    Bye,
    Challenge,
    ControlMessage,
    Frame,
    Heartbeat,
    Hello,
    Refuse,
    decode,
    encode,
    encode_frame,
)
from kvxfer.disagg.seal import SealedChannel, SealError
from kvxfer.errors import (
    AuthenticationError,
    ConfigError,
    ControlTimeout,
    KvxferError,
    PeerUnreachable,
    ProtocolError,
)

log = logging.getLogger("kvxfer.disagg.control")

PeerLostCallback = Callable[["PeerConnection", str], None]
ArrivalHook = Callable[["PeerConnection", ControlMessage], bool]
Secret = AuthKey | str | bytes | None
_ANY_VERSION = (0, 1 << 16)
#: How long ``PeerConnection.send_urgent`` waits for the I/O thread to take its message (a hint for the
#: scheduler, not a delivery guarantee: the message is sent either way).
URGENT_HANDOFF_S = 0.005


def check_timeout(timeout: float, what: str) -> float:
    """``timeout`` as seconds; every wait in the control plane is finite (ConfigError otherwise)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) \
            or timeout < 0:
        raise ConfigError(f"{what}: timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def _as_key(secret: Secret) -> AuthKey:
    return secret if isinstance(secret, AuthKey) else AuthKey.load(secret)


class _Lost:
    """Inbox sentinel: the connection ended with ``error``."""

    def __init__(self, error: KvxferError) -> None:
        self.error = error


class PeerConnection:
    """An authenticated connection to one peer: ``send``, ``recv(timeout)``, ``close``."""

    def __init__(self, endpoint: _Endpoint, route: bytes, peer: PeerInfo, channel: SealedChannel) -> None:
        self.peer = peer
        self._endpoint = endpoint
        self._route = route
        self._channel = channel
        self._inbox: queue.Queue[ControlMessage | _Lost] = queue.Queue()
        self._error: KvxferError | None = None
        self._wake: Callable[[], None] | None = None
        self._on_arrival: ArrivalHook | None = None
        now = time.monotonic()
        self.last_seen = now
        self.next_heartbeat = now

    @property
    def alive(self) -> bool:
        """False once the peer was lost, closed, or misbehaved."""
        return self._error is None

    @property
    def lost_reason(self) -> str | None:
        """Why the connection ended (None while alive)."""
        return None if self._error is None else str(self._error)

    def _raise_lost(self) -> None:
        assert self._error is not None
        raise type(self._error)(str(self._error))

    def send(self, message: ControlMessage) -> None:
        """Queue a message to the peer; ProtocolError if it does not fit its type, PeerUnreachable if lost."""
        self._enqueue(message)

    def send_urgent(self, message: ControlMessage) -> None:
        """``send``, then wait (at most ``URGENT_HANDOFF_S``) until the I/O thread has handed the message to
        the socket: for a message on a request's critical path sent by a thread with more Python work to
        do (the engine), which would otherwise hold the GIL while the I/O thread waits to send."""
        self._endpoint.wait_handed(self._enqueue(message), URGENT_HANDOFF_S)

    def _enqueue(self, message: ControlMessage) -> int:
        if self._error is not None:
            self._raise_lost()
        return self._endpoint.enqueue(self._route, encode(message, self.peer.version))

    def sign_notice(self, data: bytes) -> bytes:
        """A tag that lets the peer check ``data`` came from this side of this connection (``verify_notice``):
        for what travels outside the control plane, such as a transfer's completion notice."""
        return self._channel.sign(data)

    def verify_notice(self, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the peer's ``sign_notice`` tag of ``data`` on this connection."""
        return self._channel.verify(data, tag)

    def watch(self, wake: Callable[[], None], on_arrival: ArrivalHook | None = None) -> None:
        """Call ``wake()`` (from the I/O thread; it must not block) whenever a message arrives or the
        connection ends, so that one thread can serve many connections with ``poll``. ``on_arrival(conn,
        msg)`` runs on the I/O thread first and returns True when it consumed the message (for what must
        take effect on arrival, such as lease renewals); it must be quick and must not raise."""
        self._on_arrival = on_arrival
        self._wake = wake
        wake()   # anything that arrived before the watch is served too

    def poll(self) -> ControlMessage | None:
        """The next application message if one is waiting, else None; PeerUnreachable (or ProtocolError)
        once the connection ended and every message before the end was taken."""
        try:
            item = self._inbox.get_nowait()
        except queue.Empty:
            if self._error is not None:
                self._raise_lost()
            return None
        if isinstance(item, _Lost):
            self._inbox.put(item)
            self._raise_lost()
        assert isinstance(item, ControlMessage)
        return item

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except Exception:
                log.exception("wake-up callback of the connection to %s failed", self.peer.name)

    def recv(self, timeout: float) -> ControlMessage:
        """The next application message; ControlTimeout after ``timeout`` s, PeerUnreachable (or
        ProtocolError) once the connection ended."""
        wait = check_timeout(timeout, f"recv from {self.peer.name}")
        try:
            item = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            if self._error is not None:
                self._raise_lost()
            raise ControlTimeout(f"no message from {self.peer.role} {self.peer.name!r} within {wait:.3f} s") from None
        if isinstance(item, _Lost):
            self._inbox.put(item)
            self._raise_lost()
        assert isinstance(item, ControlMessage)
        return item

    def close(self, reason: str = "closed") -> None:
        """Say goodbye to the peer and end the connection (a client connection also ends its endpoint)."""
        self._endpoint.close_peer(self._route, reason)

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"lost: {self.lost_reason}"
        return f"PeerConnection({self.peer.role} {self.peer.name!r} v{self.peer.version}, {state})"


class _Endpoint:
    """A ZeroMQ socket owned by one I/O thread, with connections keyed by ZeroMQ routing id."""

    def __init__(self, kind: int, local: LocalIdentity, key: AuthKey, *, versions: tuple[int, int],
                 heartbeat_misses: int, on_peer_lost: PeerLostCallback | None, max_message_bytes: int,
                 inbox_limit: int, layout_check: LayoutCheck, outbox_limit: int = 65536) -> None:
        if isinstance(heartbeat_misses, bool) or not isinstance(heartbeat_misses, int) or heartbeat_misses < 1:
            raise ConfigError(f"heartbeat_misses must be an int >= 1, got {heartbeat_misses!r}")
        if not (isinstance(versions, tuple) and len(versions) == 2 and 0 <= versions[0] <= versions[1]):
            raise ConfigError(f"versions must be (min, max) with 0 <= min <= max, got {versions!r}")
        self.local, self.key, self.versions = local, key, versions
        self.heartbeat_misses = heartbeat_misses
        self.on_peer_lost = on_peer_lost
        self.max_message_bytes = max_message_bytes
        for what, v in (("inbox_limit", inbox_limit), ("outbox_limit", outbox_limit)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{what} must be an int >= 1, got {v!r}")
        self.inbox_limit = inbox_limit
        self.outbox_limit = outbox_limit
        self.layout_check = layout_check
        self._router = kind == zmq.ROUTER
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 1024)
        self._sock.setsockopt(zmq.SNDHWM, outbox_limit)
        self._sock.setsockopt(zmq.RCVHWM, inbox_limit)
        if self._router:
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._outbox: deque[tuple[bytes, bytes]] = deque()
        self._calls: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self._flushed = threading.Condition(self._lock)
        self._enqueued = 0     # frames ever queued ...
        self._handed = 0       # ... and ever handed to the socket (or dropped), both under _lock
        self._peers: dict[bytes, PeerConnection] = {}
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-control-{local.name}", daemon=True)

    # --- user-thread side --------------------------------------------------------------------------
    def enqueue(self, route: bytes, frame: bytes) -> int:
        """Queue ``frame`` (unsealed: the I/O thread seals it in sending order) and wake the I/O thread;
        returns its sequence number (for ``wait_handed``). PeerUnreachable when the endpoint is closed or
        ``outbox_limit`` frames already wait."""
        with self._lock:
            if self._closed:
                raise PeerUnreachable(f"{self.local.name}: control endpoint is closed")
            if len(self._outbox) >= self.outbox_limit:
                raise PeerUnreachable(f"{self.local.name}: send queue full ({self.outbox_limit} frames not yet "
                                      f"handed to the socket)")
            self._outbox.append((route, frame))
            self._enqueued += 1
            seq = self._enqueued
        self._wake()
        return seq

    def wait_handed(self, seq: int, timeout: float) -> bool:
        """Block (the GIL released) until frame ``seq`` left the outbox, at most ``timeout`` seconds;
        whether it did. A thread that sends a message on the critical path and then has Python work to do
        calls this so that the I/O thread is not kept waiting for the GIL behind that work."""
        with self._flushed:
            return self._flushed.wait_for(lambda: self._handed >= seq or self._closed, timeout)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):   # a wake-up is already pending, or the endpoint is closing
            self._wake_w.send(b"\0")

    def close_peer(self, route: bytes, reason: str) -> None:
        """End one connection with a goodbye (a client endpoint closes with its only connection)."""
        if not self._router:
            self.close(reason)
            return
        conn = self._peers.get(route)
        if conn is not None and conn.alive:
            with contextlib.suppress(PeerUnreachable):
                self.enqueue(route, encode(Bye(reason=reason[:1024]), conn.peer.version))
            self._call_soon(lambda: self._fail(conn, PeerUnreachable(f"connection to {conn.peer.name!r} closed "
                                                                     f"locally: {reason}"), notify=False, clean=True))

    def _call_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._calls.append(fn)
        self._wake()

    def close(self, reason: str = "endpoint closing") -> None:
        """Say goodbye to every peer, stop the I/O thread and free the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for route, conn in self._peers.items():
                if conn.alive:
                    self._outbox.append((route, encode(Bye(reason=reason[:1024]), conn.peer.version)))
        self._stop.set()
        self._wake()
        if threading.current_thread() is self._thread:
            return   # called from a callback: the loop ends after this iteration and closes the socket
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        elif self._thread.ident is None:
            self._sock.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()
        if self._thread.is_alive():
            log.error("%s: control I/O thread did not stop within 5 s; leaving its context", self.local.name)
        else:
            self._ctx.term()

    # --- I/O thread ----------------------------------------------------------------------------------
    def _start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms()))
                if self._wake_r.fileno() in events:
                    self._drain_wake()
                self._flush()
                if self._sock in events:
                    self._drain_socket()
                if not self._stop.is_set():   # nothing follows a goodbye
                    self._on_timers(time.monotonic())
            self._flush()
        except Exception as exc:   # the loop must never die silently: fail every connection
            log.exception("%s: control I/O thread failed", self.local.name)
            for conn in list(self._peers.values()):
                self._fail(conn, PeerUnreachable(f"control I/O thread of {self.local.name} failed: {exc!r}"),
                           notify=False)
        finally:
            with self._lock:
                self._closed = True
            for conn in list(self._peers.values()):
                self._fail(conn, PeerUnreachable(f"control endpoint {self.local.name} closed"), notify=False,
                           clean=True)
            self._sock.close(linger=200)

    def _poll_ms(self) -> int:
        now = time.monotonic()
        due = [now + 1.0, *self._timer_deadlines()]
        for conn in self._peers.values():
            due.append(conn.next_heartbeat)
            due.append(conn.last_seen + conn.peer.heartbeat_interval * self.heartbeat_misses)
        return max(0, min(1000, math.ceil((min(due) - now) * 1000)))

    def _timer_deadlines(self) -> list[float]:
        return []

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, deque()
            items, self._outbox = self._outbox, deque()
        for route, frame in items:
            conn = self._peers.get(route)
            if conn is not None and conn.alive:
                err = self._send_now(route, conn._channel.seal(frame))
                if err is not None:
                    self._fail(conn, PeerUnreachable(f"cannot send to {conn.peer.name!r}: {err}"))
        if items:
            with self._flushed:
                self._handed += len(items)
                self._flushed.notify_all()
        for fn in calls:
            fn()

    def _send_now(self, route: bytes, frame: bytes) -> str | None:
        try:
            if self._router:
                self._sock.send_multipart([route, frame], zmq.NOBLOCK)
            else:
                self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return "send queue full (peer not reading)"
        except zmq.ZMQError as exc:
            return f"{exc.strerror}"
        return None

    def _drain_socket(self) -> None:
        for _ in range(10_000):   # bounded burst; the poll loop comes back for more
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            route, parts = (frames[0], frames[1:]) if self._router else (b"", frames)
            self._on_frames(route, parts)

    def _on_frames(self, route: bytes, parts: list[bytes]) -> None:
        conn = self._peers.get(route)
        if conn is None:
            self._on_stranger(route, parts)
            return
        try:
            if len(parts) != 1:
                raise ProtocolError(f"message: expected one frame, got {len(parts)}")
            plain = conn._channel.open(parts[0])
        except SealError as exc:
            self._fail(conn, AuthenticationError(f"{conn.peer.role} {conn.peer.name!r}: {exc}"), bye=str(exc))
            return
        except ProtocolError as exc:
            self._fail(conn, ProtocolError(f"{conn.peer.role} {conn.peer.name!r} sent a bad message: {exc}"),
                       bye=f"protocol error: {exc}")
            return
        conn.last_seen = time.monotonic()
        try:
            msg = decode(plain, (conn.peer.version, conn.peer.version), self.max_message_bytes).message
        except ProtocolError as exc:
            self._fail(conn, ProtocolError(f"{conn.peer.role} {conn.peer.name!r} sent a bad message: {exc}"),
                       bye=f"protocol error: {exc}")
            return
        match msg:
            case Heartbeat():
                return
            case Bye(reason=reason):
                self._fail(conn, PeerUnreachable(f"{conn.peer.role} {conn.peer.name!r} closed the connection: "
                                                 f"{reason}"), clean=True)
            case Refuse(code=code, reason=reason):
                self._fail(conn, PeerUnreachable(f"{conn.peer.role} {conn.peer.name!r} refused us ({code}): "
                                                 f"{reason}"))
            case Hello() | Challenge() | Auth() | Accept():
                self._fail(conn, ProtocolError(f"{conn.peer.name!r} sent {msg.kind!r} after the handshake"),
                           bye=f"unexpected {msg.kind!r} after the handshake")
            case _:
                self._deliver(conn, msg)

    def _deliver(self, conn: PeerConnection, msg: ControlMessage) -> None:
        """Hand an application message to the arrival hook, or else to the connection's bounded inbox."""
        hook = conn._on_arrival
        if hook is not None:
            try:
                if hook(conn, msg):
                    return
            except Exception:
                log.exception("%s: on-arrival hook failed for a %r from %s", self.local.name, msg.kind,
                              conn.peer.name)
        if conn._inbox.qsize() >= self.inbox_limit:
            self._fail(conn, ProtocolError(f"{conn.peer.name!r} overflowed its inbox ({self.inbox_limit} "
                                           f"unread messages)"), bye=f"inbox overflow ({self.inbox_limit} unread)")
            return
        conn._inbox.put(msg)
        conn._notify()

    def _on_stranger(self, route: bytes, parts: list[bytes]) -> None:
        log.debug("%s: ignoring a message from an unknown route %s", self.local.name, route.hex())

    def _on_timers(self, now: float) -> None:
        for conn in list(self._peers.values()):
            silent = now - conn.last_seen
            limit = conn.peer.heartbeat_interval * self.heartbeat_misses
            if silent > limit:
                self._fail(conn, PeerUnreachable(
                    f"{conn.peer.role} {conn.peer.name!r} lost: silent for {silent:.3f} s ({self.heartbeat_misses} "
                    f"heartbeats of {conn.peer.heartbeat_interval:.3f} s missed)"))
            elif now >= conn.next_heartbeat:
                conn.next_heartbeat = now + self.local.heartbeat_interval
                err = self._send_now(conn._route, conn._channel.seal(encode(Heartbeat(), conn.peer.version)))
                if err is not None:
                    self._fail(conn, PeerUnreachable(f"cannot send to {conn.peer.name!r}: {err}"))

    def _fail(self, conn: PeerConnection, error: KvxferError, bye: str | None = None, notify: bool = True,
              clean: bool = False) -> None:
        """End ``conn`` with ``error`` (I/O thread only): wake its readers and tell the callback. A clean
        end (the peer said goodbye, or we closed it) is logged at DEBUG, any other at WARNING."""
        if conn._error is not None:
            return
        conn._error = error
        self._peers.pop(conn._route, None)
        if bye is not None:
            self._send_now(conn._route, conn._channel.seal(encode(Bye(reason=bye[:1024]), conn.peer.version)))
        conn._inbox.put(_Lost(error))
        conn._notify()
        log.log(logging.DEBUG if clean else logging.WARNING, "%s: connection to %s ended: %s", self.local.name,
                conn.peer.name, error)
        if notify and self.on_peer_lost is not None:
            try:
                self.on_peer_lost(conn, str(error))
            except Exception:
                log.exception("%s: on_peer_lost callback failed", self.local.name)


class ControlServer(_Endpoint):
    """Accepts authenticated peers on ``bind`` (``tcp://127.0.0.1:0`` picks a free port; see ``address``)."""

    def __init__(self, local: LocalIdentity, secret: Secret = None, *, bind: str = "tcp://127.0.0.1:0",
                 accept_roles: tuple[str, ...] = ROLES, versions: tuple[int, int] = SUPPORTED_VERSIONS,
                 handshake_timeout: float = 5.0, heartbeat_misses: int = 3,
                 on_peer_lost: PeerLostCallback | None = None, max_pending: int = 1024,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, inbox_limit: int = 4096,
                 layout_check: LayoutCheck = check_compatible, refusal_log_size: int = 1024,
                 outbox_limit: int = 65536) -> None:
        """``max_pending``: handshakes in progress at once; a new hello beyond it evicts the oldest (a
        correct client answers its challenge within a round trip, strangers that never do are the
        oldest). ``inbox_limit``: unread messages per peer before it is disconnected."""
        super().__init__(zmq.ROUTER, local, _as_key(secret), versions=versions, heartbeat_misses=heartbeat_misses,
                         on_peer_lost=on_peer_lost, max_message_bytes=max_message_bytes, inbox_limit=inbox_limit,
                         layout_check=layout_check, outbox_limit=outbox_limit)
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.accept_roles = accept_roles
        self.handshake_timeout = check_timeout(handshake_timeout, "handshake_timeout")
        self.max_pending = max_pending
        self._pending: dict[bytes, tuple[ServerHandshake, float]] = {}
        self._nonces = NonceCache()
        self._accepted: queue.Queue[PeerConnection | None] = queue.Queue()   # None: closed
        self.refusals: deque[tuple[str, str]] = deque(maxlen=refusal_log_size)
        self.evicted = 0
        """Half-open handshakes dropped to make room for newer ones (a flood shows here)."""
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"ControlServer: cannot bind {bind!r}: {exc.strerror}") from exc
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._start()

    @property
    def peers(self) -> list[PeerConnection]:
        """Live authenticated connections."""
        return list(self._peers.values())

    @property
    def num_pending(self) -> int:
        """Handshakes in progress (the only per-stranger state the server keeps)."""
        return len(self._pending)

    def accept(self, timeout: float) -> PeerConnection:
        """The next authenticated peer; ControlTimeout if none completes a handshake within ``timeout`` s."""
        wait = check_timeout(timeout, "accept")
        try:
            conn = self._accepted.get(timeout=wait) if wait > 0 else self._accepted.get_nowait()
        except queue.Empty:
            raise ControlTimeout(f"{self.local.name}: no peer completed a handshake within {wait:.3f} s") from None
        if conn is None:
            self._accepted.put(None)
            raise PeerUnreachable(f"{self.local.name}: control server closed")
        return conn

    def close(self, reason: str = "endpoint closing") -> None:
        """Close as ``_Endpoint.close`` does, and end every ``accept`` waiting now or later."""
        super().close(reason)
        self._accepted.put(None)

    def _timer_deadlines(self) -> list[float]:
        return [deadline for _, deadline in self._pending.values()]

    def _on_timers(self, now: float) -> None:
        for route, (_, deadline) in list(self._pending.items()):
            if now >= deadline:
                self._refuse(route, Refusal("timeout", f"handshake not completed within {self.handshake_timeout} s"))
        super()._on_timers(now)

    def _on_stranger(self, route: bytes, parts: list[bytes]) -> None:
        entry = self._pending.get(route)
        try:
            if len(parts) != 1:
                raise Refusal("protocol", f"message: expected one frame, got {len(parts)}")
            try:
                frame = decode(parts[0], self.versions, self.max_message_bytes)
            except ProtocolError as exc:
                raise Refusal("version" if str(exc).startswith("message.version") else "protocol", str(exc)) from exc
            if entry is None:
                if not isinstance(frame.message, Hello):
                    raise Refusal("protocol", f"expected 'hello' to start a handshake, got {frame.message.kind!r}")
                if len(self._pending) >= self.max_pending:
                    self._evict_oldest()
                handshake = ServerHandshake(self.local, self.key, self.versions, self.accept_roles,
                                            self.layout_check, self._nonces)
            else:
                handshake = entry[0]
            reply, peer = handshake.on_message(frame)
        except Refusal as exc:
            self._refuse(route, exc)
            return
        except ProtocolError as exc:
            self._refuse(route, Refusal("protocol", str(exc)))
            return
        if peer is None:
            deadline = entry[1] if entry is not None else time.monotonic() + self.handshake_timeout
            self._pending[route] = (handshake, deadline)
            self._send_now(route, encode_frame(reply))
            return
        self._pending.pop(route, None)
        conn = PeerConnection(self, route, peer, handshake.channel())
        self._peers[route] = conn
        if self._send_now(route, encode_frame(reply)) is not None:
            self._fail(conn, PeerUnreachable(f"{peer.name!r} went away during the handshake"), notify=False)
            return
        log.info("%s: accepted %s %r (protocol %d, backend %r)", self.local.name, peer.role, peer.name,
                 peer.version, peer.backend)
        self._accepted.put(conn)

    def _evict_oldest(self) -> None:
        """Drop the oldest half-open handshake (told "busy") to make room for a new hello."""
        route = next(iter(self._pending))
        self.evicted += 1
        self._refuse(route, Refusal("busy", f"handshake evicted: {self.max_pending} newer handshakes started "
                                            f"before it completed"), quiet=True)

    def _refuse(self, route: bytes, refusal: Refusal, *, quiet: bool = False) -> None:
        """Tell a stranger why it is refused, log the detail, and keep nothing about it."""
        self._pending.pop(route, None)
        self.refusals.append((route.hex(), str(refusal)))
        (log.debug if quiet else log.warning)("%s: refused peer %s (%s): %s", self.local.name, route.hex(),
                                              refusal.code, refusal)
        self._send_now(route, encode_frame(refusal_frame(refusal.code, refusal.public)))


class _ClientEndpoint(_Endpoint):
    """The DEALER side: runs the client handshake in the caller's thread, then the I/O thread."""

    def handshake(self, address: str, expect_role: str | None, timeout: float) -> PeerConnection:
        deadline = time.monotonic() + timeout
        hs = ClientHandshake(self.local, self.key, self.versions, expect_role, self.layout_check)
        self._sock.connect(address)
        self._sock.send(encode_frame(hs.hello()))
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, math.ceil(remaining * 1000)), zmq.POLLIN):
                raise ControlTimeout(f"handshake with {address}: no reply within {timeout:.3f} s")
            try:
                step = hs.on_message(decode(self._sock.recv(), _ANY_VERSION, self.max_message_bytes))
            except Refusal as exc:
                self._tell_refused(exc.code, exc.public)
                raise
            except AuthenticationError as exc:
                if "refused by the server" not in str(exc):
                    self._tell_refused("auth", "authentication failed")
                raise
            except ProtocolError as exc:
                if not str(exc).startswith("refused by the server"):
                    self._tell_refused("protocol", str(exc))
                raise
            if isinstance(step, Frame):
                self._sock.send(encode_frame(step))
            else:
                conn = PeerConnection(self, b"", step, hs.channel())
                self._peers[b""] = conn
                self._start()
                return conn

    def _tell_refused(self, code: str, reason: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(encode_frame(refusal_frame(code, reason)), zmq.NOBLOCK)


def connect(address: str, local: LocalIdentity, secret: Secret = None, *, timeout: float = 5.0,
            expect_role: str | None = None, versions: tuple[int, int] = SUPPORTED_VERSIONS,
            heartbeat_misses: int = 3, on_peer_lost: PeerLostCallback | None = None,
            max_message_bytes: int = MAX_MESSAGE_BYTES, inbox_limit: int = 4096,
            layout_check: LayoutCheck = check_compatible, outbox_limit: int = 65536) -> PeerConnection:
    """Connect to a ControlServer at ``address`` and authenticate both ways within ``timeout`` s.

    Raises AuthenticationError (wrong secret, altered or replayed handshake), HandshakeRefused (with
    the server's reason: version, role, layout), ControlTimeout, or ProtocolError.
    """
    wait = check_timeout(timeout, "connect")
    endpoint = _ClientEndpoint(zmq.DEALER, local, _as_key(secret), versions=versions,
                               heartbeat_misses=heartbeat_misses, on_peer_lost=on_peer_lost,
                               max_message_bytes=max_message_bytes, inbox_limit=inbox_limit,
                               layout_check=layout_check, outbox_limit=outbox_limit)
    try:
        return endpoint.handshake(address, expect_role, wait)
    except BaseException:
        endpoint.close()
        raise

