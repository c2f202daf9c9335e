"""Control connections cut during or right after the handshake (hello -> challenge -> auth -> accept,
then ``kv_ranks``): a half-open handshake is dropped at the server's handshake timeout with nothing
allocated; a decode facing a server that answers nothing or garbage fails fast with the reason and
leaves nothing running; a decode that vanishes once authenticated is forgotten by prefill, blocks and
all. Each time the prefill then serves a real decode worker with exact tokens."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from kvxfer.disagg.auth import AuthKey
from kvxfer.disagg.handshake import ClientHandshake, LocalIdentity, PeerInfo, ServerHandshake
from kvxfer.disagg.messages import (
    Auth,
    Bye,
    Challenge,
    ControlMessage,
    Frame,
    Heartbeat,
    Hello,
    KvBlocks,
    KvPull,
    KvRanks,
    KvRequest,
    Refuse,
    decode,
    encode,
    encode_frame,
)
from kvxfer.disagg.seal import SealedChannel
from kvxfer.disagg.worker import WorkerConfig, all_regions
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.disagg.worker_protocol import (
    encode_block_ids,
    encode_checksum_policy,
    encode_layouts,
    encode_tokens,
)
from kvxfer.errors import ControlTimeout, ProtocolError
from kvxfer.transport import create
from tests.e2e.test_loopback import KV, NEW, SECRET, assert_matches_reference, name
from tests.faults.conftest import assert_settled

MARGIN = 3.0
KEY = AuthKey.load(SECRET)


def prompt(seed: int, length: int = 24) -> np.ndarray:
    """A prompt of ``length`` tokens."""
    return np.random.default_rng(2000 + seed).integers(0, 512, length).astype(np.int64)


def wait_for(what: str, cond: Callable[[], bool], timeout: float) -> float:
    """Poll ``cond`` until it holds; the seconds it took (AssertionError naming ``what`` after ``timeout``)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def recv(sock: zmq.Socket[bytes], timeout: float, channel: SealedChannel | None = None) -> Frame:
    """The next message other than a heartbeat on a raw socket, opened with ``channel`` after the handshake
    (AssertionError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000) + 1, zmq.POLLIN), "no message in time"
        frame = sock.recv()
        got = decode(frame if channel is None else channel.open(frame), (0, 1 << 16))
        if not isinstance(got.message, Heartbeat):
            return got


def serve_one(prefill: PrefillWorker, seed: int) -> None:
    """A real decode worker connects to ``prefill`` and gets exact tokens; both end settled."""
    with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET, prefill=prefill.address) as worker:
        tokens = prompt(seed)
        assert_matches_reference(worker.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert prefill.status()["peers"] == 1
        assert_settled(prefill, worker)


@pytest.fixture
def prefill() -> Iterator[PrefillWorker]:
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256), SECRET) as worker:
        yield worker


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


# --- (a) a client that says hello and goes away ----------------------------------------------------
def test_half_open_handshake_is_dropped_at_the_timeout(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=64), SECRET, handshake_timeout=1.0) as prefill:
        _half_open_handshake_is_dropped(prefill, ctx)


def _half_open_handshake_is_dropped(prefill: PrefillWorker, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    assert prefill.server.handshake_timeout == 1.0
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(prefill.address)
    hs = ClientHandshake(LocalIdentity("decode", "half-open"), KEY, expect_role="prefill")
    t0 = time.monotonic()
    sock.send(encode_frame(hs.hello()))
    challenge = recv(sock, 5)
    assert isinstance(challenge.message, Challenge) and isinstance(hs.on_message(challenge), Frame)  # a valid one
    assert prefill.server.num_pending == 1
    sock.close()                               # gone before auth
    wait_for("the half-open handshake to be dropped", lambda: prefill.server.num_pending == 0, 1.0 + MARGIN)
    assert time.monotonic() - t0 >= 1.0
    assert "handshake not completed within 1.0 s" in prefill.server.refusals[-1][1]
    status = prefill.status()
    assert status["peers"] == 0 and status["requests"] == 0
    assert_settled(prefill)
    serve_one(prefill, 1)


# --- (b) a "prefill" that answers the hello with nothing or with garbage ---------------------------
class FakePrefill:
    """A ROUTER socket on a thread of its own that plays a broken prefill, as ``behaviour`` says:
    ``silent`` never answers; ``garbage`` answers the hello with bytes that are not a message;
    ``truncated`` with the first half of a real challenge; ``mute`` completes the handshake and then
    never answers ``kv_ranks``; ``bad_ranks`` answers it with layouts that do not decode. Records
    every frame the client sends until stopped."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], behaviour: str) -> None:
        self.behaviour = behaviour
        managers = WorkerConfig("fake", num_blocks=8).managers()
        layout = managers[0].layout
        for m in managers:
            m.shutdown()
        self.handshake = ServerHandshake(LocalIdentity("prefill", "fake", layout, "loopback", b""), KEY)
        self.version = 0
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.received: list[bytes] = []
        self.channel: SealedChannel | None = None   # after the handshake, frames are sealed both ways
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-prefill", daemon=True)
        self._thread.start()

    def messages(self) -> list[ControlMessage]:
        """What the client sent, decoded (opened first once the handshake is done)."""
        return [decode(f, (0, 1 << 16)).message for f in list(self.received)]

    def _answer(self, frame: bytes) -> bytes | None:
        got = decode(frame, (0, 1 << 16))
        if self.channel is not None:
            return None if not isinstance(got.message, KvRanks) or self.behaviour != "bad_ranks" else \
                self.channel.seal(encode(KvRanks(layouts=b"\x01"), self.version))
        if isinstance(got.message, Hello | Auth):
            if self.behaviour == "silent":
                return None
            if self.behaviour == "garbage":
                return b"\xc1 this is not msgpack"
            reply, peer = self.handshake.on_message(got)
            if peer is not None:
                self.version = peer.version
                self.channel = self.handshake.channel()
            out = encode_frame(reply)
            return out[: len(out) // 2] if self.behaviour == "truncated" else out
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20, zmq.POLLIN):
                continue
            route, frame = self.sock.recv_multipart()
            if self.channel is not None:
                frame = self.channel.open(frame)
            self.received.append(frame)
            answer = self._answer(frame)
            if answer is not None:
                self.sock.send_multipart([route, answer])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.parametrize(("behaviour", "error", "match"), [
    ("silent", ControlTimeout, r"handshake with tcp://127\.0\.0\.1:\d+: no reply within 1\.000 s"),
    ("garbage", ProtocolError, r"message: invalid msgpack"),
    ("truncated", ProtocolError, r"message: invalid msgpack"),
    ("mute", ControlTimeout, r"no message from prefill 'fake' within 1\.000 s"),
    ("bad_ranks", ProtocolError, r"kv_ranks\.layouts"),
], ids=["silent", "garbage", "truncated", "mute", "bad_ranks"])
def test_decode_fails_fast_against_a_broken_server(ctx: zmq.Context[zmq.Socket[bytes]], behaviour: str,
                                                   error: type[Exception], match: str) -> None:
    fake = FakePrefill(ctx, behaviour)
    cfg = WorkerConfig(name("decode"), num_blocks=256)
    try:
        t0 = time.monotonic()
        with pytest.raises(error, match=match):
            DecodeWorker(cfg, SECRET, prefill=fake.address, connect_timeout=1.0)
        took = time.monotonic() - t0
        assert took < 2 * 1.0 + MARGIN           # at most the handshake's and kv_ranks' waits
        if error is ControlTimeout:
            assert took >= 1.0
        # The server is told why (refuse before the handshake completed, bye after), then nothing more.
        expected: dict[str, type[Refuse | Bye] | None] = {"silent": None, "garbage": Refuse, "truncated": Refuse,
                                                           "mute": Bye, "bad_ranks": Bye}
        last = expected[behaviour]
        if last is not None:
            wait_for(f"decode's {last.__name__}", lambda: isinstance(fake.messages()[-1], last), 5)
            told = fake.messages()[-1]
            assert isinstance(told, Refuse | Bye)
            if last is Refuse:
                assert "invalid msgpack" in told.reason
            else:
                assert told.reason == "decode could not finish connecting"
    finally:
        fake.close()
    assert not fake._thread.is_alive()
    create("loopback", cfg.name).close()       # the failed worker released its transport's name


