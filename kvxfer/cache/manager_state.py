"""The KVCacheManager's state (declared here, set by KVCacheManager.__init__) and its small shared
queries: configuration, published pools, slot allocators per tier, tier indices."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.common import LifeCycleId
from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, PrimaryTier
from kvxfer.cache.copy_engine import CopyEngine
from kvxfer.cache.descriptors import CacheLayoutDesc, PoolGroupDesc
from kvxfer.cache.events import EventQueue
from kvxfer.cache.hashing import HASH_V2_SHA256_PACKED, DigestTable, TokenArray
from kvxfer.cache.kv_cache import CacheState, KVCache
from kvxfer.cache.manager_config import (
    EXTRA_COMMIT_MIN_SNAPSHOT,
    EXTRA_STORE_TAIL_BLOCKS,
    KVCacheManagerConfig,
)
from kvxfer.cache.pool_ratio import PoolRatioPlanner
from kvxfer.cache.radix_tree import BlockNode, PrefixTree
from kvxfer.cache.stats import ReusedBlocksByLevel, StatsCollector, TierTrafficCounter
from kvxfer.cache.streams import SlotReadiness
from kvxfer.cache.tiers import TierStorage
from kvxfer.errors import CapacityError, KVCacheError, ManagerBusyError, TierError


class ManagerState:
    """State every part of the manager reads: declared here, assigned by ``KVCacheManager.__init__``."""

    config: CacheConfig
    current: CacheConfig
    key_algo: str
    #: Codes of the multimodal digest tokens this manager has seen (``v2_sha256_packed`` keys only).
    digests: DigestTable
    device: torch.device
    pools: list[list[torch.Tensor]]
    layout: CacheLayoutDesc
    allocators: list[SlotAllocator]
    lg_pool_group: list[int]
    tree: PrefixTree
    in_tree: list[npt.NDArray[np.bool_]]
    events: EventQueue
    medium: str
    has_windows: bool
    #: The recurrent (SSM) layer groups, and the pool groups holding only their state slots.
    recurrent_groups: list[int]
    recurrent_pool_groups: set[int]
    #: (id of a tree block, layer group) -> open planned drops naming that page.
    planned_drops: dict[tuple[int, int], int]
    #: Open kv caches by id, held weakly: a cache its owner drops unclosed is closed by the manager
    #: (queued in ``dropped`` by ``KVCache.__del__``, closed at the manager's next entry point).
    caches: weakref.WeakValueDictionary[Any, KVCache]
    dropped: list[KVCache]
    ids: Iterator[int]
    lock: threading.RLock
    shut_down: bool
    pg_layer_groups: list[list[int]]
    pinned: set[str]
    readiness: SlotReadiness | None
    tiers: list[TierStorage]
    media: list[str]
    copier: CopyEngine | None
    host_tier_error: str | None
    in_tree_t: list[list[npt.NDArray[np.bool_]]]
    tree_owner: list[list[dict[int, tuple[BlockNode, int]]]]
    traffic: TierTrafficCounter
    page_bytes: list[int]
    stats: StatsCollector
    reuse_match_backoff: int
    init_config: KVCacheManagerConfig
    event_manager: Any
    suspend_resume: list[int]
    disk_prefetch_blocks: int
    cached_tokens_by_level: list[int]
    reused_blocks_by_level: dict[LifeCycleId, ReusedBlocksByLevel]
    #: Slot counts per pool group by ratio (``pool_ratio``), for the initial split and the tuner.
    planner: PoolRatioPlanner

    @property
    def current_config(self) -> CacheConfig:
        """The configuration in force now: ``config`` with the quotas ``resize_quota`` set and without
        a host tier that could not be set up."""
        return self.current

    @property
    def drops_stale_window_pages(self) -> bool:
        """Whether the tree lets go of sliding-window pages a request moved past (kvxfer's ``CacheConfig``
        default, and ``KVCacheManagerConfig.commit_min_snapshot``); a ``KVCacheManagerConfig`` manager
        without it keeps them reusable (evictable) as the reference does."""
        return bool(dict(self.config.extra).get(EXTRA_COMMIT_MIN_SNAPSHOT, True))

    @property
    def drops_reused_window_pages(self) -> bool:
        """Whether a request moving past sliding-window pages it reused from the tree takes them out of
        the tree too (kvxfer's ``CacheConfig`` default). Under ``KVCacheManagerConfig.commit_min_snapshot``
        a request's commits keep only the minimum snapshot of what it enters; pages earlier requests
        entered stay for the endpoints that need them."""
        return EXTRA_COMMIT_MIN_SNAPSHOT not in dict(self.config.extra)

    @property
    def stores_tail_blocks(self) -> bool:
        """Whether a closing request enters its partial last block into the prefix tree (a
        ``KVCacheManagerConfig`` manager, as the reference; not a ``CacheConfig`` one by default)."""
        return bool(dict(self.config.extra).get(EXTRA_STORE_TAIL_BLOCKS, False))

    def encode_tokens(self, tokens: Any, what: str) -> TokenArray:
        """``tokens`` as the manager's int64 token array: ids, and under ``v2_sha256_packed`` keys also
        32-byte multimodal digests (as their ``DigestTable`` codes); CapacityError for anything else."""
        arr = self.digests.encode(tokens, what)
        if self.key_algo != HASH_V2_SHA256_PACKED and arr.size and int(arr.min()) < 0:
            raise CapacityError(f"{what}: multimodal digest tokens need hash_algo {HASH_V2_SHA256_PACKED!r} "
                                f"(the manager keys blocks with {self.key_algo!r})")
        return arr

    @property
    def hash_algo(self) -> str:
        """The block-key algorithm as configured (``CacheConfig.hash_algo``; may be ``auto``)."""
        return self.config.hash_algo

    @property
    def resolved_hash_algo(self) -> str:
        """The concrete block-key algorithm (``auto`` resolved to ``v1_block_key``); pass either name
        to ``kvxfer.cache.hashing.block_hash_for_event`` to publish a key."""
        return self.key_algo


    @property
    def pool_group_descs(self) -> tuple[PoolGroupDesc, ...]:
        """The pool groups of the published layout."""
        return self.layout.pool_groups

    def pool_tensor(self, pool_group: int, pool: int) -> torch.Tensor:
        """The raw byte tensor of one pool (for copy engines and tests)."""
        return self.pools[pool_group][pool]

    def allocator(self, pool_group: int, tier: int = 0) -> SlotAllocator:
        """The slot allocator of a pool group in a tier (0 = primary; read-only use: counts and
        reference counts)."""
        if tier:
            self.check_tier_index(tier)
            return self.alloc_of(tier, pool_group)
        return self.allocators[pool_group]

    def num_free_slots(self, pool_group: int = 0) -> int:
        """Free slots of a pool group."""
        return self.allocators[pool_group].num_free

    def alloc_of(self, tier: int, pool_group: int) -> SlotAllocator:
        """The slot allocator of a pool group in a tier (no index check)."""
        return self.tiers[tier].allocator(pool_group)

    def node_medium(self, node: BlockNode) -> str:
        """The medium of the coldest tier holding one of ``node``'s pages (the primary's when none)."""
        held = node.tiers[node.pages >= 0]
        return self.media[int(held.max()) if held.size else 0]

    def unmark_tree_page(self, tier: int, pool_group: int, page: int) -> None:
        """Record that a tier's slot no longer holds a tree page."""
        self.in_tree_t[tier][pool_group][page] = False
        self.tree_owner[tier][pool_group].pop(page, None)

    def copy_slots(self, pool_group: int, src: npt.ArrayLike, dst: npt.ArrayLike) -> None:
        """Copy whole slots ``src[i] -> dst[i]`` in every pool of a pool group (one batched copy
        per pool, on the pool's device)."""
        pg = self.layout.pool_groups[pool_group]
        src_ids = self.allocators[pool_group].check(src, "copy source slot").astype(np.int64)
        dst_ids = self.allocators[pool_group].check(dst, "copy destination slot").astype(np.int64)
        if src_ids.shape != dst_ids.shape:
            raise KVCacheError(f"copy_slots: {src_ids.size} sources for {dst_ids.size} destinations")
        for pool, raw in zip(pg.pools, self.pools[pool_group], strict=True):
            rows = raw.view(pool.num_slots, pool.slot_bytes)
            rows[torch.from_numpy(dst_ids).to(raw.device)] = rows[torch.from_numpy(src_ids).to(raw.device)]

    @property
    def prefix_tree(self) -> PrefixTree:
        """The prefix tree (read-only use: inspection, tests, benchmarks)."""
        return self.tree

    @property
    def open_caches(self) -> list[KVCache]:
        """Caches created and not yet closed."""
        return list(self.caches.values())

    @property
    def tier_media(self) -> tuple[str, ...]:
        """Each tier's medium name in events ("GPU", "CPU", "DISK"), primary first."""
        return tuple(self.media)

    @property
    def num_tiers(self) -> int:
        """Tiers of this manager, primary first (1 without host or disk tiers)."""
        return len(self.tiers)

    def tier_index(self, tier: int | type[PrimaryTier | HostTier | DiskTier]) -> int:
        """Index of a tier given as an index or as its config class (PrimaryTier, HostTier, DiskTier)."""
        if isinstance(tier, type):
            for i, cfg in enumerate(self.current.tiers):
                if isinstance(cfg, tier):
                    return i
            missing = f"; its set-up failed: {self.host_tier_error}" if tier is HostTier and self.host_tier_error else ""
            raise TierError(f"the manager has no {tier.__name__} (tiers: "
                            f"{[type(t).__name__ for t in self.current.tiers]}){missing}")
        self.check_tier_index(tier)
        return int(tier)

    def check_tier_index(self, tier: int) -> None:
        """TierError unless ``tier`` is the index of a tier in force."""
        if isinstance(tier, bool) or not isinstance(tier, int | np.integer) or not 0 <= tier < len(self.tiers):
            raise TierError(f"no tier {tier!r} (have 0..{len(self.tiers) - 1})")

    def check_no_active(self, what: str) -> None:
        """ManagerBusyError while any kv cache is active (``what`` names the refused call)."""
        active = [c.id for c in self.caches.values() if c.state is CacheState.ACTIVE]
        if active:
            raise ManagerBusyError(f"{what}: {len(active)} KV caches are active: {active[:5]} "
                                   f"(suspend or close them first)")

    def set_tier_config(self, t: int, cfg: PrimaryTier | HostTier | DiskTier) -> None:
        """Record a tier's new configuration in ``current`` (after a quota resize)."""
        tiers = list(self.current.tiers)
        tiers[t] = cfg
        self.current = dataclasses.replace(self.current, tiers=tuple(tiers))
