"""Control-plane messages: typed, bounded msgspec structs in one tagged union, and one decoder for them.

Wire form of every message: a msgpack array ``[version, message]`` where ``version`` is the protocol
version (int) and ``message`` is a map tagged by its ``type`` field (``{"type": "hello", ...}``) whose
other keys are exactly the fields of that message's struct. Every field is bounded (value range for
numbers, length for strings, bytes and lists, a fixed set of choices for enumerations), so ``decode``
allocates nothing a peer can make larger than the frame it sent (``max_bytes`` at most); anything else
raises ProtocolError naming the offending field. Receivers dispatch on the struct's class
(``match msg: case KvPushed(): ...``), never on its type string. The messages of the workers (see
docs/disagg.md) and of the vLLM connector live here too: the union is closed, so one decoder knows them all.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal, TypeAlias, Union

import msgspec
from msgspec import Meta

from kvxfer.errors import ProtocolError

#: 2 adds ``kv_posted`` (push: decode learns the first token while the writes are in flight).
PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
MAX_MESSAGE_BYTES = 64 << 20
NONCE_BYTES = 32
PROOF_BYTES = 32
ROLES = ("prefill", "decode", "client")
REFUSAL_CODES = ("auth", "version", "role", "layout", "protocol", "busy", "timeout")
MODES = ("push", "pull")
MAX_PROMPT_TOKENS = 1 << 20
_I64 = (1 << 63) - 1
_TOKEN_ID_MAX = (1 << 31) - 1

Role: TypeAlias = Literal["prefill", "decode", "client"]
RefusalCode: TypeAlias = Literal["auth", "version", "role", "layout", "protocol", "busy", "timeout"]
Mode: TypeAlias = Literal["push", "pull"]
Count: TypeAlias = Annotated[int, Meta(ge=0, le=_I64)]
Version: TypeAlias = Annotated[int, Meta(ge=0, le=1 << 16)]
Parts: TypeAlias = Annotated[int, Meta(ge=0, le=1 << 16)]
Readers: TypeAlias = Annotated[int, Meta(ge=1, le=1 << 16)]
TokenId: TypeAlias = Annotated[int, Meta(ge=0, le=_TOKEN_ID_MAX)]
PromptLength: TypeAlias = Annotated[int, Meta(ge=0, le=MAX_PROMPT_TOKENS)]
Seconds: TypeAlias = Annotated[float, Meta(ge=0.0, le=1e6)]
ClockReading: TypeAlias = Annotated[float, Meta(ge=0.0, le=1e15)]
HeartbeatInterval: TypeAlias = Annotated[float, Meta(ge=0.001, le=3600.0)]
RequestId: TypeAlias = Annotated[str, Meta(min_length=1, max_length=128)]
Name: TypeAlias = Annotated[str, Meta(max_length=128)]
Reason: TypeAlias = Annotated[str, Meta(max_length=1024)]
Backend: TypeAlias = Annotated[str, Meta(max_length=64)]
Nonce: TypeAlias = Annotated[bytes, Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Proof: TypeAlias = Annotated[bytes, Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
HalfFrame: TypeAlias = Annotated[bytes, Meta(max_length=MAX_MESSAGE_BYTES // 2)]
QuarterFrame: TypeAlias = Annotated[bytes, Meta(max_length=MAX_MESSAGE_BYTES // 4)]
Stats: TypeAlias = Annotated[bytes, Meta(max_length=1 << 16)]


class ControlMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every control message; a subclass's ``tag`` is its wire ``type``."""

    @property
    def kind(self) -> str:
        """The wire type name (for logs and error messages; dispatch on the class instead)."""
        return str(self.__struct_config__.tag)


# Handshake (see docs/control-plane.md): hello -> challenge -> auth -> accept, or refuse at any step.
class Hello(ControlMessage, tag="hello", frozen=True):
    """Client -> server: the versions and role of the connecting side, and its fresh nonce."""

    min_version: Version
    max_version: Version
    role: Role
    name: Name
    nonce: Nonce


class Challenge(ControlMessage, tag="challenge", frozen=True):
    """Server -> client: the chosen version, the server's identity and nonce, proven with the secret."""

    version: Version
    role: Role
    name: Name
    nonce: Nonce
    heartbeat_interval: HeartbeatInterval
    proof: Proof


class Auth(ControlMessage, tag="auth", frozen=True):
    """Client -> server: the client's layout, backend and transport metadata, proven with the secret."""

    layout: HalfFrame
    backend: Backend
    metadata: HalfFrame
    heartbeat_interval: HeartbeatInterval
    proof: Proof


class Accept(ControlMessage, tag="accept", frozen=True):
    """Server -> client: the server's layout, backend and metadata, proven; the connection is open."""

    layout: HalfFrame
    backend: Backend
    metadata: HalfFrame
    proof: Proof


class Refuse(ControlMessage, tag="refuse", frozen=True):
    """Either side, at any handshake step: why the connection is refused."""

    code: RefusalCode
    reason: Reason


