"""Published layout descriptors: frozen, hashable, versioned, with a msgpack/JSON codec.

These are the only view other stages get of the cache manager's memory (DESIGN.md, "Published
descriptors"). Every decoder checks types and invariants, because descriptors arrive from peers.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import blake3
import msgpack

from kvxfer.cache.dtypes import dtype_name, itemsize
from kvxfer.errors import ConfigError, DecodeError, LayoutError

LAYOUT_VERSION = 1
MEMORY_KINDS = ("cpu", "cuda", "pinned", "disk")
_MAX_U64 = (1 << 64) - 1

T = TypeVar("T")


# --- decoding helpers: every field read from untrusted input goes through these --------------------
def _get(d: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise DecodeError(f"{where}: expected a mapping, got {type(d).__name__}")
    if key not in d:
        raise DecodeError(f"{where}: missing field {key!r}")
    return d[key]


def _int(d: Mapping[str, Any], key: str, where: str, lo: int = 0, hi: int = _MAX_U64) -> int:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise DecodeError(f"{where}.{key}: expected an int in [{lo}, {hi}], got {v!r}")
    return v


def _opt_int(d: Mapping[str, Any], key: str, where: str) -> int | None:
    if _get(d, key, where) is None:
        return None
    return _int(d, key, where, 1)


def _str(d: Mapping[str, Any], key: str, where: str, max_len: int = 64) -> str:
    v = _get(d, key, where)
    if not isinstance(v, str) or len(v) > max_len:
        raise DecodeError(f"{where}.{key}: expected a string of <= {max_len} chars, got {v!r:.80}")
    return v


def _seq(d: Mapping[str, Any], key: str, where: str, item: Callable[[Any, str], T], max_len: int) -> tuple[T, ...]:
    v = _get(d, key, where)
    if not isinstance(v, list | tuple) or len(v) > max_len:
        raise DecodeError(f"{where}.{key}: expected a list of <= {max_len} items, got {type(v).__name__}"
                          f"{'' if not isinstance(v, list | tuple) else f' of {len(v)}'}")
    return tuple(item(x, f"{where}.{key}[{i}]") for i, x in enumerate(v))


def _build(cls: Callable[..., T], where: str, **kw: Any) -> T:
    try:
        return cls(**kw)
    except (LayoutError, ConfigError, TypeError, ValueError) as exc:
        raise DecodeError(f"{where}: {exc}") from exc


# --- descriptors -----------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class BufferId:
    """The bytes of one (layer, role) for one block."""

    layer_id: int
    role: str

    def __post_init__(self) -> None:
        if isinstance(self.layer_id, bool) or not isinstance(self.layer_id, int) or self.layer_id < 0:
            raise LayoutError(f"BufferId.layer_id must be an int >= 0, got {self.layer_id!r}")
        if not isinstance(self.role, str) or not self.role:
            raise LayoutError(f"BufferId.role must be a non-empty string, got {self.role!r}")

    def to_wire(self) -> list[Any]:
        return [self.layer_id, self.role]

    @classmethod
    def from_wire(cls, v: Any, where: str = "BufferId") -> BufferId:
        if not isinstance(v, list | tuple) or len(v) != 2:
            raise DecodeError(f"{where}: expected [layer_id, role], got {v!r:.80}")
        return _build(cls, where, layer_id=v[0], role=v[1])


@dataclass(frozen=True)
class BufferFormat:
    """How the bytes of one buffer map to (head, token, element).

    HND: [num_heads][tokens_per_block][head_dim] (a head slice is contiguous); NHD: [tokens][heads][dim].
    ``head_start``/``num_heads`` are the global head range this rank holds out of ``total_heads``.
    """

    dtype: str
    head_dim: int
    tokens_per_block: int
    head_start: int
    num_heads: int
    total_heads: int
    order: Literal["HND", "NHD"] = "HND"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        except ConfigError as exc:
            raise LayoutError(f"BufferFormat.dtype: {exc}") from exc
        for name in ("head_dim", "tokens_per_block", "num_heads", "total_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise LayoutError(f"BufferFormat.{name} must be an int > 0, got {v!r}")
        if isinstance(self.head_start, bool) or not isinstance(self.head_start, int) or self.head_start < 0:
            raise LayoutError(f"BufferFormat.head_start must be an int >= 0, got {self.head_start!r}")
        if self.head_start + self.num_heads > self.total_heads:
            raise LayoutError(f"BufferFormat heads [{self.head_start}, {self.head_start + self.num_heads}) "
                              f"exceed total_heads={self.total_heads}")
        if self.order not in ("HND", "NHD"):
            raise LayoutError(f"BufferFormat.order must be 'HND' or 'NHD', got {self.order!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer (one block of one layer and role)."""
        return self.num_heads * self.tokens_per_block * self.head_dim * self.itemsize

    def to_wire(self) -> list[Any]:
        return [self.dtype, self.head_dim, self.tokens_per_block, self.head_start, self.num_heads,
                self.total_heads, self.order]

    @classmethod
    def from_wire(cls, v: Any, where: str = "BufferFormat") -> BufferFormat:
        if not isinstance(v, list | tuple) or len(v) != 7:
            raise DecodeError(f"{where}: expected 7 fields, got {v!r:.80}")
        if not isinstance(v[0], str) or not isinstance(v[6], str):
            raise DecodeError(f"{where}: dtype and order must be strings, got {v!r:.80}")
        return _build(cls, where, dtype=v[0], head_dim=v[1], tokens_per_block=v[2], head_start=v[3],
                      num_heads=v[4], total_heads=v[5], order=v[6])


