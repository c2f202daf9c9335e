"""The reference design's vocabulary (TensorRT-LLM KVCacheManagerV2): typed index spaces, constants,
enums, half-open ranges, sliding-window life cycles and page-index conversion, shared by the manager,
its kv caches and the layout descriptors."""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, NewType, TypeAlias, TypeVar

from kvxfer.errors import ConfigError, IndexMathError

T = TypeVar("T")
U = TypeVar("U")
Idx = TypeVar("Idx", bound=int)

# --- typed index spaces ---------------------------------------------------------------------------
#: Whether invariant self-checks are skipped (set ``KVXFER_DEBUG_MODE=1`` to run them).
NDEBUG: Final[int] = int(os.environ.get("KVXFER_DEBUG_MODE", "")[:1] != "1")

LayerId = NewType("LayerId", int)
LifeCycleId = NewType("LifeCycleId", int)
#: A layer group is one life cycle: the layers sharing a sliding-window shape.
LayerGroupId: TypeAlias = LifeCycleId
CacheLevel = NewType("CacheLevel", int)
TokenId = NewType("TokenId", int)
#: A token of a key sequence in the reference design: an id, or bytes standing for a multimodal item
#: (``kvxfer.cache.hashing`` keys them; the manager's caches take integer ids).
TokenIdExt: TypeAlias = TokenId | bytes
BeamIndex = NewType("BeamIndex", int)
MemAddress = NewType("MemAddress", int)
Priority = NewType("Priority", int)
PoolGroupIndex = NewType("PoolGroupIndex", int)
PoolIndex = NewType("PoolIndex", int)
SlotId = NewType("SlotId", int)
BlockOrdinal = NewType("BlockOrdinal", int)
CudaStream = NewType("CudaStream", int)
DataRole = NewType("DataRole", str)
SlidingWindowSize: TypeAlias = int | None

DEFAULT_BEAM_INDEX: Final[BeamIndex] = BeamIndex(0)
#: The page index of a block that has no page (out of a sliding window, or not allocated).
BAD_PAGE_INDEX: Final[int] = -1
GPU_LEVEL: Final[CacheLevel] = CacheLevel(0)
CACHE_LEVEL1: Final[CacheLevel] = CacheLevel(1)
PRIORITY_DEFAULT: Final[Priority] = Priority(35)


class CacheTier(enum.IntEnum):
    """The medium of a cache level."""

    GPU_MEM = 0
    HOST_MEM = 1
    DISK = 2


class PageStatus(enum.Enum):
    """A page's pin state: locked by an active request, held by a suspended one, or droppable (only
    the prefix tree has it)."""

    LOCKED = enum.auto()
    HELD = enum.auto()
    DROPPABLE = enum.auto()


class PageIndexMode(enum.IntEnum):
    """How page indices address a buffer: ``SHARED`` indices are the same for every buffer of a layer
    group and address from the buffer's own base; ``PER_LAYER`` indices include the buffer's sub-page
    within its slot and address from the pool's base (what scratch blocks need)."""

    SHARED = 0
    PER_LAYER = 1


