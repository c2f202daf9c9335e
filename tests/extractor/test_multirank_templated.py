"""multirank.plan_between with a template cache (what the workers pass, one cache per peer): rank pairs of
differing layouts are planned from run templates and list exactly the runs plan_transfer pairs, refuse
what it refuses, and keep their templates in the cache given; identical layouts keep plan_transfer's plan."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from kvxfer.cache import CacheConfig, CacheLayoutDesc
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.errors import ConfigError, KvxferError, PageTableError, ReadOnlyPageError
from kvxfer.extractor import TemplateCache, check_writable, check_writable_phased, multirank
from kvxfer.pagetable import BlockPlan, PhasedPlan, TransferPlan

LAYERS, HEADS, HEAD_DIM = 4, 4, 16


def layouts(tp: int, tpb: int, blocks: int, base: int, **kw: Any) -> list[CacheLayoutDesc]:
    """``tp`` ranks' layouts at fake, non-overlapping addresses (the planner only reads descriptors)."""
    out, nxt = [], base
    for rank in range(tp):
        cfg = CacheConfig.for_model(LAYERS, HEADS, HEAD_DIM, tpb, "bfloat16", blocks, device="cpu",
                                    tp_size=tp, tp_rank=rank)
        if kw:
            cfg = dataclasses.replace(cfg, **kw)
        plan = plan_layout(cfg)
        bases: list[list[int]] = []
        for pg in plan.pool_groups:
            bases.append([])
            for pool in pg.pools:
                bases[-1].append(nxt)
                nxt += pool.nbytes + (1 << 16)
        out.append(place_layout(plan, bases, "cuda", 0))
    return out


def entries(plan: TransferPlan) -> list[tuple[int, ...]]:
    """The plan's runs in a canonical form: sorted by source and merged where both sides continue (order
    carries no meaning, and plan_transfer merges runs that happen to meet across its segments)."""
    plan = plan.sort_by_source().coalesce()
    cols = (plan.src.addr, plan.src.region, plan.dst.addr, plan.dst.region, plan.src.nbytes)
    return sorted(zip(*(c.tolist() for c in cols), strict=True))


def ids_for(lays: list[CacheLayoutDesc], tokens: int, rng: np.random.Generator) -> list[dict[int, np.ndarray]]:
    out = []
    for lay in lays:
        slots = lay.pool_groups[0].num_slots
        out.append({0: rng.permutation(slots)[:math.ceil(tokens / lay.tokens_per_block)].astype(np.int64)})
    return out


