"""Position-keyed blake3 digests of a request's KV: each side hashes its own pages by logical coordinates.

A digest **cell** is (layer, role, head, token chunk): the bytes of that head's rows for the chunk's
tokens, row after row in token order (a row is ``head_dim`` elements), read through the side's own
layout (tokens per block, head range, HND/NHD, coalesced or expanded pools) and the request's block
ids. Chunks are ``chunk_tokens`` long and aligned to absolute token positions, so they do not depend
on either side's tokens per block. Nothing in a digest depends on a TransferPlan: the source digests
its pages, the destination digests its own after arrival, and a plan that paired the wrong pages
(swapped blocks, shifted tokens, head ranges swapped between tensor-parallel ranks, a wrong layer, a
stale block, another request's block) makes some cell differ; ``verify_kv`` names it (layer, role,
head, token range) with both tags. A destination rank checks only the heads it holds.

A ``ChecksumPolicy`` selects cells (all, every k-th, or a seeded random subset) by their ordinal in
the digest's canonical cell order (buffers by (layer, role), then head, then chunk): both peers
derive the same choice from the digest's header alone. A ``KVDigest`` carries the header (token
range, covered token spans per buffer, chunk size), a short tag per selected cell and a 32-byte root
over every selected cell's full blake3; it is a small versioned msgpack blob whose decoder is
bounded (DecodeError). The digest guards against accidental corruption and mispairing, not against
a malicious peer (one that writes the bytes can write a matching digest). RELIABILITY.md,
"Position-keyed digests", says what it can and cannot see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import blake3
import msgpack
import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import BufferFormat, BufferId, CacheLayoutDesc
from kvxfer.cache.dtypes import dtype_name, itemsize
from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import BackendUnavailable, ConfigError, DecodeError, IntegrityError, LayoutError
from kvxfer.extractor import BlockIds, layout_regions, placements
from kvxfer.extractor.block_ids import block_id_map
from kvxfer.transport.copy import host_view

I64 = npt.NDArray[np.int64]

DIGEST_VERSION = 2
DEFAULT_CHUNK_TOKENS = 32
"""Tokens per cell unless the grid would exceed MAX_DIGEST_CELLS (the chunk then doubles)."""
MAX_CHUNK_TOKENS = 1 << 24
MAX_TOKENS = 1 << 31
MAX_DIGEST_CELLS = 1 << 20
"""Most cells one digest's grid holds (8 MiB of 8-byte tags)."""
MAX_DIGEST_BUFFERS = 1 << 14
MAX_SPANS = 64
"""Most token spans one buffer's coverage has (sliding windows give two)."""
MAX_TRANSFER_NAME = 256
MAX_NAME = 64
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_DIGEST_BYTES = (MAX_DIGEST_CELLS * 32) + (8 << 20)
#: CUDA pages (and host pages) are staged in groups of at most this many bytes: one gather each.
STAGE_BYTES = 64 << 20
STAGE_ROWS = 1 << 20
#: Host pages are hashed in place (no staging copy) when their rows form runs of at least this many rows.
DIRECT_MIN_RUN_ROWS = 4

