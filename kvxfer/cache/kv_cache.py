"""A request's KV cache: block ids per layer group and the create/resume/resize/commit/suspend/close
lifecycle.

Token counts obey ``num_committed_tokens <= history_length <= capacity``: capacity is what the
allocated blocks can hold, history is how many tokens' KV has been written, committed is how many
tokens the caller has declared final (and, with prefix reuse, shareable).
"""

from __future__ import annotations

import array
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.cache.common import (
    BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX,
    BeamIndex,
    CacheLevel,
    CudaStream,
    HalfOpenRange,
    LayerGroupId,
    PageIndexMode,
    PlannedDropHandle,
    ScratchDesc,
)
from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.hashing import DEFAULT_SCOPE, ReuseScope, TokenIdExt
from kvxfer.cache.radix_tree import BlockNode, check_priority
from kvxfer.cache.stats import KVCacheStatsDelta, PendingStats
from kvxfer.errors import (
    CacheClosedError,
    CacheStateError,
    CapacityError,
    ConfigError,
    LogicError,
    OutOfPagesError,
    OutOfSlotsError,
)

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]


class CacheOps(Protocol):
    """What a KVCache calls on its manager's life-cycle part (``KVCacheManager.lifecycle``). A protocol,
    so this module does not import the manager (which imports this module)."""

    @property
    def layout(self) -> CacheLayoutDesc: ...

    def check_stream(self, stream: Any, what: str) -> Any: ...

    def resume(self, cache: KVCache, stream: Any) -> bool: ...

    def suspend(self, cache: KVCache) -> None: ...

    def drop(self, cache: KVCache) -> None: ...

    def resize(self, cache: KVCache, capacity: int, history: int | None = None, *, skip_stale: bool = False) -> None: ...

    def encode_tokens(self, tokens: Any, what: str) -> npt.NDArray[np.int64]: ...

    def decode_tokens(self, tokens: npt.NDArray[np.int64]) -> list[int | bytes]: ...

    def check_commit(self, cache: KVCache, num_new: int) -> None: ...

    def on_commit(self, cache: KVCache, priority: int | None = None, is_end: bool = False) -> None: ...

    def release_out_of_window(self, cache: KVCache) -> None: ...

    def set_priority(self, cache: KVCache, priority: int) -> None: ...

    def close(self, cache: KVCache) -> None: ...

    def store_tail(self, cache: KVCache) -> None: ...

    def commit_stats(self, cache: KVCache) -> KVCacheStatsDelta: ...

    def discard_stats(self, cache: KVCache) -> None: ...

    def set_scratch_reuse(self, cache: KVCache, enable: bool) -> None: ...

    def switch_stream(self, cache: KVCache, stream: Any) -> None: ...

    def prefetch(self, cache: KVCache, target: int) -> bool: ...

    def plan_drop(self, cache: KVCache) -> PlannedDropHandle | None: ...


class RequestState:
    """One request's pages and bookkeeping: read by the KVCache, written by the manager's parts (the
    life cycle, prefix reuse, tiers, statistics), which own the invariants between them.

    ``blocks[lg]`` / ``tiers[lg]``: slot id (-1: none) and tier of each block's page per layer group;
    ``tokens``: the committed token ids; ``keys`` / ``tree_nodes``: keys of the committed full blocks
    and the tree node tied to each (None once the chain could not be inserted); ``partial_src``: the
    tree block a partially reused block was taken from (until it is copied); ``tail_node``: the tree
    block that took the pages of the cache's partial last committed block; ``prompt_keys``: the
    prompt's block keys; ``scratch`` / ``scratch_range``: scratch slots per layer group and the block
    range they stand in for; ``pending``: statistics not yet committed; ``block_priority``: the
    eviction priority ``custom_priority_callback`` gave each block when it was allocated. A recurrent
    layer group's ``blocks[lg]`` holds one entry, the request's state slot (none before the first
    resume); ``ssm_shared``: the recurrent layer groups whose entry is still the prefix tree's snapshot
    (copied into a private slot at resume); ``unpruned_tokens``: the prefix match's length before the
    recurrent layer groups' snapshots cut it; ``walked_tokens``: how far the lookup's content matched the
    tree before any page was checked.
    """

    blocks: list[IntArray]
    tiers: list[TierArray]
    scratch: list[IntArray]
    scratch_range: list[tuple[int, int]]
    pending: PendingStats
    keys: list[bytes]
    tree_nodes: list[BlockNode | None]
    partial_src: BlockNode | None
    tail_node: BlockNode | None
    prompt_keys: list[bytes]
    root_key: bytes
    last_used: int
    published_blocks: int
    extra_keys: dict[int, bytes]
    tokens: npt.NDArray[np.int64]
    stream: Any
    history: int
    capacity: int
    swa_scratch_reuse: bool
    block_priority: dict[int, int]
    ssm_shared: set[int]
    unpruned_tokens: int
    walked_tokens: int


