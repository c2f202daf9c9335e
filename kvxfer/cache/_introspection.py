"""Backend-neutral inspection helpers (the reference design's ``_introspection`` module): what tests,
the extractor and sparse-attention managers read off a manager or a kv cache, computed from their
public interfaces only, plus the pool-sizing arithmetic (grains of a memory granularity to slots,
from ``pool_ratio``).

Test blocks for event tests (``make_test_block``) are stand-alone blocks keyed as the manager keys its
tree blocks. The auto-tuner hooks set the counters and the target of the manager's ``pool_tuner``.
The reference's helpers that reach into its C++ backend (the padding cold-page codec) have no kvxfer
counterpart and are absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.cache.common import GPU_LEVEL, PRIORITY_DEFAULT
from kvxfer.cache.hashing import ReuseScope, TokenIdExt, block_keys
from kvxfer.cache.manager_config import BatchDesc, SwaScratchReuseConfig
from kvxfer.cache.pool_ratio import grains_for_slots as grains_for_slots
from kvxfer.cache.pool_ratio import grains_to_slots as grains_to_slots
from kvxfer.cache.pool_ratio import ratio_to_slot_count_list as ratio_to_slot_count_list
from kvxfer.cache.stats import StorageStatistics
from kvxfer.errors import ConfigError

# --- pool sizing (``pool_ratio``) and the auto-tuner (``pool_tuner``) ------------------------------


def compute_slots_for_batch(manager: Any, batch: BatchDesc, tokens_per_block: int,
                            swa_scratch_reuse: SwaScratchReuseConfig | None = None) -> list[int]:
    """The fewest primary slots per pool group that run ``batch`` at once; with ``swa_scratch_reuse``
    a request's scratch blocks take the shared slots that hold them (None: a slot each)."""
    if tokens_per_block != manager.tokens_per_block:
        raise ConfigError(f"compute_slots_for_batch: tokens_per_block {tokens_per_block} is not the manager's "
                          f"{manager.tokens_per_block}")
    return list(manager.compute_slots_for_batch(batch, swa_scratch_reuse))


def set_num_sampled_kv_caches(manager: Any, value: int) -> None:
    """Set the sampled-kv-cache counter the auto-tuner's first gate reads."""
    manager.pool_tuner.set_num_sampled(value)


def set_last_adjustment_time(manager: Any, value: float) -> None:
    """Set the ``time.monotonic()`` of the last pool re-split (the cooldown counts from it)."""
    manager.pool_tuner.set_last_adjustment_time(value)


def set_target_ratio_list_gpu(manager: Any, ratios: Sequence[float]) -> None:
    """Override the auto-tuner's target primary ratio (drives the next re-split)."""
    manager.pool_tuner.set_target_ratio(ratios)


def set_target_ratio_list_other(manager: Any, ratios: Sequence[float]) -> None:
    """Override the auto-tuner's target ratio of the colder levels (host, disk); kvxfer's addition."""
    manager.pool_tuner.set_target_ratio(ratios, colder=True)


def current_other_ratio(manager: Any) -> list[float]:
    """Each pool group's share of the colder levels' bytes, averaged over them (kvxfer's addition)."""
    return list(manager.pool_tuner.current_other_ratio())


def force_rebalance_precondition(manager: Any, skew: float = 2.0) -> None:
    """Open the auto-tuner's sample and cooldown gates and scale pool group 0's target share by
    ``skew`` (renormalised), so the next ``adjust()`` really moves slots; ConfigError with fewer than
    two pool groups (the re-split would be a no-op)."""
    current = current_gpu_ratio(manager)
    if len(current) < 2:
        raise ConfigError(f"force_rebalance_precondition: needs at least 2 pool groups, got {len(current)}")
    if not skew > 0:
        raise ConfigError(f"force_rebalance_precondition: skew must be > 0, got {skew!r}")
    set_num_sampled_kv_caches(manager, max(manager.init_config.rebalance_min_sampled_kv_caches, 0) + 1)
    set_last_adjustment_time(manager, 0.0)
    skewed = [current[0] * skew, *current[1:]]
    total = sum(skewed)
    set_target_ratio_list_gpu(manager, [x / total for x in skewed])


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