CASES: dict[str, tuple[tuple[int, int, dict[str, str]], tuple[int, int, dict[str, str]]]] = {
    "tokens/block 16->8": ((1, 16, {}), (1, 8, {})),
    "tokens/block 8->32": ((1, 8, {}), (1, 32, {})),
    "TP 1->2, HND->NHD": ((1, 16, {}), (2, 16, {"head_order": "NHD"})),
    "TP 2->1 + 16->8": ((2, 16, {}), (1, 8, {})),
    "TP 2->4 + 16->32, NHD": ((2, 16, {}), (4, 32, {"head_order": "NHD"})),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", ["whole", "cut"])
def test_templated_plans_list_exactly_the_runs_plan_transfer_pairs(case: str, window: str) -> None:
    """Every mismatch case, the whole prompt and a cut one (a token range off block boundaries, a subset of
    the layers: a layer-wise send), gives the same runs as plan_transfer; the templates land in the cache
    given (none in the module's), and a second request (other blocks) reuses them."""
    (tp_s, tpb_s, kw_s), (tp_d, tpb_d, kw_d) = CASES[case]
    tokens = 200
    src = layouts(tp_s, tpb_s, 64, 0x7000_0000_0000, **kw_s)
    dst = layouts(tp_d, tpb_d, 96, 0x6000_0000_0000, **kw_d)
    token_range, layers = ((0, tokens), None) if window == "whole" else ((5, tokens - 3), [1, 2])
    cache = TemplateCache()
    rng = np.random.default_rng(7)
    for request in range(2):
        si, di = ids_for(src, tokens, rng), ids_for(dst, tokens, rng)
        want = multirank.plan_between(src, si, dst, di, token_range=token_range, layers=layers)
        got = multirank.plan_between(src, si, dst, di, token_range=token_range, layers=layers, templates=cache)
        assert len(want) and entries(got) == entries(want)
        if request == 0:
            kept = len(cache)
            assert kept > 0
    assert len(cache) == kept   # the second request made no template


def test_identical_layouts_keep_plan_transfers_plan_and_make_no_template() -> None:
    src, dst = layouts(1, 16, 64, 0x7000_0000_0000), layouts(1, 16, 64, 0x6000_0000_0000)
    rng = np.random.default_rng(1)
    si, di = ids_for(src, 100, rng), ids_for(dst, 100, rng)
    cache = TemplateCache()
    got = multirank.plan_between(src, si, dst, di, token_range=(0, 100), templates=cache)
    want = multirank.plan_between(src, si, dst, di, token_range=(0, 100))
    assert len(cache) == 0
    for a, b in ((got.src, want.src), (got.dst, want.dst)):
        assert np.array_equal(a.addr, b.addr) and np.array_equal(a.nbytes, b.nbytes) and np.array_equal(a.region, b.region)


def test_templated_plans_refuse_what_plan_transfer_refuses() -> None:
    """Committed (read-only) destination blocks and a destination block listed twice are refused alike,
    with the same error type and message."""
    src, dst = layouts(1, 16, 64, 0x7000_0000_0000), layouts(2, 8, 96, 0x6000_0000_0000, head_order="NHD")
    rng = np.random.default_rng(3)
    si, di = ids_for(src, 96, rng), ids_for(dst, 96, rng)
    twice = [{0: d[0].copy()} for d in di]
    twice[1][0][3] = twice[1][0][0]
    cases: list[tuple[list[dict[int, np.ndarray]], list[int | None] | None]] = [(di, [16, 16]), (twice, None)]
    for dst_ids, committed in cases:
        errors = []
        for templates in (None, TemplateCache()):
            with pytest.raises(KvxferError) as info:
                multirank.plan_between(src, si, dst, dst_ids, token_range=(0, 96), dst_committed=committed,
                                       templates=templates)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]


