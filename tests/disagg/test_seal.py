"""Sealed control plane and handshake flood resistance: every message after the handshake is encrypted
and authenticated with per-direction counters; strangers without the secret cannot lock clients out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvxfer.disagg.auth import AuthKey
from kvxfer.disagg.control import ControlServer, connect
from kvxfer.disagg.handshake import ClientHandshake, LocalIdentity, PeerInfo
from kvxfer.disagg.messages import (
    Challenge,
    Frame,
    Refuse,
    WorkerStatus,
    WorkerStatusReply,
    decode,
    encode,
    encode_frame,
)
from kvxfer.disagg.seal import OVERHEAD_BYTES, SealedChannel, SealError
from kvxfer.errors import AuthenticationError

SECRET = "sealed control plane test secret"
KEY = AuthKey.load(SECRET)


def ident(role: str, name: str) -> LocalIdentity:
    return LocalIdentity(role, name, None, "", b"", 0.05)


@pytest.fixture
def server() -> Iterator[ControlServer]:
    srv = ControlServer(ident("decode", "decode-0"), SECRET, accept_roles=("client",))
    yield srv
    srv.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def pair() -> tuple[SealedChannel, SealedChannel]:
    a, b = bytes(range(32)), bytes(range(1, 33))
    return SealedChannel(a, b), SealedChannel(b, a)


def test_channel_round_trip_and_every_refusal_names_its_reason() -> None:
    client, server = pair()
    frames = [client.seal(b"message %d" % i) for i in range(3)]
    assert all(len(f) == len(b"message 0") + OVERHEAD_BYTES for f in frames)
    assert b"message" not in b"".join(frames)                         # encrypted, not only tagged
    assert server.open(frames[0]) == b"message 0"
    with pytest.raises(SealError, match=r"reordered message refused: frame counter 2, expected 1") as err:
        server.open(frames[2])
    assert err.value.reason == "reordered"
    assert server.open(frames[1]) == b"message 1"
    with pytest.raises(SealError, match=r"replayed message refused: frame counter 0, expected 2"):
        server.open(frames[0])
    bad = bytearray(frames[2])
    bad[OVERHEAD_BYTES // 2 + 4] ^= 0x01                              # one bit of the ciphertext
    with pytest.raises(SealError, match=r"tampered message refused: frame 2 does not authenticate"):
        server.open(bytes(bad))
    with pytest.raises(SealError, match="tampered"):
        server.open(frames[2][:10])
    with pytest.raises(SealError, match="tampered"):                  # its own direction's key is not ours
        server.open(server.seal(b"reflected"))
    assert server.open(frames[2]) == b"message 2"                      # refusals consumed nothing
    assert client.sent == 3 and server.received == 3


def handshake_by_hand(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> tuple[zmq.Socket[bytes], SealedChannel]:
    hs = ClientHandshake(ident("client", "raw"), KEY)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(encode_frame(hs.hello()))
    assert sock.poll(3000)
    step = hs.on_message(decode(sock.recv(), (0, 99)))
    assert isinstance(step, Frame)
    sock.send(encode_frame(step))
    assert sock.poll(3000)
    assert isinstance(hs.on_message(decode(sock.recv(), (0, 99))), PeerInfo)
    return sock, hs.channel()


@pytest.mark.parametrize("attack", ["tampered", "replayed", "unsealed"])
def test_altered_or_replayed_frame_ends_the_connection_with_the_reason(
        server: ControlServer, ctx: zmq.Context[zmq.Socket[bytes]], attack: str) -> None:
    sock, channel = handshake_by_hand(ctx, server.address)
    conn = server.accept(3)
    frame = channel.seal(encode(WorkerStatus()))
    sock.send(frame)
    assert isinstance(conn.recv(3), WorkerStatus)                     # the genuine frame is served
    if attack == "tampered":
        nxt = bytearray(channel.seal(encode(WorkerStatus())))
        nxt[-1] ^= 0x80
        sock.send(bytes(nxt))
    elif attack == "replayed":
        sock.send(frame)
    else:                                                             # an injected plain message
        sock.send(encode(WorkerStatus()))
    expected = {"tampered": "tampered message refused", "replayed": "replayed message refused: frame counter 0, "
                "expected 1", "unsealed": "tampered message refused"}[attack]
    with pytest.raises(AuthenticationError, match=expected):
        conn.recv(3)
    with pytest.raises(AuthenticationError, match=expected):   # the connection stays ended
        conn.send(WorkerStatus())
    sock.close()


def test_worker_messages_travel_sealed(server: ControlServer) -> None:
    client = connect(server.address, ident("client", "c"), SECRET, timeout=3)
    conn = server.accept(3)
    client.send(WorkerStatus())
    assert isinstance(conn.recv(3), WorkerStatus)
    conn.send(WorkerStatusReply(stats=b"\x80"))
    assert client.recv(3) == WorkerStatusReply(stats=b"\x80")
    client.close()


def strangers(ctx: zmq.Context[zmq.Socket[bytes]], address: str, n: int,
              go: threading.Event | None = None, seen: Callable[[], int] | None = None) -> list[zmq.Socket[bytes]]:
    """``n`` peers without the secret that each send a hello (on ``go``, from a thread of their own, when
    given) and never answer their challenge. With ``seen`` (the server's count of hellos handled), each
    hello waits until the server handled the one before: every peer has its own TCP connection, so
    without it the server may see them in any order and "the oldest" would not be ``socks[0]``."""
    socks = []
    for _ in range(n):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    hellos = [encode_frame(ClientHandshake(ident("client", f"stranger-{i}"), AuthKey(b"x" * 16)).hello()) for i in range(n)]

    def flood() -> None:
        for i, (sock, hello) in enumerate(zip(socks, hellos, strict=True)):
            sock.send(hello)
            deadline = time.monotonic() + 10.0
            while seen is not None and seen() <= i:
                assert time.monotonic() < deadline, f"the server did not handle hello {i} within 10 s"
                time.sleep(0.001)

    if go is None:
        flood()
    else:
        threading.Thread(target=lambda: go.wait(10) and flood(), daemon=True).start()
    return socks


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_full_handshake_table_evicts_the_oldest_stranger(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    srv = ControlServer(ident("decode", "decode-0"), SECRET, accept_roles=("client",), max_pending=8)
    socks = strangers(ctx, srv.address, 20, seen=lambda: srv.evicted + srv.num_pending)
    try:
        wait_until(lambda: srv.evicted + srv.num_pending == 20)
        assert (srv.evicted, srv.num_pending) == (12, 8)
        replies = []
        while len(replies) < 2 and socks[0].poll(10_000):   # generous: a loaded CI machine is slow to send
            replies.append(decode(socks[0].recv(), (0, 99)).message)
        assert [type(m) for m in replies] == [Challenge, Refuse]
        refusal = replies[1]
        assert isinstance(refusal, Refuse) and refusal.code == "busy" and "handshake evicted" in refusal.reason
        client = connect(srv.address, ident("client", "correct"), SECRET, timeout=1.0)
        srv.accept(1.0)
        client.close()
    finally:
        for sock in socks:
            sock.close()
        srv.close()


def test_flood_of_half_open_hellos_does_not_lock_out_a_correct_client(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """1,000 strangers send a hello each and never answer the challenge (no secret); a correct client
    connecting during the flood and after it completes its handshake within 1 s (``connect``'s timeout)
    both times, and a second flood evicts the first one's leftovers instead of refusing newcomers."""
    srv = ControlServer(ident("decode", "decode-0"), SECRET, accept_roles=("client",))
    ctx2: zmq.Context[zmq.Socket[bytes]] = zmq.Context()   # a context holds at most 1,023 sockets
    go = threading.Event()
    socks = strangers(ctx, srv.address, 1000, go)
    try:
        go.set()
        wait_until(lambda: srv.num_pending > 100)                        # mid-flood
        client = connect(srv.address, ident("client", "during"), SECRET, timeout=1.0)
        srv.accept(1.0)
        client.close()
        wait_until(lambda: srv.num_pending >= 1000)
        client = connect(srv.address, ident("client", "after"), SECRET, timeout=1.0)
        srv.accept(1.0)
        client.close()
        for sock in socks:                                               # abandoned, still pending
            sock.close()
        socks = strangers(ctx2, srv.address, 1000)
        wait_until(lambda: srv.evicted + srv.num_pending == 2000)
        assert srv.num_pending == srv.max_pending == 1024
        client = connect(srv.address, ident("client", "second"), SECRET, timeout=1.0)
        srv.accept(1.0)
        client.close()
        # The server's thread sees the goodbye after close() returns; a peer it never drops still fails.
        wait_until(lambda: srv.peers == [], timeout=5.0)
    finally:
        for sock in socks:
            sock.close()
        srv.close()
        ctx2.destroy(linger=0)
