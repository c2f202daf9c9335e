"""The node-local notification channel (cuda_ipc's notices): frames arrive whole, in order, with their
sender; hostile connections (over-long frames or names, undecodable names, junk, a flood of
connections) are closed without delivering anything or stopping the receiver; a sender whose peer is
gone or stopped reading gets PeerUnreachable within its timeout."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.errors import DecodeError, PeerUnreachable
from kvxfer.transport.notify_channel import MAX_NAME_BYTES, NotifyInbox, NotifyOutbox, parse_endpoint


class Collected:
    """What an inbox delivered, with a wait for the n-th frame."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []
        self._cond = threading.Condition()

    def __call__(self, sender: str, frame: bytes) -> None:
        with self._cond:
            self.frames.append((sender, frame))
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> list[tuple[str, bytes]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.frames) >= n, timeout), f"{len(self.frames)} of {n} frames"
            return list(self.frames)

    def wait_until(self, cond: Callable[[list[tuple[str, bytes]]], bool], timeout: float = 5.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: cond(self.frames), timeout), f"not seen in {self.frames!r:.200}"


@pytest.fixture(autouse=True)
def _record_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """The channel's warnings reach ``caplog`` even after an earlier test quieted the ``kvxfer`` loggers
    (the demo and bench e2e set them to ERROR)."""
    caplog.set_level(logging.WARNING, logger="kvxfer.transport.notify_channel")


@pytest.fixture
def inbox() -> Iterator[tuple[NotifyInbox, Collected]]:
    got = Collected()
    box = NotifyInbox("test", got, max_frame=1024, max_connections=8)
    yield box, got
    box.close()


