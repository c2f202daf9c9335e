"""A faulty transfer planner for tests: deliberate pairing bugs in the workers' plans, so that tests can
prove each check (the KV oracle, the demo's check, ``--checksum full``) catches every class of bug.

``FaultyPlanner(NAME)`` is a ``kvxfer.disagg.worker.Planner``: give it to workers as
``WorkerConfig(planner=...)``. It applies its bug to every plan the worker builds:

- ``block_swap``: the destination slots of the first two destination blocks of the token range swap.
- ``token_shift``: source token t lands at destination position t + 1 (position ``start`` keeps old bytes).
- ``head_swap``: head ranges swap between tensor-parallel ranks (needs two or more ranks on one side).
- ``foreign_block``: the first source block of the token range is replaced by a slot the request does
  not hold (the nearest lower slot: in practice an earlier request's block, stale bytes, or zeros).
- ``zero_layer``: layer 1 (layer 0 of a one-layer model) is left out: its destination pages keep their
  old bytes (zeros in a fresh pool).
- ``per_request``: no bug, except for requests whose id contains ``mutate=NAME`` (NAME one of the
  above): one worker pair then serves healthy and mutated requests side by side.

Worker processes a test starts (``kvxfer serve``, ``kvxfer demo``) get it through the test plugin
``tests/support/plugins/faulty_planner`` (``install``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg import worker
from kvxfer.errors import ConfigError, PageTableError
from kvxfer.extractor import layout_regions, multirank, plan_transfer
from kvxfer.pagetable import PageTable, TransferPlan

#: The environment variable the test plugin reads in a worker process: a mutation or ``per_request``.
PLUGIN_ENV = "TEST_FAULTY_PLANNER"
MUTATIONS = ("block_swap", "token_shift", "head_swap", "foreign_block", "zero_layer")
PER_REQUEST = "per_request"
_TAG = re.compile(r"mutate=([a-z_]+)")

BlockIds = Sequence[Mapping[int, npt.ArrayLike]]


def check_setting(value: str) -> str:
    """``value`` when it names a mutation or ``per_request``; ConfigError otherwise."""
    if value not in (*MUTATIONS, PER_REQUEST):
        raise ConfigError(f"faulty planner {value!r} is not a test mutation; expected one of "
                          f"{[*MUTATIONS, PER_REQUEST]}")
    return value


class FaultyPlanner:
    """A ``Planner`` that corrupts plans with one mutation (or per request, ``per_request``)."""

    def __init__(self, setting: str) -> None:
        self.setting = check_setting(setting)

    def mutation_for(self, request_id: str) -> str | None:
        """The mutation applied to the plans of ``request_id``, or None."""
        if self.setting != PER_REQUEST:
            return self.setting
        m = _TAG.search(request_id)
        return check_setting(m.group(1)) if m else None

    def __call__(self, src_layouts: Sequence[CacheLayoutDesc], src_ids: Sequence[Any],
                 dst_layouts: Sequence[CacheLayoutDesc], dst_ids: Sequence[Any], *, token_range: tuple[int, int],
                 layers: Sequence[int] | None = None, dst_committed: Sequence[int | None] | None = None,
                 request_id: str = "") -> TransferPlan:
        mutation = self.mutation_for(request_id)
        if mutation is None:
            return multirank.plan_between(src_layouts, src_ids, dst_layouts, dst_ids, token_range=token_range,
                                          layers=layers, dst_committed=dst_committed)
        return mutated_plan(mutation, src_layouts, [_id_map(x) for x in src_ids], dst_layouts,
                            [_id_map(x) for x in dst_ids], token_range=token_range, layers=layers)


def install(setting: str) -> None:
    """Make every ``WorkerConfig`` of this process without a planner of its own use ``FaultyPlanner(setting)``
    (the test plugin calls this in worker processes, where the test cannot pass a config)."""
    planner = FaultyPlanner(setting)
    original = worker.WorkerConfig.__post_init__

    def post_init(self: worker.WorkerConfig) -> None:
        original(self)
        if self.planner is None:
            object.__setattr__(self, "planner", planner)

    worker.WorkerConfig.__post_init__ = post_init  # type: ignore[method-assign]


def _id_map(ids: Any) -> Any:
    """A block-id map from a KVCache or a map."""
    return ids.block_id_map() if hasattr(ids, "block_id_map") else ids


def _region_offsets(layouts: Sequence[CacheLayoutDesc]) -> list[int]:
    counts = [sum(len(pg.pools) for pg in lay.pool_groups) for lay in layouts]
    return [int(x) for x in np.cumsum([0, *counts[:-1]])]


def _swap_first_blocks(layout: CacheLayoutDesc, ids: Mapping[int, npt.ArrayLike],
                       start: int, end: int) -> dict[int, npt.NDArray[np.int64]]:
    tpb = layout.tokens_per_block
    out: dict[int, npt.NDArray[np.int64]] = {}
    for g, raw in ids.items():
        a = np.array(raw, dtype=np.int64)
        b0 = start // tpb
        if b0 + 1 < a.size and (b0 + 1) * tpb < end:
            a[[b0, b0 + 1]] = a[[b0 + 1, b0]]
        out[g] = a
    return out


def _foreign_first_block(layout: CacheLayoutDesc, ids: Mapping[int, npt.ArrayLike],
                         start: int) -> dict[int, npt.NDArray[np.int64]]:
    tpb = layout.tokens_per_block
    out: dict[int, npt.NDArray[np.int64]] = {}
    for g, raw in ids.items():
        a = np.array(raw, dtype=np.int64)
        b0 = start // tpb
        if b0 < a.size and a[b0] >= 0:
            slots = layout.pool_groups[layout.layer_groups[g].pool_group_index].num_slots
            held = set(a[a >= 0].tolist())
            other = (int(a[a >= 0].min()) - 1) % slots
            while other in held:
                other = (other - 1) % slots
            a[b0] = other
        out[g] = a
    return out


def _shifted(sl: CacheLayoutDesc, si: Mapping[int, npt.ArrayLike], dl: CacheLayoutDesc,
             di: Mapping[int, npt.ArrayLike], layers: Sequence[int] | None, start: int, end: int) -> TransferPlan:
    """Source token t -> destination position t + 1, for t in [start, end - 1)."""
    per_token = [plan_transfer(sl, si, dl, di, layers=layers, token_range=(t, t + 1)) for t in range(start, end)]
    pieces: list[TransferPlan] = []
    for here, nxt in itertools.pairwise(per_token):
        if len(here) != len(nxt) or not np.array_equal(here.src.nbytes, nxt.dst.nbytes):
            raise PageTableError("token_shift test mutation: consecutive tokens plan to different entry shapes")
        pieces.append(TransferPlan(here.src, nxt.dst))
    return TransferPlan.concat(pieces) if pieces else TransferPlan.empty()


def _retarget(table: PageTable, from_layout: CacheLayoutDesc, to_layout: CacheLayoutDesc) -> PageTable:
    """``table`` (region indices local to ``from_layout``) moved to the same offsets in ``to_layout``'s pools."""
    src_base = np.array([r.base_address for r in layout_regions(from_layout)], dtype=np.uint64)
    dst_base = np.array([r.base_address for r in layout_regions(to_layout)], dtype=np.uint64)
    return PageTable(table.addr - src_base[table.region] + dst_base[table.region], table.nbytes, table.region)


