"""Published layout descriptors: frozen, hashable, versioned, with a msgspec schema for msgpack and JSON.

These are the only view other stages get of the cache manager's memory (docs/architecture.md,
"Decisions"). Every decoder checks types and invariants, because descriptors arrive from peers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import blake3
import msgspec

from kvxfer.cache.dtypes import dtype_name, itemsize
from kvxfer.errors import ConfigError, DecodeError, LayoutError

LAYOUT_VERSION = 2
MEMORY_KINDS = ("cpu", "cuda", "pinned", "disk")
_MAX_U64 = (1 << 64) - 1


# --- descriptors -----------------------------------------------------------------------------------
def _check_int(value: Any, where: str, lo: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise LayoutError(f"{where} must be an int >= {lo}, got {value!r}")


class _BufferIdFields(NamedTuple):
    layer_id: int
    role: str


class BufferId(_BufferIdFields):
    """The bytes of one (layer, role) for one block: a ``(layer_id, role)`` tuple, as in the
    reference design (iterable, hashable and equal to the plain tuple)."""

    __slots__ = ()

    def __new__(cls, layer_id: int, role: str) -> BufferId:
        _check_int(layer_id, "BufferId.layer_id")
        if not isinstance(role, str) or not role:
            raise LayoutError(f"BufferId.role must be a non-empty string, got {role!r}")
        return super().__new__(cls, layer_id, role)




@dataclass(frozen=True)
class BufferFormat:
    """How the bytes of one buffer map to (head, token, element).

    HND: [num_heads][tokens_per_block][head_dim] (a head slice is contiguous); NHD: [tokens][heads][dim].
    ``head_start``/``num_heads`` are the global head range this rank holds out of ``total_heads``.
    ``tokens_per_block`` is the buffer's own page size: the layout's, or a divisor of it for an
    expanded buffer (``ExpandedBuffer``), whose slot then holds ``expansion`` such pages back to back.
    ``block_bytes`` > 0 makes the buffer opaque: a page is that many bytes with no (head, token)
    structure (one nominal head of one element); slots hold it, nothing maps its bytes to tokens.
    """

    dtype: str
    head_dim: int
    tokens_per_block: int
    head_start: int
    num_heads: int
    total_heads: int
    order: Literal["HND", "NHD"] = "HND"
    block_bytes: int = 0

    def __post_init__(self) -> None:
        _check_int(self.block_bytes, "BufferFormat.block_bytes")
        if self.block_bytes and (self.num_heads, self.total_heads, self.head_start) != (1, 1, 0):
            raise LayoutError(f"BufferFormat: an opaque buffer (block_bytes={self.block_bytes}) has one nominal "
                              f"head, got heads [{self.head_start}, {self.head_start + self.num_heads}) of "
                              f"{self.total_heads}")
        try:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        except ConfigError as exc:
            raise LayoutError(f"BufferFormat.dtype: {exc}") from exc
        for name in ("head_dim", "tokens_per_block", "num_heads", "total_heads"):
            _check_int(getattr(self, name), f"BufferFormat.{name}", 1)
        _check_int(self.head_start, "BufferFormat.head_start")
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
    def opaque(self) -> bool:
        """Whether the buffer's bytes have no (head, token) structure (``block_bytes``)."""
        return self.block_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes of one page of this buffer (``tokens_per_block`` tokens of one layer and role)."""
        if self.block_bytes:
            return self.block_bytes
        return self.num_heads * self.tokens_per_block * self.head_dim * self.itemsize




@dataclass(frozen=True)
class CoalescedBuffer:
    """Equal-size buffers of several (layer, role) of one layer group, back to back in one pool's slot:
    buffer ``i`` sits at byte ``i * single_buffer_size``."""

    single_buffer_size: int
    buffer_ids: tuple[BufferId, ...]

    def __post_init__(self) -> None:
        _check_int(self.single_buffer_size, "CoalescedBuffer.single_buffer_size", 1)
        ids = tuple(self.buffer_ids)
        if not ids:
            raise LayoutError("CoalescedBuffer.buffer_ids must not be empty")
        if not all(isinstance(b, BufferId) for b in ids):
            raise LayoutError(f"CoalescedBuffer.buffer_ids must be BufferIds, got {ids!r:.120}")
        if len(set(ids)) != len(ids):
            raise LayoutError(f"CoalescedBuffer.buffer_ids has duplicates: {ids}")
        object.__setattr__(self, "buffer_ids", ids)

    @property
    def size(self) -> int:
        """Bytes of the whole coalesced buffer: the slot size of its pool."""
        return self.single_buffer_size * len(self.buffer_ids)

    @property
    def num_buffers(self) -> int:
        """How many (layer, role) buffers it holds."""
        return len(self.buffer_ids)




@dataclass(frozen=True)
class ExpandedBuffer:
    """A buffer and its expansion factor (the reference design's meaning): the layout's
    tokens_per_block divided by the buffer's own, i.e. how many of the buffer's pages one slot holds."""

    id: BufferId
    expansion: int

    def __post_init__(self) -> None:
        if not isinstance(self.id, BufferId):
            raise LayoutError(f"ExpandedBuffer.id must be a BufferId, got {self.id!r}")
        _check_int(self.expansion, "ExpandedBuffer.expansion", 1)


@dataclass(frozen=True)
class BufferSpan:
    """kvxfer's per-buffer view of a slot: where one buffer's bytes lie inside its pool's slot."""

    buffer_id: BufferId
    layer_group_id: int
    pool_index: int
    offset: int
    size: int


@dataclass(frozen=True)
class AggregatedPageDesc:
    """Consecutive buffers of one layer group in one pool: page ``i`` of them is the byte range
    ``base + stride * i + [0, size)`` (``i`` a slot id of the layer group)."""

    base: int
    size: int
    stride: int
    layer_group_id: int
    buffers: tuple[ExpandedBuffer, ...]


@dataclass(frozen=True)
class SlotDescVariant:
    """One layer group's composition of a pool group's slot: one coalesced buffer per pool (pool ``i``
    holds ``coalesced_buffers[i]``), sorted by size, largest first."""

    layer_group_id: int
    coalesced_buffers: tuple[CoalescedBuffer, ...]

    def __post_init__(self) -> None:
        _check_int(self.layer_group_id, "SlotDescVariant.layer_group_id")
        cbs = tuple(self.coalesced_buffers)
        where = f"SlotDescVariant(layer group {self.layer_group_id})"
        if not cbs or not all(isinstance(c, CoalescedBuffer) for c in cbs):
            raise LayoutError(f"{where}: coalesced_buffers must be a non-empty list of CoalescedBuffer")
        sizes = [c.size for c in cbs]
        if sizes != sorted(sizes, reverse=True):
            raise LayoutError(f"{where}: coalesced_buffers must be sorted by size, largest first, got sizes {sizes}")
        ids = [b for c in cbs for b in c.buffer_ids]
        if len(set(ids)) != len(ids):
            raise LayoutError(f"{where}: a buffer appears in two coalesced buffers")
        object.__setattr__(self, "coalesced_buffers", cbs)

    @property
    def slot_size_list(self) -> tuple[int, ...]:
        """The slot size of each pool (bytes)."""
        return tuple(c.size for c in self.coalesced_buffers)

    def buffer_spans(self) -> tuple[BufferSpan, ...]:
        """Every buffer's pool, offset and size, pool by pool in offset order."""
        return tuple(BufferSpan(b, self.layer_group_id, p, i * c.single_buffer_size, c.single_buffer_size)
                     for p, c in enumerate(self.coalesced_buffers) for i, b in enumerate(c.buffer_ids))




@dataclass(frozen=True)
class SlotDesc:
    """The slot of a pool group: one variant per layer group sharing it. Variants may differ in buffer
    sizes and counts; their ``slot_size_list`` must match."""

    variants: tuple[SlotDescVariant, ...]

    def __post_init__(self) -> None:
        variants = tuple(self.variants)
        if not variants or not all(isinstance(v, SlotDescVariant) for v in variants):
            raise LayoutError("SlotDesc.variants must be a non-empty list of SlotDescVariant")
        groups = [v.layer_group_id for v in variants]
        if len(set(groups)) != len(groups):
            raise LayoutError(f"SlotDesc.variants name a layer group twice: {groups}")
        first = variants[0].slot_size_list
        for v in variants[1:]:
            if v.slot_size_list != first:
                raise LayoutError(f"SlotDesc: layer group {v.layer_group_id} has slot sizes {list(v.slot_size_list)}, "
                                  f"layer group {variants[0].layer_group_id} has {list(first)}")
        object.__setattr__(self, "variants", variants)

    @property
    def slot_size_list(self) -> tuple[int, ...]:
        """The slot size of each pool (bytes), shared by every variant."""
        return self.variants[0].slot_size_list

    @property
    def layer_group_ids(self) -> tuple[int, ...]:
        """The layer groups whose slots these are, in variant order."""
        return tuple(v.layer_group_id for v in self.variants)

    def variant_of(self, layer_group_id: int) -> SlotDescVariant:
        """The variant of one layer group."""
        for v in self.variants:
            if v.layer_group_id == layer_group_id:
                return v
        raise LayoutError(f"no variant for layer group {layer_group_id} (have {list(self.layer_group_ids)})")




@dataclass(frozen=True)
class PoolDesc:
    """One contiguous memory region: slot ``i`` lives at ``base_address + i * slot_bytes``."""

    pool_index: int
    base_address: int
    slot_bytes: int
    #: kvxfer's additions (the reference's PoolDesc has the three fields above): the pool's slot count
    #: (0: not published) and where its memory is (the reference's pools are always device memory).
    num_slots: int = 0
    memory_kind: str = "cuda"
    device_id: int = 0

    def __post_init__(self) -> None:
        for name in ("pool_index", "base_address", "slot_bytes", "num_slots", "device_id"):
            _check_int(getattr(self, name), f"PoolDesc.{name}")
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




@dataclass(frozen=True)
class PoolGroupDesc:
    """Pools whose slots are allocated together: one slot id (block id) indexes every pool; pool ``i``
    has slots of ``slot_desc.slot_size_list[i]`` bytes."""

    pool_group_index: int
    num_slots: int
    slot_desc: SlotDesc
    pools: tuple[PoolDesc, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        where = f"PoolGroupDesc {self.pool_group_index}"
        _check_int(self.num_slots, f"{where}: num_slots")
        if not isinstance(self.slot_desc, SlotDesc):
            raise LayoutError(f"{where}: slot_desc must be a SlotDesc, got {type(self.slot_desc).__name__}")
        sizes = self.slot_desc.slot_size_list
        if len(self.pools) != len(sizes):
            raise LayoutError(f"{where}: {len(self.pools)} pools for {len(sizes)} slot sizes {list(sizes)}")
        for i, pool in enumerate(self.pools):
            if pool.pool_index != i:
                raise LayoutError(f"{where}: pools[{i}].pool_index is {pool.pool_index}")
            if pool.slot_bytes != sizes[i]:
                raise LayoutError(f"{where}: pools[{i}].slot_bytes={pool.slot_bytes} != slot_size_list[{i}]={sizes[i]}")
            if pool.num_slots != self.num_slots:
                raise LayoutError(f"{where}: pools[{i}].num_slots={pool.num_slots} != num_slots={self.num_slots}")

    @property
    def layer_group_ids(self) -> tuple[int, ...]:
        """The layer groups sharing this pool group (one slot-desc variant each)."""
        return self.slot_desc.layer_group_ids




@dataclass(frozen=True)
class LayerGroupDesc:
    """Layers with the same attention window; a request holds one block-id list per layer group.

    ``recurrent``: the group's layers are recurrent (SSM) layers, whose state is one slot per request
    (its block-id list has one entry, whatever the request's length) rather than one page per block.
    """

    layer_group_id: int
    layer_ids: tuple[int, ...]
    window: int | None
    sink_tokens: int
    pool_group_index: int
    recurrent: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise LayoutError(f"LayerGroupDesc {self.layer_group_id}: layer_ids must be non-empty and distinct")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window <= 0):
            raise LayoutError(f"LayerGroupDesc {self.layer_group_id}: window must be None or > 0, got {self.window!r}")
        if not isinstance(self.recurrent, bool):
            raise LayoutError(f"LayerGroupDesc {self.layer_group_id}: recurrent must be a bool, got {self.recurrent!r}")
        if self.recurrent and (self.window is not None or self.sink_tokens):
            raise LayoutError(f"LayerGroupDesc {self.layer_group_id}: a recurrent layer group has no window or sinks")


@dataclass(frozen=True)
class CacheLayoutDesc:
    """The whole published layout of one cache (one tensor-parallel rank), allocated by kvxfer's
    manager or owned by an engine (``kvxfer.cache.engine_layouts``).

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
        _check_int(self.tokens_per_block, "CacheLayoutDesc.tokens_per_block", 1)
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
        for j, pg in enumerate(self.pool_groups):
            if pg.pool_group_index != j:
                raise LayoutError(f"CacheLayoutDesc.pool_groups[{j}].pool_group_index is {pg.pool_group_index}")
        placed: dict[int, int] = {}
        for pg in self.pool_groups:
            for g in pg.layer_group_ids:
                if g in placed:
                    raise LayoutError(f"layer group {g} has variants in pool groups {placed[g]} and "
                                      f"{pg.pool_group_index}")
                placed[g] = pg.pool_group_index
        layer_of_group: dict[int, int] = {}
        for i, lg in enumerate(self.layer_groups):
            if lg.layer_group_id != i:
                raise LayoutError(f"CacheLayoutDesc.layer_groups[{i}].layer_group_id is {lg.layer_group_id}")
            if placed.get(i) != lg.pool_group_index:
                raise LayoutError(f"LayerGroupDesc {i}: pool_group_index {lg.pool_group_index}, but its slot variant "
                                  f"is in pool group {placed.get(i)}")
            for lid in lg.layer_ids:
                if lid in layer_of_group:
                    raise LayoutError(f"layer {lid} is in layer groups {layer_of_group[lid]} and {i}")
                layer_of_group[lid] = i
        if len(placed) != len(self.layer_groups):
            raise LayoutError(f"pool groups name layer groups {sorted(set(placed) - set(range(len(self.layer_groups))))} "
                              f"that do not exist")
        seen: set[BufferId] = set()
        tpb = self.tokens_per_block
        for pg in self.pool_groups:
            for variant in pg.slot_desc.variants:
                group = variant.layer_group_id
                for p, cb in enumerate(variant.coalesced_buffers):
                    for bid in cb.buffer_ids:
                        where = f"pool group {pg.pool_group_index} layer group {group} pool {p}: buffer {bid}"
                        if layer_of_group.get(bid.layer_id) != group:
                            raise LayoutError(f"{where} is not in layer group {group}")
                        if bid in seen:
                            raise LayoutError(f"buffer {bid} appears twice in the layout")
                        seen.add(bid)
                        if bid not in fmt:
                            raise LayoutError(f"buffer {bid} has no BufferFormat")
                        f = fmt[bid]
                        if tpb % f.tokens_per_block:
                            raise LayoutError(f"{where}: tokens_per_block {f.tokens_per_block} does not divide the "
                                              f"layout's {tpb}")
                        need = f.nbytes * (tpb // f.tokens_per_block)
                        if need != cb.single_buffer_size:
                            raise LayoutError(f"{where}: its format needs {need} bytes per slot, the coalesced buffer "
                                              f"says {cb.single_buffer_size}")
        _check_no_overlap(self.pool_groups)
        if seen != set(fmt):
            raise LayoutError(f"formats name buffers no slot holds: {sorted(set(fmt) - seen)[:4]}")

    # --- queries --------------------------------------------------------------------------------
    def format_of(self, buffer_id: BufferId) -> BufferFormat:
        """The BufferFormat of a buffer."""
        fmt = self._formats_by_id.get(buffer_id)
        if fmt is None:
            raise LayoutError(f"no buffer {buffer_id} in this layout")
        return fmt

    @cached_property
    def _formats_by_id(self) -> dict[BufferId, BufferFormat]:
        return dict(self.formats)

    def expansion_of(self, buffer_id: BufferId) -> int:
        """How many of the buffer's own pages one slot holds (1 unless its tokens_per_block is smaller)."""
        return self.tokens_per_block // self.format_of(buffer_id).tokens_per_block

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

    def buffer_spans(self) -> dict[BufferId, tuple[PoolGroupDesc, PoolDesc, BufferSpan]]:
        """Every buffer's pool group, pool and span inside the slot."""
        return {s.buffer_id: (pg, pg.pools[s.pool_index], s)
                for pg in self.pool_groups for v in pg.slot_desc.variants for s in v.buffer_spans()}

    @cached_property
    def _located(self) -> dict[BufferId, tuple[PoolGroupDesc, PoolDesc, BufferSpan]]:
        # The layout is immutable, so the index is built once: engines ask for addresses per layer per step.
        return self.buffer_spans()

    def locate(self, buffer_id: BufferId) -> tuple[PoolGroupDesc, PoolDesc, BufferSpan]:
        """(pool group, pool, span) where ``buffer_id`` lives."""
        found = self._located.get(buffer_id)
        if found is None:
            raise LayoutError(f"no buffer {buffer_id} in this layout")
        return found

    def aggregated_pages(self, buffers: Iterable[BufferId]) -> tuple[AggregatedPageDesc, ...]:
        """The reference design's aggregated pages of ``buffers``: one descriptor per run of consecutive
        requested buffers of one coalesced buffer (layer group, pool), in layout order."""
        wanted = set(buffers)
        unknown = wanted - {b for b, _ in self.formats}
        if unknown:
            raise LayoutError(f"no buffers {sorted(unknown)[:4]} in this layout")
        out: list[AggregatedPageDesc] = []
        for pg in self.pool_groups:
            for v in pg.slot_desc.variants:
                for pool, cb in zip(pg.pools, v.coalesced_buffers, strict=True):
                    run: list[int] = []
                    for i, bid in enumerate([*cb.buffer_ids, None]):
                        if bid is not None and bid in wanted:
                            run.append(i)
                            continue
                        if run:
                            out.append(AggregatedPageDesc(
                                pool.base_address + run[0] * cb.single_buffer_size, len(run) * cb.single_buffer_size,
                                pool.slot_bytes, v.layer_group_id,
                                tuple(ExpandedBuffer(cb.buffer_ids[k], self.expansion_of(cb.buffer_ids[k]))
                                      for k in run)))
                            run = []
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The wire dictionary (JSON- and msgpack-ready, named fields only; ``CacheLayoutWire``'s shape)."""
        d: dict[str, Any] = plain(self)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> CacheLayoutDesc:
        """Decode and validate a wire dictionary; raises DecodeError naming the bad field."""
        return decode_layout(lambda: msgspec.convert(d, CacheLayoutWire))

    def to_msgpack(self) -> bytes:
        """Compact binary encoding for the control plane."""
        return _ENCODER.encode(self.to_dict())

    @classmethod
    def from_msgpack(cls, data: bytes, max_bytes: int = 16 << 20) -> CacheLayoutDesc:
        """Decode a msgpack encoding under the schema's bounds; hostile input raises DecodeError."""
        if not isinstance(data, bytes | bytearray | memoryview) or len(data) > max_bytes:
            raise DecodeError(f"CacheLayoutDesc: expected <= {max_bytes} bytes of msgpack")
        return decode_layout(lambda: _MSGPACK_DECODER.decode(data))

    def to_json(self, indent: int | None = 2) -> str:
        """Human-readable encoding with named fields (``kvxfer inspect --json``)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> CacheLayoutDesc:
        return decode_layout(lambda: _JSON_DECODER.decode(text))


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
        "layer_groups": plain(layout.layer_groups),
        "slot_descs": [plain(pg.slot_desc) for pg in layout.pool_groups],
        "formats": [[plain(b), plain(f)] for b, f in layout.formats],
    }
    return blake3.blake3(_ENCODER.encode(canon)).digest()


# --- wire form: one msgspec schema, bounded field by field ------------------------------------------
# The descriptors above are the in-memory API (frozen dataclasses whose ``__post_init__`` holds the
# invariants); their wire form is the schema below, named fields only (JSON- and msgpack-ready). One
# decoder per encoding reads bytes into it under every bound, then ``build`` makes the descriptors,
# which check the invariants; ``plain`` writes any descriptor in the same shape.
U16 = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Address = Annotated[int, msgspec.Meta(ge=0)]   # msgpack holds at most 2**64 - 1; PoolDesc checks the end
Name = Annotated[str, msgspec.Meta(max_length=64)]


class _Wire(msgspec.Struct, frozen=True):
    """A descriptor's wire record: ``build`` makes the descriptor ``target`` from its fields."""

    target: ClassVar[Callable[..., Any]]

    def build(self) -> Any:
        return self.target(**{f: _built(getattr(self, f)) for f in self.__struct_fields__})


def _built(value: Any) -> Any:
    if isinstance(value, _Wire):
        return value.build()
    if isinstance(value, tuple):
        return tuple(_built(v) for v in value)
    return value


class BufferIdWire(_Wire, frozen=True):
    target = BufferId
    layer_id: Small
    role: Name


class BufferFormatWire(_Wire, frozen=True):
    target = BufferFormat
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    head_dim: Positive
    tokens_per_block: Positive
    head_start: Small
    num_heads: Positive
    total_heads: Positive
    order: Annotated[str, msgspec.Meta(max_length=8)]
    block_bytes: Count = 0


class CoalescedBufferWire(_Wire, frozen=True):
    target = CoalescedBuffer
    single_buffer_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
    buffer_ids: Annotated[tuple[BufferIdWire, ...], msgspec.Meta(max_length=1 << 16)]


class SlotDescVariantWire(_Wire, frozen=True):
    target = SlotDescVariant
    layer_group_id: Small
    coalesced_buffers: Annotated[tuple[CoalescedBufferWire, ...], msgspec.Meta(max_length=1 << 12)]


class SlotDescWire(_Wire, frozen=True):
    target = SlotDesc
    variants: Annotated[tuple[SlotDescVariantWire, ...], msgspec.Meta(max_length=1 << 12)]


class PoolDescWire(_Wire, frozen=True):
    target = PoolDesc
    pool_index: Small
    base_address: Address
    slot_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 44)]
    num_slots: Count
    memory_kind: Annotated[str, msgspec.Meta(max_length=16)]
    device_id: U16