# --- (c) an authenticated decode that vanishes -----------------------------------------------------
class RawDecode:
    """A decode peer driven by hand over a bare DEALER socket: it never sends heartbeats or a goodbye,
    so closing its socket is a peer that vanished (as a killed process does)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, heartbeat: float) -> None:
        self.cfg = WorkerConfig(name("raw-decode"), num_blocks=256)
        self.managers = self.cfg.managers()
        self.transport = create("loopback", self.cfg.name)
        self.transport.register(all_regions([m.layout for m in self.managers]))
        ident = LocalIdentity("decode", self.cfg.name, self.managers[0].layout, "loopback",
                              self.transport.metadata(), heartbeat)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        hs = ClientHandshake(ident, KEY, expect_role="prefill")
        self.sock.send(encode_frame(hs.hello()))
        auth = hs.on_message(recv(self.sock, 5))
        assert isinstance(auth, Frame)
        self.sock.send(encode_frame(auth))
        peer = hs.on_message(recv(self.sock, 5))
        assert isinstance(peer, PeerInfo) and peer.role == "prefill"
        self.version = peer.version
        self.channel = hs.channel()

    def send(self, message: ControlMessage) -> None:
        self.sock.send(self.channel.seal(encode(message, self.version)))

    def recv(self, timeout: float) -> ControlMessage:
        return recv(self.sock, timeout, self.channel).message

    def vanish(self) -> None:
        self.sock.close()

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.close()
        self.transport.close()
        for m in self.managers:
            m.shutdown()


@pytest.mark.parametrize(("stage", "how"), [("after_auth", "close"), ("after_kv_ranks", "close"),
                                           ("after_kv_request", "close"), ("after_kv_request", "freeze")])
def test_vanished_decode_is_forgotten(prefill: PrefillWorker, ctx: zmq.Context[zmq.Socket[bytes]],
                                      stage: str, how: str) -> None:
    """The raw peer announces 0.5 s heartbeats and then closes its socket, or keeps it open and sends
    nothing (a frozen process): prefill must drop it 1.5 s after its last frame at the latest, with every
    block of its pulled request freed long before that request's 30 s lease."""
    heartbeat = 0.5
    last_frame = time.monotonic()
    raw = RawDecode(ctx, prefill.address, heartbeat)
    try:
        wait_for("prefill to accept the raw decode", lambda: len(prefill.server.peers) == 1, 5)
        if stage != "after_auth":
            raw.send(KvRanks(layouts=encode_layouts([m.layout for m in raw.managers])))
            assert isinstance(raw.recv(5), KvRanks)
        if stage == "after_kv_request":
            tokens = prompt(2, 40)
            cache = raw.managers[0].create_kv_cache_for_prompt(tokens)
            assert cache.resume() and cache.resize(int(tokens.size))
            raw.send(KvRequest(request_id="r1", tokens=encode_tokens(tokens), mode="pull", layerwise=False,
                               layers_per_send=1, lease_s=30.0, checksum=encode_checksum_policy(None)))
            raw.send(KvBlocks(request_id="r1", skip=0, blocks=encode_block_ids([cache.block_id_map()])))
            pull = raw.recv(10)
            assert isinstance(pull, KvPull) and pull.request_id == "r1"
            last_frame = time.monotonic()
            raw.send(Heartbeat())
            assert prefill.held_slots() > 0 and prefill.status()["jobs"] == 1
            cache.close()
        if how == "close":
            raw.vanish()
        took = wait_for("prefill to forget the vanished decode",
                        lambda: not prefill.server.peers and prefill.status()["peers"] == 0, heartbeat * 3 + MARGIN)
        assert took < heartbeat * 3 + MARGIN
        if how == "freeze":                    # only the heartbeat deadline can tell
            assert time.monotonic() - last_frame >= heartbeat * 3
        assert_settled(prefill)
        if stage == "after_kv_request":
            assert any(r.startswith("decode peer lost") for r in prefill.stats.reasons)
    finally:
        raw.close()
    serve_one(prefill, 3)