def mutated_plan(mutation: str, src_layouts: Sequence[CacheLayoutDesc], src_ids: BlockIds,
                 dst_layouts: Sequence[CacheLayoutDesc], dst_ids: BlockIds, *, token_range: tuple[int, int],
                 layers: Sequence[int] | None = None) -> TransferPlan:
    """The plan of ``plan_between``'s arguments with ``mutation`` applied."""
    start, end = token_range
    sids: list[Mapping[int, npt.ArrayLike]] = list(src_ids)
    dids: list[Mapping[int, npt.ArrayLike]] = list(dst_ids)
    if mutation == "block_swap":
        dids = [_swap_first_blocks(lay, m, start, end) for lay, m in zip(dst_layouts, dids, strict=True)]
    elif mutation == "foreign_block":
        sids = [_foreign_first_block(lay, m, start) for lay, m in zip(src_layouts, sids, strict=True)]
    elif mutation == "zero_layer":
        num_layers = len(src_layouts[0].layer_ids)
        victim = 1 if num_layers > 1 else 0
        layers = [x for x in (range(num_layers) if layers is None else layers) if x != victim]
        if not layers:
            return TransferPlan.empty()
    src_off, dst_off = _region_offsets(src_layouts), _region_offsets(dst_layouts)
    plans: list[TransferPlan] = []
    for i, (sl, si) in enumerate(zip(src_layouts, sids, strict=True)):
        for j, (dl, di) in enumerate(zip(dst_layouts, dids, strict=True)):
            if mutation == "token_shift":
                plan = _shifted(sl, si, dl, di, layers, start, end)
            else:
                plan = plan_transfer(sl, si, dl, di, layers=layers, token_range=token_range)
            if not len(plan):
                continue
            src, dst, to_i, to_j = plan.src, plan.dst, i, j
            if mutation == "head_swap" and len(dst_layouts) > 1:
                to_j = (j + 1) % len(dst_layouts)
                dst = _retarget(dst, dl, dst_layouts[to_j])
            elif mutation == "head_swap" and len(src_layouts) > 1:
                to_i = (i + 1) % len(src_layouts)
                src = _retarget(src, sl, src_layouts[to_i])
            plans.append(TransferPlan(PageTable(src.addr, src.nbytes, src.region + np.uint32(src_off[to_i])),
                                      PageTable(dst.addr, dst.nbytes, dst.region + np.uint32(dst_off[to_j]))))
    if not plans:
        return TransferPlan.empty()
    return plans[0] if len(plans) == 1 else TransferPlan.concat(plans)