@dataclass(frozen=True)
class CoalescedBuffer:
    """Equal-size buffers of several (layer, role) stored back to back in one slot."""

    single_buffer_size: int
    buffer_ids: tuple[BufferId, ...]

    def __post_init__(self) -> None:
        if isinstance(self.single_buffer_size, bool) or not isinstance(self.single_buffer_size, int) \
                or self.single_buffer_size <= 0:
            raise LayoutError(f"CoalescedBuffer.single_buffer_size must be an int > 0, got "
                              f"{self.single_buffer_size!r}")
        ids = tuple(self.buffer_ids)
        if not ids:
            raise LayoutError("CoalescedBuffer.buffer_ids must not be empty")
        if len(set(ids)) != len(ids):
            raise LayoutError(f"CoalescedBuffer.buffer_ids has duplicates: {ids}")
        object.__setattr__(self, "buffer_ids", ids)

    def to_wire(self) -> dict[str, Any]:
        return {"single_buffer_size": self.single_buffer_size, "buffer_ids": [b.to_wire() for b in self.buffer_ids]}

    @classmethod
    def from_wire(cls, v: Any, where: str = "CoalescedBuffer") -> CoalescedBuffer:
        return _build(cls, where, single_buffer_size=_int(v, "single_buffer_size", where, 1, 1 << 40),
                      buffer_ids=_seq(v, "buffer_ids", where, BufferId.from_wire, 1 << 16))


@dataclass(frozen=True)
class ExpandedBuffer:
    """One buffer's byte offset and size inside its slot (a "buffer-offset descriptor")."""

    buffer_id: BufferId
    offset: int
    size: int


