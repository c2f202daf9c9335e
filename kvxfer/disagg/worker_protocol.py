"""Worker message types (registered with the control plane) and the bounded codecs of their payloads.

Decode <-> prefill, after the authenticated handshake (see docs/disagg.md):
``kv_ranks`` (both ways, once: every tensor-parallel rank's layout), ``kv_request`` (decode asks for a
request's KV: the prompt, so prefill starts computing at once), ``kv_blocks`` (right after, once decode
allocated them: which tokens decode already holds and where the rest must go), ``kv_posted`` (push,
protocol 2: every write is posted; the first token and what decode checks at arrival, sent while the data
moves, so that decode takes the KV as soon as the transport's notifications say it landed), ``kv_pushed``
(push: the pages are written, prefill reads them no more: what frees a cancelled request's blocks), ``kv_pull`` (pull: where to read them from), ``kv_release`` (pull: read done),
``lease_renew``, ``kv_cancel``, ``kv_failed``. Client <-> decode: ``generate``, ``generate_cancel``,
``generated``, ``generate_failed`` (``generate.return_kv`` > 0 asks for the committed prompt KV of that
many positions in ``generated.kv``: the KV oracle's input, see ``kvxfer.disagg.oracle``). Any authenticated peer (clients included, on both workers):
``worker_status`` -> ``worker_status_reply`` (slot accounting and counters, for operators and tests).

Integrity (optional, decode decides): ``kv_request.checksum`` carries decode's ChecksumPolicy; prefill
answers with a position-keyed KVDigest of the source pages over the tokens decode asked for in
``kv_pushed.digest`` or ``kv_pull.digest``; decode digests its own destination pages the same way and
compares before it commits them (no plan is involved, so a mispaired plan cannot agree with itself).
``kv_blocks.blocks`` names decode's read-only blocks (committed, shared with its prefix tree) as -1.

Shutdown: a prefill that stops (drains, or closes) answers ``kv_failed`` with a reason beginning with
``PREFILL_SHUTDOWN``; such a request's KV did not reach decode and never will from there, so decode sends
it to another prefill (``is_prefill_shutdown``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg.messages import MAX_MESSAGE_BYTES, Field, Message, MessageSpec, register
from kvxfer.disagg.seal import NOTICE_TAG_BYTES
from kvxfer.errors import ConfigError, DecodeError, LayoutError, ProtocolError
from kvxfer.transport.integrity import ChecksumPolicy

MODES = ("push", "pull")
MAX_RANKS = 64
MAX_PROMPT_TOKENS = 1 << 20
MAX_LAYER_GROUPS = 1024
_TOKEN_ID_MAX = (1 << 31) - 1

_RID = Field("request_id", "str", min_len=1, max_len=128)
_REASON = Field("reason", "str", max_len=1024)
_SECONDS = (0.0, 1e6)
#: Prefill's control time around its compute, reported for decode's TTFT split: request arrival to the
#: compute thread starting it, and compute end to the transfer posted (``kv_pull`` sent).
_STAGES = (Field("queued_s", "float", lo=_SECONDS[0], hi=_SECONDS[1]),
           Field("post_s", "float", lo=_SECONDS[0], hi=_SECONDS[1]))

KV_RANKS = register(MessageSpec("kv_ranks", (Field("layouts", "bytes", max_len=MAX_MESSAGE_BYTES // 2),)))
KV_REQUEST = register(MessageSpec("kv_request", (
    _RID,
    Field("tokens", "bytes", max_len=4 * MAX_PROMPT_TOKENS),   # int32 little-endian: encode_tokens
    Field("mode", "str", max_len=8, choices=MODES),
    Field("layerwise", "bool"),
    Field("layers_per_send", "int", lo=1, hi=1 << 16),
    Field("lease_s", "float", lo=0.01, hi=3600.0),
    Field("checksum", "bytes", max_len=64),
)))
KV_BLOCKS = register(MessageSpec("kv_blocks", (
    _RID,
    Field("skip", "int", hi=MAX_PROMPT_TOKENS),
    Field("blocks", "bytes", max_len=MAX_MESSAGE_BYTES // 4),
)))
KV_PUSHED = register(MessageSpec("kv_pushed", (
    _RID, Field("first_token", "int", hi=_TOKEN_ID_MAX), Field("parts", "int", hi=1 << 16),
    Field("nbytes", "int"), Field("reused_tokens", "int", hi=MAX_PROMPT_TOKENS),
    Field("prefill_s", "float", lo=_SECONDS[0], hi=_SECONDS[1]),
    Field("transfer_s", "float", lo=_SECONDS[0], hi=_SECONDS[1]),
    Field("digest", "bytes", max_len=MAX_MESSAGE_BYTES // 4),
    *_STAGES,
)))
#: ``kv_pushed`` without the transfer time (unknown when sent), plus prefill's clock readings at its
#: compute's end and at the last post: monotonic seconds, comparable with decode's clock only when both
#: run on one host (``kvxfer bench e2e`` then splits "after prefill" exactly; decode never relies on them).
KV_POSTED = register(MessageSpec("kv_posted", (
    _RID, Field("first_token", "int", hi=_TOKEN_ID_MAX), Field("parts", "int", hi=1 << 16),
    Field("nbytes", "int"), Field("reused_tokens", "int", hi=MAX_PROMPT_TOKENS),
    Field("prefill_s", "float", lo=_SECONDS[0], hi=_SECONDS[1]),
    Field("digest", "bytes", max_len=MAX_MESSAGE_BYTES // 4),
    *_STAGES,
    Field("computed_at", "float", lo=0.0, hi=1e15), Field("posted_at", "float", lo=0.0, hi=1e15),
)))
KV_PULL = register(MessageSpec("kv_pull", (
    _RID, Field("first_token", "int", hi=_TOKEN_ID_MAX), Field("blocks", "bytes", max_len=MAX_MESSAGE_BYTES // 4),
    Field("reused_tokens", "int", hi=MAX_PROMPT_TOKENS), Field("prefill_s", "float", lo=_SECONDS[0], hi=_SECONDS[1]),
    Field("digest", "bytes", max_len=MAX_MESSAGE_BYTES // 4),
    *_STAGES,
)))
KV_RELEASE = register(MessageSpec("kv_release", (_RID,)))
LEASE_RENEW = register(MessageSpec("lease_renew", (_RID,)))
KV_CANCEL = register(MessageSpec("kv_cancel", (_RID, _REASON)))
KV_FAILED = register(MessageSpec("kv_failed", (_RID, _REASON)))
#: How ``kv_failed.reason`` begins when prefill fails a request because it is stopping (draining or closing).
PREFILL_SHUTDOWN = "prefill worker shutting down"


def is_prefill_shutdown(reason: str) -> bool:
    """Whether a ``kv_failed.reason`` says the prefill is stopping (so the request may go to another one)."""
    return reason.startswith(PREFILL_SHUTDOWN)


GENERATE = register(MessageSpec("generate", (
    _RID, Field("tokens", "ints", hi=_TOKEN_ID_MAX, max_len=MAX_PROMPT_TOKENS),
    Field("max_new_tokens", "int", hi=1 << 20), Field("mode", "str", max_len=8, choices=("", *MODES)),
    Field("layerwise", "bool"), Field("return_kv", "int", hi=MAX_PROMPT_TOKENS),
)))
GENERATE_CANCEL = register(MessageSpec("generate_cancel", (_RID, _REASON)))
WORKER_STATUS = register(MessageSpec("worker_status", ()))
WORKER_STATUS_REPLY = register(MessageSpec("worker_status_reply", (Field("stats", "bytes", max_len=1 << 16),)))
GENERATED = register(MessageSpec("generated", (
    _RID, Field("tokens", "ints", hi=_TOKEN_ID_MAX, max_len=1 << 20), Field("stats", "bytes", max_len=1 << 16),
    Field("kv", "bytes", max_len=MAX_MESSAGE_BYTES // 2),
)))
GENERATE_FAILED = register(MessageSpec("generate_failed", (_RID, Field("error", "str", max_len=64), _REASON)))


#: Protocol 2: a write's completion notice (what the transport delivers after the data) starts with this.
NOTICE_MAGIC = b"KVX2"
_NOTICE_MAX_BYTES = 2048
_PART = Field("part", "int", lo=1, hi=1 << 16)


@dataclass(frozen=True)
class Notice:
    """A decoded completion notice: part ``part`` of request ``request_id`` landed. ``summary`` (the
    request's one write): what ``kv_posted`` would say, so the notice alone completes the request.
    Trust it only once ``verify(signed, tag)`` holds on the request's connection."""

    request_id: str
    part: int
    summary: Message | None
    signed: bytes
    tag: bytes


def encode_notice(request_id: str, part: int, summary: Mapping[str, Any] | None,
                  sign: Callable[[bytes], bytes]) -> bytes:
    """``NOTICE_MAGIC`` + msgpack ``[request_id, part, summary or nil]`` + the connection's tag of both
    (``PeerConnection.sign_notice``). ``summary``: the fields of ``kv_posted`` but ``request_id`` and
    ``digest`` (a notice carries no digest: with checksums, ``kv_posted`` does)."""
    signed = NOTICE_MAGIC + bytes(msgpack.packb([request_id, part, None if summary is None else dict(summary)],
                                                use_bin_type=True))
    return signed + sign(signed)


def decode_notice(raw: bytes) -> Notice:
    """Inverse of ``encode_notice`` without the tag check (the receiver checks it against the connection
    the request belongs to); ProtocolError naming what is malformed."""
    if not raw.startswith(NOTICE_MAGIC) or not len(NOTICE_MAGIC) + NOTICE_TAG_BYTES < len(raw) <= _NOTICE_MAX_BYTES:
        raise ProtocolError(f"notice: {len(raw)} bytes, not a tagged {NOTICE_MAGIC!r} notice of at most "
                            f"{_NOTICE_MAX_BYTES} bytes")
    signed, tag = raw[:-NOTICE_TAG_BYTES], raw[-NOTICE_TAG_BYTES:]
    obj = _unpack(signed[len(NOTICE_MAGIC):], "notice")
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("notice: expected [request_id, part, summary]")
    rid, part, summary = obj
    _RID.check(rid, "notice")
    _PART.check(part, "notice")
    if summary is not None and not isinstance(summary, dict):
        raise ProtocolError("notice.summary: expected a map or nil")
    message = None if summary is None else \
        Message("kv_posted", KV_POSTED.check_body({**summary, "request_id": rid, "digest": b""}, "notice.summary"))
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