class CacheState(enum.Enum):
    """Lifecycle state of a KVCache (the reference design's ``KvCacheStatus``)."""

    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


#: The reference design's name of the kv-cache status enum.
KvCacheStatus = CacheState
#: ``custom_priority_callback(block_ordinal, life_cycle) -> priority`` of ``create_kv_cache``.
PriorityCallback = Callable[[int, Any], int]


class KVCache:
    """Per-request paged KV storage handed out by ``KVCacheManager.create_kv_cache`` (the reference
    design's ``_KVCache``)."""

    Status: ClassVar[type[CacheState]] = CacheState

    def __init__(self, manager: Any, cache_id: Any, input_tokens: npt.NDArray[np.int64] | None,
                 reuse_scope: ReuseScope = DEFAULT_SCOPE, extra_keys: dict[int, bytes] | None = None, *,
                 expected_prompt_length: int | None = None, swa_scratch_reuse: bool = False) -> None:
        self._manager = manager
        self._ops: CacheOps = manager.lifecycle
        self.record = RequestState()
        self.id: Any = cache_id
        self.state = CacheState.SUSPENDED
        self.input_tokens = input_tokens
        #: Prompt tokens: allocations inside the prompt count as missed, past it as generation.
        self.expected_prompt_length = expected_prompt_length
        self.record.stream = None
        self.record.swa_scratch_reuse = swa_scratch_reuse
        n_groups = len(manager.layout.layer_groups)
        self.record.blocks = [np.empty(0, dtype=np.int32) for _ in range(n_groups)]
        # Tier of each block's page (0 = primary); only a suspended cache has pages in colder tiers.
        self.record.tiers = [np.empty(0, dtype=np.int8) for _ in range(n_groups)]
        self.record.last_used = 0   # LRU stamp of the request's held pages (the prefix tree's clock)
        self.record.capacity = 0
        self.record.history = 0
        self.record.tokens = np.empty(0, dtype=np.int64)   # committed token ids
        self.num_reused_tokens = 0
        self.reuse_scope = reuse_scope
        # Prefix-reuse bookkeeping, kept by the manager: keys of the committed full blocks, the tree
        # node tied to each of them (None once the chain could not be inserted), the tree block a
        # partially reused block was taken from (until it is copied), the prompt's keys.
        self.record.extra_keys = dict(extra_keys or {})
        self.record.keys = []
        self.record.tree_nodes = []
        self.record.partial_src = None
        self.record.tail_node = None
        self.record.prompt_keys = []
        self.record.root_key = b""   # the scope's root under the manager's hash algorithm
        self.record.block_priority = {}
        self.record.ssm_shared = set()
        self.record.unpruned_tokens = 0
        self.record.walked_tokens = 0
        #: Layer groups whose block-id list is one state slot (recurrent layers), not pages per block.
        self._recurrent = frozenset(lg.layer_group_id for lg in manager.layout.layer_groups if lg.recurrent)
        self.record.published_blocks = 0   # full committed blocks whose pages were stamped ready (streams)
        self.record.pending = PendingStats()
        # Scratch slots per layer group (held by this cache) and the block range they stand in for.
        self.record.scratch = [np.empty(0, dtype=np.int32) for _ in range(n_groups)]
        self.record.scratch_range = [(0, 0)] * n_groups
        self._commit_allowed = True
        self._text_only = False
        self.enable_request_stats = False
        self.priority_callback: PriorityCallback | None = None
        #: Reused tokens by the cache level their pages were found at (set when the cache is created).
        self.reused_tokens_by_level: list[int] = []
        self._index_bufs: dict[int, memoryview] = {}

    # --- properties ----------------------------------------------------------------------------
    @property
    def history_length(self) -> int:
        """Tokens whose KV has been written."""
        return self.record.history

    @history_length.setter
    def history_length(self, n: int) -> None:
        self._check_open("set history_length")
        if not self.num_committed_tokens <= n <= self.record.capacity:
            raise CapacityError(f"KVCache {self.id}: history_length {n} outside [committed="
                                f"{self.num_committed_tokens}, capacity={self.record.capacity}]")
        self.record.history = n
        self._ops.release_out_of_window(self)
        self._sync_index_bufs()

    @property
    def num_committed_tokens(self) -> int:
        """Tokens declared final by ``commit``."""
        return int(self.record.tokens.size)

    @property
    def committed_tokens(self) -> list[int | bytes]:
        """The committed tokens (a new list): ids, and the 32-byte digests of multimodal tokens."""
        return self._ops.decode_tokens(self.record.tokens)

    @property
    def committed_token_array(self) -> npt.NDArray[np.int64]:
        """The committed token ids as an int64 array (a copy)."""
        return self.record.tokens.copy()

    @property
    def num_blocks(self) -> int:
        """Blocks (of tokens_per_block tokens) covering the capacity."""
        for lg, blocks in enumerate(self.record.blocks):
            if lg not in self._recurrent:
                return int(blocks.size)
        return -(-self.record.capacity // self.tokens_per_block)

    @property
    def pending_stats(self) -> KVCacheStatsDelta:
        """This request's counters not yet committed (a copy)."""
        return self.record.pending.request.copy()

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """Merge this request's pending counters into the manager's committed and iteration stats;
        returns the delta committed (empty with stats disabled or the request excluded)."""
        return self._ops.commit_stats(self)

    def discard_pending_stats(self) -> None:
        """Forget this request's pending counters (e.g. a step rolled back)."""
        self._ops.discard_stats(self)

    # --- streams and scratch --------------------------------------------------------------------
    @property
    def cuda_stream(self) -> CudaStream | None:
        """The ``cudaStream_t`` (an int) this request's kernels run on: the int ``resume`` or the setter
        was given, as the reference returns it, or a torch.cuda.Stream's handle (``torch_stream`` is
        the stream object). None: the device's current stream; always None on a CPU primary tier."""
        stream = self.record.stream
        return None if stream is None else CudaStream(int(stream.cuda_stream))

    @cuda_stream.setter
    def cuda_stream(self, stream: Any) -> None:
        self._check_open("set cuda_stream")
        checked = self._ops.check_stream(stream, f"KVCache {self.id}.cuda_stream")
        self._ops.switch_stream(self, checked)      # an active cache's new stream waits for its old one
        self.record.stream = checked

    @property
    def torch_stream(self) -> Any:
        """The request's stream as a torch.cuda.Stream (None: the device's current stream)."""
        return self.record.stream

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether a step's blocks of a sliding-window group that are out of the window by the step's end
        get shared scratch slots instead of pages (the manager's setting by default). Changing it is
        refused (ScratchInUseError) while the current step would use scratch blocks."""
        return self.record.swa_scratch_reuse

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, enable: bool) -> None:
        self._check_open("set enable_swa_scratch_reuse")
        if not isinstance(enable, bool):
            raise ConfigError(f"KVCache {self.id}.enable_swa_scratch_reuse must be a bool, got {enable!r}")
        self._ops.set_scratch_reuse(self, enable)
        self.record.swa_scratch_reuse = enable

    def get_scratch_desc(self, layer_group_id: int) -> ScratchDesc | None:
        """The scratch blocks of a layer group for the current step and the slots holding them (to pass
        to ``PageIndexConverter`` with ``PER_LAYER`` indices), or None when it has none. Valid until the
        next change of capacity or history."""
        self._check_layer_group(layer_group_id)
        begin, end = self.record.scratch_range[layer_group_id]
        if end <= begin:
            return None
        return ScratchDesc(HalfOpenRange(begin, end), tuple(int(s) for s in self.record.scratch[layer_group_id]))

    @property
    def has_scratch_slots(self) -> bool:
        """Whether this request holds scratch slots now."""
        return any(s.size for s in self.record.scratch)

    def block_ids(self, layer_group_id: int = 0) -> IntArray:
        """Primary-tier slot ids of this request's blocks in layer group ``layer_group_id`` (-1: no
        page); CacheStateError while a suspended request has pages offloaded to a colder tier."""
        self._check_layer_group(layer_group_id)
        if (self.record.tiers[layer_group_id] != 0).any():
            raise CacheStateError(f"KVCache {self.id}: layer group {layer_group_id} has pages offloaded to a "
                                  f"colder tier; resume() before reading block ids")
        return self.record.blocks[layer_group_id].copy()

    def block_id_map(self) -> dict[int, IntArray]:
        """Block ids of every layer group: what the extractor takes."""
        return {g: self.block_ids(g) for g in range(len(self.record.blocks))}

    def page_tiers(self, layer_group_id: int = 0) -> TierArray:
        """Tier index (0 = primary, then the config's colder tiers in order) of each block's page."""
        self._check_layer_group(layer_group_id)
        return self.record.tiers[layer_group_id].copy()

    def page_locations(self, layer_group_id: int = 0) -> tuple[IntArray, TierArray]:
        """(slot id, tier index) of each block's page in layer group ``layer_group_id``, in whatever
        tier it lives (slot -1: no page)."""
        self._check_layer_group(layer_group_id)
        return self.record.blocks[layer_group_id].copy(), self.record.tiers[layer_group_id].copy()

    def _check_layer_group(self, layer_group_id: int) -> None:
        if not 0 <= layer_group_id < len(self.record.blocks):
            raise CacheStateError(f"KVCache {self.id}: no layer group {layer_group_id} "
                                  f"(have 0..{len(self.record.blocks) - 1})")

    # --- the reference design's view ------------------------------------------------------------
    @property
    def manager(self) -> Any:
        """The manager that created this cache."""
        return self._manager

    @property
    def status(self) -> CacheState:
        """ACTIVE, SUSPENDED or CLOSED."""
        return self.state

    @property
    def is_active(self) -> bool:
        """Whether the cache is resumed (its pages are in the primary tier and may be written)."""
        return self.state is CacheState.ACTIVE

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block of the manager's layout."""
        return self._ops.layout.tokens_per_block

    @property
    def beam_width(self) -> BeamIndex:
        """Beams of this request: always 1 (kvxfer keeps one sequence per cache)."""
        return BeamIndex(1)

    @beam_width.setter
    def beam_width(self, beam_width: BeamIndex) -> None:
        if beam_width != 1:
            raise ConfigError(f"KVCache {self.id}.beam_width: only beam width 1 is supported, got {beam_width!r}")

    def _check_beam(self, beam_id: int, what: str) -> None:
        if beam_id != DEFAULT_BEAM_INDEX:
            raise ConfigError(f"KVCache {self.id}.{what}: only beam {DEFAULT_BEAM_INDEX} exists, got {beam_id!r}")

    def get_base_page_indices(self, layer_group_id: LayerGroupId,
                              beam_id: BeamIndex = DEFAULT_BEAM_INDEX) -> array.array[int]:
        """Slot ids of this request's blocks in a layer group (``BAD_PAGE_INDEX``: no page)."""
        self._check_beam(beam_id, "get_base_page_indices")
        return array.array("i", self.block_ids(layer_group_id).tolist())

    def get_ssm_block_base_index(self, layer_group_id: LayerGroupId, beam_id: BeamIndex = DEFAULT_BEAM_INDEX) -> int:
        """The primary-tier slot of this request's state in a recurrent layer group (``BAD_PAGE_INDEX``
        before the first resume, and while a suspended request's state is offloaded to a colder tier);
        ConfigError for an attention layer group."""
        self._check_beam(beam_id, "get_ssm_block_base_index")
        self._check_layer_group(layer_group_id)
        if layer_group_id not in self._recurrent:
            raise ConfigError(f"KVCache {self.id}.get_ssm_block_base_index: layer group {layer_group_id} is not "
                              f"a recurrent (SSM) layer group")
        blocks = self.record.blocks[layer_group_id]
        if blocks.size == 0 or layer_group_id in self.record.ssm_shared or self.record.tiers[layer_group_id][0] != 0:
            return BAD_PAGE_INDEX
        return int(blocks[0])

    def _get_num_reusable_tokens_before_hybrid_pruning(self) -> int:
        """Tokens the prefix match reached before the recurrent layer groups' snapshots cut it back to
        the reused length (equal to it when nothing was cut, or without recurrent layers)."""
        return max(self.record.unpruned_tokens, self.num_reused_tokens)

    #: The name this diagnostic had in earlier versions of the reference design.
    _get_num_tokens_before_hybrid_pruning = _get_num_reusable_tokens_before_hybrid_pruning

    def _get_num_reusable_tokens_before_pruning(self) -> int:
        """How far the lookup's content matched the prefix tree (where it forks from what the tree
        holds), before any layer group's missing pages or snapshots cut the match."""
        return max(self.record.walked_tokens, self._get_num_reusable_tokens_before_hybrid_pruning())

    def get_aggregated_page_indices(self, layer_group_id: LayerGroupId, beam_id: BeamIndex = DEFAULT_BEAM_INDEX,
                                    valid_only: bool = False) -> Iterator[int]:
        """Aggregated page indices (one per block; see ``KVCacheManager.get_aggregated_pages``), without
        the blocks that have no page when ``valid_only``."""
        for index in self.get_base_page_indices(layer_group_id, beam_id):
            if not valid_only or index != BAD_PAGE_INDEX:
                yield index

    def set_base_page_index_buf(self, beam_idx: BeamIndex, layer_group_id: LayerGroupId,
                                buf: memoryview | None) -> None:
        """Keep ``buf`` (an int32 buffer of at least ``num_blocks`` entries) equal to the base page
        indices of a layer group, padded with ``BAD_PAGE_INDEX``, from now on; None stops that."""
        self._check_open("set_base_page_index_buf")
        self._check_beam(beam_idx, "set_base_page_index_buf")
        self._check_layer_group(layer_group_id)
        if buf is None:
            self._index_bufs.pop(layer_group_id, None)
            return
        view = memoryview(buf).cast("B").cast("i") if memoryview(buf).format != "i" else memoryview(buf)
        if len(view) < self.num_blocks:
            raise CapacityError(f"KVCache {self.id}.set_base_page_index_buf: buffer of {len(view)} entries is "
                                f"shorter than the {self.num_blocks} blocks of layer group {layer_group_id}")
        self._index_bufs[layer_group_id] = view
        self._sync_index_bufs()

    def _sync_index_bufs(self) -> None:
        for layer_group_id, view in self._index_bufs.items():
            ids = self.record.blocks[layer_group_id]
            if len(view) < ids.size:
                raise CapacityError(f"KVCache {self.id}: the base page index buffer of layer group "
                                    f"{layer_group_id} ({len(view)} entries) cannot hold {ids.size} blocks")
            for i, v in enumerate(ids.tolist()):
                view[i] = int(v)
            for i in range(ids.size, len(view)):
                view[i] = BAD_PAGE_INDEX

    @property
    def cached_tokens_by_level(self) -> list[int]:
        """Reused tokens by the cache level their pages were found at when the cache was created."""
        return list(self.reused_tokens_by_level)

    def _get_last_cached_token_level(self) -> int | None:
        """The cache level of the last reused token's page (None: nothing was reused)."""
        for level in range(len(self.reused_tokens_by_level) - 1, -1, -1):
            if self.reused_tokens_by_level[level]:
                return level
        return None

    def stop_committing(self) -> None:
        """No further ``commit``: the request's remaining tokens advance ``history_length`` only (a
        reference-API manager enters its partial last committed block into the prefix tree now)."""
        self._check_open("stop_committing")
        if self._commit_allowed:
            self._ops.store_tail(self)
        self._commit_allowed = False

    @property
    def commit_allowed(self) -> bool:
        """Whether ``commit`` is still allowed (``stop_committing`` not called)."""
        return self._commit_allowed

    def plan_committed_block_drop(self) -> PlannedDropHandle | None:
        """A handle that later drops, from the prefix tree, the pages of this request's committed
        blocks that nothing else holds then; None when no committed block of it is in the tree."""
        self._check_open("plan_committed_block_drop")
        return self._ops.plan_drop(self)

    def prefetch(self, target: CacheLevel) -> bool:
        """Bring this suspended request's pages held in levels colder than ``target`` up to ``target``;
        False when that level has no room for them."""
        self._check_open("prefetch")
        return self._ops.prefetch(self, int(target))

    @property
    def text_only(self) -> bool:
        """Whether the request has no multimodal tokens (a hint; kvxfer keys every token alike)."""
        return self._text_only

    @text_only.setter
    def text_only(self, text_only: bool) -> None:
        self._text_only = bool(text_only)

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """``PER_LAYER`` always; ``SHARED`` while the cache holds no scratch slots (scratch blocks of
        different buffers share slots, which only ``PER_LAYER`` indices tell apart)."""
        if mode is PageIndexMode.SHARED:
            return not self.has_scratch_slots
        return mode is PageIndexMode.PER_LAYER

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
        stream = self._ops.check_stream(cuda_stream, f"KVCache {self.id}.resume") \
            if cuda_stream is not None else self.record.stream
        if self.state is CacheState.ACTIVE:
            self.record.stream = stream
            return True
        if not self._ops.resume(self, stream):
            return False
        self.record.stream = stream
        self.state = CacheState.ACTIVE
        self._sync_index_bufs()
        return True

    def suspend(self) -> None:
        """Let the cache's pages be offloaded to colder tiers under pressure until ``resume``
        (they are held, never dropped)."""
        self._check_open("suspend")
        if self.state is CacheState.SUSPENDED:
            return
        self._ops.suspend(self)
        self.state = CacheState.SUSPENDED

    def resize(self, capacity: int | None, history_length: int | None = None) -> bool:
        """Grow or shrink to hold ``capacity`` tokens (None: keep it) and set ``history_length`` when
        given; False (nothing changed) when out of slots."""
        self._check_active("resize")
        if capacity is None:
            capacity = self.record.capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 0:
            raise CapacityError(f"KVCache {self.id}: capacity must be an int >= 0, got {capacity!r}")
        capacity = int(capacity)
        history = self.record.history if history_length is None else int(history_length)
        if capacity < history:
            raise CapacityError(f"KVCache {self.id}: capacity {capacity} below history_length {history}")
        if history_length is not None and history < self.record.history:
            self.history_length = history
        try:
            self._ops.resize(self, capacity, history, skip_stale=history_length is not None)
        except OutOfSlotsError:
            return False
        self.record.capacity = capacity
        if history_length is not None and history != self.record.history:
            self.history_length = history
        self._sync_index_bufs()
        return True

    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold; setting it resizes (OutOfPagesError when out of slots)."""
        return self.record.capacity

    @capacity.setter
    def capacity(self, capacity: int) -> None:
        if self.record.swa_scratch_reuse:
            raise ConfigError(f"KVCache {self.id}: cannot set capacity ({capacity!r}) while SWA scratch reuse is "
                              f"enabled (the scratch range depends on history too); use resize(capacity, history_length)")
        if not self.resize(capacity):
            raise OutOfPagesError(f"KVCache {self.id}: no pages for capacity {capacity}")

    def commit(self, accepted_input_tokens: Sequence[TokenIdExt] | npt.ArrayLike, beam_search_indices: Sequence[int] | None = None,
               is_end: bool = False, *, priority: int | None = None) -> None:
        """Declare the KV of ``accepted_input_tokens`` (appended after the committed ones) written and
        final; ``is_end`` also stops committing.

        With prefix reuse, blocks this fills enter the prefix tree; ``priority`` (0-100, default 35)
        is their eviction priority (lower goes first) and also updates blocks already there.
        """
        self._check_active("commit")
        if beam_search_indices is not None:
            raise ConfigError(f"KVCache {self.id}.commit: beam_search_indices are not supported (beam width 1)")
        if not self._commit_allowed:
            raise LogicError(f"KVCache {self.id}.commit: committing was stopped (stop_committing or is_end)")
        if priority is not None:
            priority = check_priority(priority, f"KVCache {self.id}.commit")
        arr = self._ops.encode_tokens(accepted_input_tokens, f"KVCache {self.id}.commit")
        if self.num_committed_tokens + arr.size > self.record.capacity:
            raise CapacityError(f"KVCache {self.id}: commit of {arr.size} tokens past capacity "
                                f"({self.num_committed_tokens} committed, capacity {self.record.capacity})")
        self._ops.check_commit(self, int(arr.size))
        self.record.tokens = np.concatenate([self.record.tokens, arr])
        self.record.history = max(self.record.history, self.num_committed_tokens)
        self._ops.on_commit(self, priority, is_end)
        self._ops.release_out_of_window(self)
        self._sync_index_bufs()
        if is_end:
            self._ops.store_tail(self)
            self._commit_allowed = False

    def set_priority(self, priority: int) -> None:
        """Set the eviction priority (0-100, lower goes first) of every committed block of this
        request that is in the prefix tree."""
        self._check_open("set_priority")
        self._ops.set_priority(self, check_priority(priority, f"KVCache {self.id}.set_priority"))

    def __del__(self) -> None:
        """A cache dropped unclosed is handed back to its manager, which closes it (as ``close()``)."""
        try:
            if self.state is not CacheState.CLOSED:
                self._ops.drop(self)
        except Exception:   # interpreter teardown: nothing left to release into
            pass

    def close(self) -> None:
        """Release every page this cache holds (a second close does nothing). Pending statistics are
        committed first (``discard_pending_stats()`` before closing drops them)."""
        if self.state is CacheState.CLOSED:
            return
        self._ops.close(self)
        self.state = CacheState.CLOSED
        self.record.blocks = [np.empty(0, dtype=np.int32) for _ in self.record.blocks]
        self.record.tiers = [np.empty(0, dtype=np.int8) for _ in self.record.tiers]
        self.record.scratch = [np.empty(0, dtype=np.int32) for _ in self.record.scratch]
        self.record.scratch_range = [(0, 0)] * len(self.record.scratch)
        self.record.capacity = 0
        self._sync_index_bufs()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state is not CacheState.CLOSED:
            self.close()

    def __repr__(self) -> str:
        return (f"KVCache(id={self.id!r}, state={self.state.value}, capacity={self.record.capacity}, "
                f"history={self.record.history}, committed={self.num_committed_tokens})")
