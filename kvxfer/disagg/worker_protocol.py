"""The workers' protocol: the bounded codecs of their messages' payloads, and completion notices.

The messages themselves (``KvRanks``, ``KvRequest``, ``KvBlocks``, ``KvPosted``, ``KvPushed``, ``KvPull``,
``KvRelease``, ``LeaseRenew``, ``KvCancel``, ``KvFailed`` between decode and prefill; ``Generate``,
``GenerateCancel``, ``Generated``, ``GenerateFailed`` between a client and decode; ``WorkerStatus`` ->
``WorkerStatusReply`` for any authenticated peer) are typed structs of ``kvxfer.disagg.messages``; see
docs/disagg.md for their sequence. ``Generate.return_kv`` > 0 asks for the committed prompt KV of that
many positions in ``Generated.kv``: the KV oracle's input, see ``kvxfer.disagg.oracle``.

Integrity (optional, decode decides): ``KvRequest.checksum`` carries decode's ChecksumPolicy; prefill
answers with a position-keyed KVDigest of the source pages over the tokens decode asked for in
``KvPushed.digest`` or ``KvPull.digest``; decode digests its own destination pages the same way and
compares before it commits them (no plan is involved, so a mispaired plan cannot agree with itself).
``KvBlocks.blocks`` names decode's read-only blocks (committed, shared with its prefix tree) as -1.

Shutdown: a prefill that stops (drains, or closes) answers ``KvFailed`` with a reason beginning with
``PREFILL_SHUTDOWN``; such a request's KV did not reach decode and never will from there, so decode sends
it to another prefill (``is_prefill_shutdown``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg.messages import MAX_MESSAGE_BYTES, MAX_PROMPT_TOKENS, KvPosted, RequestId
from kvxfer.disagg.seal import NOTICE_TAG_BYTES
from kvxfer.errors import ConfigError, DecodeError, LayoutError, ProtocolError
from kvxfer.transport.integrity import ChecksumPolicy

MAX_RANKS = 64
MAX_LAYER_GROUPS = 1024
_NOTICE_SUMMARY = msgspec.msgpack.Decoder(
    tuple[RequestId, Annotated[int, msgspec.Meta(ge=1, le=1 << 16)], dict[str, Any] | None])

#: How ``kv_failed.reason`` begins when prefill fails a request because it is stopping (draining or closing).
PREFILL_SHUTDOWN = "prefill worker shutting down"


def is_prefill_shutdown(reason: str) -> bool:
    """Whether a ``kv_failed.reason`` says the prefill is stopping (so the request may go to another one)."""
    return reason.startswith(PREFILL_SHUTDOWN)


#: Protocol 2: a write's completion notice (what the transport delivers after the data) starts with this.
NOTICE_MAGIC = b"KVX2"
_NOTICE_MAX_BYTES = 2048


@dataclass(frozen=True)
class Notice:
    """A decoded completion notice: part ``part`` of request ``request_id`` landed. ``summary`` (the
    request's one write): what ``kv_posted`` would say, so the notice alone completes the request.
    Trust it only once ``verify(signed, tag)`` holds on the request's connection."""

    request_id: str
    part: int
    summary: KvPosted | None
    signed: bytes
    tag: bytes


def encode_notice(request_id: str, part: int, summary: KvPosted | None, sign: Callable[[bytes], bytes]) -> bytes:
    """``NOTICE_MAGIC`` + msgpack ``[request_id, part, summary or nil]`` + the connection's tag of both
    (``PeerConnection.sign_notice``). ``summary``: the fields of ``kv_posted`` but ``type``, ``request_id``
    and ``digest`` (a notice carries no digest: with checksums, ``kv_posted`` does)."""
    fields = None if summary is None else \
        {k: v for k, v in msgspec.structs.asdict(summary).items() if k not in ("request_id", "digest")}
    signed = NOTICE_MAGIC + bytes(msgpack.packb([request_id, part, fields], use_bin_type=True))
    return signed + sign(signed)


def decode_notice(raw: bytes) -> Notice:
    """Inverse of ``encode_notice`` without the tag check (the receiver checks it against the connection
    the request belongs to); ProtocolError naming what is malformed."""
    if not raw.startswith(NOTICE_MAGIC) or not len(NOTICE_MAGIC) + NOTICE_TAG_BYTES < len(raw) <= _NOTICE_MAX_BYTES:
        raise ProtocolError(f"notice: {len(raw)} bytes, not a tagged {NOTICE_MAGIC!r} notice of at most "
                            f"{_NOTICE_MAX_BYTES} bytes")
    signed, tag = raw[:-NOTICE_TAG_BYTES], raw[-NOTICE_TAG_BYTES:]
    try:
        rid, part, summary = _NOTICE_SUMMARY.decode(signed[len(NOTICE_MAGIC):])
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$[0]`", "`notice.request_id`").replace("`$[1]`", "`notice.part`") \
            .replace("`$[2]`", "`notice.summary`")
        raise ProtocolError(f"notice: expected [request_id, part, summary]: {where}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"notice: invalid msgpack ({exc})") from exc
    try:
        message = None if summary is None else \
            msgspec.convert({**summary, "request_id": rid, "digest": b"", "type": "kv_posted"}, KvPosted)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"notice.summary: {exc}") from exc
    return Notice(rid, part, message, signed, tag)


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, max_str_len=1 << 10,
                               max_bin_len=MAX_MESSAGE_BYTES // 2, max_array_len=MAX_PROMPT_TOKENS,
                               max_map_len=MAX_LAYER_GROUPS, max_ext_len=0)
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"{what}: invalid msgpack ({type(exc).__name__})") from exc


def encode_layouts(layouts: Sequence[CacheLayoutDesc]) -> bytes:
    """The layouts of every rank, in rank order, as one msgpack list of layout encodings."""
    return bytes(msgpack.packb([lay.to_msgpack() for lay in layouts], use_bin_type=True))


def decode_layouts(data: bytes) -> list[CacheLayoutDesc]:
    """Inverse of ``encode_layouts``; ProtocolError naming the bad rank."""
    obj = _unpack(data, "kv_ranks.layouts")
    if not isinstance(obj, list) or not 1 <= len(obj) <= MAX_RANKS or not all(isinstance(x, bytes) for x in obj):
        raise ProtocolError(f"kv_ranks.layouts: expected a list of 1..{MAX_RANKS} layout encodings")
    out: list[CacheLayoutDesc] = []
    for i, raw in enumerate(obj):
        try:
            out.append(CacheLayoutDesc.from_msgpack(raw))
        except (DecodeError, LayoutError) as exc:
            raise ProtocolError(f"kv_ranks.layouts[{i}]: {exc}") from exc
    return out


BlockIdMaps = list[dict[int, npt.NDArray[np.int64]]]


def encode_tokens(tokens: npt.ArrayLike) -> bytes:
    """``kv_request.tokens``: the prompt as int32 little-endian bytes (a 16k-token prompt costs ~0.02 ms
    to encode and check this way, ~2 ms as a msgpack list of ints checked one by one)."""
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def decode_tokens(data: bytes, what: str) -> npt.NDArray[np.int64]:
    """Inverse of ``encode_tokens``; ProtocolError for a ragged length or a negative token id."""
    if len(data) % 4:
        raise ProtocolError(f"{what}: {len(data)} bytes is not a whole number of int32 token ids")
    tokens = np.frombuffer(data, dtype="<i4").astype(np.int64)
    if tokens.size and int(tokens.min()) < 0:
        raise ProtocolError(f"{what}: token id {int(tokens.min())} is negative")
    return tokens


def encode_block_ids(maps: Sequence[Mapping[int, npt.ArrayLike]]) -> bytes:
    """Per rank, layer group -> block ids (int32 little-endian bytes), as msgpack."""
    return bytes(msgpack.packb([{int(g): np.asarray(ids, dtype="<i4").tobytes() for g, ids in m.items()}
                                for m in maps], use_bin_type=True))


def decode_block_ids(data: bytes, num_ranks: int, what: str) -> BlockIdMaps:
    """Inverse of ``encode_block_ids`` for a peer with ``num_ranks`` ranks; ProtocolError when malformed.

    Ids are only decoded here; ``plan_transfer`` checks each against its layout's pool groups."""
    obj = _unpack(data, what)
    if not isinstance(obj, list) or len(obj) != num_ranks:
        raise ProtocolError(f"{what}: expected one block-id map per rank ({num_ranks}), got "
                            f"{len(obj) if isinstance(obj, list) else type(obj).__name__}")
    out: BlockIdMaps = []
    for r, m in enumerate(obj):
        if not isinstance(m, dict):
            raise ProtocolError(f"{what}[{r}]: expected a map layer group -> ids")
        ranked: dict[int, npt.NDArray[np.int64]] = {}
        for g, raw in m.items():
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < MAX_LAYER_GROUPS \
                    or not isinstance(raw, bytes) or len(raw) % 4:
                raise ProtocolError(f"{what}[{r}]: bad entry for layer group {g!r}")
            ranked[g] = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        out.append(ranked)
    return out


def encode_checksum_policy(policy: ChecksumPolicy | None) -> bytes:
    """``kv_request.checksum``: the policy's wire form as msgpack, or empty bytes for no checksum."""
    return b"" if policy is None else bytes(msgpack.packb(policy.to_wire(), use_bin_type=True))


def decode_checksum_policy(data: bytes) -> ChecksumPolicy | None:
    """Inverse of ``encode_checksum_policy``; ProtocolError naming the field when malformed."""
    if not data:
        return None
    obj = _unpack(data, "kv_request.checksum")
    if not isinstance(obj, list) or len(obj) != 5:
        raise ProtocolError("kv_request.checksum: expected [mode, stride, fraction, seed, tag_bytes]")
    try:
        return ChecksumPolicy(*obj)
    except (ConfigError, TypeError) as exc:
        raise ProtocolError(f"kv_request.checksum: {exc}") from exc


def encode_stats(stats: Mapping[str, int | float | str]) -> bytes:
    """A flat map of per-request figures, as msgpack."""
    return bytes(msgpack.packb(dict(stats), use_bin_type=True))


def decode_stats(data: bytes) -> dict[str, int | float | str]:
    """Inverse of ``encode_stats``; ProtocolError unless a flat map of numbers and strings."""
    obj = _unpack(data, "stats")
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, int | float | str)
                                            for k, v in obj.items()):
        raise ProtocolError("stats: expected a map of names to numbers or strings")
    return obj