#: Messages that belong to the handshake only (a peer sending one afterwards breaks the protocol).
HANDSHAKE_MESSAGES: tuple[type[ControlMessage], ...] = (Hello, Challenge, Auth, Accept)


# After the handshake.
class Heartbeat(ControlMessage, tag="heartbeat", frozen=True):
    """Liveness: sent when nothing else was, consumed by the control plane."""


class Bye(ControlMessage, tag="bye", frozen=True):
    """The sender ends the connection, and says why."""

    reason: Reason


# Decode <-> prefill (see kvxfer.disagg.worker_protocol for the payload codecs of the bytes fields).
class KvRanks(ControlMessage, tag="kv_ranks", frozen=True):
    """Both ways, once: every tensor-parallel rank's layout (``encode_layouts``)."""

    layouts: HalfFrame


class KvRequest(ControlMessage, tag="kv_request", frozen=True):
    """Decode asks for a request's KV: the prompt (``encode_tokens``), so prefill starts computing at once.
    ``checksum``: decode's ChecksumPolicy (``encode_checksum_policy``), empty for none."""

    request_id: RequestId
    tokens: Annotated[bytes, Meta(max_length=4 * MAX_PROMPT_TOKENS)]
    mode: Mode
    layerwise: bool
    layers_per_send: Annotated[int, Meta(ge=1, le=1 << 16)]
    lease_s: Annotated[float, Meta(ge=0.01, le=3600.0)]
    checksum: Annotated[bytes, Meta(max_length=64)]


class KvBlocks(ControlMessage, tag="kv_blocks", frozen=True):
    """Right after ``kv_request``, once decode allocated them: the tokens decode already holds (``skip``)
    and where the rest must go (``encode_block_ids``; read-only blocks as -1)."""

    request_id: RequestId
    skip: PromptLength
    blocks: QuarterFrame


class KvPushed(ControlMessage, tag="kv_pushed", frozen=True):
    """Push: the pages are written and prefill reads them no more (what frees a cancelled request's
    blocks). ``digest``: the source pages' KVDigest when decode asked for checksums. ``queued_s`` and
    ``post_s``: prefill's control time around its compute (arrival to compute start, compute end to the
    transfer posted), for decode's TTFT split."""

    request_id: RequestId
    first_token: TokenId
    parts: Parts
    nbytes: Count
    reused_tokens: PromptLength
    prefill_s: Seconds
    transfer_s: Seconds
    digest: QuarterFrame
    queued_s: Seconds
    post_s: Seconds


class KvPosted(ControlMessage, tag="kv_posted", frozen=True):
    """Push, protocol 2: every write is posted. ``kv_pushed`` without the transfer time (unknown when
    sent), plus prefill's monotonic clock at its compute's end and at the last post (comparable with
    decode's clock only on one host; decode never relies on them)."""

    request_id: RequestId
    first_token: TokenId
    parts: Parts
    nbytes: Count
    reused_tokens: PromptLength
    prefill_s: Seconds
    digest: QuarterFrame
    queued_s: Seconds
    post_s: Seconds
    computed_at: ClockReading
    posted_at: ClockReading


class KvPull(ControlMessage, tag="kv_pull", frozen=True):
    """Pull: where decode reads the request's KV from (``encode_block_ids`` of prefill's blocks)."""

    request_id: RequestId
    first_token: TokenId
    blocks: QuarterFrame
    reused_tokens: PromptLength
    prefill_s: Seconds
    digest: QuarterFrame
    queued_s: Seconds
    post_s: Seconds


class KvRelease(ControlMessage, tag="kv_release", frozen=True):
    """Pull: decode's read is done, prefill may free the request's blocks."""

    request_id: RequestId


class LeaseRenew(ControlMessage, tag="lease_renew", frozen=True):
    """Decode still wants the request: prefill keeps its blocks for another lease."""

    request_id: RequestId


class KvCancel(ControlMessage, tag="kv_cancel", frozen=True):
    """Decode no longer wants the request."""

    request_id: RequestId
    reason: Reason


class KvFailed(ControlMessage, tag="kv_failed", frozen=True):
    """Prefill could not serve the request (``is_prefill_shutdown(reason)``: it is stopping)."""

    request_id: RequestId
    reason: Reason


# Client <-> decode.
class Generate(ControlMessage, tag="generate", frozen=True):
    """A client's request. ``mode`` "" lets decode choose; ``return_kv`` > 0 asks for the committed
    prompt KV of that many positions in ``Generated.kv`` (the KV oracle's input)."""

    request_id: RequestId
    tokens: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]
    max_new_tokens: Annotated[int, Meta(ge=0, le=1 << 20)]
    mode: Literal["", "push", "pull"]
    layerwise: bool
    return_kv: PromptLength


class GenerateCancel(ControlMessage, tag="generate_cancel", frozen=True):
    """The client gives a request up."""

    request_id: RequestId
    reason: Reason


