"""BlockPlan: a transfer plan stored per block pair, one run template plus the block pairs' slot ids.

KV plans repeat one pattern per block: every block pair (source slot, destination slot) moves the same
runs, at the same offsets inside its slots. A BlockPlan keeps that pattern once (``T`` template runs:
per side a slot stride and an offset, one length, one region) and the ``B`` slot pairs, so it is
``O(B + T)`` in size, where the ``TransferPlan`` it stands for has ``B x T`` entries. Run ``(b, t)`` moves
``nbytes[t]`` bytes from ``src_slots[b] * src_step[t] + src_offset[t]`` to
``dst_slots[b] * dst_step[t] + dst_offset[t]``; ``expand`` lists them block by block. Its checks
(``validate``) cost ``O(B + T)`` too, so a device backend can post a 131,072-run TP plan without touching
131,072 entries on the host.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError
from kvxfer.memory_region import MemoryRegion
from kvxfer.pagetable import wire
from kvxfer.pagetable.plan import TransferPlan, regions_disjoint
from kvxfer.pagetable.table import PageTable

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]

BLOCKS_MAGIC = b"KVBB"
TEMPLATE_MAGIC = b"KVBT"
_BLOCK_COLUMNS: tuple[tuple[str, np.dtype[np.generic]], ...] = (
    ("src_slots", np.dtype(np.uint64)), ("dst_slots", np.dtype(np.uint64)))
_TEMPLATE_COLUMNS: tuple[tuple[str, np.dtype[np.generic]], ...] = (
    ("src_step", np.dtype(np.uint64)), ("src_offset", np.dtype(np.uint64)), ("dst_step", np.dtype(np.uint64)),
    ("dst_offset", np.dtype(np.uint64)), ("nbytes", np.dtype(np.uint64)), ("src_region", np.dtype(np.uint32)),
    ("dst_region", np.dtype(np.uint32)))
_LENGTH = struct.Struct("<Q")
#: Every address a BlockPlan can name stays below this (checked at construction), so its arithmetic in
#: uint64 never wraps.
_ADDRESS_LIMIT = 1 << 63


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Run ``(b, t)``: ``nbytes[t]`` bytes from ``src_slots[b] * src_step[t] + src_offset[t]`` (region
    ``src_region[t]``) to ``dst_slots[b] * dst_step[t] + dst_offset[t]`` (region ``dst_region[t]``)."""

    src_slots: U64
    dst_slots: U64
    src_step: U64
    src_offset: U64
    dst_step: U64
    dst_offset: U64
    nbytes: U64
    src_region: U32
    dst_region: U32

    def __post_init__(self) -> None:
        # Own copies (O(B + T)), made read-only: the checks hold for the arrays as they were checked.
        blocks = [np.array(getattr(self, n), dtype=np.uint64) for n, _ in _BLOCK_COLUMNS]
        template = [np.array(getattr(self, n), dtype=dt) for n, dt in _TEMPLATE_COLUMNS]
        if any(a.ndim != 1 for a in blocks + template) or blocks[0].size != blocks[1].size:
            raise PageTableError(f"BlockPlan: slot arrays must be 1-D of equal length, got "
                                 f"{[a.shape for a in blocks]}")
        if len({a.size for a in template}) != 1:
            raise PageTableError(f"BlockPlan: template arrays must be 1-D of equal length, got "
                                 f"{[a.shape for a in template]}")
        for a in blocks + template:
            a.flags.writeable = False
        for name, a in zip((n for n, _ in _BLOCK_COLUMNS + _TEMPLATE_COLUMNS), blocks + template, strict=True):
            object.__setattr__(self, name, a)
        if blocks[0].size and template[0].size:
            for side in ("src", "dst"):
                slots, step, offset = (getattr(self, f"{side}_{n}") for n in ("slots", "step", "offset"))
                top = float(slots.max()) * float(step.max()) + float(offset.max()) + float(self.nbytes.max())
                if top >= _ADDRESS_LIMIT:
                    raise PageTableError(f"BlockPlan {side}: slot {int(slots.max())} x step {int(step.max())} + "
                                         f"offset {int(offset.max())} + {int(self.nbytes.max())} bytes passes "
                                         f"2**63 (addresses overflow)")

    @property
    def num_blocks(self) -> int:
        """Block pairs (``B``)."""
        return int(self.src_slots.size)

    @property
    def runs_per_block(self) -> int:
        """Template runs (``T``)."""
        return int(self.nbytes.size)

    def __len__(self) -> int:
        return self.num_blocks * self.runs_per_block

    def __repr__(self) -> str:
        return f"BlockPlan({self.num_blocks} blocks x {self.runs_per_block} runs, {self.total_bytes} bytes)"

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return self.num_blocks * int(self.nbytes.sum(dtype=np.uint64))

    def shift_regions(self, src: int, dst: int) -> BlockPlan:
        """The same runs with region ids ``+ src`` / ``+ dst`` (a layout's regions registered after others)."""
        return BlockPlan(self.src_slots, self.dst_slots, self.src_step, self.src_offset, self.dst_step,
                         self.dst_offset, self.nbytes, self.src_region + np.uint32(src),
                         self.dst_region + np.uint32(dst))

    def expand(self) -> TransferPlan:
        """The equivalent TransferPlan: ``B x T`` entries, block by block, template order inside a block."""
        src = (self.src_slots[:, None] * self.src_step[None, :] + self.src_offset[None, :]).ravel()
        dst = (self.dst_slots[:, None] * self.dst_step[None, :] + self.dst_offset[None, :]).ravel()
        b = self.num_blocks
        nbytes = np.tile(self.nbytes, b)
        return TransferPlan(PageTable(src, nbytes, np.tile(self.src_region, b)),
                            PageTable(dst, nbytes, np.tile(self.dst_region, b)))

    # --- checks ---------------------------------------------------------------------------------
    def validate(self, src_regions: Sequence[MemoryRegion], dst_regions: Sequence[MemoryRegion]) -> None:
        """Raise PageTableError when a run lies outside its registered region on either side, or when two
        destination runs overlap: the same contract as ``TransferPlan.validate``, in ``O(B + T)`` when the
        destination's shape shows that no two runs meet (``_disjoint_by_shape``), else through ``expand``."""
        if not len(self):
            return
        for side, regions in (("source", src_regions), ("destination", dst_regions)):
            self._check_bounds(side, regions)
        if not self._disjoint_by_shape(dst_regions):
            self.expand().validate(src_regions, dst_regions)

    def _check_bounds(self, side: str, regions: Sequence[MemoryRegion]) -> None:
        """Every run of one side inside its region: per template run, the lowest and the highest slot."""
        key = "src" if side == "source" else "dst"
        slots, step, offset = (getattr(self, f"{key}_{n}") for n in ("slots", "step", "offset"))
        region = getattr(self, f"{key}_region")
        if int(region.max()) >= len(regions):
            t = int(np.argmax(region >= len(regions)))
            raise PageTableError(f"BlockPlan {side} template run {t}: region {int(region[t])} not registered "
                                 f"({len(regions)} regions)")
        lo_slot, hi_slot = np.uint64(slots.min()), np.uint64(slots.max())
        lo = lo_slot * step + offset                 # no wrap: construction bounds every address by 2**63
        hi = hi_slot * step + offset + self.nbytes
        base = np.array([r.base_address for r in regions], dtype=np.uint64)[region]
        end = np.array([r.end_address for r in regions], dtype=np.uint64)[region]
        bad = (lo < base) | (hi > end)
        if bad.any():
            t = int(np.argmax(bad))
            low = bool(lo[t] < base[t])
            b = int(np.argmin(slots) if low else np.argmax(slots))
            addr = int(slots[b]) * int(step[t]) + int(offset[t])
            r = regions[int(region[t])]
            raise PageTableError(
                f"BlockPlan {side} run (block {b}, template run {t}): [{addr:#x}, +{int(self.nbytes[t])}) lies "
                f"outside region {int(region[t])} [{r.base_address:#x}, {r.end_address:#x})")

    def _disjoint_by_shape(self, regions: Sequence[MemoryRegion]) -> bool:
        """True when no two destination runs can meet: the destination slots are distinct, the regions
        the template writes share no byte, and inside each region the template's runs share one step,
        do not overlap each other and span at most that step (so different slots' copies of them are
        apart). False means "not shown" (the caller checks the expanded plan)."""
        slots = self.dst_slots
        if slots.size > 1:
            ordered = np.sort(slots)
            if bool((ordered[1:] == ordered[:-1]).any()):
                return False
        used = np.unique(self.dst_region)
        if used.size > 1 and not regions_disjoint([regions[int(r)] for r in used]):
            return False
        keep = self.nbytes > 0
        for r in used.tolist():
            inside = np.flatnonzero(keep & (self.dst_region == r))
            if not inside.size:
                continue
            step = self.dst_step[inside]
            # Block 0's own addresses: with one step they are the offsets shifted alike for every block; with
            # several (allowed for one block only) the offsets alone would not show a clash.
            first = self.dst_offset[inside] + np.uint64(slots[0]) * step
            order = np.argsort(first, kind="stable")
            start = first[order]
            stop = start + self.nbytes[inside][order]
            if start.size > 1 and bool((start[1:] < np.maximum.accumulate(stop)[:-1]).any()):
                return False
            if slots.size > 1 and (int(step.min()) != int(step.max()) or int(stop.max()) - int(start[0]) > int(step.max())):
                return False
        return True

    # --- wire format ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The slot pairs, then the template: two versioned wire messages, the first one's length first."""
        blocks = wire.encode(BLOCKS_MAGIC, [(n, dt, getattr(self, n)) for n, dt in _BLOCK_COLUMNS], {})
        template = wire.encode(TEMPLATE_MAGIC, [(n, dt, getattr(self, n)) for n, dt in _TEMPLATE_COLUMNS], {})
        return _LENGTH.pack(len(blocks)) + blocks + template

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> BlockPlan:
        """Decode ``to_bytes`` output; malformed or hostile input raises PageTableError only."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise PageTableError(f"BlockPlan.from_bytes: expected bytes, got {type(data).__name__}")
        buf = memoryview(data).cast("B")
        if len(buf) < _LENGTH.size:
            raise PageTableError(f"BlockPlan.from_bytes: truncated ({len(buf)} bytes, the length prefix is 8)")
        (first,) = _LENGTH.unpack_from(buf, 0)
        if first > len(buf) - _LENGTH.size:
            raise PageTableError(f"BlockPlan.from_bytes: the slot message claims {first} bytes, "
                                 f"{len(buf) - _LENGTH.size} follow")
        blocks, named_b = wire.decode(buf[_LENGTH.size:_LENGTH.size + first], BLOCKS_MAGIC, "BlockPlan", _BLOCK_COLUMNS)
        template, named_t = wire.decode(buf[_LENGTH.size + first:], TEMPLATE_MAGIC, "BlockPlan", _TEMPLATE_COLUMNS)
        if named_b or named_t:
            raise PageTableError(f"BlockPlan.from_bytes: unexpected named columns {sorted(named_b) + sorted(named_t)}")
        def u64(c: wire.Column) -> U64:
            return np.asarray(c, np.uint64)

        def u32(c: wire.Column) -> U32:
            return np.asarray(c, np.uint32)
        return cls(u64(blocks["src_slots"]), u64(blocks["dst_slots"]), u64(template["src_step"]),
                   u64(template["src_offset"]), u64(template["dst_step"]), u64(template["dst_offset"]),
                   u64(template["nbytes"]), u32(template["src_region"]), u32(template["dst_region"]))