Mode = Literal["full", "stride", "random"]
MODES: tuple[Mode, ...] = ("full", "stride", "random")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class ChecksumPolicy:
    """Which cells of a digest are checked, and how long each cell's tag is.

    ``full``: every cell. ``stride``: cells ``i`` with ``i % stride == seed % stride``.
    ``random``: each cell with probability ``fraction``, decided by a seeded 64-bit mix of its
    ordinal (at least one cell of a non-empty grid). ``tag_bytes`` (4..32) per selected cell lets
    the verifier name the first bad one; the 32-byte root always covers every selected byte.
    """

    mode: Mode = "full"
    stride: int = 1
    fraction: float = 1.0
    seed: int = 0
    tag_bytes: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"ChecksumPolicy.mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or not 1 <= self.stride <= 1 << 32:
            raise ConfigError(f"ChecksumPolicy.stride must be an int in [1, 2**32], got {self.stride!r}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float) \
                or not math.isfinite(self.fraction) or not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"ChecksumPolicy.fraction must be in (0, 1], got {self.fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 64:
            raise ConfigError(f"ChecksumPolicy.seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.tag_bytes, bool) or not isinstance(self.tag_bytes, int) or not 4 <= self.tag_bytes <= 32:
            raise ConfigError(f"ChecksumPolicy.tag_bytes must be an int in [4, 32], got {self.tag_bytes!r}")

    @classmethod
    def every(cls, stride: int, seed: int = 0) -> ChecksumPolicy:
        """Every ``stride``-th cell, starting at cell ``seed % stride``."""
        return cls("stride", stride=stride, seed=seed)

    @classmethod
    def sample(cls, fraction: float, seed: int) -> ChecksumPolicy:
        """A seeded random subset of about ``fraction`` of the cells."""
        return cls("random", fraction=fraction, seed=seed)

    def select(self, count: int) -> I64:
        """Ascending ordinals of the checked cells of a ``count``-cell grid (the same on both peers)."""
        if count < 0:
            raise ConfigError(f"ChecksumPolicy.select: cell count must be >= 0, got {count}")
        index = np.arange(count, dtype=np.int64)
        if self.mode == "full" or count == 0:
            return index
        if self.mode == "stride":
            return index[self.seed % self.stride::self.stride]
        mixed = _splitmix64(index.astype(np.uint64) ^ np.uint64(self.seed))
        threshold = self.fraction * 2.0**64
        chosen = index[mixed.astype(np.float64) < threshold] if self.fraction < 1.0 else index
        return chosen if chosen.size else index[[int(np.argmin(mixed))]]

    def count(self, count: int) -> int:
        """``select(count).size`` without materialising the selection (a peer's header may claim a large
        grid: decoding it must not allocate in proportion to the claim)."""
        if self.mode == "full" or count == 0:
            return count
        if self.mode == "stride":
            return len(range(self.seed % self.stride, count, self.stride))
        if self.fraction >= 1.0:
            return count
        step, total = 1 << 16, 0
        threshold = self.fraction * 2.0**64
        for lo in range(0, count, step):
            index = np.arange(lo, min(lo + step, count), dtype=np.uint64)
            total += int(np.count_nonzero(_splitmix64(index ^ np.uint64(self.seed)).astype(np.float64) < threshold))
        return max(total, 1)

    def describe(self) -> str:
        """Short text for tables and logs: ``full``, ``every:K`` or ``sample:F`` (seed and tag when not default)."""
        text = {"full": "full", "stride": f"every:{self.stride}", "random": f"sample:{self.fraction:g}"}[self.mode]
        extras = [f"seed={self.seed}"] * (self.seed != 0 and self.mode != "full")
        extras += [f"tag={self.tag_bytes}B"] * (self.tag_bytes != 8)
        return text + (f" ({', '.join(extras)})" if extras else "")

    def to_wire(self) -> list[Any]:
        """``[mode, stride, fraction, seed, tag_bytes]`` for the digest's encoding."""
        return [self.mode, self.stride, float(self.fraction), self.seed, self.tag_bytes]


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser, vectorised (fully specified, so both peers agree on any numpy)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


# --- the digest ------------------------------------------------------------------------------------
Span = tuple[int, int]


@dataclass(frozen=True)
class DigestBuffer:
    """One (layer, role) of a digest: its element format and the token spans the source covered."""

    layer_id: int
    role: str
    dtype: str
    head_dim: int
    total_heads: int
    spans: tuple[Span, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one (head, token) row."""
        return self.head_dim * itemsize(self.dtype)

    def num_chunks(self, chunk_tokens: int) -> int:
        """Chunks of ``chunk_tokens`` (aligned to absolute positions) its spans cut into."""
        return sum((b - 1) // chunk_tokens - a // chunk_tokens + 1 for a, b in self.spans)

    def chunks(self, chunk_tokens: int) -> tuple[I64, I64]:
        """(first token, end token) of each chunk, in token order."""
        if not self.spans:
            empty = np.empty(0, np.int64)
            return empty, empty
        lo = np.array([a for a, _ in self.spans], np.int64)
        hi = np.array([b for _, b in self.spans], np.int64)
        first = lo // chunk_tokens
        seg, j = _expand((hi - 1) // chunk_tokens - first + 1)
        k = first[seg] + j
        return np.maximum(lo[seg], k * chunk_tokens), np.minimum(hi[seg], (k + 1) * chunk_tokens)

    def to_wire(self) -> list[Any]:
        """``[layer, role, dtype, head_dim, total_heads, [[start, stop], ...]]`` for the digest's encoding."""
        return [self.layer_id, self.role, self.dtype, self.head_dim, self.total_heads, [list(s) for s in self.spans]]

    def name(self) -> str:
        """``layer L role 'R'`` for messages."""
        return f"layer {self.layer_id} role {self.role!r}"


@dataclass(frozen=True)
class KVDigest:
    """What the source sends next to a request's KV: the cell grid's header, the policy, the selected
    cells' tags (canonical order) and a root over their full blake3 digests."""

    transfer: str
    policy: ChecksumPolicy
    chunk_tokens: int
    token_range: Span
    buffers: tuple[DigestBuffer, ...]
    root: bytes
    tags: bytes

    @property
    def num_cells(self) -> int:
        """Cells of the grid (selected or not)."""
        return sum(b.total_heads * b.num_chunks(self.chunk_tokens) for b in self.buffers)

    @property
    def checked_cells(self) -> int:
        """Cells the digest has a tag for."""
        return len(self.tags) // self.policy.tag_bytes

    def header(self) -> list[Any]:
        """Everything but the tags and root: what the root is bound to."""
        return [DIGEST_VERSION, self.transfer, self.policy.to_wire(), self.chunk_tokens, list(self.token_range),
                [b.to_wire() for b in self.buffers]]

    def to_bytes(self) -> bytes:
        """Versioned msgpack: ``[v, transfer, policy, chunk_tokens, [lo, hi], buffers, root, tags]``."""
        return bytes(msgpack.packb([*self.header(), self.root, self.tags], use_bin_type=True))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KVDigest:
        """Decode ``to_bytes`` output from a peer; anything malformed raises DecodeError naming the field."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError(f"kv digest: expected bytes, got {type(data).__name__}")
        if len(data) > MAX_DIGEST_BYTES:
            raise DecodeError(f"kv digest: {len(data)} bytes exceed the limit of {MAX_DIGEST_BYTES}")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                                  max_str_len=MAX_TRANSFER_NAME, max_bin_len=min(MAX_DIGEST_CELLS * 32, len(data)),
                                  max_array_len=MAX_DIGEST_BUFFERS, max_map_len=0, max_ext_len=0)
        except (ValueError, TypeError, OverflowError, RecursionError, MemoryError, msgpack.UnpackException) as exc:
            raise DecodeError(f"kv digest: invalid msgpack ({type(exc).__name__}: {str(exc)[:80]})") from exc
        if not isinstance(obj, list) or len(obj) != 8:
            raise DecodeError(f"kv digest: expected an 8-item array, got {_show(obj)}")
        version, transfer, raw_policy, chunk, token_range, raw_buffers, root, tags = obj
        if version != DIGEST_VERSION or isinstance(version, bool):
            raise DecodeError(f"kv digest.version: unsupported {_show(version)} (expected {DIGEST_VERSION})")
        if not isinstance(transfer, str) or len(transfer) > MAX_TRANSFER_NAME:
            raise DecodeError(f"kv digest.transfer: expected a str of <= {MAX_TRANSFER_NAME} chars, "
                              f"got {_show(transfer)}")
        if not isinstance(raw_policy, list) or len(raw_policy) != 5:
            raise DecodeError(f"kv digest.policy: expected [mode, stride, fraction, seed, tag_bytes], "
                              f"got {_show(raw_policy)}")
        try:
            policy = ChecksumPolicy(*raw_policy)
        except ConfigError as exc:
            raise DecodeError(f"kv digest.policy: {exc}") from exc
        _check_int("chunk_tokens", chunk, 1, MAX_CHUNK_TOKENS)
        if not isinstance(token_range, list) or len(token_range) != 2:
            raise DecodeError(f"kv digest.token_range: expected [start, stop], got {_show(token_range)}")
        lo = _check_int("token_range start", token_range[0], 0, MAX_TOKENS)
        hi = _check_int("token_range stop", token_range[1], lo, MAX_TOKENS)
        if not isinstance(raw_buffers, list):
            raise DecodeError(f"kv digest.buffers: expected a list, got {_show(raw_buffers)}")
        buffers = tuple(_buffer_from_wire(b, i, (lo, hi)) for i, b in enumerate(raw_buffers))
        keys = [(b.layer_id, b.role) for b in buffers]
        if keys != sorted(set(keys)):
            raise DecodeError("kv digest.buffers: expected distinct (layer, role) entries in ascending order")
        if not isinstance(root, bytes) or len(root) != 32:
            raise DecodeError(f"kv digest.root: expected 32 bytes, got {_show(root)}")
        if not isinstance(tags, bytes) or len(tags) % policy.tag_bytes:
            raise DecodeError(f"kv digest.tags: expected a multiple of {policy.tag_bytes} bytes, got {_show(tags)}")
        digest = cls(transfer, policy, chunk, (lo, hi), buffers, root, tags)
        cells = digest.num_cells
        if cells > MAX_DIGEST_CELLS:
            raise DecodeError(f"kv digest.buffers: {cells} cells exceed the limit of {MAX_DIGEST_CELLS}")
        expected = policy.count(cells)
        if digest.checked_cells != expected:
            raise DecodeError(f"kv digest.tags: {digest.checked_cells} tags, the policy selects {expected} of "
                              f"{cells} cells")
        return digest


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise DecodeError(f"kv digest.{name}: expected an int in [{lo}, {hi}], got {_show(value)}")
    return value


def _buffer_from_wire(raw: Any, i: int, token_range: Span) -> DigestBuffer:
    where = f"kv digest.buffers[{i}]"
    if not isinstance(raw, list) or len(raw) != 6:
        raise DecodeError(f"{where}: expected [layer, role, dtype, head_dim, total_heads, spans], got {_show(raw)}")
    layer, role, dtype, head_dim, heads, spans = raw
    _check_int(f"buffers[{i}].layer", layer, 0, 1 << 31)
    for name, text in (("role", role), ("dtype", dtype)):
        if not isinstance(text, str) or not text or len(text) > MAX_NAME:
            raise DecodeError(f"{where}.{name}: expected a non-empty str of <= {MAX_NAME} chars, got {_show(text)}")
    try:
        if dtype_name(dtype) != dtype:
            raise DecodeError(f"{where}.dtype: {dtype!r} is not a canonical dtype name")
    except ConfigError as exc:
        raise DecodeError(f"{where}.dtype: {exc}") from exc
    _check_int(f"buffers[{i}].head_dim", head_dim, 1, MAX_HEAD_DIM)
    _check_int(f"buffers[{i}].total_heads", heads, 1, MAX_HEADS)
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        raise DecodeError(f"{where}.spans: expected a list of <= {MAX_SPANS} [start, stop], got {_show(spans)}")
    out: list[Span] = []
    last = token_range[0]
    for s in spans:
        if not isinstance(s, list) or len(s) != 2:
            raise DecodeError(f"{where}.spans: expected [start, stop] pairs, got {_show(s)}")
        a = _check_int(f"buffers[{i}].spans start", s[0], last, token_range[1])
        b = _check_int(f"buffers[{i}].spans stop", s[1], a + 1, token_range[1])
        out.append((a, b))
        last = b + 1   # spans are disjoint and not adjacent (adjacent ones are one span)
    return DigestBuffer(layer, role, dtype, head_dim, heads, tuple(out))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- the cell grid ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Cells:
    """Selected cells as parallel arrays (canonical order): buffer index, global head, token span, and
    the cell's position among the selected ones (its tag index)."""

    buffer: I64
    head: I64
    start: I64
    stop: I64
    tag: I64

    def take(self, mask: npt.NDArray[np.bool_]) -> _Cells:
        """The cells where ``mask`` is true (tag indices kept)."""
        return _Cells(self.buffer[mask], self.head[mask], self.start[mask], self.stop[mask], self.tag[mask])


def _selected_cells(policy: ChecksumPolicy, chunk_tokens: int, buffers: Sequence[DigestBuffer]) -> _Cells:
    """The cells ``policy`` selects: ordinal -> (buffer, head, chunk), vectorised."""
    chunk_lo: list[I64] = []
    chunk_hi: list[I64] = []
    for b in buffers:
        lo, hi = b.chunks(chunk_tokens)
        chunk_lo.append(lo)
        chunk_hi.append(hi)
    m = np.array([c.size for c in chunk_lo], np.int64)
    heads = np.array([b.total_heads for b in buffers], np.int64)
    per_buffer = heads * m
    ends = np.cumsum(per_buffer)
    chosen = policy.select(int(ends[-1]) if ends.size else 0)
    j = np.searchsorted(ends, chosen, side="right").astype(np.int64)
    local = chosen - (ends - per_buffer)[j]
    head, k = np.divmod(local, np.maximum(m[j], 1))
    offsets = np.cumsum(m) - m
    all_lo = np.concatenate(chunk_lo) if chunk_lo else np.empty(0, np.int64)
    all_hi = np.concatenate(chunk_hi) if chunk_hi else np.empty(0, np.int64)
    where = offsets[j] + k
    return _Cells(j, head, all_lo[where], all_hi[where], np.arange(chosen.size, dtype=np.int64))


def _expand(count: I64) -> tuple[I64, I64]:
    """For ``count[s]`` items per group: (group of each item, index of the item inside its group)."""
    seg = np.repeat(np.arange(count.size, dtype=np.int64), count)
    first = np.cumsum(count) - count
    return seg, np.arange(seg.size, dtype=np.int64) - first[seg]


# --- reading one rank's pages ----------------------------------------------------------------------
class _Rank:
    """One tensor-parallel rank of a side: where each digest buffer's rows live in its pools."""

    def __init__(self, layout: CacheLayoutDesc, block_ids: BlockIds | Any, buffers: Sequence[DigestBuffer],
                 side: str) -> None:
        self.layout = layout
        self.side = side
        place = placements(layout)
        self.regions = layout_regions(layout)
        n = len(buffers)
        self.holds = np.zeros(n, bool)
        self.head_start = np.zeros(n, np.int64)
        self.num_heads = np.zeros(n, np.int64)
        self.region = np.zeros(n, np.int64)
        self.base = np.zeros(n, np.int64)
        self.slot_bytes = np.zeros(n, np.int64)
        self.head_stride = np.zeros(n, np.int64)
        self.token_stride = np.zeros(n, np.int64)
        self.row = np.zeros(n, np.int64)
        self.page_tokens = np.ones(n, np.int64)   # an expanded buffer holds several pages per block
        self.page_bytes = np.zeros(n, np.int64)
        self.group = np.zeros(n, np.int64)
        groups: list[int] = []
        for i, b in enumerate(buffers):
            p = place.get(BufferId(b.layer_id, b.role))
            if p is None:
                continue
            fmt, row = p.fmt, b.row_bytes
            self.holds[i] = True
            self.head_start[i], self.num_heads[i] = fmt.head_start, fmt.num_heads
            self.region[i] = p.region
            self.base[i] = p.base - self.regions[p.region].base_address
            self.slot_bytes[i] = p.slot_bytes
            self.head_stride[i], self.token_stride[i] = ((fmt.tokens_per_block * row, row) if fmt.order == "HND"
                                                         else (row, fmt.num_heads * row))
            self.row[i] = row
            self.page_tokens[i], self.page_bytes[i] = fmt.tokens_per_block, fmt.nbytes
            if p.layer_group not in groups:
                groups.append(p.layer_group)
            self.group[i] = groups.index(p.layer_group)
        ids = block_id_map(layout, block_ids, groups, side)
        width = max((ids[g].size for g in groups), default=0)
        self.ids = np.full((max(len(groups), 1), width + 1), -1, np.int64)   # last column: past the end
        for k, g in enumerate(groups):
            self.ids[k, :ids[g].size] = ids[g]
        self.tpb = layout.tokens_per_block

    def present(self, i: int, lo: int, hi: int) -> npt.NDArray[np.bool_]:
        """Which tokens of [lo, hi) buffer ``i``'s block ids give a page."""
        block = np.minimum(np.arange(lo, hi, dtype=np.int64) // self.tpb, self.ids.shape[1] - 1)
        found: npt.NDArray[np.bool_] = self.ids[self.group[i], block] >= 0
        return found

    def hash_cells(self, cells: _Cells, buffers: Sequence[DigestBuffer]) -> list[bytes]:
        """Full blake3 of each cell (this rank must hold its head), reading the pages in bounded groups."""
        out: list[bytes] = [b""] * cells.head.size
        if not cells.head.size:
            return out
        b = cells.buffer
        length = cells.stop - cells.start
        # Gather per (region, row size): one strided view each; within it, groups of bounded size.
        klass = self.region[b] * (1 << 20) + self.row[b]
        order = np.argsort(klass, kind="stable")
        for key in np.unique(klass).tolist():
            members = order[klass[order] == key]
            rows = length[members]
            nbytes = rows * self.row[b[members]]
            group = np.floor(np.maximum(np.cumsum(nbytes) / STAGE_BYTES, np.cumsum(rows) / STAGE_ROWS)).astype(np.int64)
            for g in np.unique(group).tolist():
                part = members[group == g]
                self._hash_group(cells, part, buffers, out)
        return out

    def _hash_group(self, cells: _Cells, part: I64, buffers: Sequence[DigestBuffer], out: list[bytes]) -> None:
        """Hash the cells ``part`` (one region, one row size, bounded bytes) into ``out``: every row's
        byte offset computed at once, then in place (long runs in host memory) or after one gather."""
        b = cells.buffer[part]
        length = cells.stop[part] - cells.start[part]
        seg, j = _expand(length)
        tok = cells.start[part][seg] + j
        bb = b[seg]
        block = np.minimum(tok // self.tpb, self.ids.shape[1] - 1)
        slot = self.ids[self.group[bb], block]
        if (slot < 0).any():
            bad = int(np.argmax(slot < 0))
            buf = buffers[int(bb[bad])]
            raise IntegrityError(f"{self.side}: no page holds {buf.name()} token {int(tok[bad])} (block "
                                 f"{int(tok[bad]) // self.tpb}), which the digest covers")
        page, in_page = np.divmod(tok - block * self.tpb, self.page_tokens[bb])
        offset = (self.base[bb] + slot * self.slot_bytes[bb] + page * self.page_bytes[bb]
                  + (cells.head[part][seg] - self.head_start[bb]) * self.head_stride[bb] + in_page * self.token_stride[bb])
        row = int(self.row[b[0]])
        region = self.regions[int(self.region[b[0]])]
        first_row = np.cumsum(length) - length
        # Runs of rows adjacent in memory inside one cell (HND: a head's tokens within a block).
        starts = np.zeros(offset.size, bool)
        starts[first_row] = True
        starts[1:] |= offset[1:] != offset[:-1] + row
        run = np.flatnonzero(starts)
        if region.memory_kind != "cuda" and run.size * DIRECT_MIN_RUN_ROWS <= offset.size:
            # Long runs in host memory: hash them in place, no staging copy.
            self._hash_runs(region, part, offset[run], np.diff(np.append(run, offset.size)) * row,
                            np.searchsorted(run, first_row), out)
            return
        staged = _gather_rows(region, offset, row)
        ends = np.cumsum(length * row)
        view = staged.data
        for k, a, e in zip(part.tolist(), (ends - length * row).tolist(), ends.tolist(), strict=True):
            out[k] = blake3.blake3(view[a:e]).digest()

    @staticmethod
    def _hash_runs(region: MemoryRegion, part: I64, run_offset: I64, run_bytes: I64, cell_first_run: I64,
                   out: list[bytes]) -> None:
        """Hash each cell of ``part`` over its runs (``cell_first_run[i]`` up to the next cell's) read in
        place from a host region."""
        if int(run_offset.min()) < 0 or int((run_offset + run_bytes).max()) > region.nbytes:
            raise IntegrityError(f"digest rows fall outside the region at {region.base_address:#x} "
                                 f"({region.nbytes} bytes): the layout and block ids disagree")
        view = host_view(region).data
        bounds = np.append(cell_first_run, run_offset.size).tolist()
        offsets, sizes = run_offset.tolist(), run_bytes.tolist()
        for k, lo, hi in zip(part.tolist(), bounds[:-1], bounds[1:], strict=True):
            hasher = blake3.blake3()
            for r in range(lo, hi):
                hasher.update(view[offsets[r]:offsets[r] + sizes[r]])
            out[k] = hasher.digest()


def _gather_rows(region: MemoryRegion, offsets: I64, row: int) -> npt.NDArray[np.uint8]:
    """The ``row``-byte rows at ``offsets`` (bytes into ``region``), back to back in host memory."""
    import torch

    if region.memory_kind == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable("checksums of CUDA memory need a CUDA device; torch sees none here")
        raw = _cuda_tensor(region, torch)
    else:
        raw = torch.from_numpy(host_view(region))
    if offsets.size and (int(offsets.min()) < 0 or int(offsets.max()) + row > region.nbytes):
        raise IntegrityError(f"digest rows fall outside the region at {region.base_address:#x} "
                             f"({region.nbytes} bytes): the layout and block ids disagree")
    if not (offsets % row).any():    # rows on a row grid (every layout kvxfer builds): a plain row gather
        rows = raw[:region.nbytes // row * row].view(-1, row)
        index = torch.from_numpy(offsets // row).to(raw.device)
    else:                             # any byte offset: an overlapping view with one row per byte
        rows = raw.as_strided((region.nbytes - row + 1, row), (1, 1))
        index = torch.from_numpy(offsets).to(raw.device)
    staged: npt.NDArray[np.uint8] = rows.index_select(0, index).cpu().numpy().reshape(-1)
    return staged


class _CudaBytes:
    """A ``__cuda_array_interface__`` over a CUDA region's bytes, so torch can view it without a copy."""

    def __init__(self, region: MemoryRegion) -> None:
        self.__cuda_array_interface__ = {"shape": (region.nbytes,), "typestr": "|u1",
                                         "data": (region.base_address, False), "version": 3, "strides": None}


def _cuda_tensor(region: MemoryRegion, torch: Any) -> Any:
    """A uint8 torch tensor viewing ``region`` on its device."""
    with torch.cuda.device(region.device_id):
        return torch.as_tensor(_CudaBytes(region), device=f"cuda:{region.device_id}")


# --- both sides --------------------------------------------------------------------------------------
def _side_buffers(layouts: Sequence[CacheLayoutDesc],
                  layers: Sequence[int] | None) -> dict[tuple[int, str], BufferFormat]:
    """(layer, role) -> format of the first rank holding it, for the selected layers."""
    if not layouts:
        raise ConfigError("a digest needs at least one rank's layout")
    wanted = None if layers is None else {int(x) for x in layers}
    out: dict[tuple[int, str], BufferFormat] = {}
    for lay in layouts:
        for bid, fmt in lay.formats:
            if wanted is None or bid.layer_id in wanted:
                if fmt.opaque:      # no per-token rows: nothing to key a position's digest by
                    raise LayoutError(f"digest_kv: buffer {bid} is opaque ({fmt.block_bytes} bytes per page, no "
                                      f"per-token rows); leave its layer out with layers=")
                out.setdefault((bid.layer_id, bid.role), fmt)
    return out


def _root(header: list[Any], full: Sequence[bytes]) -> bytes:
    """blake3 over the digest's header and every selected cell's full digest, in canonical order."""
    hasher = blake3.blake3(msgpack.packb(header, use_bin_type=True))
    hasher.update(b"".join(full))
    return hasher.digest()


def _spans(mask: npt.NDArray[np.bool_], lo: int) -> tuple[Span, ...]:
    """Runs of True in ``mask`` (token ``lo + i``) as (start, stop) spans."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts, stops = np.flatnonzero(edges == 1) + lo, np.flatnonzero(edges == -1) + lo
    return tuple(zip(starts.tolist(), stops.tolist(), strict=True))


def digest_kv(layouts: Sequence[CacheLayoutDesc], block_ids: Sequence[BlockIds | Any], token_range: Span,
              policy: ChecksumPolicy, transfer: str, *, layers: Sequence[int] | None = None,
              chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> KVDigest:
    """Source side: the digest of one request's KV over ``token_range`` (of ``layers``, default all),
    read from its pages on every rank (``layouts[r]`` with ``block_ids[r]``: a mapping layer group ->
    slot ids, or a KVCache). Each head is read from the first rank holding it. A (layer, role) covers
    the tokens every rank holding it has a page for (sliding windows drop old blocks); the chunk size
    doubles until the grid fits MAX_DIGEST_CELLS."""
    if not isinstance(transfer, str) or len(transfer) > MAX_TRANSFER_NAME:
        raise ConfigError(f"transfer name must be a str of <= {MAX_TRANSFER_NAME} chars, got {transfer!r:.80}")
    if len(layouts) != len(block_ids):
        raise ConfigError(f"digest_kv: {len(layouts)} layouts for {len(block_ids)} block-id maps")
    lo, hi = int(token_range[0]), int(token_range[1])
    if not 0 <= lo <= hi <= MAX_TOKENS:
        raise ConfigError(f"digest_kv: token_range must satisfy 0 <= start <= stop <= {MAX_TOKENS}, got {token_range}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise ConfigError(f"digest_kv: chunk_tokens must be an int in [1, {MAX_CHUNK_TOKENS}], got {chunk_tokens!r}")
    formats = _side_buffers(layouts, layers)
    stub = tuple(DigestBuffer(lid, role, f.dtype, f.head_dim, f.total_heads, ()) for (lid, role), f in sorted(formats.items()))
    ranks = [_Rank(lay, ids, stub, "source") for lay, ids in zip(layouts, block_ids, strict=True)]
    # The rank each head is read from, and the tokens every rank holding the buffer has pages for.
    owner: list[I64] = []
    buffers: list[DigestBuffer] = []
    for i, b in enumerate(stub):
        who = np.full(b.total_heads, -1, np.int64)
        mask = np.ones(hi - lo, bool)
        for r, rank in enumerate(ranks):
            if rank.holds[i]:
                span = who[rank.head_start[i]:rank.head_start[i] + rank.num_heads[i]]
                span[span < 0] = r
                mask &= rank.present(i, lo, hi)
        if (who < 0).any():
            raise ConfigError(f"digest_kv: heads {np.flatnonzero(who < 0).tolist()} of {b.name()} are held by "
                              f"no rank")
        spans = _spans(mask, lo)
        if len(spans) > MAX_SPANS:
            raise ConfigError(f"digest_kv: {b.name()} has pages for {len(spans)} separate token spans "
                              f"(at most {MAX_SPANS})")
        owner.append(who)
        buffers.append(DigestBuffer(b.layer_id, b.role, b.dtype, b.head_dim, b.total_heads, spans))
    while sum(b.total_heads * b.num_chunks(chunk_tokens) for b in buffers) > MAX_DIGEST_CELLS:
        chunk_tokens *= 2
    cells = _selected_cells(policy, chunk_tokens, buffers)
    owners = np.full((max(len(owner), 1), max((o.size for o in owner), default=1)), -1, np.int64)
    for j, who in enumerate(owner):
        owners[j, :who.size] = who
    reader = owners[cells.buffer, cells.head]
    full: list[bytes] = [b""] * cells.head.size
    for r, rank in enumerate(ranks):
        mine = reader == r
        if mine.any():
            for k, d in zip(np.flatnonzero(mine).tolist(), rank.hash_cells(cells.take(mine), buffers), strict=True):
                full[k] = d
    header_digest = KVDigest(transfer, policy, chunk_tokens, (lo, hi), tuple(buffers), b"", b"")
    return KVDigest(transfer, policy, chunk_tokens, (lo, hi), tuple(buffers), _root(header_digest.header(), full),
                    b"".join(d[:policy.tag_bytes] for d in full))


def verify_kv(layouts: Sequence[CacheLayoutDesc], block_ids: Sequence[BlockIds | Any], digest: KVDigest, *,
              token_range: Span, layers: Sequence[int] | None = None) -> None:
    """Destination side: raise IntegrityError unless this side's pages hold, at every selected cell of
    the heads its ranks hold, the bytes ``digest`` describes. ``token_range`` is what this side expects
    the digest to cover (for a layer with a sliding window, the digest may leave out tokens no future
    token attends to); the digest's buffers must be exactly this side's (layer, role) buffers with the
    same element format. The message names the first differing cell: layer, role, head, tokens, rank,
    both tags, and how many cells differ."""
    where = f"transfer {digest.transfer!r}"
    lo, hi = int(token_range[0]), int(token_range[1])
    if digest.token_range != (lo, hi):
        raise IntegrityError(f"{where}: the digest covers tokens [{digest.token_range[0]}, {digest.token_range[1]}), "
                             f"the destination expects [{lo}, {hi})")
    formats = _side_buffers(layouts, layers)
    theirs = {(b.layer_id, b.role): b for b in digest.buffers}
    if set(theirs) != set(formats):
        missing, extra = sorted(set(formats) - set(theirs)), sorted(set(theirs) - set(formats))
        raise IntegrityError(f"{where}: the digest's (layer, role) buffers differ from the destination's: "
                             f"missing {missing[:8]}, unexpected {extra[:8]}")
    for key, fmt in formats.items():
        b = theirs[key]
        for name, ours in (("dtype", fmt.dtype), ("head_dim", fmt.head_dim), ("total_heads", fmt.total_heads)):
            if getattr(b, name) != ours:
                raise IntegrityError(f"{where}: {b.name()} {name} is {getattr(b, name)!r} in the digest, "
                                     f"{ours!r} on the destination")
        _check_coverage(where, b, layouts[0], lo, hi)
    ranks = [_Rank(lay, ids, digest.buffers, "destination") for lay, ids in zip(layouts, block_ids, strict=True)]
    cells = _selected_cells(digest.policy, digest.chunk_tokens, digest.buffers)
    width = digest.policy.tag_bytes
    sent = np.frombuffer(digest.tags, np.uint8).reshape(-1, width) if cells.head.size else np.empty((0, width), np.uint8)
    full: list[bytes | None] = [None] * cells.head.size
    bad: list[tuple[int, int, bytes]] = []   # (tag index, rank, full digest)
    for r, rank in enumerate(ranks):
        held = rank.holds[cells.buffer] & (cells.head >= rank.head_start[cells.buffer]) \
            & (cells.head < rank.head_start[cells.buffer] + rank.num_heads[cells.buffer])
        if not held.any():
            continue
        mine = cells.take(held)
        got = rank.hash_cells(mine, digest.buffers)
        tags = np.frombuffer(b"".join(d[:width] for d in got), np.uint8).reshape(-1, width)
        differ = np.flatnonzero((tags != sent[mine.tag]).any(axis=1))
        bad.extend((int(mine.tag[k]), r, got[k]) for k in differ.tolist())
        for k, d in zip(mine.tag.tolist(), got, strict=True):
            full[k] = d
    if bad:
        bad.sort()
        k, r, d = bad[0]
        b = digest.buffers[int(cells.buffer[k])]
        raise IntegrityError(
            f"{where}: KV differs from the source at {b.name()} head {int(cells.head[k])} tokens "
            f"[{int(cells.start[k])}, {int(cells.stop[k])}) (destination rank {r}): blake3 tag {d[:width].hex()} != "
            f"source's {digest.tags[k * width:(k + 1) * width].hex()}; {len(bad)} of {cells.head.size} checked "
            f"cells differ")
    if all(d is not None for d in full) and _root(digest.header(), [d for d in full if d is not None]) != digest.root:
        raise IntegrityError(f"{where}: checksum root differs although every cell tag matches (a difference "
                             f"past the {width}-byte tags; {cells.head.size} cells checked)")


def _check_coverage(where: str, b: DigestBuffer, layout: CacheLayoutDesc, lo: int, hi: int) -> None:
    """The digest's spans of ``b`` cover every token the destination will attend to: all of [lo, hi) for
    full attention; the window's last tokens and the sink tokens for a sliding-window layer."""
    group = layout.layer_group_of(b.layer_id)
    if group.window is None:
        needed: list[Span] = [(lo, hi)] if hi > lo else []
    else:
        needed = [s for s in ((lo, min(hi, group.sink_tokens)), (max(lo, hi - group.window + 1), hi)) if s[1] > s[0]]
    covered = np.zeros(hi - lo, bool)
    for a, e in b.spans:
        covered[a - lo:e - lo] = True
    for a, e in needed:
        missing = np.flatnonzero(~covered[a - lo:e - lo])
        if missing.size:
            raise IntegrityError(f"{where}: the digest of {b.name()} does not cover token {a + int(missing[0])}, "
                                 f"which the destination needs (covered: {list(b.spans)[:4]})")