def test_a_template_cache_keeps_at_most_what_it_is_told() -> None:
    src, dst = layouts(1, 16, 64, 0x7000_0000_0000), layouts(1, 8, 96, 0x6000_0000_0000)
    rng = np.random.default_rng(5)
    cache = TemplateCache(kept=1)
    si, di = ids_for(src, 64, rng), ids_for(dst, 64, rng)
    for layers in ([0], [1], [2]):
        multirank.plan_between(src, si, dst, di, token_range=(0, 64), layers=layers, templates=cache)
        assert len(cache) == 1
    with pytest.raises(ConfigError, match="positive"):
        TemplateCache(kept=0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", ["whole", "cut"])
def test_phased_plans_expand_to_exactly_plan_betweens_runs_and_check_alike(case: str, window: str) -> None:
    """``plan_phased`` keeps every rank pair's phases as BlockPlans (no expansion): its expansion lists
    exactly ``plan_between``'s runs in the same order, its size is O(blocks + template runs), and its
    check (``PhasedPlan.validate``, O(blocks + template) across phases) passes the plan and refuses a copy
    whose last phase writes a destination run of the first one again."""
    (tp_s, tpb_s, kw_s), (tp_d, tpb_d, kw_d) = CASES[case]
    tokens = 200
    src = layouts(tp_s, tpb_s, 64, 0x7000_0000_0000, **kw_s)
    dst = layouts(tp_d, tpb_d, 96, 0x6000_0000_0000, **kw_d)
    token_range, layers = ((0, tokens), None) if window == "whole" else ((5, tokens - 3), [1, 2])
    rng = np.random.default_rng(11)
    si, di = ids_for(src, tokens, rng), ids_for(dst, tokens, rng)
    cache = TemplateCache()
    want = multirank.plan_between(src, si, dst, di, token_range=token_range, layers=layers, templates=cache)
    phased = multirank.plan_phased(src, si, dst, di, token_range=token_range, layers=layers, templates=cache)
    got = phased.expand()
    for a, b in ((got.src, want.src), (got.dst, want.dst)):
        assert np.array_equal(a.addr, b.addr) and np.array_equal(a.nbytes, b.nbytes) and np.array_equal(a.region, b.region)
    assert sum(p.num_blocks + p.runs_per_block for p in phased.phases) < len(want)
    src_regions = multirank.all_regions(src)
    dst_regions = multirank.all_regions(dst)
    expand = PhasedPlan.expand
    try:   # the phases' shapes show them apart: checked without listing a run
        PhasedPlan.expand = None  # type: ignore[assignment,method-assign]
        phased.validate(src_regions, dst_regions)
    finally:
        PhasedPlan.expand = expand  # type: ignore[method-assign]
    first, last = phased.phases[0], phased.phases[-1]
    n = np.minimum(first.nbytes[:1], last.nbytes[:1])
    clash = BlockPlan(last.src_slots[:1], first.dst_slots[:1], last.src_step[:1], last.src_offset[:1],
                      first.dst_step[:1], first.dst_offset[:1], n, last.src_region[:1], first.dst_region[:1])
    clash.validate(src_regions, dst_regions)   # fine on its own: it writes a run the first phase writes
    with pytest.raises(PageTableError, match="overlap"):
        PhasedPlan((*phased.phases, clash)).validate(src_regions, dst_regions)


def test_an_identical_pair_is_one_block_of_plan_transfers_runs() -> None:
    src, dst = layouts(1, 16, 64, 0x7000_0000_0000), layouts(1, 16, 64, 0x6000_0000_0000)
    rng = np.random.default_rng(2)
    si, di = ids_for(src, 100, rng), ids_for(dst, 100, rng)
    phased = multirank.plan_phased(src, si, dst, di, token_range=(0, 100), templates=TemplateCache())
    want = multirank.plan_between(src, si, dst, di, token_range=(0, 100))
    assert len(phased.phases) == 1 and phased.phases[0].num_blocks == 1
    got = phased.expand()
    assert np.array_equal(got.src.addr, want.src.addr) and np.array_equal(got.dst.addr, want.dst.addr)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_template_check_of_read_only_pages_refuses_what_the_entry_check_refuses(case: str) -> None:
    """``check_writable_phased`` on a phased plan (no expansion) accepts and refuses exactly as
    ``check_writable`` on its expansion, for committed prefixes that the plan writes into (refused: the
    page is named) and that it stays clear of (a plan from past them). Mutation: dropping the slot check,
    or the run's slot offset within the block, changes an outcome."""
    (tp_s, tpb_s, kw_s), (tp_d, tpb_d, kw_d) = CASES[case]
    tokens = 200
    src = layouts(tp_s, tpb_s, 64, 0x7000_0000_0000, **kw_s)
    dst = layouts(tp_d, tpb_d, 96, 0x6000_0000_0000, **kw_d)
    rng = np.random.default_rng(13)
    si, di = ids_for(src, tokens, rng), ids_for(dst, tokens, rng)
    for start, committed in ((0, 0), (0, 32), (0, 40), (64, 64), (64, 32), (0, tokens)):
        plan = multirank.plan_phased(src, si, dst, di, token_range=(start, tokens), dst_committed=[0] * len(dst),
                                     templates=TemplateCache())
        limits = [committed] * len(dst)
        # The same runs named one slot lower with the offsets one step higher (a template run k slots off).
        shifted = PhasedPlan(tuple(
            BlockPlan(p.src_slots, p.dst_slots - np.uint64(1), p.src_step, p.src_offset, p.dst_step,
                      p.dst_offset + p.dst_step, p.nbytes, p.src_region, p.dst_region) if int(p.dst_slots.min()) else p
            for p in plan.phases))
        outcomes = []
        for phased in (None, plan, shifted):
            expand = BlockPlan.expand
            try:
                if phased is not None:   # the template check lists no run (each run lies in one slot)
                    BlockPlan.expand = None  # type: ignore[assignment,method-assign]
                    check_writable_phased(phased, dst, di, limits)
                else:
                    check_writable(plan.expand().dst, dst, di, limits)
                outcomes.append("ok")
            except ReadOnlyPageError as exc:
                outcomes.append("refused")
                assert "committed page" in str(exc)
            finally:
                BlockPlan.expand = expand  # type: ignore[method-assign]
        assert outcomes[0] == outcomes[1] == outcomes[2], (start, committed, outcomes)
        assert outcomes[0] == ("refused" if start < committed // tpb_d * tpb_d else "ok")


@pytest.mark.parametrize("case", sorted(CASES))
def test_templates_made_when_a_peers_layouts_are_learned_serve_whole_prompts(case: str) -> None:
    """``warm_templates`` (a worker calls it at the handshake) makes the templates of whole transfers for every
    rank pair of differing layouts: a whole prompt of any block count then makes none, a prompt ending
    inside a block only its last segment's, and the plans list plan_transfer's runs."""
    (tp_s, tpb_s, kw_s), (tp_d, tpb_d, kw_d) = CASES[case]
    src = layouts(tp_s, tpb_s, 64, 0x7000_0000_0000, **kw_s)
    dst = layouts(tp_d, tpb_d, 96, 0x6000_0000_0000, **kw_d)
    cache = TemplateCache()
    made = multirank.warm_templates(src, dst, cache)
    assert made == len(cache) > 0
    rng = np.random.default_rng(3)
    period = tpb_s * tpb_d // math.gcd(tpb_s, tpb_d)
    for tokens in (period, 7 * period, 200):
        si, di = ids_for(src, tokens, rng), ids_for(dst, tokens, rng)
        before = len(cache)
        got = multirank.plan_between(src, si, dst, di, token_range=(0, tokens), templates=cache)
        assert entries(got) == entries(multirank.plan_between(src, si, dst, di, token_range=(0, tokens)))
        new = len(cache) - before
        assert new == 0 if tokens % min(tpb_s, tpb_d) == 0 else new <= tp_s * tp_d


def test_warm_templates_leaves_alone_what_templates_do_not_plan() -> None:
    """Identical layouts, a layout of two layer groups and a pool too small for one common period make no
    template (requests plan those as before)."""
    cache = TemplateCache()
    same = layouts(1, 16, 64, 0x7000_0000_0000)
    assert multirank.warm_templates(same, layouts(1, 16, 64, 0x6000_0000_0000), cache) == 0
    cfg = CacheConfig.for_model(LAYERS, HEADS, HEAD_DIM, 16, "bfloat16", 64, device="cpu", windows=[None, 32] * 2)
    plan = plan_layout(cfg)
    windowed = [place_layout(plan, [[0x5000_0000_0000 + ((8 * g + i) << 32) for i, _ in enumerate(pg.pools)]
                                    for g, pg in enumerate(plan.pool_groups)], "cuda", 0)]
    assert len(windowed[0].layer_groups) == 2
    assert multirank.warm_templates(windowed, layouts(1, 8, 64, 0x6000_0000_0000), cache) == 0
    assert multirank.warm_templates(layouts(1, 32, 1, 0x7000_0000_0000), layouts(1, 48, 64, 0x6000_0000_0000),
                                    cache) == 0   # one 96-token period needs 3 source slots
    assert len(cache) == 0