class PoolGroupDescWire(_Wire, frozen=True):
    target = PoolGroupDesc
    pool_group_index: Small
    num_slots: Count
    slot_desc: SlotDescWire
    pools: Annotated[tuple[PoolDescWire, ...], msgspec.Meta(max_length=1 << 12)]


class LayerGroupDescWire(_Wire, frozen=True):
    target = LayerGroupDesc
    layer_group_id: Small
    layer_ids: Annotated[tuple[Small, ...], msgspec.Meta(max_length=1 << 16)]
    window: Annotated[int, msgspec.Meta(ge=1)] | None
    sink_tokens: Count
    pool_group_index: Small
    recurrent: bool = False


class FormatWire(msgspec.Struct, frozen=True):
    """One entry of ``CacheLayoutDesc.formats``: a buffer and its format, by name."""

    buffer_id: BufferIdWire
    format: BufferFormatWire

    def build(self) -> tuple[BufferId, BufferFormat]:
        return self.buffer_id.build(), self.format.build()


class CacheLayoutWire(msgspec.Struct, frozen=True):
    """The wire form of a ``CacheLayoutDesc`` (its fingerprint as hex)."""

    version: U16
    tokens_per_block: Positive
    layer_groups: Annotated[tuple[LayerGroupDescWire, ...], msgspec.Meta(max_length=1 << 12)]
    pool_groups: Annotated[tuple[PoolGroupDescWire, ...], msgspec.Meta(max_length=1 << 12)]
    formats: Annotated[tuple[FormatWire, ...], msgspec.Meta(max_length=1 << 18)]
    fingerprint: Annotated[str, msgspec.Meta(max_length=128, pattern="^([0-9a-f]{2})*$")]

    def build(self) -> CacheLayoutDesc:
        if self.version != LAYOUT_VERSION:
            raise DecodeError(f"CacheLayoutDesc.version {self.version} is not supported (expected {LAYOUT_VERSION})")
        return CacheLayoutDesc(self.version, self.tokens_per_block, _built(self.layer_groups), _built(self.pool_groups),
                               tuple(f.build() for f in self.formats), bytes.fromhex(self.fingerprint))


