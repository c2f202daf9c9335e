"""Backend-neutral inspection helpers (the reference design's ``_introspection`` module): what tests,
the extractor and sparse-attention managers read off a manager or a kv cache, computed from their
public interfaces only, plus the pool-sizing arithmetic (grains of a memory granularity to slots).

Test blocks for event tests (``make_test_block``) are stand-alone blocks keyed as the manager keys its
tree blocks. The reference's helpers that reach into its C++ backend (the padding cold-page codec,
auto-tuner knobs) have no kvxfer counterpart and are absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.cache.common import GPU_LEVEL, PRIORITY_DEFAULT, div_up
from kvxfer.cache.hashing import ReuseScope, TokenIdExt, block_keys
from kvxfer.cache.stats import StorageStatistics
from kvxfer.errors import ConfigError

# --- pool sizing --------------------------------------------------------------------------------------


def grains_for_slots(num_slots: int, slot_size_list: Sequence[int], granularity: int) -> int:
    """Grains of ``granularity`` bytes that ``num_slots`` slots take: each pool of the pool group
    (one per slot size) is rounded up to whole grains."""
    if granularity <= 0:
        raise ConfigError(f"grains_for_slots: granularity must be > 0, got {granularity}")
    return sum(div_up(num_slots * size, granularity) for size in slot_size_list)


def grains_to_slots(pg_grains: int, slot_size_list: Sequence[int], granularity: int) -> tuple[int, int]:
    """(the most slots ``pg_grains`` grains hold, the grains those slots take)."""
    per_slot = sum(slot_size_list)
    if per_slot <= 0:
        raise ConfigError(f"grains_to_slots: slot sizes must be positive, got {list(slot_size_list)}")
    lo, hi = 0, pg_grains * granularity // per_slot
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if grains_for_slots(mid, slot_size_list, granularity) <= pg_grains:
            lo = mid
        else:
            hi = mid - 1
    return lo, grains_for_slots(lo, slot_size_list, granularity)


def ratio_to_slot_count_list(quota: int, slot_size_lists: Sequence[Sequence[int]], ratio_list: Sequence[float],
                             granularity: int, min_slots: Sequence[int]) -> list[int]:
    """Slots per pool group splitting ``quota`` bytes by ``ratio_list``, each pool group getting at
    least ``min_slots`` (a pool group whose share would fall short is held at its minimum and the
    rest is split among the others by their ratios)."""
    n = len(slot_size_lists)
    if not len(ratio_list) == len(min_slots) == n:
        raise ConfigError(f"ratio_to_slot_count_list: {n} pool groups, {len(ratio_list)} ratios, "
                          f"{len(min_slots)} minimums")
    total = quota // granularity
    mins = [grains_for_slots(m, sizes, granularity) for m, sizes in zip(min_slots, slot_size_lists, strict=True)]
    if sum(mins) > total:
        raise ConfigError(f"ratio_to_slot_count_list: quota {quota} holds {total} grains, the minimums need "
                          f"{sum(mins)}")
    pinned: set[int] = set()
    while True:
        free = total - sum(mins[i] for i in pinned)
        weight = sum(ratio_list[i] for i in range(n) if i not in pinned)
        grains = [mins[i] if i in pinned else (int(free * ratio_list[i] / weight) if weight > 0 else 0)
                  for i in range(n)]
        short = [i for i in range(n) if i not in pinned and grains[i] < mins[i]]
        if not short:
            break
        pinned.update(short)
    out = []
    for i in range(n):
        slots, _ = grains_to_slots(grains[i], slot_size_lists[i], granularity)
        out.append(max(slots, int(min_slots[i])))
    return out


# --- manager and kv-cache views ------------------------------------------------------------------------


def storage_statistics(manager: Any, cache_level: int = 0) -> list[StorageStatistics]:
    """Slot counts of each pool group at a cache level."""
    return list(manager.get_storage_statistics(cache_level))


def storage_utilization(manager: Any, cache_level: int = 0) -> list[float]:
    """Fraction of each pool group's slots held by requests at a cache level."""
    return [s.unavailable / s.total if s.total else 0.0 for s in manager.get_storage_statistics(cache_level)]