def raw(box: NotifyInbox) -> socket.socket:
    return socket.create_connection(("127.0.0.1", parse_endpoint(box.endpoint)), timeout=5)


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def wait_until(cond: object, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_frames_arrive_whole_in_order_with_their_sender(inbox: tuple[NotifyInbox, Collected]) -> None:
    box, got = inbox
    a, b = NotifyOutbox(box.endpoint, "prefill-a"), NotifyOutbox(box.endpoint, "prefill-b")
    for i in range(50):
        a.send(f"a{i}".encode())
        b.send(f"b{i}".encode() * 20)
    a.send(b"")   # an empty notification is a frame too
    frames = got.wait_for(101)
    assert [f for s, f in frames if s == "prefill-a"] == [f"a{i}".encode() for i in range(50)] + [b""]
    assert [f for s, f in frames if s == "prefill-b"] == [f"b{i}".encode() * 20 for i in range(50)]
    a.close()
    b.close()


def test_frames_from_several_threads_do_not_interleave(inbox: tuple[NotifyInbox, Collected]) -> None:
    box, got = inbox
    out = NotifyOutbox(box.endpoint, "prefill")
    payloads = [bytes([t]) * (100 + t) for t in range(8)]

    def send(t: int) -> None:
        for _ in range(100):
            out.send(payloads[t])
    threads = [threading.Thread(target=send, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    frames = got.wait_for(800)
    assert sorted(f for _, f in frames) == sorted(payloads * 100)
    out.close()


@pytest.mark.parametrize("bad", ["long frame", "long name", "name not utf-8", "empty name"])
def test_a_hostile_connection_is_closed_and_others_go_on(inbox: tuple[NotifyInbox, Collected], bad: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    box, got = inbox
    sock = raw(box)
    if bad == "long frame":
        sock.sendall(frame(b"mallory") + frame(b"x" * 1025) + frame(b"after"))
    elif bad == "long name":
        sock.sendall(frame(b"m" * (MAX_NAME_BYTES + 1)) + frame(b"after"))
    elif bad == "empty name":
        sock.sendall(frame(b"") + frame(b"after"))
    else:
        sock.sendall(frame(b"\xff\xfe") + frame(b"after"))
    assert sock.recv(16) == b""   # the inbox closed it
    sock.close()
    good = NotifyOutbox(box.endpoint, "prefill")
    good.send(b"ok")
    assert got.wait_for(1) == [("prefill", b"ok")]   # nothing of the hostile connection was delivered
    assert {"long frame": "a frame of 1025 bytes (at most 1024)", "long name": f"(at most {MAX_NAME_BYTES})",
            "name not utf-8": "not UTF-8", "empty name": "name is empty"}[bad] in caplog.text
    good.close()


def test_a_frame_cut_short_delivers_nothing(inbox: tuple[NotifyInbox, Collected],
                                           caplog: pytest.LogCaptureFixture) -> None:
    box, got = inbox
    sock = raw(box)
    sock.sendall(frame(b"prefill") + frame(b"whole") + frame(b"cut short")[:-3])
    got.wait_for(1)
    sock.close()
    wait_until(lambda: box.num_connections == 0)
    assert got.frames == [("prefill", b"whole")]
    assert "ended in the middle of a frame" in caplog.text


def test_connections_past_the_bound_are_closed_at_once(inbox: tuple[NotifyInbox, Collected]) -> None:
    box, got = inbox
    held = [raw(box) for _ in range(8)]
    wait_until(lambda: box.num_connections == 8)
    extra = raw(box)
    assert extra.recv(16) == b""
    for s in held:
        s.close()
    wait_until(lambda: box.num_connections == 0)
    out = NotifyOutbox(box.endpoint, "prefill")   # room again
    out.send(b"ok")
    assert got.wait_for(1) == [("prefill", b"ok")]
    out.close()
    extra.close()


def test_a_failing_delivery_does_not_stop_the_receiver(caplog: pytest.LogCaptureFixture) -> None:
    got = Collected()

    def deliver(sender: str, data: bytes) -> None:
        if data == b"boom":
            raise RuntimeError("owner failed")
        got(sender, data)
    box = NotifyInbox("test", deliver)
    out = NotifyOutbox(box.endpoint, "prefill")
    out.send(b"boom")
    out.send(b"after")
    assert got.wait_for(1) == [("prefill", b"after")]
    assert "owner failed" in caplog.text
    out.close()
    box.close()


@given(st.lists(st.binary(max_size=64), max_size=6))
def test_junk_never_stops_the_receiver(chunks: list[bytes]) -> None:
    got = Collected()
    box = NotifyInbox("junk", got, max_frame=64)
    try:
        sock = raw(box)
        with contextlib.suppress(OSError):   # the inbox may have closed it already
            for c in chunks:
                sock.sendall(c)
        sock.close()
        out = NotifyOutbox(box.endpoint, "prefill")
        out.send(b"ok")
        # Junk that names itself may be delivered first (under its own name): wait for "ok" itself.
        got.wait_until(lambda frames: ("prefill", b"ok") in frames)
        assert all(len(f) <= 64 and s for s, f in got.frames)
        out.close()
    finally:
        box.close()


def test_close_stops_the_receiver_at_once() -> None:
    box = NotifyInbox("test", Collected())
    out = NotifyOutbox(box.endpoint, "prefill")
    started = time.monotonic()
    box.close()
    assert time.monotonic() - started < 0.5
    assert not box._thread.is_alive()
    with pytest.raises(PeerUnreachable, match="send failed"):
        for _ in range(100):   # the first writes after the peer closed may still be accepted by the kernel
            out.send(b"x" * 1024)
            time.sleep(0.001)
    out.close()


def test_nothing_listening_is_unreachable() -> None:
    box = NotifyInbox("test", Collected())
    endpoint = box.endpoint
    box.close()
    with pytest.raises(PeerUnreachable, match=f"{endpoint}: cannot connect"):
        NotifyOutbox(endpoint, "prefill")


def test_a_peer_that_stops_reading_times_the_sender_out() -> None:
    listener = socket.create_server(("127.0.0.1", 0))   # accepts, never reads
    out = NotifyOutbox(f"tcp://127.0.0.1:{listener.getsockname()[1]}", "prefill", timeout=0.2)
    started = time.monotonic()
    with pytest.raises(PeerUnreachable, match="send failed"):
        for _ in range(100_000):
            out.send(b"x" * 60_000)
    assert time.monotonic() - started < 10
    with pytest.raises(PeerUnreachable, match="send failed"):   # and stays failed: a frame may be cut
        out.send(b"x")
    out.close()
    listener.close()


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.1:5000", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536",
                                      "tcp://127.0.0.1:", "tcp://127.0.0.1:12a", "ipc:///tmp/x",
                                      "tcp://127.0.0.1:¹²"])
def test_endpoints_off_this_host_or_malformed_are_refused(endpoint: str) -> None:
    with pytest.raises(DecodeError, match="notification endpoint"):
        parse_endpoint(endpoint)


def test_a_connection_that_never_names_itself_is_closed_and_frees_its_slot(caplog: pytest.LogCaptureFixture) -> None:
    """Idle connections cannot hold every slot: one that sends no name within ``hello_timeout`` is closed,
    one that named itself stays open however long it is quiet. (Mutation: no timeout keeps it open.)"""
    got = Collected()
    box = NotifyInbox("test", got, max_connections=2, hello_timeout=0.2)
    try:
        named = NotifyOutbox(box.endpoint, "prefill")
        silent = raw(box)
        silent.settimeout(5)
        started = time.monotonic()
        assert silent.recv(16) == b""   # closed by the inbox
        assert 0.15 < time.monotonic() - started < 3
        assert "no name within 0.2 s" in caplog.text
        time.sleep(0.3)
        named.send(b"still here")
        assert got.wait_for(1) == [("prefill", b"still here")]
        wait_until(lambda: box.num_connections == 1)
        named.close()
        silent.close()
    finally:
        box.close()


@pytest.mark.parametrize("failing", ["socketpair", "thread"])
def test_an_inbox_that_cannot_start_releases_what_it_opened(failing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A constructor that fails halfway closes the sockets it opened. (Mutation: no clean-up leaves the
    listener, or the listener and the socket pair, open.)"""
    opened: list[socket.socket] = []
    real_server, real_pair = socket.create_server, socket.socketpair

    def server(*a: Any, **k: Any) -> socket.socket:
        opened.append(real_server(*a, **k))
        return opened[-1]

    def pair(*a: Any, **k: Any) -> tuple[socket.socket, socket.socket]:
        if failing == "socketpair":
            raise OSError("injected")
        both = real_pair(*a, **k)
        opened.extend(both)
        return both

    def fail(*a: object, **k: object) -> None:
        raise OSError("injected")
    monkeypatch.setattr(socket, "create_server", server)
    monkeypatch.setattr(socket, "socketpair", pair)
    if failing == "thread":
        monkeypatch.setattr(threading.Thread, "start", fail)
    with pytest.raises(OSError, match="injected"):
        NotifyInbox("test", Collected())
    assert len(opened) == (1 if failing == "socketpair" else 3)
    assert all(sock.fileno() == -1 for sock in opened), "a socket of the failed inbox is still open"
