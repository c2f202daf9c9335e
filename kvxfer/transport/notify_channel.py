"""A node-local notification channel: length-prefixed frames over TCP on 127.0.0.1, written by the
sending thread straight into its socket and read by one receiver thread.

cuda_ipc's notifications (a request's KV landed) are on the time to first token. Over ZeroMQ each
one passed two I/O threads besides the sender and the receiver: 0.35 ms from prefill's send to
decode's receiver on an H200 host, 176 us one way against 12 us for a plain
TCP socket on a 2-core VM. Here the sending thread's ``sendall`` is the whole send, and the receiver
thread wakes from ``select`` with the frame in its socket.

Wire: a connection's first frame names the sender (UTF-8, at most ``MAX_NAME_BYTES``), every later
frame is one notification; a frame is a 4-byte big-endian length and that many bytes. The receiver
bounds what a peer can make it hold: frames over ``max_frame`` bytes, an over-long or undecodable
name end that connection (logged), as does a connection that has not named itself within
``hello_timeout`` seconds (so idle connections cannot hold every slot); past ``max_connections`` new
connections are closed at once; a failing ``accept`` (out of file descriptors) is logged and retried.
Anyone on the host can connect, as to any 127.0.0.1 port: the receiver hands every frame with its
claimed sender to ``deliver``, which must check it (cuda_ipc keeps only connected peers' frames; the
workers trust a notice only when its tag checks).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvxfer.errors import DecodeError, PeerUnreachable

log = logging.getLogger(__name__)

MAX_NAME_BYTES = 256
_HEADER = struct.Struct(">I")
_READ_BYTES = 1 << 16
ENDPOINT_PREFIX = "tcp://127.0.0.1:"


def parse_endpoint(endpoint: str) -> int:
    """The port of a ``tcp://127.0.0.1:<port>`` endpoint (DecodeError for anything else: notifications
    stay on this host)."""
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_PREFIX):
        raise DecodeError(f"notification endpoint {endpoint!r}: expected {ENDPOINT_PREFIX}<port>")
    port = endpoint[len(ENDPOINT_PREFIX):]
    if not (port.isascii() and port.isdigit() and 0 < len(port) <= 5 and 0 < int(port) < 65536):
        raise DecodeError(f"notification endpoint {endpoint!r}: port {port!r} is not in 1..65535")
    return int(port)


class NotifyOutbox:
    """The sending end to one peer's inbox: ``send`` writes one frame from the calling thread."""

    def __init__(self, endpoint: str, sender: str, *, timeout: float = 5.0) -> None:
        """Connect to ``endpoint`` and introduce ourselves as ``sender``; PeerUnreachable when nothing
        listens there. ``timeout`` bounds the connect and every send (a receiver that stopped reading)."""
        port = parse_endpoint(endpoint)
        name = sender.encode()
        if not 0 < len(name) <= MAX_NAME_BYTES:
            raise PeerUnreachable(f"notification sender name of {len(name)} bytes (1 to {MAX_NAME_BYTES})")
        self.endpoint = endpoint
        try:
            self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        except OSError as exc:
            raise PeerUnreachable(f"notification endpoint {endpoint}: cannot connect: {exc}") from exc
        self._lock = threading.Lock()
        self._broken: str | None = None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.send(name)
        except BaseException:
            self._sock.close()
            raise

    def send(self, payload: bytes) -> None:
        """Write one frame (any thread; frames from several threads do not interleave). PeerUnreachable
        once the connection failed (the peer is gone, or did not read for ``timeout`` s)."""
        frame = _HEADER.pack(len(payload)) + payload
        with self._lock:
            if self._broken is not None:
                raise PeerUnreachable(f"notification endpoint {self.endpoint}: {self._broken}")
            try:
                self._sock.sendall(frame)
            except OSError as exc:   # a timed-out sendall may have written part of a frame: never write again
                self._broken = f"send failed: {exc}"
                raise PeerUnreachable(f"notification endpoint {self.endpoint}: {self._broken}") from exc

    def close(self) -> None:
        """Close the connection (frames already sent are still delivered)."""
        with self._lock:
            self._broken = self._broken or "closed"
            self._sock.close()


class _Reader:
    """What the receiver knows of one connection: the bytes of its unfinished frame and its sender."""

    __slots__ = ("buffer", "opened", "sender", "where")

    def __init__(self, where: str) -> None:
        self.buffer = bytearray()
        self.sender: str | None = None
        self.where = where
        self.opened = time.monotonic()


