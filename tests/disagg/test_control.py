"""Control plane on 127.0.0.1: handshake, mutual auth, refusals, strict decoding, deadlines, heartbeats."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.cache import CacheLayoutDesc, KVCacheManager
from kvxfer.disagg.auth import AuthKey, digest, load_secret
from kvxfer.disagg.control import ControlServer, PeerConnection, connect
from kvxfer.disagg.handshake import ClientHandshake, LocalIdentity, PeerInfo, Refusal, ServerHandshake
from kvxfer.disagg.messages import (
    MESSAGE_SPECS,
    PROTOCOL_VERSION,
    Field,
    Message,
    MessageSpec,
    decode,
    encode,
    register,
)
from kvxfer.errors import (
    AuthenticationError,
    ConfigError,
    ControlTimeout,
    HandshakeRefused,
    PeerUnreachable,
    ProtocolError,
)
from kvxfer.model import ModelConfig, preset

SECRET = "correct horse battery staple 42"
KEY = AuthKey.load(SECRET)
ECHO = register(MessageSpec("test.echo", (Field("n", "int"), Field("data", "bytes", max_len=1 << 20))))


TINY = preset("tiny")


def layout(config: ModelConfig = TINY, tpb: int = 16, order: str = "HND") -> CacheLayoutDesc:
    return KVCacheManager(config.cache_config(tpb, 4, head_order=order)).layout


LAYOUT = layout()


def ident(role: str, name: str, lay: CacheLayoutDesc | None = LAYOUT, hb: float = 0.05) -> LocalIdentity:
    return LocalIdentity(role, name, lay, "loopback", f"{name}-metadata".encode(), hb)


@pytest.fixture
def server() -> Iterator[ControlServer]:
    srv = ControlServer(ident("decode", "decode-0"), SECRET, accept_roles=("prefill", "client"))
    yield srv
    srv.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def rx(sock: zmq.Socket[bytes], timeout: float = 3.0) -> Message:
    assert sock.poll(int(timeout * 1000)), "no reply"
    return decode(sock.recv(), (0, 99))


def by_hand(ctx: zmq.Context[zmq.Socket[bytes]], address: str,
            me: LocalIdentity) -> tuple[zmq.Socket[bytes], bytes, bytes, PeerInfo]:
    """A correct client handshake on a raw socket (frames recorded); the socket then stays silent."""
    hs = ClientHandshake(me, KEY)
    sock = dealer(ctx, address)
    hello = encode(hs.hello())
    sock.send(hello)
    step = hs.on_message(rx(sock))
    assert isinstance(step, Message)
    auth = encode(step)
    sock.send(auth)
    peer = hs.on_message(rx(sock))
    assert isinstance(peer, PeerInfo)
    return sock, hello, auth, peer


def wait_for(cond: object, timeout: float = 3.0) -> float:
    start = time.monotonic()
    while not cond():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, "condition not reached"
        time.sleep(0.005)
    return time.monotonic() - start


def control_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvxfer-control")]


# --- successful handshakes -------------------------------------------------------------------------
def test_handshake_and_messages_both_ways(server: ControlServer) -> None:
    other = layout(tpb=64, order="NHD")           # a different but compatible layout is accepted
    client = connect(server.address, ident("prefill", "prefill-0", other), SECRET, timeout=3, expect_role="decode")
    conn = server.accept(3)
    assert (client.peer.role, client.peer.name, client.peer.backend, client.peer.metadata) == \
        ("decode", "decode-0", "loopback", b"decode-0-metadata")
    assert (conn.peer.role, conn.peer.name, conn.peer.metadata) == ("prefill", "prefill-0", b"prefill-0-metadata")
    assert client.peer.layout == LAYOUT and conn.peer.layout is not None
    assert conn.peer.layout.fingerprint == other.fingerprint != LAYOUT.fingerprint
    assert client.peer.version == conn.peer.version == PROTOCOL_VERSION
    client.send("test.echo", n=7, data=b"\x00" * 1000)
    got = conn.recv(3)
    assert (got.type, got["n"], got["data"]) == ("test.echo", 7, b"\x00" * 1000)
    conn.send("test.echo", n=8, data=b"back")
    assert client.recv(3)["data"] == b"back"
    with pytest.raises(ProtocolError, match=r"message 'test.echo'\.n: expected an int"):
        client.send("test.echo", n="x", data=b"")
    client.close("done")
    with pytest.raises(PeerUnreachable, match="prefill 'prefill-0' closed the connection: done"):
        conn.recv(3)
    with pytest.raises(PeerUnreachable, match="closed"):
        client.send("test.echo", n=1, data=b"")
    assert server.peers == []


def test_send_urgent_returns_once_the_io_thread_has_taken_the_message(server: ControlServer) -> None:
    """``send_urgent`` hands the frame over before returning (so the sender's next Python work cannot
    keep the I/O thread waiting for the GIL); ``wait_handed`` on a frame not yet queued times out."""
    client = connect(server.address, ident("prefill", "prefill-0"), SECRET, timeout=3, expect_role="decode")
    conn = server.accept(3)
    endpoint = client._endpoint
    for n in range(20):
        client.send_urgent("test.echo", n=n, data=b"x")
        with endpoint._lock:
            assert endpoint._handed == endpoint._enqueued   # taken by the I/O thread, not still queued
    assert [conn.recv(3)["n"] for _ in range(20)] == list(range(20))
    start = time.monotonic()
    assert not endpoint.wait_handed(endpoint._enqueued + 1, 0.05)
    assert time.monotonic() - start >= 0.04
    client.close("done")


def test_reverse_roles_and_plain_client_without_layout() -> None:
    srv = ControlServer(ident("prefill", "prefill-0"), SECRET, accept_roles=("decode",))
    try:
        client = connect(srv.address, ident("decode", "decode-0"), SECRET, timeout=3)
        assert srv.accept(3).peer.role == "decode" and client.peer.role == "prefill"
        client.close()
    finally:
        srv.close()
    srv = ControlServer(ident("decode", "decode-0"), SECRET)
    try:
        client = connect(srv.address, ident("client", "cli", None), SECRET, timeout=3)
        assert srv.accept(3).peer.layout is None and client.peer.layout == LAYOUT
        client.close()
    finally:
        srv.close()
    assert wait_for(lambda: not control_threads()) < 3


# --- authentication --------------------------------------------------------------------------------
def test_wrong_secret_is_refused_both_ways(server: ControlServer, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(AuthenticationError, match="server 'decode-0' failed authentication"):
        connect(server.address, ident("prefill", "p"), "a different secret of length", timeout=3)
    # A client that cannot prove the secret: the server answers with a reason and nothing else.
    hs = ClientHandshake(ident("prefill", "mallory"), AuthKey(b"wrong secret, 16+ bytes"))
    sock = dealer(ctx, server.address)
    sock.send(encode(hs.hello()))
    challenge = rx(sock)
    assert set(challenge.body) == {"version", "role", "name", "nonce", "heartbeat_interval", "proof"}
    forged = {"layout": LAYOUT.to_msgpack(), "backend": "loopback", "metadata": b"", "heartbeat_interval": 1.0,
              "proof": AuthKey(b"wrong secret, 16+ bytes").proof("client-auth", b"anything")}
    sock.send(encode(Message("auth", forged)))
    refusal = rx(sock)
    assert refusal.type == "refuse" and dict(refusal.body) == {"code": "auth", "reason": "authentication failed"}
    wait_for(lambda: server.num_pending == 0)
    assert server.peers == [] and "proof does not verify" in server.refusals[-1][1]
    with pytest.raises(ControlTimeout):
        server.accept(0.05)


def test_replayed_hello_and_replayed_auth_are_refused(server: ControlServer,
                                                      ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    held, hello, auth, _ = by_hand(ctx, server.address, ident("prefill", "p", hb=60.0))   # slow heartbeat
    server.accept(3)
    # 1. The recorded hello again (same client nonce) on a new connection.
    replay = dealer(ctx, server.address)
    replay.send(hello)
    assert dict(rx(replay).body) == {"code": "auth", "reason": "authentication failed"}
    assert "replayed hello nonce" in server.refusals[-1][1]
    # 2. A fresh hello, then the recorded auth: its proof covers the old server nonce.
    fresh = dealer(ctx, server.address)
    fresh.send(encode(ClientHandshake(ident("prefill", "p"), KEY).hello()))
    assert rx(fresh).type == "challenge"
    fresh.send(auth)
    assert rx(fresh)["code"] == "auth"
    assert len(server.peers) == 1 and server.num_pending == 0
    held.close()


def test_unauthenticated_connections_get_nothing(server: ControlServer, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    import socket as pysocket
    raw = pysocket.create_connection(tuple(server.address.removeprefix("tcp://").rsplit(":", 1)))  # type: ignore[arg-type]
    raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 16)
    raw.close()
    cases = [
        (encode(Message("test.echo", {"n": 1, "data": b"x"})), "protocol", "expected 'hello'"),
        (encode(Message("auth", {"layout": b"", "backend": "", "metadata": b"", "heartbeat_interval": 1.0,
                                 "proof": bytes(32)})), "protocol", "expected 'hello'"),
        (b"\xc1garbage", "protocol", "invalid msgpack"),
        (msgpack.packb([1, "hello", {"min_version": 1}]), "protocol", "missing field 'max_version'"),
    ]
    for frame, code, reason in cases:
        sock = dealer(ctx, server.address)
        sock.send(frame)
        reply = rx(sock)
        assert reply.type == "refuse" and reply["code"] == code and reason in reply["reason"]
        assert set(reply.body) == {"code", "reason"}
        sock.close()
    assert server.peers == [] and server.num_pending == 0
    client = connect(server.address, ident("prefill", "p"), SECRET, timeout=3)   # still serving
    server.accept(3)
    client.close()


def test_version_too_old_is_refused_with_the_reason(server: ControlServer) -> None:
    with pytest.raises(HandshakeRefused, match=r"refused by the server \(version\): message.version: unsupported "
                                               rf"protocol version 0 \(this side speaks 1..{PROTOCOL_VERSION}\)"):
        connect(server.address, ident("prefill", "old"), SECRET, timeout=3, versions=(0, 0))
    assert server.peers == [] and server.num_pending == 0


def test_version_downgrade_in_transit_fails_authentication(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    srv = ControlServer(ident("decode", "d"), SECRET, versions=(1, 2))
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    back = dealer(ctx, srv.address)
    stop = threading.Event()

    def mitm() -> None:   # rewrites the client's offer 1..2 to 1..1
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        route = b""
        while not stop.is_set():
            events = dict(poller.poll(20))
            if front in events:
                route, frame = front.recv_multipart()
                msg = decode(frame, (0, 99))
                if msg.type == "hello":
                    frame = encode(Message("hello", {**msg.body, "max_version": 1}, 1))
                back.send(frame)
            if back in events:
                front.send_multipart([route, back.recv()])

    thread = threading.Thread(target=mitm, daemon=True)
    thread.start()
    try:
        direct = connect(srv.address, ident("prefill", "p"), SECRET, timeout=3, versions=(1, 2))
        assert direct.peer.version == 2 and srv.accept(3).peer.version == 2
        direct.close()
        with pytest.raises(AuthenticationError, match="failed authentication"):
            connect(f"tcp://127.0.0.1:{port}", ident("prefill", "p"), SECRET, timeout=3, versions=(1, 2))
        assert wait_for(lambda: srv.num_pending == 0) < 3 and srv.peers == []
    finally:
        stop.set()
        thread.join()
        srv.close()


# --- compatibility and roles -----------------------------------------------------------------------
def test_incompatible_layout_is_refused_naming_the_field(server: ControlServer) -> None:
    other = layout(ModelConfig(head_dim=16))
    with pytest.raises(HandshakeRefused, match=r"\(layout\): incompatible layout: layer 0 role 'key': head_dim "
                                               r"local 32 != remote 16"):
        connect(server.address, ident("prefill", "p", other), SECRET, timeout=3)
    swa = layout(ModelConfig(windows=(None, 16)))
    with pytest.raises(HandshakeRefused, match=r"layer 1: window/sink_tokens local \(None, 0\) != remote \(16, 0\)"):
        connect(server.address, ident("prefill", "p", swa), SECRET, timeout=3)
    with pytest.raises(HandshakeRefused, match=r"\(role\): role 'decode' not accepted here"):
        connect(server.address, ident("decode", "d2"), SECRET, timeout=3)
    assert server.peers == [] and server.num_pending == 0


# --- deadlines and heartbeats ----------------------------------------------------------------------
def test_receive_deadlines(server: ControlServer, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    client = connect(server.address, ident("prefill", "p"), SECRET, timeout=3)
    conn = server.accept(3)
    start = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"no message from prefill 'p' within 0.200 s"):
        conn.recv(0.2)
    assert 0.19 <= time.monotonic() - start < 1.0
    for bad in (None, float("inf"), -1, float("nan")):
        with pytest.raises(ConfigError, match="timeout must be a finite number"):
            conn.recv(bad)  # type: ignore[arg-type]
    client.close()
    silent = ctx.socket(zmq.ROUTER)     # a server that never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    start = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"no reply within 0\.300 s"):
        connect(f"tcp://127.0.0.1:{port}", ident("prefill", "p"), SECRET, timeout=0.3)
    assert time.monotonic() - start < 1.5
    silent.close(linger=0)


def test_half_open_handshake_expires(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    srv = ControlServer(ident("decode", "d"), SECRET, handshake_timeout=0.2)
    try:
        sock = dealer(ctx, srv.address)
        sock.send(encode(ClientHandshake(ident("prefill", "p"), KEY).hello()))
        assert rx(sock).type == "challenge" and srv.num_pending == 1
        refusal = rx(sock, 2.0)         # then silence: the server gives up and forgets it
        assert dict(refusal.body) == {"code": "timeout", "reason": "handshake not completed within 0.2 s"}
        assert srv.num_pending == 0 and srv.peers == []
    finally:
        srv.close()


def test_heartbeats_keep_idle_peers_and_detect_a_silent_client(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    lost: list[tuple[str, str]] = []
    srv = ControlServer(ident("decode", "d"), SECRET, heartbeat_misses=3,
                        on_peer_lost=lambda c, why: lost.append((c.peer.name, why)))
    try:
        live = connect(srv.address, ident("prefill", "live"), SECRET, timeout=3)
        live_conn = srv.accept(3)
        time.sleep(0.6)                 # 12 heartbeat intervals of idleness
        assert live.alive and live_conn.alive and lost == []
        sock, _, _, _ = by_hand(ctx, srv.address, ident("prefill", "frozen"))
        frozen = srv.accept(3)
        took = wait_for(lambda: bool(lost))
        assert took < 1.5 and lost[0][0] == "frozen" and "3 heartbeats of 0.050 s missed" in lost[0][1]
        with pytest.raises(PeerUnreachable, match="prefill 'frozen' lost: silent for"):
            frozen.recv(1)
        assert live_conn.alive and [c.peer.name for c in srv.peers] == ["live"]
        live.close()
        sock.close()
    finally:
        srv.close()


def test_client_detects_a_silent_server(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_handshake_then_freeze() -> None:
        hs = ServerHandshake(ident("decode", "frozen-decode", hb=0.05), KEY)
        for _ in range(2):
            route, frame = router.recv_multipart()
            reply, _ = hs.on_message(decode(frame))
            router.send_multipart([route, encode(reply)])

    thread = threading.Thread(target=answer_handshake_then_freeze, daemon=True)
    thread.start()
    lost: list[str] = []
    conn: PeerConnection = connect(f"tcp://127.0.0.1:{port}", ident("prefill", "p"), SECRET, timeout=3,
                                   on_peer_lost=lambda c, why: lost.append(why))
    thread.join()
    assert wait_for(lambda: bool(lost)) < 1.5 and "decode 'frozen-decode' lost" in lost[0]
    with pytest.raises(PeerUnreachable, match="lost: silent"):
        conn.recv(1)
    conn.close()
    assert wait_for(lambda: not control_threads()) < 3


# --- strict decoding -------------------------------------------------------------------------------
def test_decoder_names_the_bad_field() -> None:
    good = {"min_version": 1, "max_version": 1, "role": "prefill", "name": "p", "nonce": bytes(32)}
    cases = [
        (msgpack.packb([PROTOCOL_VERSION + 1, "hello", good]),
         rf"message\.version: unsupported protocol version {PROTOCOL_VERSION + 1}"),
        (msgpack.packb([True, "hello", good]), r"message\.version"),
        (msgpack.packb([1, "nope", {}]), r"message\.type: unknown message type 'nope'"),
        (msgpack.packb([1, "hello", {**good, "extra": 1}]), r"body: unexpected field 'extra'"),
        (msgpack.packb([1, "hello", {**good, "nonce": bytes(31)}]), r"message 'hello'\.nonce: expected bytes of 32"),
        (msgpack.packb([1, "hello", {**good, "role": "admin"}]), r"'hello'\.role: expected one of"),
        (msgpack.packb([1, "hello", {**good, "max_version": 1.0}]), r"'hello'\.max_version: expected an int"),
        (msgpack.packb([1, "hello", [1, 2]]), r"'hello'\.body: expected a map"),
        (msgpack.packb([1, "hello"]), r"expected \[version, type, body\]"),
        (msgpack.packb([1, "hello", good])[:-5], r"invalid msgpack"),
        (msgpack.packb([1, "hello", good]) + b"\x00", r"invalid msgpack"),
        (msgpack.packb([1, "test.echo", {"n": 1, "data": bytes(100)}]), r"exceed the limit of 64"),
    ]
    for frame, pattern in cases:
        with pytest.raises(ProtocolError, match=pattern):
            decode(frame, max_bytes=64 if b"test.echo" in frame else 1 << 20)
    assert decode(msgpack.packb([1, "hello", good]))["nonce"] == bytes(32)


def decodes_or_refuses(frame: bytes) -> None:
    """Hostile bytes either raise ProtocolError or decode into a message that satisfies its spec."""
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert msg.type in MESSAGE_SPECS and decode(encode(msg)) == msg


def valid_frames() -> list[bytes]:
    hs = ClientHandshake(ident("prefill", "p"), KEY)
    return [encode(hs.hello()), encode(Message("bye", {"reason": "x"})), encode(Message("heartbeat")),
            encode(Message("refuse", {"code": "auth", "reason": "r"})),
            encode(Message("test.echo", {"n": 3, "data": b"abc"}))]


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), (1 << 64) - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300))
def test_fuzz_decoder_random_bytes(data: bytes) -> None:
    decodes_or_refuses(data)


@settings(max_examples=200, deadline=None)
@given(version=msgpack_values | st.integers(0, 3), mtype=msgpack_values | st.sampled_from(
    ["hello", "challenge", "auth", "accept", "refuse", "bye", "heartbeat", "test.echo"]), body=msgpack_values)
def test_fuzz_decoder_structured(version: object, mtype: object, body: object) -> None:
    try:
        frame = msgpack.packb([version, mtype, body], use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert encode(msg) == frame or msg.type in {"heartbeat"}   # what decodes re-encodes


@settings(max_examples=200, deadline=None)
@given(which=st.integers(0, 4), cut=st.integers(0, 200), pos=st.integers(0, 200), byte=st.integers(0, 255))
def test_fuzz_decoder_mutated_frames(which: int, cut: int, pos: int, byte: int) -> None:
    frame = bytearray(valid_frames()[which])
    frame[pos % len(frame)] = byte
    for candidate in (bytes(frame), bytes(frame[:cut % (len(frame) + 1)])):
        decodes_or_refuses(candidate)


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200) | st.builds(lambda b: LAYOUT.to_msgpack()[:b], st.integers(0, 2000)))
def test_fuzz_authenticated_hostile_layout_only_refused(raw: bytes) -> None:
    """Even an authenticated peer's layout bytes only ever yield a refusal, never a crash."""
    server = ServerHandshake(ident("decode", "d"), KEY)
    client = ClientHandshake(ident("prefill", "p", None), KEY)
    auth = client.on_message(server.on_message(client.hello())[0])
    assert isinstance(auth, Message)
    body = {**auth.body, "layout": raw}
    proof = KEY.proof("client-auth", *client._transcript,
                      digest(raw, body["backend"], body["metadata"], body["heartbeat_interval"]))
    try:
        server.on_message(Message("auth", {**body, "proof": proof}))
    except Refusal as exc:
        assert exc.code == "layout"


# --- secrets -----------------------------------------------------------------------------------------
def test_secret_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVXFER_SECRET", raising=False)
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    with pytest.raises(ConfigError, match="no shared secret"):
        load_secret()
    monkeypatch.setenv("KVXFER_SECRET", "x" * 20)
    assert load_secret() == b"x" * 20
    path = tmp_path / "secret"
    path.write_bytes(b"y" * 24 + b"\n")
    assert load_secret(path=path) == b"y" * 24
    monkeypatch.delenv("KVXFER_SECRET")
    monkeypatch.setenv("KVXFER_SECRET_FILE", str(path))
    assert load_secret() == b"y" * 24
    with pytest.raises(ConfigError, match="is 5 bytes; at least 16"):
        load_secret("short")
    with pytest.raises(ConfigError, match="cannot read secret file"):
        load_secret(path=tmp_path / "missing")
    assert "hidden" in repr(KEY) and KEY.proof("a", 1) != AuthKey(b"z" * 16).proof("a", 1)