_MSGPACK_DECODER = msgspec.msgpack.Decoder(CacheLayoutWire)
_JSON_DECODER = msgspec.json.Decoder(CacheLayoutWire)
_ENCODER = msgspec.msgpack.Encoder()


def decode_layout(read: Callable[[], CacheLayoutWire]) -> CacheLayoutDesc:
    """The layout ``read`` decodes (one of the decoders above, or ``msgspec.convert``), built and checked;
    DecodeError naming the field for anything malformed, out of bounds or inconsistent."""
    try:
        wire = read()
    except msgspec.ValidationError as exc:
        raise DecodeError(f"CacheLayoutDesc: {exc}") from exc
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, MemoryError) as exc:
        raise DecodeError(f"CacheLayoutDesc: malformed encoding: {exc}") from exc
    try:
        return wire.build()
    except (LayoutError, ConfigError, TypeError, ValueError) as exc:
        raise DecodeError(f"CacheLayoutDesc: {exc}") from exc


def plain(value: Any) -> Any:
    """A descriptor (or a tuple of them) in its wire shape: named fields, lists, hex fingerprint."""
    if isinstance(value, BufferId):
        return {"layer_id": value.layer_id, "role": value.role}
    if isinstance(value, CacheLayoutDesc):
        return {"version": value.version, "tokens_per_block": value.tokens_per_block,
                "layer_groups": plain(value.layer_groups), "pool_groups": plain(value.pool_groups),
                "formats": [{"buffer_id": plain(b), "format": plain(f)} for b, f in value.formats],
                "fingerprint": value.fingerprint.hex()}
    if isinstance(value, BufferFormat) and not value.block_bytes:
        # ``block_bytes`` only when set: structured formats keep their wire form and fingerprint
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "block_bytes"}
    if isinstance(value, LayerGroupDesc) and not value.recurrent:
        # ``recurrent`` only when set: attention-only layouts keep their wire form and fingerprint
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "recurrent"}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value
