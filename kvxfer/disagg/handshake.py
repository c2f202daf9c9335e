"""The control-plane handshake as two state machines without I/O (the ZeroMQ layer drives them).

    client                                   server
    hello(versions, role, name, Nc)     ->
                                        <-   challenge(version, role, name, Ns, hb, Ps)
    [check Ps]  auth(layout, backend, metadata, hb, Pc)   ->
                                        [check Pc, then decode and check the layout]
                                        <-   accept(layout, backend, metadata, Pa)
    [check Pa, decode and check the layout]

T = (client versions, role, name, Nc, chosen version, server role, name, Ns, server hb);
Ps = MAC("server-challenge", T); Pc = MAC("client-auth", T, H(client payload));
Pa = MAC("server-accept", T, H(client payload), H(server payload)).
Nothing but a refusal reason leaves the server before Pc verified; no layout is decoded before then.
Once both proofs verified, each side derives the connection's two sealing keys from the secret-derived
key and the whole transcript (``channel()``): every later message is sealed (see ``seal``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg.auth import AuthKey, digest, new_nonce
from kvxfer.disagg.messages import (
    MIN_PROTOCOL_VERSION,
    ROLES,
    SUPPORTED_VERSIONS,
    Accept,
    Auth,
    Challenge,
    Frame,
    Hello,
    Refuse,
)
from kvxfer.disagg.seal import SealedChannel
from kvxfer.errors import (
    AuthenticationError,
    DecodeError,
    HandshakeRefused,
    LayoutError,
    LayoutMismatch,
    ProtocolError,
)

LayoutCheck = Callable[[CacheLayoutDesc, CacheLayoutDesc], None]


class Refusal(HandshakeRefused):
    """A refusal decided by this side: ``code`` and the ``public`` reason sent to the peer."""

    def __init__(self, code: str, public: str, detail: str | None = None) -> None:
        super().__init__(detail or public)
        self.code = code
        self.public = public


@dataclass(frozen=True)
class LocalIdentity:
    """What this side announces once the peer is authenticated (``layout`` None: a plain client)."""

    role: str
    name: str
    layout: CacheLayoutDesc | None = None
    backend: str = ""
    metadata: bytes = b""
    heartbeat_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(f"LocalIdentity.role must be one of {list(ROLES)}, got {self.role!r}")
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 128:
            raise ProtocolError(f"LocalIdentity.name must be 1..128 chars, got {self.name!r}")
        if not isinstance(self.metadata, bytes) or not isinstance(self.backend, str) or len(self.backend) > 64:
            raise ProtocolError("LocalIdentity.backend must be a str of <= 64 chars and metadata bytes")
        if not 0.001 <= self.heartbeat_interval <= 3600.0:
            raise ProtocolError(f"LocalIdentity.heartbeat_interval must be in [0.001, 3600] s, got "
                                f"{self.heartbeat_interval!r}")

    def payload(self) -> tuple[bytes, str, bytes]:
        """The post-authentication fields: layout (msgpack, empty if none), backend, metadata."""
        layout = self.layout.to_msgpack() if self.layout is not None else b""
        return layout, self.backend, self.metadata


@dataclass(frozen=True)
class PeerInfo:
    """An authenticated peer: what it announced during the handshake."""

    role: str
    name: str
    version: int
    layout: CacheLayoutDesc | None
    backend: str
    metadata: bytes
    heartbeat_interval: float


def check_compatible(local: CacheLayoutDesc, remote: CacheLayoutDesc) -> None:
    """LayoutMismatch naming the first field that makes KV of ``remote`` unusable by ``local``'s model.

    Layers, roles, dtype, head_dim, total heads and attention windows must agree; tokens per block,
    head order, tensor-parallel head ranges and pooling may differ (the extractor pairs those).
    """
    if local.layer_ids != remote.layer_ids:
        raise LayoutMismatch(f"layer ids: local {local.layer_ids} != remote {remote.layer_ids}")
    lf, rf = dict(local.formats), dict(remote.formats)
    lroles = sorted({(b.layer_id, b.role) for b in lf})
    rroles = sorted({(b.layer_id, b.role) for b in rf})
    if lroles != rroles:
        diff = sorted(set(lroles) ^ set(rroles))[0]
        raise LayoutMismatch(f"roles: buffer (layer {diff[0]}, {diff[1]!r}) is on one side only")
    for bid in sorted(lf):
        a, b = lf[bid], rf[bid]
        for name in ("dtype", "head_dim", "total_heads"):
            if getattr(a, name) != getattr(b, name):
                raise LayoutMismatch(f"layer {bid.layer_id} role {bid.role!r}: {name} local "
                                     f"{getattr(a, name)!r} != remote {getattr(b, name)!r}")
    for lid in local.layer_ids:
        a_lg, b_lg = local.layer_group_of(lid), remote.layer_group_of(lid)
        if (a_lg.window, a_lg.sink_tokens) != (b_lg.window, b_lg.sink_tokens):
            raise LayoutMismatch(f"layer {lid}: window/sink_tokens local {(a_lg.window, a_lg.sink_tokens)} != "
                                 f"remote {(b_lg.window, b_lg.sink_tokens)}")


def _decode_payload(msg: Auth | Accept, where: str) -> tuple[CacheLayoutDesc | None, str, bytes]:
    """The layout, backend and metadata of an authenticated auth/accept message."""
    try:
        layout = CacheLayoutDesc.from_msgpack(msg.layout) if msg.layout else None
    except (DecodeError, LayoutError) as exc:
        raise Refusal("layout", f"{where} layout does not decode: {exc}") from exc
    return layout, msg.backend, msg.metadata


def _check_layouts(check: LayoutCheck, mine: CacheLayoutDesc | None, theirs: CacheLayoutDesc | None,
                   roles: tuple[str, str]) -> None:
    """Workers must announce compatible layouts; a plain client (no KV) needs none."""
    if "client" in roles:
        return
    if mine is None or theirs is None:
        raise Refusal("layout", "incompatible layout: a prefill/decode worker announced no KV layout")
    try:
        check(mine, theirs)
    except LayoutError as exc:
        raise Refusal("layout", f"incompatible layout: {exc}") from exc


def _channel(key: AuthKey, transcript: tuple[object, ...], client_hash: bytes, server_hash: bytes,
             side: str) -> SealedChannel:
    """The sealing keys of one connection: one per direction, bound to the whole handshake."""
    c2s = key.proof("session-key client-to-server", *transcript, client_hash, server_hash)
    s2c = key.proof("session-key server-to-client", *transcript, client_hash, server_hash)
    return SealedChannel(c2s, s2c) if side == "client" else SealedChannel(s2c, c2s)


class NonceCache:
    """Recently seen nonces (bounded, oldest forgotten first): a replayed hello is refused."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def add(self, nonce: bytes) -> bool:
        """Record ``nonce``; False when it was already seen."""
        if nonce in self._seen:
            return False
        self._seen[nonce] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True