def committed_page_is_linked(kv_cache: Any, ordinal: int, lc_id: int) -> bool | None:
    """Whether the kv cache's page of block ``ordinal`` in life cycle ``lc_id`` is still a prefix-tree
    block's page (None: no page there, or an uncommitted one). A page a wider one replaced in its block
    is no longer tied to that block, so nothing reaches the block through it once the block goes."""
    linked: bool | None = kv_cache.manager.lifecycle.committed_page_in_tree(kv_cache, ordinal, lc_id)
    return linked


def all_tree_pages_droppable(manager: Any) -> bool:
    """Whether only the prefix tree holds every page of every tree block (no request shares one)."""
    pg_of = manager.get_life_cycle_pool_group_indices(0)
    for node in manager.prefix_tree.nodes():
        for lg, (page, tier) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0 and manager.allocator(pg_of[lg], tier).refcount[page] != 1:
                return False
    return True


def active_page_stats(kv_cache: Any) -> tuple[list[int], list[int]]:
    """(the kv cache's pages by cache level, those of them that are evictable but not eviction
    candidates). kvxfer's eviction takes its victims from every page no active or resuming request
    locks, so a page of a suspended request is a candidate the moment it is suspended: the second list
    counts only the primary pages of a request held in place while it resumes (zero otherwise)."""
    manager = kv_cache.manager
    levels = len(manager.cache_tier_list)
    counts = [0] * levels
    unscheduled = [0] * levels
    held_in_place = not kv_cache.is_active and kv_cache.id in manager.resuming_cache_ids
    for lg in range(len(manager.layer_grouping)):
        ids, tiers = kv_cache.page_locations(lg)
        for page, tier in zip(ids.tolist(), tiers.tolist(), strict=True):
            if page < 0:
                continue
            counts[tier] += 1
            if held_in_place and tier == 0 < levels - 1:
                unscheduled[tier] += 1
    return counts, unscheduled


def _reuse_match(manager: Any, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt], enable_partial: bool,
                 caller: str) -> tuple[int, list[Any]]:
    """(tokens matched, the matched tree blocks, the partial one last) of ``tokens`` in the prefix tree."""
    scope = reuse_scope or ReuseScope()
    algo = manager.resolved_hash_algo
    root = scope.root_key_for(algo)
    arr = manager.lifecycle.encode_tokens(list(tokens), caller)
    keys = block_keys(arr, manager.tokens_per_block, root, algo=algo, scope=scope, digests=manager.digest_table)
    match = manager.prefix_tree.match(root, keys, arr, exact_only=not enable_partial)
    nodes = list(match.nodes) + ([match.partial] if match.partial is not None else [])
    num_tokens = len(match.nodes) * manager.tokens_per_block + (match.partial_tokens if match.partial else 0)
    return num_tokens, nodes


def reuse_match_pages(manager: Any, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt], lc_id: int,
                      enable_partial: bool = False) -> tuple[int, list[tuple[int, int | None] | None]]:
    """Match ``tokens`` against the prefix tree: (tokens matched, per matched block ``(slot, tokens its
    page holds)`` of layer group ``lc_id``'s page, or None where that block has no page there). An
    attention page holds a prefix of its block; a recurrent snapshot is the state after exactly that
    many tokens of it."""
    num_tokens, nodes = _reuse_match(manager, reuse_scope, tokens, enable_partial, "reuse_match_pages")
    pages: list[tuple[int, int | None] | None] = []
    for node in nodes:
        page = int(node.pages[lc_id])
        pages.append(None if page < 0 else (page, node.page_coverage(lc_id)))
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