class NotifyInbox:
    """The receiving end: listens on 127.0.0.1 and calls ``deliver(sender, frame)`` on its own thread
    for every notification, in arrival order per connection."""

    def __init__(self, name: str, deliver: Callable[[str, bytes], None], *, max_frame: int = 1 << 16,
                 max_connections: int = 1024, hello_timeout: float = 5.0) -> None:
        self.name = name
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.hello_timeout = hello_timeout
        self._deliver = deliver
        self._readers: dict[socket.socket, _Reader] = {}
        self._closing = False
        self._selector = selectors.DefaultSelector()
        opened: list[socket.socket] = []
        try:   # whatever was opened is closed again if a later step fails
            self._listener = socket.create_server(("127.0.0.1", 0))
            opened.append(self._listener)
            self._wake_r, self._wake_w = socket.socketpair()
            opened += [self._wake_r, self._wake_w]
            self._listener.setblocking(False)
            self._wake_r.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._selector.register(self._wake_r, selectors.EVENT_READ)
            self.endpoint = f"{ENDPOINT_PREFIX}{self._listener.getsockname()[1]}"
            self._thread = threading.Thread(target=self._run, name=f"notify-inbox-{name}", daemon=True)
            self._thread.start()
        except BaseException:
            for sock in opened:
                sock.close()
            self._selector.close()
            raise

    @property
    def num_connections(self) -> int:
        """Connections open now."""
        return len(self._readers)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the receiver thread and close every socket."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("notification inbox %r: the receiver did not stop within %.0f s", self.name, timeout)
            return
        self._release()

    def _release(self) -> None:
        for sock in list(self._readers):
            sock.close()
        self._readers.clear()
        self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def _run(self) -> None:
        try:
            while not self._closing:
                unnamed = [r.opened for r in self._readers.values() if r.sender is None]
                timeout = None if not unnamed else max(0.0, min(unnamed) + self.hello_timeout - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        self._accept()
                    elif sock is not self._wake_r and sock in self._readers:
                        self._read(sock)
                if unnamed:
                    self._drop_silent()
        except Exception as exc:   # notifications stop: transfers still complete, waiters time out naming it
            log.error("notification inbox %r: the receiver failed; no more notifications will arrive: %s",
                      self.name, exc, exc_info=exc)

    def _drop_silent(self) -> None:
        """Close the connections that have not named themselves within ``hello_timeout``."""
        late = time.monotonic() - self.hello_timeout
        for sock in [s for s, r in self._readers.items() if r.sender is None and r.opened <= late]:
            self._drop(sock, f"no name within {self.hello_timeout:g} s")

    def _accept(self) -> None:
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:   # out of file descriptors, say: the connection waits in the backlog
            log.warning("notification inbox %r: accept failed (retrying in 10 ms): %s", self.name, exc)
            time.sleep(0.01)
            return
        if len(self._readers) >= self.max_connections:
            log.warning("notification inbox %r: refusing a connection from %s: %d already open", self.name, addr,
                        len(self._readers))
            sock.close()
            return
        sock.setblocking(False)
        self._readers[sock] = _Reader(f"{addr[0]}:{addr[1]}")
        self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, sock: socket.socket, reason: str | None) -> None:
        reader = self._readers.pop(sock)
        if reason is not None:
            log.warning("notification inbox %r: closing the connection from %s (%s): %s", self.name, reader.where,
                        reader.sender or "unnamed", reason)
        self._selector.unregister(sock)
        sock.close()

    def _read(self, sock: socket.socket) -> None:
        reader = self._readers[sock]
        try:
            data = sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(sock, f"receive failed: {exc}")
            return
        if not data:
            self._drop(sock, "ended in the middle of a frame" if reader.buffer else None)
            return
        buf = reader.buffer
        buf += data
        start = 0
        while len(buf) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf, start)
            limit = MAX_NAME_BYTES if reader.sender is None else self.max_frame
            if size > limit:
                self._drop(sock, f"a frame of {size} bytes (at most {limit})")
                return
            end = start + _HEADER.size + size
            if len(buf) < end:
                break
            frame = bytes(buf[start + _HEADER.size:end])
            start = end
            if reader.sender is None:
                try:
                    name = frame.decode()
                except UnicodeDecodeError:
                    self._drop(sock, "the sender's name is not UTF-8")
                    return
                if not name:
                    self._drop(sock, "the sender's name is empty")
                    return
                reader.sender = name
                continue
            try:
                self._deliver(reader.sender, frame)
            except Exception as exc:   # the owner's problem, not the connection's: report, keep reading
                log.error("notification inbox %r: delivering a notification from %s failed: %s", self.name,
                          reader.sender, exc, exc_info=exc)
        del buf[:start]


__all__ = ["ENDPOINT_PREFIX", "MAX_NAME_BYTES", "NotifyInbox", "NotifyOutbox", "parse_endpoint"]
