"""Storage across tiers: onboarding a request's offloaded pages, tier statistics, quotas (colder tiers
rebuilt at a new size; the primary resized and rebalanced inside its registered pools)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache import tiers as tier_storage
from kvxfer.cache.config import DiskTier, HostTier, PrimaryTier
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.layout import check_placed, plan_layout
from kvxfer.cache.manager_config import EXTRA_POOL_RATIO
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.memory import allocate_pool
from kvxfer.cache.radix_tree import BlockNode
from kvxfer.cache.stats import TierTraffic
from kvxfer.cache.tiers import DiskTierStorage, TierStats, TierStorage, primary_tier_of
from kvxfer.errors import ConfigError, TierError

IntArray = npt.NDArray[np.int32]


class TierQuotas:
    """Onboarding and tier quotas."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    def offloaded_pages(self, cache: KVCache) -> dict[int, dict[int, IntArray]]:
        """The cache's pages outside the primary tier: {pool group: {tier: slots}}."""
        out: dict[int, dict[int, list[IntArray]]] = {}
        for lg, (blocks, tiers) in enumerate(zip(cache.record.blocks, cache.record.tiers, strict=True)):
            away = (blocks >= 0) & (tiers > 0)
            for tier in np.unique(tiers[away]).tolist():
                out.setdefault(self.state.lg_pool_group[lg], {}).setdefault(tier, []).append(blocks[away & (tiers == tier)])
        return {pg: {t: np.unique(np.concatenate(parts)).astype(np.int32) for t, parts in by_tier.items()}
                for pg, by_tier in out.items()}

    def cow_needs(self, cache: KVCache) -> dict[int, int]:
        """Primary slots the copy of a partially reused block will take, per pool group."""
        if cache.record.partial_src is None:
            return {}
        b = cache.num_committed_tokens // self.state.layout.tokens_per_block
        needs: dict[int, int] = {}
        for lg, blocks in enumerate(cache.record.blocks):
            if lg not in self.state.recurrent_groups and blocks[b] >= 0:
                needs[self.state.lg_pool_group[lg]] = needs.get(self.state.lg_pool_group[lg], 0) + 1
        return needs

    def over_resume_limit(self) -> bool:
        """Whether some primary pool group's utilization (slots neither free nor evictable, over its
        usable slots: what ``get_storage_statistics`` reports) is above ``resume_max_utilization``: a
        resume is then refused whatever it needs, leaving room for the running caches to grow. Every
        pool group counts, recurrent state slots included, as in the reference's gate."""
        limit = self.state.config.resume_max_utilization
        for pg in range(len(self.state.allocators)):
            acc = self.parts.usage.quick_accounting(0, pg)
            if acc.total and (acc.total - acc.available) / acc.total > limit:
                return True
        return False

    def can_take(self, pool_group: int, n: int, swap: bool) -> bool:
        """Whether ``n`` more primary slots can be locked: within ``resume_max_utilization`` of the
        pool group, and obtainable (free, or freed by offloading/dropping unlocked pages). With
        ``swap`` (the slots are for onboarding pages from colder tiers) one slot to start with is
        enough: every page brought up frees a slot below that a displaced page can take."""
        alloc = self.state.allocators[pool_group]
        limit = math.floor(self.state.config.resume_max_utilization * alloc.usable + 1e-9)
        # The headroom rule holds back slots for attention pages to grow into; a pool group of recurrent
        # state slots only has nothing to grow (a request keeps one state slot), so there a resume takes
        # what is obtainable, as the reference's resume does once its utilization gate has passed.
        if pool_group not in self.state.recurrent_pool_groups and \
                int(np.count_nonzero(self.parts.eviction.locked_mask(0, pool_group))) + n > limit:
            return False
        start = min(n, 1) if swap else n
        return alloc.num_free >= start or alloc.num_free + self.parts.eviction.room_estimate(0, pool_group) >= start

    def onboard(self, cache: KVCache, pool_group: int, n: int) -> bool:
        """Bring the cache's offloaded pages of a pool group back to the primary tier (warmest tier
        first) and leave ``n`` minus their count slots free for its partial-block copy. Room is made
        as it goes: when the tiers are full, each chunk brought up frees the slots the pages it
        displaces move down to. False when no room could be made (the cache must be pinned)."""
        alloc = self.state.allocators[pool_group]
        extra = n - sum(src.size for src in self.offloaded_pages(cache).get(pool_group, {}).values())
        while True:
            # Making room may move the cache's colder pages further down: read them afresh.
            by_tier = self.offloaded_pages(cache).get(pool_group, {})
            left = sum(src.size for src in by_tier.values())
            want = left + extra
            if alloc.num_free < want:
                self.parts.eviction.make_room_in(0, pool_group, want - alloc.num_free)
                by_tier = self.offloaded_pages(cache).get(pool_group, {})
            if left == 0:
                return alloc.num_free >= want
            take = min(alloc.num_free, left)
            if take == 0:
                return False
            jobs: list[tuple[int, IntArray, int, IntArray]] = []
            for t in sorted(by_tier):                        # warmest first
                part = by_tier[t][:take]
                if part.size:
                    jobs.append((t, part, 0, alloc.alloc(part.size)))
                    take -= part.size
            self.parts.movement.copy_pages(pool_group, jobs)
            for t, src, _, dst in jobs:
                self.parts.movement.relocate(pool_group, t, src, 0, dst)

    def tier_traffic(self) -> TierTraffic:
        """Pages offloaded into / onboarded from each tier, blocks dropped, bytes moved (cumulative)."""
        with self.state.lock:
            return self.state.traffic.snapshot()

    def storage_stats(self, tier: int | type[PrimaryTier | HostTier | DiskTier] = 0) -> TierStats:
        """Capacity and occupancy (slots per pool group) of one tier."""
        with self.state.lock:
            return self.state.tiers[self.state.tier_index(tier)].stats()

    def resize_quota(self, tier: int | type[PrimaryTier | HostTier | DiskTier], quota_bytes: int) -> None:
        """Give a tier a new quota; only while no request is ACTIVE (ManagerBusyError).

        Host or disk: a new tier of that size is built (a ``KVCacheManagerConfig`` manager splits it by
        the auto-tuner's target of the colder levels, floors kept), the tier's live pages are copied into
        its first slots (after offloading or dropping the surplus, coldest first), and the old tier is
        closed. Primary: its pools stay where they are (their addresses are published to transports
        and registered), so the quota can only shrink below, or grow back up to, the initial
        ``PrimaryTier.quota_bytes``: each pool group's usable slot count becomes what the layout
        planner gives that quota, pages above it are evicted or moved down (``rebalance_slots``).
        When the surplus cannot be evicted (held pages with no room below) nothing changes (TierError).
        ``config`` keeps the initial configuration; ``current_config`` has the new quota.
        """
        with self.state.lock:
            t = self.state.tier_index(tier)
            self.state.check_no_active("resize_quota")
            if t == 0:
                limit = self.state.config.primary.quota_bytes
                if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or not 0 < quota_bytes <= limit:
                    raise TierError(f"resize_quota: the primary quota must be an int in (0, {limit}] (the registered "
                                    f"pools' size; they cannot grow), got {quota_bytes!r}")
                if dict(self.state.config.extra).get(EXTRA_POOL_RATIO):
                    # split by the auto-tuner's target ratio, the floors kept (the reference's re-split)
                    planner = self.state.planner
                    grain = planner.granularity(quota_bytes)
                    if quota_bytes < planner.min_quota(grain):
                        raise TierError(f"resize_quota: primary quota {quota_bytes} is below the "
                                        f"{planner.min_quota(grain)} bytes the slot floors and constraints need")
                    counts = planner.slot_counts(quota_bytes, self.parts.tuner.target_gpu_ratio, grain)
                    self.resize_primary_slots(counts, quota_bytes, "resize_quota")
                    return
                try:
                    plan = plan_layout(dataclasses.replace(self.state.config, tiers=(PrimaryTier(
                        quota_bytes, self.state.config.primary.device),)))
                except ConfigError as exc:
                    raise TierError(f"resize_quota: primary quota {quota_bytes}: {exc}") from exc
                self.rebalance([min(pg.num_slots, a.num_slots) for pg, a in zip(
                    plan.pool_groups, self.state.allocators, strict=True)], quota_bytes)
                return
            old_cfg = self.state.current.tiers[t]
            assert isinstance(old_cfg, HostTier | DiskTier)
            colder_counts: list[int] | None = None
            if dict(self.state.config.extra).get(EXTRA_POOL_RATIO):
                # split by the auto-tuner's target of the colder levels, the floors kept (the reference's
                # resize of a level), byte-exact as the colder tiers are planned
                planner = self.state.planner
                if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes < planner.min_quota(1):
                    raise TierError(f"resize_quota: {self.state.tiers[t].name} quota {quota_bytes!r} is below the "
                                    f"{planner.min_quota(1)} bytes the slot floors and constraints need")
                colder_counts = planner.slot_counts(quota_bytes, self.parts.tuner.target_other_ratio, 1)
            self.replace_colder_tier(t, dataclasses.replace(old_cfg, quota_bytes=quota_bytes), colder_counts,
                                     "resize_quota")

    def replace_colder_tier(self, t: int, new_cfg: HostTier | DiskTier, num_slots: Sequence[int] | None,
                            what: str) -> None:
        """Rebuild colder tier ``t`` as ``new_cfg`` (with ``num_slots[pg]`` slots per pool group when
        given): the surplus of a pool group that shrinks is evicted first (moved one tier down, or dropped
        from the coldest tier, coldest first), then every live page is copied into the first slots of the
        new tier with its owners repointed, and the old tier is closed. TierError, the old tier kept, when
        held pages cannot be evicted."""
        new_tier: TierStorage
        if isinstance(new_cfg, HostTier):
            new_tier = tier_storage.open_host_tier(self.state.config, new_cfg, num_slots)
        else:
            new_tier = DiskTierStorage(self.state.config, new_cfg, num_slots=num_slots)
        try:
            self.shrink_to(t, new_tier, what)
            self.move_into(t, new_tier)
        except BaseException:
            new_tier.close()
            raise
        old = self.state.tiers[t]
        self.state.tiers[t] = new_tier
        old.close()
        self.state.set_tier_config(t, new_cfg)
        self.parts.usage.sample_usage()

    def resplit_colder_tier(self, t: int, counts: Sequence[int]) -> None:
        """Give colder tier ``t`` ``counts[pg]`` slots per pool group (the auto-tuner's re-split of a host
        or disk level; no kv cache active). Its quota stays, raised to the bytes of the counts where the
        floors need more."""
        with self.state.lock:
            self.state.check_no_active("adjust")
            want = [int(n) for n in counts]
            if not 0 < t < len(self.state.tiers) or len(want) != len(self.state.allocators) or any(n < 1 for n in want):
                raise TierError(f"adjust: colder tier {t} of {len(self.state.tiers)} tiers needs one slot count >= 1 "
                                f"per pool group ({len(self.state.allocators)}), got {want}")
            cfg = self.state.current.tiers[t]
            assert isinstance(cfg, HostTier | DiskTier)
            nbytes = sum(n * b for n, b in zip(want, self.state.page_bytes, strict=True))
            self.replace_colder_tier(t, dataclasses.replace(cfg, quota_bytes=max(cfg.quota_bytes, nbytes)), want,
                                     "adjust")

    def rebalance_slots(self, num_slots: Sequence[int]) -> None:
        """Set the usable slot count of every primary pool group (``num_slots[pg]``), each at most
        the registered ``PoolGroupDesc.num_slots``, their bytes within the current primary quota.

        No memory moves and no address changes: slots above a new count stop being handed out, and
        the pages living there are first evicted (offloaded or dropped, coldest first) or copied to
        free slots below it. Only while no request is ACTIVE (ManagerBusyError); TierError, changing
        nothing, when the pages cannot be made to fit.
        """
        with self.state.lock:
            self.state.check_no_active("rebalance_slots")
            counts = list(num_slots)
            if len(counts) != len(self.state.allocators) or any(
                    isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= a.num_slots
                    for n, a in zip(counts, self.state.allocators, strict=False)):
                raise TierError(f"rebalance_slots: need one int in [0, registered slots] per pool group "
                                f"(registered: {[a.num_slots for a in self.state.allocators]}), got {counts!r}")
            quota = self.state.current.primary.quota_bytes
            nbytes = sum(int(n) * b for n, b in zip(counts, self.state.page_bytes, strict=True))
            if nbytes > quota:
                raise TierError(f"rebalance_slots: {counts} slots take {nbytes} bytes, more than the primary "
                                f"quota of {quota} bytes")
            self.rebalance([int(n) for n in counts], quota)

    def resize_primary_slots(self, counts: Sequence[int], quota_bytes: int | None = None,
                             what: str = "adjust") -> None:
        """Give every primary pool group ``counts[pg]`` usable slots (the auto-tuner's re-split; no kv
        cache active). Shrinking ones first: pages above the new count are evicted or moved below it
        (their memory stays registered); then growing ones past their registered slots get a larger
        pool each, the old bytes copied so every slot keeps its id (new base addresses, published in
        ``layout``). The primary quota becomes ``quota_bytes`` (default: unchanged), at least the bytes
        of the new counts."""
        with self.state.lock:
            self.state.check_no_active(what)
            want = [int(n) for n in counts]
            if len(want) != len(self.state.allocators) or any(n < 1 for n in want):
                raise TierError(f"{what}: need one slot count >= 1 per pool group "
                                f"({len(self.state.allocators)}), got {want}")
            nbytes = sum(n * b for n, b in zip(want, self.state.page_bytes, strict=True))
            quota = max(self.state.current.primary.quota_bytes if quota_bytes is None else quota_bytes, nbytes)
            self.rebalance([min(n, a.num_slots) for n, a in zip(want, self.state.allocators, strict=True)], quota)
            grown = False
            for pg, n in enumerate(want):
                if n > self.state.allocators[pg].num_slots:
                    self.grow_pool_group(pg, n)
                    grown = True
            if grown:
                self.state.tiers[0] = primary_tier_of(self.parts.manager)
                self.parts.usage.sample_usage()

    def grow_pool_group(self, pool_group: int, num_slots: int) -> None:
        """Reallocate a primary pool group's pools for ``num_slots`` slots, copying the old bytes (slot
        ids unchanged), and republish the layout with the new base addresses and slot count."""
        old_pools = self.state.pools[pool_group]
        device = self.state.device
        if device.type == "cuda":       # the old pools' last writers are done before they are read
            torch.cuda.synchronize(device)
        pg_desc = self.state.layout.pool_groups[pool_group]
        new_pools = []
        for pool, raw in zip(pg_desc.pools, old_pools, strict=True):
            fresh = allocate_pool(num_slots * pool.slot_bytes, str(device))
            fresh[:raw.numel()].copy_(raw)
            new_pools.append(fresh)
        if device.type == "cuda":       # the copies (on this thread's stream) land before a request writes
            torch.cuda.current_stream(device).synchronize()
        # The grown descriptors take the new base addresses and the new size together: the old base
        # with the new size would describe memory past the old pool (on CUDA, often the next pool).
        grown = dataclasses.replace(pg_desc, num_slots=num_slots, pools=tuple(
            dataclasses.replace(p, num_slots=num_slots, base_address=int(t.data_ptr()))
            for p, t in zip(pg_desc.pools, new_pools, strict=True)))
        groups = list(self.state.layout.pool_groups)
        groups[pool_group] = grown
        layout = dataclasses.replace(self.state.layout, pool_groups=tuple(groups), fingerprint=b"")
        check_placed(layout, [new_pools if pg == pool_group else pools for pg, pools in enumerate(self.state.pools)])
        self.state.pools[pool_group] = new_pools
        self.state.layout = layout
        self.state.allocators[pool_group].grow(num_slots)
        in_tree = self.state.in_tree[pool_group]
        self.state.in_tree[pool_group] = np.concatenate([in_tree, np.zeros(num_slots - in_tree.size, dtype=bool)])
        if self.state.readiness is not None:
            self.state.readiness.grow(pool_group, num_slots)

    def rebalance(self, counts: list[int], quota_bytes: int) -> None:
        """Make ``counts[pg]`` the usable primary slots of each pool group (see rebalance_slots)."""
        for pg, n in enumerate(counts):
            alloc = self.state.allocators[pg]
            surplus = alloc.num_used - n
            if surplus > 0 and self.parts.eviction.room_estimate(0, pg) < surplus:
                raise TierError(f"primary pool group {pg}: {alloc.num_used} pages in use, {surplus} more than "
                                f"{n} usable slots, and they cannot be evicted (held, no room below)")
        for pg, n in enumerate(counts):
            alloc = self.state.allocators[pg]
            if alloc.num_used > n:
                self.parts.eviction.make_room_in(0, pg, alloc.num_used - n)
            if alloc.num_used > n:
                raise TierError(f"primary pool group {pg}: {alloc.num_used} pages still in use after eviction, "
                                f"more than {n} usable slots")
            above = np.flatnonzero(alloc.refcount[n:] > 0).astype(np.int32) + np.int32(n)
            if above.size:
                # Free slots below n to move them to (taken before the limit is set, then relocated).
                below = np.flatnonzero(alloc.refcount[:n] == 0)[:above.size].astype(np.int32)
                alloc.take(below)
                self.copy_within_primary(pg, above, below)
                self.parts.movement.relocate(pg, 0, above, 0, below)
            alloc.set_usable(n)
        self.state.set_tier_config(0, PrimaryTier(quota_bytes, self.state.current.primary.device))
        self.parts.usage.sample_usage()

    def copy_within_primary(self, pool_group: int, src: IntArray, dst: IntArray) -> None:
        """Copy primary slots ``src -> dst`` (after their last users' streams) and count the copies."""
        if self.state.readiness is not None:
            self.state.readiness.synchronize(pool_group, np.concatenate([src, dst]))
            torch.cuda.current_stream(self.state.device).synchronize()
        self.state.copy_slots(pool_group, src, dst)
        if self.state.readiness is not None:   # done before the requests owning ``dst`` use them on their streams
            torch.cuda.current_stream(self.state.device).synchronize()
        self.parts.movement.count_copies(pool_group, "intra", int(src.size), None)

    def shrink_to(self, t: int, new_tier: TierStorage, what: str = "resize_quota") -> None:
        """Evict pages of tier ``t`` until each pool group's live pages fit ``new_tier``."""
        surplus = {pg: self.state.alloc_of(t, pg).num_used - new_tier.allocator(pg).num_slots
                   for pg in range(len(self.state.allocators))}
        for pg, n in surplus.items():
            if n > 0 and self.parts.eviction.room_estimate(t, pg) < n:
                raise TierError(f"{what}: the {self.state.tiers[t].name} tier holds {self.state.alloc_of(t, pg).num_used} "
                                f"pages of pool group {pg}, {n} more than {new_tier.allocator(pg).num_slots} slots "
                                f"of the new quota, and they cannot be evicted (held, no room below)")
        for pg, n in surplus.items():
            if n > 0 and self.parts.eviction.make_room_in(t, pg, n) < n:
                raise TierError(f"{what}: could not evict {n} pages of pool group {pg} from the "
                                f"{self.state.tiers[t].name} tier")

    def move_into(self, t: int, new_tier: TierStorage) -> None:
        """Copy tier ``t``'s live pages into the first slots of ``new_tier`` and repoint every owner."""
        assert self.state.copier is not None
        moves = []
        for pg in range(len(self.state.allocators)):
            live = np.flatnonzero(self.state.alloc_of(t, pg).refcount > 0).astype(np.int32)
            dst = new_tier.allocator(pg).alloc(live.size)
            handle = self.state.copier.copy_slots(self.state.tiers[t], new_tier, pg, live, dst)
            moves.append((pg, live, dst, handle))
        for *_, handle in moves:
            handle.wait()
        in_tree = [np.zeros(pg.num_slots, dtype=bool) for pg in new_tier.layout.pool_groups]
        owners: list[dict[int, tuple[BlockNode, int]]] = [{} for _ in new_tier.layout.pool_groups]
        for pg, live, dst, _ in moves:
            self.parts.movement.relocate(pg, t, live, t, dst, dst_alloc=new_tier.allocator(pg), dst_in_tree=in_tree[pg],
                           dst_owner=owners[pg])
        self.state.in_tree_t[t] = in_tree
        self.state.tree_owner[t] = owners