def pool_group_index(manager: Any, lc_id: int, cache_level: int = 0) -> int:
    """The pool group a layer group's pages live in at a cache level."""
    return int(manager.get_life_cycle_pool_group_indices(cache_level)[lc_id])


def current_gpu_ratio(manager: Any) -> list[float]:
    """Each pool group's share of the primary level's bytes."""
    sizes = [s.total * sum(s.slot_sizes) for s in manager.get_storage_statistics(0)]
    total = sum(sizes)
    return [x / total if total else 0.0 for x in sizes]


def attention_life_cycle_ids(manager: Any) -> list[int]:
    """The attention layer groups (every layer group but the recurrent one)."""
    return [lg.layer_group_id for lg in manager.layout.layer_groups if not lg.recurrent]


def swa_life_cycle_ids(manager: Any) -> list[int]:
    """The layer groups with a sliding window."""
    return [lg.layer_group_id for lg in manager.layout.layer_groups if lg.window is not None]


def ssm_life_cycle_id(manager: Any) -> int | None:
    """The recurrent (SSM) layer group, None when the manager has no recurrent layers."""
    return next((lg.layer_group_id for lg in manager.layout.layer_groups if lg.recurrent), None)


def is_commit_allowed(kv_cache: Any) -> bool:
    """Whether the kv cache still accepts ``commit``."""
    return bool(kv_cache.commit_allowed)


def all_tree_pages_droppable(manager: Any) -> bool:
    """Whether only the prefix tree holds every page of every tree block (no request shares one)."""
    pg_of = manager.get_life_cycle_pool_group_indices(0)
    for node in manager.prefix_tree.nodes():
        for lg, (page, tier) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0 and manager.allocator(pg_of[lg], tier).refcount[page] != 1:
                return False
    return True


def active_page_stats(kv_cache: Any) -> tuple[list[int], list[int]]:
    """(the kv cache's pages by cache level, those of them that could be offloaded now): a suspended
    request's pages above the coldest level can move down; an active request's cannot."""
    levels = len(kv_cache.manager.cache_tier_list)
    counts = [0] * levels
    movable = [0] * levels
    for lg in range(len(kv_cache.manager.layer_grouping)):
        ids, tiers = kv_cache.page_locations(lg)
        for page, tier in zip(ids.tolist(), tiers.tolist(), strict=True):
            if page < 0:
                continue
            counts[tier] += 1
            if not kv_cache.is_active and tier < levels - 1:
                movable[tier] += 1
    return counts, movable


def _reuse_match(manager: Any, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt], enable_partial: bool,
                 caller: str) -> tuple[int, list[Any]]:
    """(tokens matched, the matched tree blocks, the partial one last) of ``tokens`` in the prefix tree."""
    scope = reuse_scope or ReuseScope()
    algo = manager.resolved_hash_algo
    root = scope.root_key_for(algo)
    arr = manager.lifecycle.encode_tokens(list(tokens), caller)
    keys = block_keys(arr, manager.tokens_per_block, root, algo=algo, scope=scope, digests=manager.digest_table)
    match = manager.prefix_tree.match(root, keys, arr)
    partial = match.partial
    if partial is not None and not enable_partial:
        # without partial matching a tail block still matches when its tokens are exactly the rest
        rest = arr.size - len(match.nodes) * manager.tokens_per_block
        if not match.partial_tokens == partial.tokens.size == rest:
            partial = None
    nodes = list(match.nodes) + ([partial] if partial is not None else [])
    num_tokens = len(match.nodes) * manager.tokens_per_block + (match.partial_tokens if partial is not None else 0)
    return num_tokens, nodes


def reuse_match_pages(manager: Any, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt], lc_id: int,
                      enable_partial: bool = False) -> tuple[int, list[tuple[int, int | None] | None]]:
    """Match ``tokens`` against the prefix tree: (tokens matched, per matched block ``(slot, tokens in
    the block)`` of layer group ``lc_id``'s page, or None where that block has no page there)."""
    num_tokens, nodes = _reuse_match(manager, reuse_scope, tokens, enable_partial, "reuse_match_pages")
    pages: list[tuple[int, int | None] | None] = []
    for node in nodes:
        page = int(node.pages[lc_id])
        pages.append(None if page < 0 else (page, int(node.tokens.size)))
    return num_tokens, pages