class Generated(ControlMessage, tag="generated", frozen=True):
    """A finished request: its tokens, its figures (``encode_stats``) and, if asked, its prompt KV."""

    request_id: RequestId
    tokens: Annotated[list[TokenId], Meta(max_length=1 << 20)]
    stats: Stats
    kv: HalfFrame


class GenerateFailed(ControlMessage, tag="generate_failed", frozen=True):
    """A failed request: the error's class name and why."""

    request_id: RequestId
    error: Annotated[str, Meta(max_length=64)]
    reason: Reason


# Any authenticated peer, on both workers.
class WorkerStatus(ControlMessage, tag="worker_status", frozen=True):
    """Asks a worker for its slot accounting and counters."""


class WorkerStatusReply(ControlMessage, tag="worker_status_reply", frozen=True):
    """The worker's figures (``encode_stats``)."""

    stats: Stats


# vLLM connector ranks (kvxfer.integrations.vllm.transfer).
VllmRequestId: TypeAlias = Annotated[str, Meta(max_length=512)]


class VllmKvDone(ControlMessage, tag="vllm_kv_done", frozen=True):
    """A reader finished with a request's blocks (``ok``: its read succeeded)."""

    request_id: VllmRequestId
    readers: Readers
    ok: bool


class VllmKvWant(ControlMessage, tag="vllm_kv_want", frozen=True):
    """A reader asks for a request's KV to be written into ``block_ids``, positions ``start``..``stop``."""

    request_id: VllmRequestId
    block_ids: Annotated[list[Count], Meta(max_length=1 << 20)]
    start: Count
    stop: Count
    readers: Readers


class VllmKvPushed(ControlMessage, tag="vllm_kv_pushed", frozen=True):
    """The writer pushed (or failed to push) a wanted request's KV."""

    request_id: VllmRequestId
    ok: bool
    nbytes: Count
    reason: Reason


AnyMessage: TypeAlias = Union[  # noqa: UP007  (msgspec needs a typing.Union of the tagged structs)
    Hello, Challenge, Auth, Accept, Refuse, Heartbeat, Bye,
    KvRanks, KvRequest, KvBlocks, KvPushed, KvPosted, KvPull, KvRelease, LeaseRenew, KvCancel, KvFailed,
    Generate, GenerateCancel, Generated, GenerateFailed, WorkerStatus, WorkerStatusReply,
    VllmKvDone, VllmKvWant, VllmKvPushed,
]
#: Every message class, in the union's order.
MESSAGE_TYPES: tuple[type[ControlMessage], ...] = typing.get_args(AnyMessage)


class Frame(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What travels: ``[version, message]``. The version matters to the handshake; after it, a
    connection's frames all carry the version it negotiated."""

    version: Version
    message: AnyMessage


_DECODER = msgspec.msgpack.Decoder(Frame)
_ENCODER = msgspec.msgpack.Encoder()


def _where(exc: msgspec.ValidationError) -> str:
    """msgspec's error with its path in this protocol's words (``$[1].nonce`` -> ``message.nonce``)."""
    return str(exc).replace("`$[0]`", "`message.version`").replace("`$[1]", "`message").replace("`$`", "`frame`")


def encode(message: ControlMessage, version: int = PROTOCOL_VERSION) -> bytes:
    """The wire bytes of ``message`` in a frame of ``version`` (``encode_frame``)."""
    return encode_frame(Frame(version, message))   # type: ignore[arg-type]


def encode_frame(frame: Frame) -> bytes:
    """The wire bytes of ``frame``; ProtocolError when a field is out of its bounds or of the wrong type
    (checked by decoding the bytes: what this side sends, a peer accepts)."""
    if not isinstance(frame, Frame) or not isinstance(frame.message, ControlMessage):
        raise ProtocolError(f"encode: expected a Frame of a ControlMessage, got {frame!r:.80}")
    data = _ENCODER.encode(frame)
    try:
        _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"message {frame.message.kind!r} does not fit its type: {_where(exc)}") from exc
    return data


def decode(data: bytes, versions: tuple[int, int] = SUPPORTED_VERSIONS,
           max_bytes: int = MAX_MESSAGE_BYTES) -> Frame:
    """Decode and validate one frame from a peer; hostile bytes raise ProtocolError naming the field."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"message: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message: {len(data)} bytes exceed the limit of {max_bytes}")
    try:
        frame = _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        field = "message.version" if "`$[0]`" in str(exc) else "message"
        raise ProtocolError(f"{field}: {_where(exc)}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"message: invalid msgpack ({exc})") from exc
    if not versions[0] <= frame.version <= versions[1]:
        raise ProtocolError(f"message.version: unsupported protocol version {frame.version} "
                            f"(this side speaks {versions[0]}..{versions[1]})")
    return frame


def decode_message(data: bytes, versions: tuple[int, int] = SUPPORTED_VERSIONS,
                   max_bytes: int = MAX_MESSAGE_BYTES) -> ControlMessage:
    """``decode(...)``'s message (for receivers that do not need the frame's version)."""
    return decode(data, versions, max_bytes).message
