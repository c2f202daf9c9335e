"""Publish KV events as vLLM does: a ZeroMQ PUB socket sending ``[topic, seq, payload]`` per batch, and
an optional ROUTER socket answering replay requests from the last ``buffer_steps`` batches.

Replay framing (vLLM's ``ZmqEventPublisher``): a client (DEALER, or REQ) sends ``[b"", start_seq]``
(8 bytes, big-endian); the ROUTER answers ``[b"", seq, payload]`` for every buffered batch with
``seq >= start_seq``, then ``[b"", -1 (8 bytes, signed big-endian), b""]``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

import zmq

from kvxfer.cache.event_wire import WireContext, encode_batch
from kvxfer.cache.events import KVEvent
from kvxfer.errors import ConfigError, TransportError

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_POLL_MS = 100


class EventSource(Protocol):
    """Where events come from: a KVCacheManager (its ``drain_events``)."""

    def drain_events(self) -> list[KVEvent]: ...


class KVEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket as ``[topic, seq (8 bytes, big-endian), payload]``
    (payload: ``encode_batch`` in ``context.wire`` form); with ``replay_endpoint``, a ROUTER socket
    (served by a thread of its own) resends buffered batches on request."""

    def __init__(self, endpoint: str, *, context: WireContext | None = None, topic: str = "kv-events",
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 zmq_context: zmq.Context[Any] | None = None) -> None:
        if isinstance(buffer_steps, bool) or not isinstance(buffer_steps, int) or buffer_steps <= 0:
            raise ConfigError(f"KVEventPublisher: buffer_steps must be an int > 0, got {buffer_steps!r}")
        self.context = context or WireContext()
        self.topic = topic.encode()
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._zmq = zmq_context or zmq.Context.instance()
        self._socket = self._bind(zmq.PUB, endpoint, hwm)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[Any] | None = None
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_error: BaseException | None = None
        if replay_endpoint is not None:
            try:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, hwm)
            except BaseException:
                self._socket.close()
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self._thread.start()

    def _bind(self, kind: int, endpoint: str, hwm: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.set_hwm(hwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise TransportError(f"KVEventPublisher: cannot bind {endpoint!r}: {exc}") from exc
        return sock

    @property
    def next_sequence(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def publish(self, events: Iterable[KVEvent]) -> int | None:
        """Send ``events`` as one batch; returns its sequence number (None: none has a wire form)."""
        payload = encode_batch(events, time.time(), self.context)
        if payload is None:
            return None
        with self._lock:
            seq = self._seq
            self._socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self._seq += 1
        return seq

    def publish_from(self, source: EventSource) -> int | None:
        """Drain ``source`` and publish what it had (call once per scheduler iteration)."""
        return self.publish(source.drain_events())

    def _serve_replay(self) -> None:
        assert self._replay is not None
        try:
            while not self._stop.is_set():
                if self._replay.poll(_REPLAY_POLL_MS):
                    self._answer(self._replay.recv_multipart())
        except BaseException as exc:   # reported, not swallowed: the owner sees replay_error
            if not self._stop.is_set():
                self.replay_error = exc
                log.error("KV event replay socket failed: %s", exc)

    def _answer(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV event replay: malformed request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._lock:
            batches = [(s, p) for s, p in self._buffer if s >= first]
        for seq, payload in batches:
            self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        """Stop the replay thread and close the sockets (pending messages are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * _REPLAY_POLL_MS / 1000)
        self._socket.close()
        if self._replay is not None:
            self._replay.close()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