class ClientHandshake:
    """The connecting side: ``hello()``, then ``on_message(challenge)`` -> auth, then
    ``on_message(accept)`` -> PeerInfo. Steps take and give frames: the version they travel in matters."""

    def __init__(self, local: LocalIdentity, key: AuthKey, versions: tuple[int, int] = SUPPORTED_VERSIONS,
                 expect_role: str | None = None, layout_check: LayoutCheck = check_compatible) -> None:
        self.local, self.key, self.versions = local, key, versions
        self.expect_role, self.layout_check = expect_role, layout_check
        self.nonce = new_nonce()
        self._transcript: tuple[object, ...] = ()
        self._challenge: Challenge | None = None
        self._payload_hash = b""
        self._server_hash = b""

    def hello(self) -> Frame:
        """The first message (sent in the frame of the lowest version this side speaks)."""
        return Frame(self.versions[0], Hello(min_version=self.versions[0], max_version=self.versions[1],
                                             role=self.local.role, name=self.local.name,   # type: ignore[arg-type]
                                             nonce=self.nonce))

    def on_message(self, frame: Frame) -> Frame | PeerInfo:
        """Next step: the auth frame after a challenge, PeerInfo after an accept."""
        match frame.message:
            case Refuse(code=code, reason=reason):
                cls = AuthenticationError if code == "auth" else HandshakeRefused
                raise cls(f"refused by the server ({code}): {reason}")
            case Challenge() as challenge if self._challenge is None:
                return self._on_challenge(challenge, frame.version)
            case Accept() as accept if self._challenge is not None:
                return self._on_accept(accept)
        raise ProtocolError(f"handshake: unexpected message {frame.message.kind!r} from the server")

    def _on_challenge(self, msg: Challenge, envelope: int) -> Frame:
        version = msg.version
        if not self.versions[0] <= version <= self.versions[1] or envelope != version:
            raise Refusal("version", f"server chose version {version} (envelope {envelope}); this side speaks "
                                     f"{self.versions[0]}..{self.versions[1]}")
        if msg.nonce == self.nonce:
            raise AuthenticationError("server echoed the client nonce (reflection)")
        self._transcript = (self.versions[0], self.versions[1], self.local.role, self.local.name, self.nonce,
                            version, msg.role, msg.name, msg.nonce, msg.heartbeat_interval)
        if not self.key.verify(msg.proof, "server-challenge", *self._transcript):
            raise AuthenticationError(f"server {msg.name!r} failed authentication (wrong secret, or the "
                                      f"handshake was altered in transit)")
        if self.expect_role is not None and msg.role != self.expect_role:
            raise Refusal("role", f"expected a {self.expect_role} server, got {msg.role}")
        self._challenge = msg
        layout, backend, metadata = self.local.payload()
        interval = self.local.heartbeat_interval
        self._payload_hash = digest(layout, backend, metadata, interval)
        proof = self.key.proof("client-auth", *self._transcript, self._payload_hash)
        return Frame(version, Auth(layout=layout, backend=backend, metadata=metadata, heartbeat_interval=interval,
                                   proof=proof))

    def _on_accept(self, msg: Accept) -> PeerInfo:
        assert self._challenge is not None
        server_hash = digest(msg.layout, msg.backend, msg.metadata)
        if not self.key.verify(msg.proof, "server-accept", *self._transcript, self._payload_hash, server_hash):
            raise AuthenticationError("server accept proof does not verify (altered in transit)")
        self._server_hash = server_hash
        layout, backend, metadata = _decode_payload(msg, "server")
        ch = self._challenge
        _check_layouts(self.layout_check, self.local.layout, layout, (self.local.role, ch.role))
        return PeerInfo(ch.role, ch.name, ch.version, layout, backend, metadata, ch.heartbeat_interval)

    def channel(self) -> SealedChannel:
        """This connection's sealing keys (after ``on_message`` returned the PeerInfo)."""
        if not self._server_hash:
            raise ProtocolError("handshake: no sealing keys before the server's accept verified")
        return _channel(self.key, self._transcript, self._payload_hash, self._server_hash, "client")