@dataclass(frozen=True)
class SlotDesc:
    """One block's storage in one pool: a coalesced buffer of ``slot_bytes // single_buffer_size``
    buffers per layer group.

    When several layer groups share the pool group, ``coalesced.buffer_ids`` lists each group's
    buffers in turn (group order of ``PoolGroupDesc.layer_group_ids``); a slot holds one group's
    buffers at a time, so the i-th buffer id sits at offset ``(i % per_slot) * single_buffer_size``.
    """

    slot_bytes: int
    coalesced: CoalescedBuffer

    def __post_init__(self) -> None:
        if isinstance(self.slot_bytes, bool) or not isinstance(self.slot_bytes, int) or self.slot_bytes <= 0:
            raise LayoutError(f"SlotDesc.slot_bytes must be an int > 0, got {self.slot_bytes!r}")
        single = self.coalesced.single_buffer_size
        if self.slot_bytes % single:
            raise LayoutError(f"SlotDesc.slot_bytes={self.slot_bytes} is not a multiple of "
                              f"single_buffer_size={single}")
        if len(self.coalesced.buffer_ids) % (self.slot_bytes // single):
            raise LayoutError(f"SlotDesc: {len(self.coalesced.buffer_ids)} buffers do not fill whole slots of "
                              f"{self.slot_bytes // single} buffers")

    @property
    def buffers_per_slot(self) -> int:
        """How many buffers one slot holds (for one layer group)."""
        return self.slot_bytes // self.coalesced.single_buffer_size

    def expanded(self) -> tuple[ExpandedBuffer, ...]:
        """Each buffer's offset and size inside the slot."""
        single, per = self.coalesced.single_buffer_size, self.buffers_per_slot
        return tuple(ExpandedBuffer(b, (i % per) * single, single) for i, b in enumerate(self.coalesced.buffer_ids))

    def to_wire(self) -> dict[str, Any]:
        return {"slot_bytes": self.slot_bytes, "coalesced": self.coalesced.to_wire()}

    @classmethod
    def from_wire(cls, v: Any, where: str = "SlotDesc") -> SlotDesc:
        return _build(cls, where, slot_bytes=_int(v, "slot_bytes", where, 1, 1 << 44),
                      coalesced=CoalescedBuffer.from_wire(_get(v, "coalesced", where), f"{where}.coalesced"))


@dataclass(frozen=True)
class PoolDesc:
    """One contiguous memory region: slot ``i`` lives at ``base_address + i * slot_bytes``."""

    pool_index: int
    base_address: int
    slot_bytes: int
    num_slots: int
    memory_kind: str
    device_id: int = 0

    def __post_init__(self) -> None:
        for name in ("pool_index", "base_address", "slot_bytes", "num_slots", "device_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise LayoutError(f"PoolDesc.{name} must be an int >= 0, got {v!r}")
        if self.slot_bytes == 0:
            raise LayoutError("PoolDesc.slot_bytes must be > 0")
        if self.memory_kind not in MEMORY_KINDS:
            raise LayoutError(f"PoolDesc.memory_kind must be one of {MEMORY_KINDS}, got {self.memory_kind!r}")
        if self.base_address + self.slot_bytes * self.num_slots > _MAX_U64:
            raise LayoutError(f"PoolDesc {self.pool_index}: base {self.base_address:#x} + "
                              f"{self.num_slots} x {self.slot_bytes} bytes overflows 64 bits")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.slot_bytes * self.num_slots

    @property
    def end_address(self) -> int:
        """First address past the pool."""
        return self.base_address + self.nbytes

    def to_wire(self) -> list[Any]:
        return [self.pool_index, self.base_address, self.slot_bytes, self.num_slots, self.memory_kind, self.device_id]

    @classmethod
    def from_wire(cls, v: Any, where: str = "PoolDesc") -> PoolDesc:
        if not isinstance(v, list | tuple) or len(v) != 6:
            raise DecodeError(f"{where}: expected 6 fields, got {v!r:.80}")
        return _build(cls, where, pool_index=v[0], base_address=v[1], slot_bytes=v[2], num_slots=v[3],
                      memory_kind=v[4], device_id=v[5])


@dataclass(frozen=True)
class PoolGroupDesc:
    """Pools whose slots are allocated together: one slot id (block id) indexes every pool."""

    pool_group_index: int
    num_slots: int
    layer_group_ids: tuple[int, ...]
    pools: tuple[PoolDesc, ...]
    slots: tuple[SlotDesc, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_group_ids", tuple(self.layer_group_ids))
        object.__setattr__(self, "pools", tuple(self.pools))
        object.__setattr__(self, "slots", tuple(self.slots))
        where = f"PoolGroupDesc {self.pool_group_index}"
        if not self.pools or len(self.pools) != len(self.slots):
            raise LayoutError(f"{where}: needs as many pools as slot descs (>0), got "
                              f"{len(self.pools)} pools, {len(self.slots)} slots")
        if not self.layer_group_ids or len(set(self.layer_group_ids)) != len(self.layer_group_ids):
            raise LayoutError(f"{where}: layer_group_ids must be non-empty and distinct, got {self.layer_group_ids}")
        n_groups = len(self.layer_group_ids)
        for i, (pool, slot) in enumerate(zip(self.pools, self.slots, strict=True)):
            if pool.pool_index != i:
                raise LayoutError(f"{where}: pools[{i}].pool_index is {pool.pool_index}")
            if pool.slot_bytes != slot.slot_bytes:
                raise LayoutError(f"{where}: pools[{i}].slot_bytes={pool.slot_bytes} != slots[{i}].slot_bytes="
                                  f"{slot.slot_bytes}")
            if pool.num_slots != self.num_slots:
                raise LayoutError(f"{where}: pools[{i}].num_slots={pool.num_slots} != num_slots={self.num_slots}")
            if len(slot.coalesced.buffer_ids) != slot.buffers_per_slot * n_groups:
                raise LayoutError(f"{where}: slots[{i}] holds {len(slot.coalesced.buffer_ids)} buffer ids, "
                                  f"expected {slot.buffers_per_slot} for each of {n_groups} layer groups")

    def to_wire(self) -> dict[str, Any]:
        return {"pool_group_index": self.pool_group_index, "num_slots": self.num_slots,
                "layer_group_ids": list(self.layer_group_ids), "pools": [p.to_wire() for p in self.pools],
                "slots": [s.to_wire() for s in self.slots]}

    @classmethod
    def from_wire(cls, v: Any, where: str = "PoolGroupDesc") -> PoolGroupDesc:
        lg = _seq(v, "layer_group_ids", where, lambda x, w: _int({"v": x}, "v", w, 0, 1 << 20), 1 << 12)
        return _build(cls, where, pool_group_index=_int(v, "pool_group_index", where, 0, 1 << 20),
                      num_slots=_int(v, "num_slots", where, 0, 1 << 40), layer_group_ids=lg,
                      pools=_seq(v, "pools", where, PoolDesc.from_wire, 1 << 16),
                      slots=_seq(v, "slots", where, SlotDesc.from_wire, 1 << 16))


@dataclass(frozen=True)
class LayerGroupDesc:
    """Layers with the same attention window; a request holds one block-id list per layer group."""

    layer_group_id: int
    layer_ids: tuple[int, ...]
    window: int | None
    sink_tokens: int
    pool_group_index: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise LayoutError(f"LayerGroupDesc {self.layer_group_id}: layer_ids must be non-empty and distinct")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise LayoutError(f"LayerGroupDesc {self.layer_group_id}: window must be None or > 0, got {self.window!r}")

    def to_wire(self) -> dict[str, Any]:
        return {"layer_group_id": self.layer_group_id, "layer_ids": list(self.layer_ids), "window": self.window,
                "sink_tokens": self.sink_tokens, "pool_group_index": self.pool_group_index}

    @classmethod
    def from_wire(cls, v: Any, where: str = "LayerGroupDesc") -> LayerGroupDesc:
        ids = _seq(v, "layer_ids", where, lambda x, w: _int({"v": x}, "v", w, 0, 1 << 20), 1 << 16)
        return _build(cls, where, layer_group_id=_int(v, "layer_group_id", where, 0, 1 << 20), layer_ids=ids,
                      window=_opt_int(v, "window", where), sink_tokens=_int(v, "sink_tokens", where, 0, 1 << 40),
                      pool_group_index=_int(v, "pool_group_index", where, 0, 1 << 20))


@dataclass(frozen=True)
class CacheLayoutDesc:
    """The whole published layout of one cache manager (one tensor-parallel rank).

    ``fingerprint`` is a blake3 digest of the canonical encoding without addresses, slot counts,
    memory kinds or devices: equal fingerprints mean byte-identical slot layouts.
    """

    version: int
    tokens_per_block: int
    layer_groups: tuple[LayerGroupDesc, ...]
    pool_groups: tuple[PoolGroupDesc, ...]
    formats: tuple[tuple[BufferId, BufferFormat], ...]
    fingerprint: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_groups", tuple(self.layer_groups))
        object.__setattr__(self, "pool_groups", tuple(self.pool_groups))
        object.__setattr__(self, "formats", tuple(sorted(tuple(self.formats))))
        if self.version != LAYOUT_VERSION:
            raise LayoutError(f"CacheLayoutDesc.version {self.version!r} is not supported (expected {LAYOUT_VERSION})")
        self._check()
        fp = _fingerprint(self)
        if self.fingerprint and self.fingerprint != fp:
            raise LayoutError(f"CacheLayoutDesc.fingerprint {self.fingerprint.hex()[:16]}... does not match the "
                              f"layout ({fp.hex()[:16]}...)")
        object.__setattr__(self, "fingerprint", fp)

    def _check(self) -> None:
        fmt = dict(self.formats)
        if len(fmt) != len(self.formats):
            raise LayoutError("CacheLayoutDesc.formats has duplicate buffer ids")
        for i, lg in enumerate(self.layer_groups):
            if lg.layer_group_id != i:
                raise LayoutError(f"CacheLayoutDesc.layer_groups[{i}].layer_group_id is {lg.layer_group_id}")
            if not 0 <= lg.pool_group_index < len(self.pool_groups):
                raise LayoutError(f"LayerGroupDesc {i}: pool_group_index {lg.pool_group_index} out of range")
            if i not in self.pool_groups[lg.pool_group_index].layer_group_ids:
                raise LayoutError(f"LayerGroupDesc {i} is not listed by pool group {lg.pool_group_index}")
        layer_of_group: dict[int, int] = {}
        for lg in self.layer_groups:
            for lid in lg.layer_ids:
                if lid in layer_of_group:
                    raise LayoutError(f"layer {lid} is in layer groups {layer_of_group[lid]} and {lg.layer_group_id}")
                layer_of_group[lid] = lg.layer_group_id
        seen: set[BufferId] = set()
        for j, pg in enumerate(self.pool_groups):
            if pg.pool_group_index != j:
                raise LayoutError(f"CacheLayoutDesc.pool_groups[{j}].pool_group_index is {pg.pool_group_index}")
            for k, slot in enumerate(pg.slots):
                per = slot.buffers_per_slot
                for n, bid in enumerate(slot.coalesced.buffer_ids):
                    group = pg.layer_group_ids[n // per]
                    if layer_of_group.get(bid.layer_id) != group:
                        raise LayoutError(f"pool group {j} slot {k}: buffer {bid} is not in layer group {group}")
                    if bid in seen:
                        raise LayoutError(f"buffer {bid} appears twice in the layout")
                    seen.add(bid)
                    if bid not in fmt:
                        raise LayoutError(f"buffer {bid} has no BufferFormat")
                    if fmt[bid].nbytes != slot.coalesced.single_buffer_size:
                        raise LayoutError(f"buffer {bid}: format says {fmt[bid].nbytes} bytes, slot says "
                                          f"{slot.coalesced.single_buffer_size}")
                    if fmt[bid].tokens_per_block != self.tokens_per_block:
                        raise LayoutError(f"buffer {bid}: tokens_per_block {fmt[bid].tokens_per_block} != "
                                          f"{self.tokens_per_block}")
        _check_no_overlap(self.pool_groups)
        if seen != set(fmt):
            raise LayoutError(f"formats name buffers no slot holds: {sorted(set(fmt) - seen)[:4]}")

    # --- queries --------------------------------------------------------------------------------
    def format_of(self, buffer_id: BufferId) -> BufferFormat:
        """The BufferFormat of a buffer."""
        for bid, fmt in self.formats:
            if bid == buffer_id:
                return fmt
        raise LayoutError(f"no buffer {buffer_id} in this layout")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """All layer ids, ascending."""
        return tuple(sorted(lid for lg in self.layer_groups for lid in lg.layer_ids))

    def layer_group_of(self, layer_id: int) -> LayerGroupDesc:
        """The layer group holding ``layer_id``."""
        for lg in self.layer_groups:
            if layer_id in lg.layer_ids:
                return lg
        raise LayoutError(f"layer {layer_id} is not in this layout (layers {self.layer_ids})")

    def locate(self, buffer_id: BufferId) -> tuple[PoolGroupDesc, PoolDesc, ExpandedBuffer]:
        """(pool group, pool, expanded buffer) where ``buffer_id`` lives."""
        for pg in self.pool_groups:
            for pool, slot in zip(pg.pools, pg.slots, strict=True):
                for eb in slot.expanded():
                    if eb.buffer_id == buffer_id:
                        return pg, pool, eb
        raise LayoutError(f"no buffer {buffer_id} in this layout")

    def with_version_fields(self) -> dict[str, Any]:
        """The wire dictionary (JSON- and msgpack-ready)."""
        return {"version": self.version, "tokens_per_block": self.tokens_per_block,
                "layer_groups": [lg.to_wire() for lg in self.layer_groups],
                "pool_groups": [pg.to_wire() for pg in self.pool_groups],
                "formats": [[b.to_wire(), f.to_wire()] for b, f in self.formats],
                "fingerprint": self.fingerprint.hex()}

    to_dict = with_version_fields

    @classmethod
    def from_dict(cls, d: Any) -> CacheLayoutDesc:
        """Decode and validate a wire dictionary; raises DecodeError/LayoutError naming the bad field."""
        where = "CacheLayoutDesc"
        version = _int(d, "version", where, 0, 1 << 16)
        if version != LAYOUT_VERSION:
            raise DecodeError(f"{where}.version {version} is not supported (expected {LAYOUT_VERSION})")

        def fmt_item(x: Any, w: str) -> tuple[BufferId, BufferFormat]:
            if not isinstance(x, list | tuple) or len(x) != 2:
                raise DecodeError(f"{w}: expected [buffer_id, format]")
            return BufferId.from_wire(x[0], w), BufferFormat.from_wire(x[1], w)

        fp = _str(d, "fingerprint", where, 128)
        try:
            fp_bytes = bytes.fromhex(fp)
        except ValueError as exc:
            raise DecodeError(f"{where}.fingerprint is not hex: {fp!r}") from exc
        return _build(cls, where, version=version, tokens_per_block=_int(d, "tokens_per_block", where, 1, 1 << 20),
                      layer_groups=_seq(d, "layer_groups", where, LayerGroupDesc.from_wire, 1 << 12),
                      pool_groups=_seq(d, "pool_groups", where, PoolGroupDesc.from_wire, 1 << 12),
                      formats=_seq(d, "formats", where, fmt_item, 1 << 18), fingerprint=fp_bytes)

    def to_msgpack(self) -> bytes:
        """Compact binary encoding for the control plane."""
        return bytes(msgpack.packb(self.to_dict(), use_bin_type=True))

    @classmethod
    def from_msgpack(cls, data: bytes, max_bytes: int = 16 << 20) -> CacheLayoutDesc:
        """Decode a msgpack encoding with bounded sizes; hostile input raises DecodeError."""
        if not isinstance(data, bytes | bytearray | memoryview) or len(data) > max_bytes:
            raise DecodeError(f"CacheLayoutDesc: expected <= {max_bytes} bytes of msgpack")
        try:
            d = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True,
                                max_array_len=min(1 << 18, len(data)), max_map_len=64, max_str_len=1 << 12,
                                max_bin_len=1 << 12)
        except (ValueError, msgpack.UnpackException, TypeError, RecursionError, MemoryError) as exc:
            raise DecodeError(f"CacheLayoutDesc: invalid msgpack: {exc}") from exc
        return cls.from_dict(d)

    def to_json(self, indent: int | None = 2) -> str:
        """Human-readable encoding (``kvxfer inspect --json``)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> CacheLayoutDesc:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise DecodeError(f"CacheLayoutDesc: invalid JSON: {exc}") from exc
        return cls.from_dict(d)


def _check_no_overlap(pool_groups: tuple[PoolGroupDesc, ...]) -> None:
    """Placed pools (base address != 0) of one memory space never overlap."""
    spans = sorted((p.memory_kind, p.device_id, p.base_address, p.end_address, g.pool_group_index, p.pool_index)
                   for g in pool_groups for p in g.pools if p.base_address and p.num_slots)
    for a, b in itertools.pairwise(spans):
        if a[:2] == b[:2] and b[2] < a[3]:
            raise LayoutError(f"pool {a[4]}.{a[5]} [{a[2]:#x}, {a[3]:#x}) overlaps pool {b[4]}.{b[5]} "
                              f"[{b[2]:#x}, {b[3]:#x})")


def _fingerprint(layout: CacheLayoutDesc) -> bytes:
    canon = {
        "version": layout.version, "tokens_per_block": layout.tokens_per_block,
        "layer_groups": [lg.to_wire() for lg in layout.layer_groups],
        "pool_groups": [{"layer_group_ids": list(pg.layer_group_ids), "slots": [s.to_wire() for s in pg.slots]}
                        for pg in layout.pool_groups],
        "formats": [[b.to_wire(), f.to_wire()] for b, f in layout.formats],
    }
    return blake3.blake3(msgpack.packb(canon, use_bin_type=True)).digest()
