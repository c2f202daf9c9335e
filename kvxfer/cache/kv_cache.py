"""A request's KV cache: block ids per layer group and the create/resume/resize/commit/suspend/close
lifecycle.

Token counts obey ``num_committed_tokens <= history_length <= capacity``: capacity is what the
allocated blocks can hold, history is how many tokens' KV has been written, committed is how many
tokens the caller has declared final (and, with prefix reuse, shareable).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.hashing import DEFAULT_SCOPE, ReuseScope, as_token_ids
from kvxfer.cache.radix_tree import BlockNode, check_priority
from kvxfer.cache.stats import KVCacheStatsDelta, PendingStats
from kvxfer.errors import CacheClosedError, CacheStateError, CapacityError, ConfigError, OutOfSlotsError

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]


class CacheOwner(Protocol):
    """What a KVCache calls on the manager that created it. A protocol, so this module does not
    import the manager (which imports this module)."""

    @property
    def layout(self) -> CacheLayoutDesc: ...

    def _check_stream(self, stream: Any, what: str) -> Any: ...

    def _resume(self, cache: KVCache, stream: Any) -> bool: ...

    def _suspend(self, cache: KVCache) -> None: ...

    def _resize(self, cache: KVCache, capacity: int) -> None: ...

    def _on_commit(self, cache: KVCache, priority: int | None = None) -> None: ...

    def _release_out_of_window(self, cache: KVCache) -> None: ...

    def _set_priority(self, cache: KVCache, priority: int) -> None: ...

    def _close(self, cache: KVCache) -> None: ...

    def _commit_stats(self, cache: KVCache) -> KVCacheStatsDelta: ...

    def _discard_stats(self, cache: KVCache) -> None: ...

    def _set_scratch_reuse(self, cache: KVCache, enable: bool) -> None: ...


@dataclass(frozen=True)
class ScratchDesc:
    """Scratch slots of a sliding-window layer group: block ordinals ``[range_begin, range_end)`` of
    the request have no page of their own (their ids read -1) because their KV is out of the window
    once the current step's tokens are written; the step writes them into ``slot_ids`` (one per
    ordinal, in order) instead. Valid until the next resize or history change."""

    range_begin: int
    range_end: int
    slot_ids: tuple[int, ...]

    @property
    def range(self) -> tuple[int, int]:
        """``(begin, end)`` block ordinals the scratch slots stand in for."""
        return self.range_begin, self.range_end

    def __bool__(self) -> bool:
        return self.range_end > self.range_begin


class CacheState(enum.Enum):
    """Lifecycle state of a KVCache."""

    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


def _as_tokens(tokens: Sequence[int] | npt.ArrayLike, what: str) -> npt.NDArray[np.int64]:
    """Token ids as int64 after the uint32 range check (CapacityError otherwise)."""
    return as_token_ids(tokens, what)


class KVCache:
    """Per-request paged KV storage handed out by ``KVCacheManager.create_kv_cache``."""

    def __init__(self, manager: CacheOwner, cache_id: str, input_tokens: npt.NDArray[np.int64] | None,
                 reuse_scope: ReuseScope = DEFAULT_SCOPE, extra_keys: dict[int, bytes] | None = None, *,
                 expected_prompt_length: int | None = None, swa_scratch_reuse: bool = False) -> None:
        self._manager = manager
        self.id = cache_id
        self.state = CacheState.SUSPENDED
        self.input_tokens = input_tokens
        #: Prompt tokens: allocations inside the prompt count as missed, past it as generation.
        self.expected_prompt_length = expected_prompt_length
        self._stream: Any = None
        self._swa_scratch_reuse = swa_scratch_reuse
        n_groups = len(manager.layout.layer_groups)
        self._blocks: list[IntArray] = [np.empty(0, dtype=np.int32) for _ in range(n_groups)]
        # Tier of each block's page (0 = primary); only a suspended cache has pages in colder tiers.
        self._tiers: list[TierArray] = [np.empty(0, dtype=np.int8) for _ in range(n_groups)]
        self._last_used = 0   # LRU stamp of the request's held pages (the prefix tree's clock)
        self._capacity = 0
        self._history = 0
        self._tokens = np.empty(0, dtype=np.int64)   # committed token ids
        self.num_reused_tokens = 0
        self.reuse_scope = reuse_scope
        # Prefix-reuse bookkeeping, kept by the manager: keys of the committed full blocks, the tree
        # node tied to each of them (None once the chain could not be inserted), the tree block a
        # partially reused block was taken from (until it is copied), the prompt's keys.
        self._extra_keys: dict[int, bytes] = dict(extra_keys or {})
        self._keys: list[bytes] = []
        self._tree_nodes: list[BlockNode | None] = []
        self._partial_src: BlockNode | None = None
        self._prompt_keys: list[bytes] = []
        self._root_key = b""   # the scope's root under the manager's hash algorithm
        self._published_blocks = 0   # full committed blocks whose pages were stamped ready (streams)
        self._pending = PendingStats()
        # Scratch slots per layer group (held by this cache) and the block range they stand in for.
        self._scratch: list[IntArray] = [np.empty(0, dtype=np.int32) for _ in range(n_groups)]
        self._scratch_range: list[tuple[int, int]] = [(0, 0)] * n_groups

    # --- properties ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold."""
        return self._capacity

    @property
    def history_length(self) -> int:
        """Tokens whose KV has been written."""
        return self._history

    @history_length.setter
    def history_length(self, n: int) -> None:
        self._check_open("set history_length")
        if not self.num_committed_tokens <= n <= self._capacity:
            raise CapacityError(f"KVCache {self.id}: history_length {n} outside [committed="
                                f"{self.num_committed_tokens}, capacity={self._capacity}]")
        self._history = n
        self._manager._release_out_of_window(self)

    @property
    def num_committed_tokens(self) -> int:
        """Tokens declared final by ``commit``."""
        return int(self._tokens.size)

    @property
    def committed_tokens(self) -> npt.NDArray[np.int64]:
        """The committed token ids (a copy)."""
        return self._tokens.copy()

    @property
    def num_blocks(self) -> int:
        """Blocks (of tokens_per_block tokens) covering the capacity."""
        return int(self._blocks[0].size) if self._blocks else 0

    @property
    def pending_stats(self) -> KVCacheStatsDelta:
        """This request's counters not yet committed (a copy)."""
        return self._pending.request.copy()

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """Merge this request's pending counters into the manager's committed and iteration stats;
        returns the delta committed (empty with stats disabled or the request excluded)."""
        return self._manager._commit_stats(self)

    def discard_pending_stats(self) -> None:
        """Forget this request's pending counters (e.g. a step rolled back)."""
        self._manager._discard_stats(self)

    # --- streams and scratch --------------------------------------------------------------------
    @property
    def cuda_stream(self) -> Any:
        """The CUDA stream this request's kernels run on (None: the device's current stream; always
        None on a CPU primary tier)."""
        return self._stream

    @cuda_stream.setter
    def cuda_stream(self, stream: Any) -> None:
        self._check_open("set cuda_stream")
        self._stream = self._manager._check_stream(stream, f"KVCache {self.id}.cuda_stream")

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether growing a sliding-window group gives blocks already out of the window at the new
        capacity scratch slots instead of pages (``CacheConfig.swa_scratch_reuse`` by default)."""
        return self._swa_scratch_reuse

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, enable: bool) -> None:
        self._check_open("set enable_swa_scratch_reuse")
        if not isinstance(enable, bool):
            raise ConfigError(f"KVCache {self.id}.enable_swa_scratch_reuse must be a bool, got {enable!r}")
        self._manager._set_scratch_reuse(self, enable)
        self._swa_scratch_reuse = enable

    def get_scratch_desc(self, layer_group_id: int) -> ScratchDesc | None:
        """The scratch slots of a layer group for the current step, or None when it has none."""
        self._check_layer_group(layer_group_id)
        begin, end = self._scratch_range[layer_group_id]
        if end <= begin:
            return None
        return ScratchDesc(begin, end, tuple(int(s) for s in self._scratch[layer_group_id][:end - begin]))

    @property
    def has_scratch_slots(self) -> bool:
        """Whether this request holds scratch slots now."""
        return any(s.size for s in self._scratch)

    def block_ids(self, layer_group_id: int = 0) -> IntArray:
        """Primary-tier slot ids of this request's blocks in layer group ``layer_group_id`` (-1: no
        page); CacheStateError while a suspended request has pages offloaded to a colder tier."""
        self._check_layer_group(layer_group_id)
        if (self._tiers[layer_group_id] != 0).any():
            raise CacheStateError(f"KVCache {self.id}: layer group {layer_group_id} has pages offloaded to a "
                                  f"colder tier; resume() before reading block ids")
        return self._blocks[layer_group_id].copy()

    def block_id_map(self) -> dict[int, IntArray]:
        """Block ids of every layer group: what the extractor takes."""
        return {g: self.block_ids(g) for g in range(len(self._blocks))}

    def page_tiers(self, layer_group_id: int = 0) -> TierArray:
        """Tier index (0 = primary, then the config's colder tiers in order) of each block's page."""
        self._check_layer_group(layer_group_id)
        return self._tiers[layer_group_id].copy()

    def page_locations(self, layer_group_id: int = 0) -> tuple[IntArray, TierArray]:
        """(slot id, tier index) of each block's page in layer group ``layer_group_id``, in whatever
        tier it lives (slot -1: no page)."""
        self._check_layer_group(layer_group_id)
        return self._blocks[layer_group_id].copy(), self._tiers[layer_group_id].copy()

    def _check_layer_group(self, layer_group_id: int) -> None:
        if not 0 <= layer_group_id < len(self._blocks):
            raise CacheStateError(f"KVCache {self.id}: no layer group {layer_group_id} "
                                  f"(have 0..{len(self._blocks) - 1})")

    # --- lifecycle -----------------------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        if self.state is CacheState.CLOSED:
            raise CacheClosedError(f"KVCache {self.id}: cannot {op} after close()")

    def _check_active(self, op: str) -> None:
        self._check_open(op)
        if self.state is not CacheState.ACTIVE:
            raise CacheStateError(f"KVCache {self.id}: cannot {op} while {self.state.value}; call resume() first")

    def resume(self, cuda_stream: Any = None) -> bool:
        """Make the cache usable: pages offloaded while suspended (or reused from a colder tier) are
        brought back to the primary tier first. False, with no side effect, when the primary tier
        cannot hold them now (``CacheConfig.resume_max_utilization``).

        ``cuda_stream`` (a torch.cuda.Stream or a raw cudaStream_t int; CUDA primary tier only) becomes
        ``cuda_stream``; slots this request takes that another stream used last are waited for on it.
        """
        self._check_open("resume")
        stream = self._manager._check_stream(cuda_stream, f"KVCache {self.id}.resume") \
            if cuda_stream is not None else self._stream
        if self.state is CacheState.ACTIVE:
            self._stream = stream
            return True
        if not self._manager._resume(self, stream):
            return False
        self._stream = stream
        self.state = CacheState.ACTIVE
        return True

    def suspend(self) -> None:
        """Let the cache's pages be offloaded to colder tiers under pressure until ``resume``
        (they are held, never dropped)."""
        self._check_open("suspend")
        if self.state is CacheState.SUSPENDED:
            return
        self._manager._suspend(self)
        self.state = CacheState.SUSPENDED

    def resize(self, capacity: int) -> bool:
        """Grow or shrink to hold ``capacity`` tokens; False (nothing allocated) when out of slots."""
        self._check_active("resize")
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 0:
            raise CapacityError(f"KVCache {self.id}: capacity must be an int >= 0, got {capacity!r}")
        capacity = int(capacity)
        if capacity < self._history:
            raise CapacityError(f"KVCache {self.id}: capacity {capacity} below history_length {self._history}")
        try:
            self._manager._resize(self, capacity)
        except OutOfSlotsError:
            return False
        self._capacity = capacity
        return True

    def commit(self, tokens: Sequence[int] | npt.ArrayLike, *, priority: int | None = None) -> None:
        """Declare the KV of ``tokens`` (appended after the committed ones) written and final.

        With prefix reuse, blocks this fills enter the prefix tree; ``priority`` (0-100, default 35)
        is their eviction priority (lower goes first) and also updates blocks already there.
        """
        self._check_active("commit")
        if priority is not None:
            priority = check_priority(priority, f"KVCache {self.id}.commit")
        arr = _as_tokens(tokens, f"KVCache {self.id}.commit")
        if self.num_committed_tokens + arr.size > self._capacity:
            raise CapacityError(f"KVCache {self.id}: commit of {arr.size} tokens past capacity "
                                f"({self.num_committed_tokens} committed, capacity {self._capacity})")
        self._tokens = np.concatenate([self._tokens, arr])
        self._history = max(self._history, self.num_committed_tokens)
        self._manager._on_commit(self, priority)
        self._manager._release_out_of_window(self)

    def set_priority(self, priority: int) -> None:
        """Set the eviction priority (0-100, lower goes first) of every committed block of this
        request that is in the prefix tree."""
        self._check_open("set_priority")
        self._manager._set_priority(self, check_priority(priority, f"KVCache {self.id}.set_priority"))

    def close(self) -> None:
        """Release every page this cache holds; a second close raises CacheClosedError. Pending
        statistics are committed first (``discard_pending_stats()`` before closing drops them)."""
        self._check_open("close")
        self._manager._close(self)
        self.state = CacheState.CLOSED
        self._blocks = [np.empty(0, dtype=np.int32) for _ in self._blocks]
        self._tiers = [np.empty(0, dtype=np.int8) for _ in self._tiers]
        self._scratch = [np.empty(0, dtype=np.int32) for _ in self._scratch]
        self._scratch_range = [(0, 0)] * len(self._scratch)
        self._capacity = 0

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state is not CacheState.CLOSED:
            self.close()

    def __repr__(self) -> str:
        return (f"KVCache(id={self.id!r}, state={self.state.value}, capacity={self._capacity}, "
                f"history={self._history}, committed={self.num_committed_tokens})")
