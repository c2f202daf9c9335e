"""Control plane on 127.0.0.1: handshake, mutual auth, refusals, strict decoding, deadlines, heartbeats."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.cache import CacheLayoutDesc, KVCacheManager
from kvxfer.disagg.auth import AuthKey, digest, load_secret
from kvxfer.disagg.control import ControlServer, PeerConnection, connect
from kvxfer.disagg.handshake import ClientHandshake, LocalIdentity, PeerInfo, Refusal, ServerHandshake
from kvxfer.disagg.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Auth,
    Bye,
    Challenge,
    Frame,
    Heartbeat,
    Hello,
    KvBlocks,
    Refuse,
    decode,
    encode,
    encode_frame,
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


def rx(sock: zmq.Socket[bytes], timeout: float = 3.0) -> Frame:
    assert sock.poll(int(timeout * 1000)), "no reply"
    return decode(sock.recv(), (0, 99))


def echo(n: int, data: bytes) -> KvBlocks:
    """A message with an int and a bytes field, for the tests of the transport of messages."""
    return KvBlocks(request_id="echo", skip=n, blocks=data)


def by_hand(ctx: zmq.Context[zmq.Socket[bytes]], address: str,
            me: LocalIdentity) -> tuple[zmq.Socket[bytes], bytes, bytes, PeerInfo]:
    """A correct client handshake on a raw socket (frames recorded); the socket then stays silent."""
    hs = ClientHandshake(me, KEY)
    sock = dealer(ctx, address)
    hello = encode_frame(hs.hello())
    sock.send(hello)
    step = hs.on_message(rx(sock))
    assert isinstance(step, Frame)
    auth = encode_frame(step)
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
    client.send(echo(7, b"\x00" * 1000))
    assert conn.recv(3) == echo(7, b"\x00" * 1000)
    conn.send(echo(8, b"back"))
    assert client.recv(3) == echo(8, b"back")
    with pytest.raises(ProtocolError, match=r"message 'kv_blocks' does not fit its type: Expected `int`, got `str` "
                                            r"- at `message\.skip`"):
        client.send(KvBlocks(request_id="echo", skip="x", blocks=b""))  # type: ignore[arg-type]
    client.close("done")
    with pytest.raises(PeerUnreachable, match="prefill 'prefill-0' closed the connection: done"):
        conn.recv(3)
    with pytest.raises(PeerUnreachable, match="closed"):
        client.send(echo(1, b""))
    assert server.peers == []


def test_send_urgent_returns_once_the_io_thread_has_taken_the_message(server: ControlServer) -> None:
    """``send_urgent`` hands the frame over before returning (so the sender's next Python work cannot
    keep the I/O thread waiting for the GIL); ``wait_handed`` on a frame not yet queued times out."""
    client = connect(server.address, ident("prefill", "prefill-0"), SECRET, timeout=3, expect_role="decode")
    conn = server.accept(3)
    endpoint = client._endpoint
    for n in range(20):
        client.send_urgent(echo(n, b"x"))
        with endpoint._lock:
            assert endpoint._handed == endpoint._enqueued   # taken by the I/O thread, not still queued
    assert [conn.recv(3) for _ in range(20)] == [echo(n, b"x") for n in range(20)]
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
    sock.send(encode_frame(hs.hello()))
    challenge = rx(sock)
    assert isinstance(challenge.message, Challenge)
    forged = Auth(layout=LAYOUT.to_msgpack(), backend="loopback", metadata=b"", heartbeat_interval=1.0,
                  proof=AuthKey(b"wrong secret, 16+ bytes").proof("client-auth", b"anything"))
    sock.send(encode(forged, challenge.version))
    assert rx(sock).message == Refuse(code="auth", reason="authentication failed")
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
    assert rx(replay).message == Refuse(code="auth", reason="authentication failed")
    assert "replayed hello nonce" in server.refusals[-1][1]
    # 2. A fresh hello, then the recorded auth: its proof covers the old server nonce.
    fresh = dealer(ctx, server.address)
    fresh.send(encode_frame(ClientHandshake(ident("prefill", "p"), KEY).hello()))
    assert isinstance(rx(fresh).message, Challenge)
    fresh.send(auth)
    refusal = rx(fresh).message
    assert isinstance(refusal, Refuse) and refusal.code == "auth"
    assert len(server.peers) == 1 and server.num_pending == 0
    held.close()


def test_unauthenticated_connections_get_nothing(server: ControlServer, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    import socket as pysocket
    raw = pysocket.create_connection(tuple(server.address.removeprefix("tcp://").rsplit(":", 1)))  # type: ignore[arg-type]
    raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 16)
    raw.close()
    cases = [
        (encode(echo(1, b"x")), "protocol", "expected 'hello'"),
        (encode(Auth(layout=b"", backend="", metadata=b"", heartbeat_interval=1.0, proof=bytes(32))), "protocol",
         "expected 'hello'"),
        (b"\xc1garbage", "protocol", "invalid msgpack"),
        (msgpack.packb([1, {"type": "hello", "min_version": 1}]), "protocol",
         "missing required field `max_version`"),
    ]
    for frame, code, reason in cases:
        sock = dealer(ctx, server.address)
        sock.send(frame)
        reply = rx(sock).message
        assert isinstance(reply, Refuse) and reply.code == code and reason in reply.reason
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
                got = decode(frame, (0, 99))
                if isinstance(got.message, Hello):
                    frame = encode(msgspec.structs.replace(got.message, max_version=1), 1)
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
        sock.send(encode_frame(ClientHandshake(ident("prefill", "p"), KEY).hello()))
        assert isinstance(rx(sock).message, Challenge) and srv.num_pending == 1
        refusal = rx(sock, 2.0)         # then silence: the server gives up and forgets it
        assert refusal.message == Refuse(code="timeout", reason="handshake not completed within 0.2 s")
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
            router.send_multipart([route, encode_frame(reply)])

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
    good = {"type": "hello", "min_version": 1, "max_version": 1, "role": "prefill", "name": "p", "nonce": bytes(32)}
    cases = [
        (msgpack.packb([PROTOCOL_VERSION + 1, good]),
         rf"message\.version: unsupported protocol version {PROTOCOL_VERSION + 1}"),
        (msgpack.packb([True, good]), r"message\.version: Expected `int`, got `bool`"),
        (msgpack.packb([1, {"type": "nope"}]), r"Invalid value 'nope' - at `message\.type`"),
        (msgpack.packb([1, {**good, "extra": 1}]), r"unknown field `extra` - at `message`"),
        (msgpack.packb([1, {**good, "nonce": bytes(31)}]), r"Expected `bytes` of length >= 32 - at `message\.nonce`"),
        (msgpack.packb([1, {**good, "role": "admin"}]), r"Invalid enum value 'admin' - at `message\.role`"),
        (msgpack.packb([1, {**good, "max_version": 1.0}]), r"Expected `int`, got `float` - at `message\.max_version`"),
        (msgpack.packb([1, [1, 2]]), r"Expected `object`, got `array` - at `message`"),
        (msgpack.packb([1]), r"Expected `array` of at least length 2"),
        (msgpack.packb([1, good, 3]), r"Expected `array` of at most length 2"),
        (msgpack.packb([1, good])[:-5], r"invalid msgpack"),
        (msgpack.packb([1, good]) + b"\x00", r"invalid msgpack"),
        (encode(echo(1, bytes(100)), 1), r"exceed the limit of 64"),
    ]
    for frame, pattern in cases:
        with pytest.raises(ProtocolError, match=pattern):
            decode(frame, max_bytes=64 if b"kv_blocks" in frame else 1 << 20)
    hello = decode(msgpack.packb([1, good])).message
    assert isinstance(hello, Hello) and hello.nonce == bytes(32)


def decodes_or_refuses(data: bytes) -> None:
    """Hostile bytes either raise ProtocolError or decode into a message that satisfies its type."""
    try:
        frame = decode(data)
    except ProtocolError:
        return
    assert isinstance(frame.message, MESSAGE_TYPES) and decode(encode_frame(frame)) == frame


def valid_frames() -> list[bytes]:
    hs = ClientHandshake(ident("prefill", "p"), KEY)
    return [encode_frame(hs.hello()), encode(Bye(reason="x")), encode(Heartbeat()),
            encode(Refuse(code="auth", reason="r")), encode(echo(3, b"abc"))]


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
    ["hello", "challenge", "auth", "accept", "refuse", "bye", "heartbeat", "kv_blocks"]), body=msgpack_values)
def test_fuzz_decoder_structured(version: object, mtype: object, body: object) -> None:
    message = {**body, "type": mtype} if isinstance(body, dict) else body
    try:
        data = msgpack.packb([version, message], use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        frame = decode(data)
    except ProtocolError:
        return
    assert decode(encode_frame(frame)) == frame   # what decodes re-encodes to itself


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
    assert isinstance(auth, Frame) and isinstance(auth.message, Auth)
    body = auth.message
    proof = KEY.proof("client-auth", *client._transcript,
                      digest(raw, body.backend, body.metadata, body.heartbeat_interval))
    try:
        server.on_message(Frame(auth.version, msgspec.structs.replace(body, layout=raw, proof=proof)))
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