class ServerHandshake:
    """The accepting side for one peer: ``on_message(hello)`` -> challenge, ``on_message(auth)`` ->
    (accept, PeerInfo). Every failure raises Refusal (or ProtocolError) carrying what to tell the peer."""

    def __init__(self, local: LocalIdentity, key: AuthKey, versions: tuple[int, int] = SUPPORTED_VERSIONS,
                 accept_roles: tuple[str, ...] = ROLES, layout_check: LayoutCheck = check_compatible,
                 nonces: NonceCache | None = None) -> None:
        self.local, self.key, self.versions = local, key, versions
        self.accept_roles, self.layout_check = accept_roles, layout_check
        self.nonces = nonces if nonces is not None else NonceCache()
        self.nonce = new_nonce()
        self._hello: Hello | None = None
        self._version = 0
        self._transcript: tuple[object, ...] = ()
        self._hashes: tuple[bytes, bytes] | None = None

    def on_message(self, frame: Frame) -> tuple[Frame, PeerInfo | None]:
        """The reply to ``frame`` and, once the peer is authenticated and compatible, its PeerInfo."""
        match frame.message:
            case Hello() as hello if self._hello is None:
                return self._on_hello(hello), None
            case Auth() as auth if self._hello is not None:
                return self._on_auth(auth, frame.version)
        raise Refusal("protocol", f"unexpected message {frame.message.kind!r} during the handshake")

    def _on_hello(self, msg: Hello) -> Frame:
        lo, hi = max(self.versions[0], msg.min_version), min(self.versions[1], msg.max_version)
        if lo > hi:
            raise Refusal("version", f"no common protocol version: peer speaks {msg.min_version}.."
                                     f"{msg.max_version}, this side {self.versions[0]}..{self.versions[1]}")
        if msg.role not in self.accept_roles:
            raise Refusal("role", f"role {msg.role!r} not accepted here (accepts {list(self.accept_roles)})")
        if not self.nonces.add(msg.nonce):
            raise Refusal("auth", "authentication failed", "replayed hello nonce")
        self.nonces.add(self.nonce)
        self._hello, self._version = msg, hi
        self._transcript = (msg.min_version, msg.max_version, msg.role, msg.name, msg.nonce,
                            hi, self.local.role, self.local.name, self.nonce, self.local.heartbeat_interval)
        proof = self.key.proof("server-challenge", *self._transcript)
        return Frame(hi, Challenge(version=hi, role=self.local.role, name=self.local.name,  # type: ignore[arg-type]
                                   nonce=self.nonce, heartbeat_interval=self.local.heartbeat_interval, proof=proof))

    def _on_auth(self, msg: Auth, envelope: int) -> tuple[Frame, PeerInfo]:
        assert self._hello is not None
        hello, version = self._hello, self._version
        client_hash = digest(msg.layout, msg.backend, msg.metadata, msg.heartbeat_interval)
        if envelope != version or not self.key.verify(msg.proof, "client-auth", *self._transcript, client_hash):
            raise Refusal("auth", "authentication failed",
                          f"client {hello.name!r} proof does not verify (wrong secret, replay or altered hello)")
        layout, backend, metadata = _decode_payload(msg, "client")
        _check_layouts(self.layout_check, self.local.layout, layout, (self.local.role, hello.role))
        my_layout, my_backend, my_metadata = self.local.payload()
        server_hash = digest(my_layout, my_backend, my_metadata)
        proof = self.key.proof("server-accept", *self._transcript, client_hash, server_hash)
        peer = PeerInfo(hello.role, hello.name, version, layout, backend, metadata, msg.heartbeat_interval)
        self._hashes = (client_hash, server_hash)
        return Frame(peer.version, Accept(layout=my_layout, backend=my_backend, metadata=my_metadata,
                                          proof=proof)), peer

    def channel(self) -> SealedChannel:
        """This connection's sealing keys (after ``on_message`` returned the PeerInfo)."""
        if self._hashes is None:
            raise ProtocolError("handshake: no sealing keys before the client's proof verified")
        return _channel(self.key, self._transcript, *self._hashes, "server")


def refusal(code: str, reason: str) -> Frame:
    """The frame that tells a peer why it is refused (in the oldest version, which every peer reads)."""
    return Frame(MIN_PROTOCOL_VERSION, Refuse(code=code, reason=reason[:1024]))  # type: ignore[arg-type]
