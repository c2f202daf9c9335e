"""A request's KV cache: block ids per layer group and the create/resume/resize/commit/suspend/close
lifecycle.

Token counts obey ``num_committed_tokens <= history_length <= capacity``: capacity is what the
allocated blocks can hold, history is how many tokens' KV has been written, committed is how many
tokens the caller has declared final (and, with prefix reuse, shareable).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvxfer.cache.hashing import DEFAULT_SCOPE, ReuseScope, as_token_ids
from kvxfer.cache.radix_tree import BlockNode, check_priority
from kvxfer.cache.stats import RequestStats
from kvxfer.errors import CacheClosedError, CacheStateError, CapacityError, OutOfSlotsError

if TYPE_CHECKING:
    from kvxfer.cache.manager import KVCacheManager

IntArray = npt.NDArray[np.int32]


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

    def __init__(self, manager: KVCacheManager, cache_id: str, input_tokens: npt.NDArray[np.int64] | None,
                 reuse_scope: ReuseScope = DEFAULT_SCOPE, extra_keys: dict[int, bytes] | None = None) -> None:
        self._manager = manager
        self.id = cache_id
        self.state = CacheState.SUSPENDED
        self.input_tokens = input_tokens
        n_groups = len(manager.layout.layer_groups)
        self._blocks: list[IntArray] = [np.empty(0, dtype=np.int32) for _ in range(n_groups)]
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
        self._pending = RequestStats()

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
    def pending_stats(self) -> RequestStats:
        """This request's statistics deltas not yet merged by ``commit_pending_stats`` (a copy)."""
        out = RequestStats()
        out.add(self._pending)
        return out

    def block_ids(self, layer_group_id: int = 0) -> IntArray:
        """Slot ids of this request's blocks in layer group ``layer_group_id`` (-1: no page)."""
        if not 0 <= layer_group_id < len(self._blocks):
            raise CacheStateError(f"KVCache {self.id}: no layer group {layer_group_id} "
                                  f"(have 0..{len(self._blocks) - 1})")
        return self._blocks[layer_group_id].copy()

    def block_id_map(self) -> dict[int, IntArray]:
        """Block ids of every layer group: what the extractor takes."""
        return {g: b.copy() for g, b in enumerate(self._blocks)}

    # --- lifecycle -----------------------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        if self.state is CacheState.CLOSED:
            raise CacheClosedError(f"KVCache {self.id}: cannot {op} after close()")

    def _check_active(self, op: str) -> None:
        self._check_open(op)
        if self.state is not CacheState.ACTIVE:
            raise CacheStateError(f"KVCache {self.id}: cannot {op} while {self.state.value}; call resume() first")

    def resume(self) -> bool:
        """Make the cache usable (its pages in the primary tier); False, with no side effect, when
        the primary tier cannot hold them now."""
        self._check_open("resume")
        if self.state is CacheState.ACTIVE:
            return True
        if not self._manager._resume(self):
            return False
        self.state = CacheState.ACTIVE
        return True

    def suspend(self) -> None:
        """Let the cache's pages be moved to colder tiers until ``resume``."""
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
        """Release every page this cache holds; a second close raises CacheClosedError."""
        self._check_open("close")
        self._manager._close(self)
        self.state = CacheState.CLOSED
        self._blocks = [np.empty(0, dtype=np.int32) for _ in self._blocks]
        self._capacity = 0

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state is not CacheState.CLOSED:
            self.close()

    def __repr__(self) -> str:
        return (f"KVCache(id={self.id!r}, state={self.state.value}, capacity={self._capacity}, "
                f"history={self._history}, committed={self.num_committed_tokens})")