def reuse_match_planned_drop_counts(manager: Any, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt],
                                    lc_id: int, enable_partial: bool = False) -> tuple[int, list[int]]:
    """Match ``tokens`` against the prefix tree: (tokens matched, per matched block the open planned drops
    naming its page of layer group ``lc_id``)."""
    num_tokens, nodes = _reuse_match(manager, reuse_scope, tokens, enable_partial, "reuse_match_planned_drop_counts")
    return num_tokens, [manager.lifecycle.planned_drop_count(node, lc_id) for node in nodes]


# --- test blocks for event tests ----------------------------------------------------------------------


@dataclass
class TestPage:
    """A page of a test block: its cache level, eviction priority and the tokens of the block it holds."""

    num_tokens: int
    cache_level: int = GPU_LEVEL
    priority: int = PRIORITY_DEFAULT


@dataclass
class TestRoot:
    """The root a first test block hangs from: the reuse scope's root key."""

    reuse_scope: ReuseScope
    key: bytes
    ordinal: int = -1


@dataclass
class TestBlock:
    """A block shaped as the manager's prefix-tree blocks are for the event manager (``EventSourceBlock``):
    its key chained from ``prev`` with the manager's block-key algorithm, its key tokens, and per life cycle
    a page covering ``coverage`` tokens. It holds no slot and is not in the manager's tree."""

    tokens: list[TokenIdExt]
    prev: TestBlock | TestRoot
    storage: list[TestPage | None] = field(default_factory=list)
    key: bytes = b""
    closed: bool = False


def make_test_block(manager: Any, tokens: Sequence[TokenIdExt], coverage_per_lc: Sequence[int],
                    parent: TestBlock | None = None, reuse_scope: ReuseScope | None = None) -> TestBlock:
    """A test block of ``tokens`` under ``parent`` (None: the root of ``reuse_scope``), keyed as ``manager``
    keys blocks, whose page of life cycle ``i`` covers ``coverage_per_lc[i]`` tokens (0: no page)."""
    num_lc = len(manager.layer_grouping)
    if len(coverage_per_lc) != num_lc:
        raise ConfigError(f"make_test_block: {len(coverage_per_lc)} coverages for {num_lc} life cycles")
    if not 0 < len(tokens) <= manager.tokens_per_block:
        raise ConfigError(f"make_test_block: a block holds 1..{manager.tokens_per_block} tokens, got {len(tokens)}")
    if any(not 0 <= c <= len(tokens) for c in coverage_per_lc):
        raise ConfigError(f"make_test_block: coverages must be in [0, {len(tokens)}], got {list(coverage_per_lc)}")
    algo = manager.resolved_hash_algo
    prev: TestBlock | TestRoot
    if parent is None:
        scope = reuse_scope or ReuseScope()
        prev = TestRoot(scope, scope.root_key_for(algo))
    else:
        prev = parent
    arr = manager.lifecycle.encode_tokens(list(tokens), "make_test_block")
    key = block_keys(arr, len(tokens), prev.key, algo=algo, digests=manager.digest_table)[0]
    pages: list[TestPage | None] = [TestPage(c) if c else None for c in coverage_per_lc]
    return TestBlock(list(tokens), prev, pages, key)


def close_test_block(block: TestBlock) -> None:
    """Release a test block (its pages are gone; a closed block publishes nothing)."""
    block.storage = [None] * len(block.storage)
    block.closed = True


def test_block_key(block: TestBlock) -> bytes:
    """A test block's key."""
    return block.key


def event_manager_add_stored_block(event_manager: Any, block: Any) -> None:
    """Publish ``block`` as stored (``KVCacheEventManager.add_stored_block_event_from_block``)."""
    event_manager.add_stored_block_event_from_block(block)


def event_manager_add_stored_life_cycle(event_manager: Any, block: Any, life_cycle_id: int) -> None:
    """Publish that ``block`` got a page for ``life_cycle_id`` (``add_stored_life_cycle_event_from_block``)."""
    event_manager.add_stored_life_cycle_event_from_block(block, life_cycle_id)