# --- ranges and integer helpers ---------------------------------------------------------------------
class HalfOpenRange(tuple[Idx, Idx], Generic[Idx]):
    """``[beg, end)``; falsy and equal to every other empty range when ``beg >= end``; unpacks as a pair."""

    __slots__ = ()

    def __new__(cls, beg: Idx, end: Idx) -> HalfOpenRange[Idx]:
        return tuple.__new__(cls, (beg, end))

    @property
    def beg(self) -> Idx:
        """First index in the range."""
        return self[0]

    @property
    def end(self) -> Idx:
        """One past the last index in the range."""
        return self[1]

    def __bool__(self) -> bool:
        return self[0] < self[1]

    def __len__(self) -> int:
        return max(0, self[1] - self[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple) or len(tuple(other)) != 2:
            return NotImplemented
        mine_empty = not self
        theirs_empty = other[0] >= other[1]
        if mine_empty or theirs_empty:
            return mine_empty and theirs_empty
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((0, 0)) if not self else tuple.__hash__(self)

    def __contains__(self, item: object) -> bool:
        return isinstance(item, int) and self[0] <= item < self[1]

    def __repr__(self) -> str:
        return f"HalfOpenRange({self[0]}, {self[1]})"


def typed_range(*args: int) -> range:
    """``range(*args)``: iterates a typed index space (``LayerId``, ``BeamIndex``, ...)."""
    return range(*args)


def exact_div(x: int, y: int) -> int:
    """``x // y`` where ``y`` must divide ``x`` (IndexMathError otherwise)."""
    if y == 0 or x % y:
        raise IndexMathError(f"exact_div: {x} is not a multiple of {y}")
    return x // y


def div_up(x: int, y: int) -> int:
    """``ceil(x / y)`` for non-negative ints."""
    return -(-x // y)


def round_up(x: int, y: int) -> int:
    """The smallest multiple of ``y`` at least ``x``."""
    return div_up(x, y) * y


def value_or(opt: T | None, default: T) -> T:
    """``opt`` unless it is None."""
    return default if opt is None else opt


def overlap(a: tuple[int, int], b: tuple[int, int]) -> HalfOpenRange[int]:
    """The intersection of two ``(beg, end)`` ranges (falsy when they do not overlap)."""
    return HalfOpenRange(max(a[0], b[0]), min(a[1], b[1]))


intersect = overlap


def remove_if(original: MutableSequence[T], predicate: Callable[[T], bool]) -> list[T]:
    """Remove, in place and keeping order, the items matching ``predicate``; returns them."""
    removed = [item for item in original if predicate(item)]
    kept = [item for item in original if not predicate(item)]
    original[:] = kept
    return removed


def get_uniform_attribute(iterable: Iterable[T], attribute: Callable[[T], U]) -> U:
    """``attribute(x)`` of the items, which must all agree (ConfigError names the two values)."""
    items = list(iterable)
    if not items:
        raise ConfigError("get_uniform_attribute: no items")
    first = attribute(items[0])
    for item in items[1:]:
        value = attribute(item)
        if value != first:
            raise ConfigError(f"get_uniform_attribute: items disagree ({first!r} vs {value!r})")
    return first


# --- life cycles -------------------------------------------------------------------------------------
class AttnLifeCycle:
    """The attention life cycle of a layer group, keyed by its sliding window and sink tokens: which
    blocks a request still needs as its history grows."""

    __slots__ = ("_num_sink_blocks", "_window_size")

    def __init__(self, window_size: int | None, num_sink_blocks: int) -> None:
        self._window_size = window_size
        self._num_sink_blocks = num_sink_blocks

    @staticmethod
    def make(window_size: int | None, num_sink_tokens: int | None, tokens_per_block: int) -> AttnLifeCycle:
        """The life cycle of a window (None: full attention) keeping ``num_sink_tokens`` leading tokens."""
        if window_size is not None and window_size <= 0:
            raise ConfigError(f"AttnLifeCycle.make: window_size must be > 0 or None, got {window_size}")
        if tokens_per_block <= 0:
            raise ConfigError(f"AttnLifeCycle.make: tokens_per_block must be > 0, got {tokens_per_block}")
        sinks = 0 if window_size is None else math.ceil((num_sink_tokens or 0) / tokens_per_block)
        return AttnLifeCycle(window_size, sinks)

    @property
    def window_size(self) -> int | None:
        """Tokens a new token attends to (None: all)."""
        return self._window_size

    @property
    def num_sink_blocks(self) -> int:
        """Leading blocks kept for the sink tokens."""
        return self._num_sink_blocks

    def get_stale_range(self, history_length: int, tokens_per_block: int) -> HalfOpenRange[int]:
        """Block ordinals no future token attends to once ``history_length`` tokens are written (the
        next token at position ``history_length`` sees ``window_size`` tokens ending with itself)."""
        if self._window_size is None:
            return HalfOpenRange(0, 0)
        first_needed = max(0, history_length - self._window_size + 1) // tokens_per_block
        if first_needed <= self._num_sink_blocks:
            return HalfOpenRange(0, 0)
        return HalfOpenRange(self._num_sink_blocks, first_needed)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AttnLifeCycle):
            return NotImplemented
        return (self._window_size, self._num_sink_blocks) == (other._window_size, other._num_sink_blocks)

    def __hash__(self) -> int:
        return hash((self._window_size, self._num_sink_blocks))

    def __repr__(self) -> str:
        return f"AttnLifeCycle(window_size={self._window_size}, num_sink_blocks={self._num_sink_blocks})"


class SsmLifeCycle:
    """The life cycle of the recurrent (SSM) layer group: one state slot per request whatever its length,
    and prefix reuse only where the prefix tree holds a snapshot of that state."""

    __slots__ = ()

    @property
    def window_size(self) -> None:
        """Recurrent state has no token window."""
        return None

    @property
    def num_sink_blocks(self) -> int:
        """No sink blocks."""
        return 0

    def get_stale_range(self, history_length: int, tokens_per_block: int) -> HalfOpenRange[int]:
        """No block ordinals: the state is one slot, not pages per block."""
        del history_length, tokens_per_block
        return HalfOpenRange(0, 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SsmLifeCycle)

    def __hash__(self) -> int:
        return hash(SsmLifeCycle)

    def __repr__(self) -> str:
        return "SsmLifeCycle()"


#: The life cycle of a layer group.
LifeCycle = AttnLifeCycle | SsmLifeCycle


class LifeCycleRegistry:
    """The life cycles of a manager's layer groups."""

    def __init__(self, life_cycles: Sequence[LifeCycle]) -> None:
        self._life_cycles = tuple(life_cycles)

    @classmethod
    def of(cls, manager: Any) -> LifeCycleRegistry:
        """The registry of a ``KVCacheManager`` (read through its life-cycle part)."""
        return cls(manager.lifecycle.life_cycles())

    @property
    def size(self) -> int:
        """Life cycles (one per layer group)."""
        return len(self._life_cycles)

    @property
    def ssm_life_cycle_id(self) -> LayerGroupId | None:
        """The recurrent (SSM) life cycle, None when the manager has no recurrent layers."""
        for i, lc in enumerate(self._life_cycles):
            if isinstance(lc, SsmLifeCycle):
                return LayerGroupId(i)
        return None

    def attention_life_cycles(self) -> Iterator[tuple[LayerGroupId, AttnLifeCycle]]:
        """(layer group id, life cycle) of every attention layer group."""
        return ((LayerGroupId(i), lc) for i, lc in enumerate(self._life_cycles) if isinstance(lc, AttnLifeCycle))

    def items(self) -> Iterator[tuple[LayerGroupId, LifeCycle]]:
        """(layer group id, life cycle) of every layer group."""
        return ((LayerGroupId(i), lc) for i, lc in enumerate(self._life_cycles))

    def get_life_cycle(self, life_cycle_id: LayerGroupId) -> LifeCycle:
        """The life cycle of one layer group."""
        return self._life_cycles[life_cycle_id]

    def __getitem__(self, life_cycle_id: LayerGroupId) -> LifeCycle:
        return self._life_cycles[life_cycle_id]


# --- page index conversion -----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ScratchDesc:
    """Scratch slots of a sliding-window layer group: block ordinals ``range`` have no page of their
    own because their KV is out of the window once the current step's tokens are written; the step
    writes them into ``slot_ids`` (one per ordinal, in order) instead. Valid until the next resize or
    history change."""

    range: HalfOpenRange[int]
    slot_ids: Sequence[int]

    def __bool__(self) -> bool:
        return bool(self.range)


@dataclass(slots=True, frozen=True)
class PageIndexConverter:
    """Turns base page indices (slot ids of a layer group) into page indices of one buffer.

    A slot of the buffer's pool holds ``scale`` pages of the buffer's size; the buffer is sub-page
    ``layer_offset`` of its slot, which ``PER_LAYER`` indices include (they address from the pool's
    base) and ``SHARED`` ones (the default) leave to the base address. A block of a buffer paged by
    fewer tokens spans ``expansion`` consecutive pages of ``1 / expansion`` the size. Blocks in a
    scratch range (``PER_LAYER`` only) live in the scratch slots, block ``i`` of the range at
    sub-page ``i * scratch_pages_per_block`` of them (wrapping into the next slot), shifted by the
    buffer's sub-page.
    """

    scale: int
    expansion: int
    layer_offset: int
    scratch_pages_per_block: int = 1

    def __call__(self, base_indices: Sequence[int], index_mode: PageIndexMode | None = None,
                 scratch: ScratchDesc | None = None) -> list[int]:
        if index_mode is None:
            if scratch:
                raise ConfigError("PageIndexConverter: index_mode must be given (PER_LAYER) with a scratch range, "
                                  f"got None with {scratch!r}")
            index_mode = PageIndexMode.SHARED
        if scratch and index_mode is not PageIndexMode.PER_LAYER:
            raise ConfigError(f"PageIndexConverter: scratch blocks need PageIndexMode.PER_LAYER indices, got {index_mode!r}")
        scale, expansion = self.scale, self.expansion
        offset = self.layer_offset if index_mode is PageIndexMode.PER_LAYER else 0
        out: list[int] = []
        for ordinal, base in enumerate(base_indices):
            if scratch and scratch.range.beg <= ordinal < scratch.range.end:
                sub = (ordinal - scratch.range.beg) * self.scratch_pages_per_block
                index = int(scratch.slot_ids[sub // scale]) * scale + (sub % scale + offset) % scale
            elif int(base) == BAD_PAGE_INDEX:
                out.extend([BAD_PAGE_INDEX] * expansion)
                continue
            else:
                index = int(base) * scale + offset
            out.extend(index * expansion + k for k in range(expansion))
        return out


class PlannedDropHandle:
    """A drop of a request's committed blocks from the prefix tree, planned while the request was open
    and run later by ``drop()`` (once: a second call raises LogicError)."""

    __slots__ = ("_action", "_done")

    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Callable[[], None] | None = action
        self._done = False

    def drop(self) -> None:
        """Drop the planned blocks' pages that nothing else holds."""
        from kvxfer.errors import LogicError

        if self._done or self._action is None:
            raise LogicError("PlannedDropHandle.drop(): the planned blocks have already been dropped")
        action, self._action = self._action, None
        self._done = True
        action()

