"""Pool sizing by ratio: how many primary slots each pool group gets.

The primary quota is cut into grains (the tier's memory granularity); each pool of a pool group takes
whole grains. A target ratio (each pool group's share of the bytes) comes from, in order of precedence,
``initial_pool_ratio`` (per layer group), the bytes a ``typical_step`` batch needs, the bytes the
``constraints`` need, or a default one-request batch; ``constraints`` (batches that must always run)
and one worst-case request per layer group are floors no ratio can push a pool group below. The
auto-tuner (``pool_tuner``) uses the same arithmetic to turn observed request lengths into a ratio.
With sliding-window scratch reuse on, a step's scratch blocks count as the shared slots that hold them
(``kvxfer.cache.scratch``), not as one slot each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from kvxfer.cache.common import div_up
from kvxfer.cache.config import CacheConfig
from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.layout import slot_floors
from kvxfer.cache.manager_config import BatchDesc, KVCacheDesc, KVCacheManagerConfig
from kvxfer.cache.scratch import scratch_range, scratch_share, scratch_slots_needed
from kvxfer.errors import ConfigError

#: Grain of the primary tier below 1 GiB of quota (doubling per doubling of the quota, up to 16x).
GPU_BASE_GRANULARITY = 2 << 20
#: The batch the ratio is planned for when the configuration names none: one long request.
DEFAULT_PLANNING_BATCH = BatchDesc([KVCacheDesc(capacity=2049, history_length=2048)])


def gpu_granularity(quota: int) -> int:
    """Grain of the primary tier for ``quota`` bytes: 2 MiB, doubled for every doubling of the quota
    past 1 GiB, at most 32 MiB (fewer, larger pools' remainders on big quotas)."""
    doublings = int(math.log2(quota / (GPU_BASE_GRANULARITY * 512))) if quota > GPU_BASE_GRANULARITY * 512 else 0
    return GPU_BASE_GRANULARITY << min(4, max(0, doublings))


def grains_for_slots(num_slots: int, slot_size_list: Sequence[int], granularity: int) -> int:
    """Grains of ``granularity`` bytes that ``num_slots`` slots take: each pool of the pool group
    (one per slot size) is rounded up to whole grains."""
    if granularity <= 0:
        raise ConfigError(f"grains_for_slots: granularity must be > 0, got {granularity}")
    return sum(div_up(num_slots * size, granularity) for size in slot_size_list)


def grains_to_slots(pg_grains: int, slot_size_list: Sequence[int], granularity: int) -> tuple[int, int]:
    """(the most slots ``pg_grains`` grains hold, the grains those slots take)."""
    per_slot = sum(slot_size_list)
    if per_slot <= 0 or any(size <= 0 for size in slot_size_list):
        raise ConfigError(f"grains_to_slots: slot sizes must be positive, got {list(slot_size_list)}")
    lo, hi = 0, max(0, pg_grains) * granularity // per_slot
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
    if any(not r > 0 for r in ratio_list):
        raise ConfigError(f"ratio_to_slot_count_list: ratios must be positive, got {list(ratio_list)}")
    total = quota // granularity
    mins = [grains_for_slots(m, sizes, granularity) for m, sizes in zip(min_slots, slot_size_lists, strict=True)]
    if sum(mins) > total:
        raise ConfigError(f"ratio_to_slot_count_list: quota {quota} holds {total} grains, the minimums need "
                          f"{sum(mins)}")
    pinned: set[int] = set()
    while True:
        free = total - sum(mins[i] for i in pinned)
        grains = [mins[i] if i in pinned else 0 for i in range(n)]
        # smallest share first, each rounded, the largest taking what is left: every grain is spent
        active = sorted((i for i in range(n) if i not in pinned), key=lambda i: ratio_list[i])
        for k, i in enumerate(active):
            weight = sum(ratio_list[j] for j in active[k:])
            grains[i] = free if k == len(active) - 1 else round(free * ratio_list[i] / weight)
            free -= grains[i]
        short = [i for i in active if grains[i] < mins[i]]
        if not short:
            break
        pinned.update(short)
    out = []
    for i in range(n):
        slots, _ = grains_to_slots(grains[i], slot_size_lists[i], granularity)
        out.append(max(slots, int(min_slots[i])))
    return out


def normalized(values: Sequence[float]) -> list[float]:
    """``values`` scaled to sum to 1 (a zero entry becomes a tiny positive share, so every pool group
    keeps a ratio the slot arithmetic accepts)."""
    total = float(sum(values))
    if total <= 0:
        return [1.0 / len(values)] * len(values)
    out = [v / total for v in values]
    tiny = 1e-9
    if any(v <= 0 for v in out):
        out = [max(v, tiny) for v in out]
        s = sum(out)
        out = [v / s for v in out]
    return out


def check_batch(batch: object, where: str) -> BatchDesc:
    """``batch`` if it is a BatchDesc of KVCacheDescs with 0 <= history_length <= capacity (ConfigError
    naming ``where`` and the bad value otherwise)."""
    if not isinstance(batch, BatchDesc):
        raise ConfigError(f"{where} must be a BatchDesc, got {batch!r}")
    spl = batch.system_prompt_length
    if isinstance(spl, bool) or not isinstance(spl, int) or spl < 0:
        raise ConfigError(f"{where}.system_prompt_length must be an int >= 0, got {spl!r}")
    for i, kv in enumerate(batch.kv_caches):
        if not isinstance(kv, KVCacheDesc):
            raise ConfigError(f"{where}.kv_caches[{i}] must be a KVCacheDesc, got {kv!r}")
        for name in ("capacity", "history_length"):
            value = getattr(kv, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}.kv_caches[{i}].{name} must be an int >= 0, got {value!r}")
        if kv.history_length > kv.capacity:
            raise ConfigError(f"{where}.kv_caches[{i}]: history_length {kv.history_length} exceeds capacity "
                              f"{kv.capacity}")
    return batch


@dataclass(frozen=True, slots=True)
class LifeCycleShape:
    """What slot planning needs of one layer group: its window (None: full attention), sink blocks,
    whether it is a recurrent state (one slot per request), its pool group and its worst-case floor
    (the slots one request may hold at once)."""

    window: int | None
    sink_blocks: int
    recurrent: bool
    pool_group: int
    floor: int
    #: Sink tokens (the scratch range starts past them) and the largest part of one of the group's
    #: slots one layer takes (``scratch.scratch_share``: how densely scratch blocks pack).
    sink_tokens: int = 0
    scratch_share: Fraction = Fraction(1)


class PoolRatioPlanner:
    """Slot counts per pool group of one manager: the layer groups' shapes, the pool groups' slot
    sizes and the floors (constraints, one worst-case request) fixed at construction."""

    def __init__(self, shapes: Sequence[LifeCycleShape], slot_size_lists: Sequence[Sequence[int]],
                 tokens_per_block: int, constraints: Sequence[BatchDesc] = (),
                 max_rewind_len: int | None = None, max_util_for_resume: float = 1.0) -> None:
        """``max_rewind_len``: the sliding-window scratch reuse setting (None: scratch reuse off).
        ``max_util_for_resume``: a constraint's slots are divided by it (rounded up), so its whole batch
        resumes below the resume gate."""
        self.shapes = tuple(shapes)
        self.max_rewind_len = max_rewind_len
        self.slot_size_lists = tuple(tuple(int(s) for s in sizes) for sizes in slot_size_lists)
        self.tokens_per_block = int(tokens_per_block)
        self.num_pool_groups = len(self.slot_size_lists)
        if any(not 0 <= s.pool_group < self.num_pool_groups for s in self.shapes):
            raise ConfigError(f"PoolRatioPlanner: a layer group names a pool group outside "
                              f"[0, {self.num_pool_groups}): {[s.pool_group for s in self.shapes]}")
        floors = [0] * self.num_pool_groups
        for shape in self.shapes:
            floors[shape.pool_group] += max(1, shape.floor)
        for i, batch in enumerate(constraints):
            need = [math.ceil(n / max_util_for_resume - 1e-9) for n in
                    self.slots_for_batch(check_batch(batch, f"KVCacheManagerConfig.constraints[{i}]"))]
            floors = [max(a, b) for a, b in zip(floors, need, strict=True)]
        #: Slots no ratio may push a pool group below.
        self.min_slots: tuple[int, ...] = tuple(floors)

    # --- what a batch or a request length needs -----------------------------------------------------
    def stale_range(self, shape: LifeCycleShape, history_length: int) -> tuple[int, int]:
        """Blocks ``[begin, end)`` a request of ``history_length`` written tokens no longer needs in a
        layer group: those after the sink blocks that fell out of the sliding window (none without one)."""
        if shape.window is None or shape.recurrent:
            return 0, 0
        begin = shape.sink_blocks
        end = max(begin, (history_length + 1 - shape.window) // self.tokens_per_block)
        return begin, end

    def slots_for_batch(self, batch: BatchDesc, max_rewind_len: int | bool | None = False) -> list[int]:
        """The fewest slots per pool group that run ``batch`` at once: per request its blocks less the
        stale ones, a recurrent group one state slot per request (zero-capacity requests included), and
        the full blocks of the shared system prompt counted once where some request still needs them.
        With scratch reuse (``max_rewind_len``, default the planner's own) a request's scratch blocks
        take the shared slots that hold them."""
        rewind = self.max_rewind_len if max_rewind_len is False else max_rewind_len
        tpb = self.tokens_per_block
        out = [0] * self.num_pool_groups
        sys_blocks = batch.system_prompt_length // tpb
        for shape in self.shapes:
            if shape.recurrent:
                out[shape.pool_group] += len(batch.kv_caches)
                continue
            stale_all = (0, sys_blocks)        # system-prompt blocks stale for every request
            for kv in batch.kv_caches:
                b, e = self.stale_range(shape, kv.history_length)
                stale_all = (max(stale_all[0], b), min(stale_all[1], e))
            out[shape.pool_group] += sys_blocks - max(0, stale_all[1] - stale_all[0])
            for kv in batch.kv_caches:
                b, e = self.stale_range(shape, kv.history_length)
                non_stale = div_up(kv.capacity, tpb) - (e - b)
                non_stale_sys = sys_blocks - max(0, min(e, sys_blocks) - min(b, sys_blocks))
                unique = max(0, non_stale - non_stale_sys)
                if rewind is not None and shape.window is not None:
                    # scratch blocks are the step's input blocks: never shared system-prompt blocks
                    n = len(scratch_range(shape.window, shape.sink_tokens, kv.history_length, kv.capacity,
                                          tpb, int(rewind)))
                    unique += scratch_slots_needed(n, shape.scratch_share) - n
                out[shape.pool_group] += unique
        return out

    def bytes_for_slots(self, counts: Sequence[int], granularity: int) -> list[int]:
        """Bytes ``counts`` slots take per pool group, each pool rounded up to whole grains."""
        return [grains_for_slots(int(n), sizes, granularity) * granularity
                for n, sizes in zip(counts, self.slot_size_lists, strict=True)]

    def ratio_from_batch(self, batch: BatchDesc, granularity: int) -> list[float]:
        """Each pool group's share of the bytes ``batch`` needs."""
        return normalized(self.bytes_for_slots(self.slots_for_batch(batch), granularity))

    def ratio_from_length(self, history_length: int, capacity: int) -> list[float]:
        """Each pool group's share of the bytes one request of ``capacity`` tokens, ``history_length``
        of them written, holds (at least one block per layer group)."""
        capacity = max(capacity, history_length)
        blocks = div_up(capacity, self.tokens_per_block)
        nbytes = [0.0] * self.num_pool_groups
        for shape in self.shapes:
            b, e = self.stale_range(shape, history_length)
            need = 1 if shape.recurrent else max(blocks - (e - b), 1)
            nbytes[shape.pool_group] += need * sum(self.slot_size_lists[shape.pool_group])
        return normalized(nbytes)

    def pool_group_ratio(self, layer_group_ratio: Sequence[float]) -> list[float]:
        """A per-layer-group ratio summed into its pool groups."""
        out = [0.0] * self.num_pool_groups
        for shape, r in zip(self.shapes, layer_group_ratio, strict=True):
            out[shape.pool_group] += float(r)
        return normalized(out)

    # --- ratio -> slots ------------------------------------------------------------------------------
    def granularity(self, quota: int) -> int:
        """The grain the primary quota is cut into: ``gpu_granularity`` where the quota holds one grain
        per pool (the reference's pools are mapped in physical pages of that size, so slot counts match
        it), else one byte (kvxfer's pools are byte-exact tensors; rounding a small quota up to whole
        grains would multiply the memory asked for)."""
        grain = gpu_granularity(quota)
        return grain if quota >= grain * sum(len(sizes) for sizes in self.slot_size_lists) else 1

    def min_quota(self, granularity: int) -> int:
        """Bytes the floors take (the smallest quota this manager can run with)."""
        return sum(self.bytes_for_slots(self.min_slots, granularity))

    def slot_counts(self, quota: int, ratio: Sequence[float], granularity: int) -> list[int]:
        """Slots per pool group for ``quota`` bytes split by ``ratio``; a quota below what the floors
        take is raised to it (the constraints are guarantees)."""
        if len(ratio) != self.num_pool_groups:
            raise ConfigError(f"slot_counts: {len(ratio)} ratios for {self.num_pool_groups} pool groups")
        budget = max(self.min_quota(granularity), div_up(quota, granularity) * granularity)
        return ratio_to_slot_count_list(budget, self.slot_size_lists, normalized(ratio), granularity,
                                        self.min_slots)

    def constrain(self, ratio: Sequence[float], quota: int, granularity: int) -> list[float]:
        """``ratio`` as it comes out once the floors are applied: the byte shares of the slot counts
        it gives for ``quota``."""
        return normalized(self.bytes_for_slots(self.slot_counts(quota, ratio, granularity), granularity))

    def initial_ratio(self, config: KVCacheManagerConfig, granularity: int) -> list[float]:
        """The starting ratio: ``initial_pool_ratio`` (per layer group, summed per pool group), else the
        bytes of ``typical_step``, else those of the constraints, else those of one long request."""
        if config.initial_pool_ratio is not None:
            return self.pool_group_ratio(config.initial_pool_ratio)
        if config.typical_step is not None:
            return self.ratio_from_batch(check_batch(config.typical_step, "KVCacheManagerConfig.typical_step"),
                                         granularity)
        if config.constraints:
            return normalized(self.bytes_for_slots(self.min_slots, granularity))
        return self.ratio_from_batch(DEFAULT_PLANNING_BATCH, granularity)


def planner_for(config: CacheConfig, layout: CacheLayoutDesc, constraints: Sequence[BatchDesc] = (),
                max_rewind_len: int | None = None, max_util_for_resume: float = 1.0) -> PoolRatioPlanner:
    """The planner of a manager's (planned) layout: its layer groups' windows, sinks and pool groups,
    its pool groups' slot sizes, the worst-case request floors, ``constraints`` and the scratch reuse
    setting (``max_rewind_len``; None: off) and the resume gate (``max_util_for_resume``)."""
    tpb = layout.tokens_per_block
    keys = [(lg.window, div_up(lg.sink_tokens, tpb), lg.recurrent) for lg in layout.layer_groups]
    floors = slot_floors(config, keys)
    shapes = [LifeCycleShape(lg.window, key[1], lg.recurrent, lg.pool_group_index, floor, lg.sink_tokens,
                             scratch_share(layout.pool_groups[lg.pool_group_index].slot_desc.variant_of(
                                 lg.layer_group_id)) if lg.window is not None and not lg.recurrent else Fraction(1))
              for lg, key, floor in zip(layout.layer_groups, keys, floors, strict=True)]
    sizes = [pg.slot_desc.slot_size_list for pg in layout.pool_groups]
    return PoolRatioPlanner(shapes, sizes, tpb, constraints, max_rewind_len, max_util_for_resume)


def check_initial_pool_ratio(ratio: object, num_layer_groups: int) -> None:
    """``KVCacheManagerConfig.initial_pool_ratio``: None, or one positive share per layer group summing
    to 1 (ConfigError naming the field and the value otherwise)."""
    if ratio is None:
        return
    if not isinstance(ratio, Sequence) or isinstance(ratio, str):
        raise ConfigError(f"KVCacheManagerConfig.initial_pool_ratio must be a list of floats, got {ratio!r}")
    values = [float(r) for r in ratio]
    if len(values) != num_layer_groups:
        raise ConfigError(f"KVCacheManagerConfig.initial_pool_ratio length {len(values)} does not match the "
                          f"{num_layer_groups} layer groups")
    if not all(v > 0 for v in values):
        raise ConfigError(f"KVCacheManagerConfig.initial_pool_ratio values must be positive, got {values}")
    if abs(sum(values) - 1.0) > 1e-6:
        raise ConfigError(f"KVCacheManagerConfig.initial_pool_ratio values must sum to 1.0, got {sum(values)}")
