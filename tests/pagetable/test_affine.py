"""Affine groups of a BlockPlan template: the greedy cut is the one a plain left-to-right scan makes, the
groups give back every template run exactly (offsets, length, steps, regions), regular re-layouts cut into
few large groups, and ``check`` refuses groups that do not describe their template."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import PageTableError
from kvxfer.pagetable import BlockPlan
from kvxfer.pagetable.affine import AffineGroups, greedy_progressions


def scan(linked: np.ndarray, step: np.ndarray) -> list[tuple[int, int]]:
    """The greedy cut, one element at a time."""
    n, out, e = linked.size + 1, [], 0
    while e < n:
        first, value = e, None
        while e < n - 1 and linked[e] and (value is None or tuple(step[e]) == value):
            value = tuple(step[e])
            e += 1
        out.append((first, e))
        e += 1
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2)), max_size=40))
def test_the_vectorised_cut_is_the_left_to_right_scan(edges: list[tuple[bool, int]]) -> None:
    linked = np.array([e[0] for e in edges], bool)
    step = np.array([[e[1]] for e in edges], np.int64).reshape(-1, 1)
    first, last = greedy_progressions(linked, step)
    assert list(zip(first.tolist(), last.tolist(), strict=True)) == scan(linked, step)


def template_plan(src_offset: np.ndarray, dst_offset: np.ndarray, nbytes: np.ndarray | None = None,
                  src_region: np.ndarray | None = None, step: int = 1 << 20) -> BlockPlan:
    t = src_offset.size
    zeros = np.zeros(t, np.uint32)
    return BlockPlan(np.arange(3, dtype=np.uint64), np.arange(3, dtype=np.uint64), np.full(t, step, np.uint64),
                     src_offset.astype(np.uint64), np.full(t, step, np.uint64), dst_offset.astype(np.uint64),
                     (np.full(t, 256) if nbytes is None else nbytes).astype(np.uint64),
                     zeros if src_region is None else src_region.astype(np.uint32), zeros)


def runs_of(groups: AffineGroups, plan: BlockPlan) -> list[tuple[int, ...]]:
    """Every run the groups name, from their numbers alone (plus each group's first run's length/regions)."""
    out = []
    for g in range(len(groups)):
        s0 = int(groups.start[g])
        for k in range(int(groups.rows[g])):
            i, j = divmod(k, int(groups.inner[g]))
            out.append((int(plan.src_offset[s0]) + i * int(groups.src_outer[g]) + j * int(groups.src_inner[g]),
                        int(plan.dst_offset[s0]) + i * int(groups.dst_outer[g]) + j * int(groups.dst_inner[g]),
                        int(plan.nbytes[s0]), int(plan.src_region[s0])))
    return out


def transpose(heads: int, tokens: int, layers: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """Head-major to token-major rows of ``layers`` consecutive [heads, tokens, row] tiles."""
    h, t = np.meshgrid(np.arange(heads), np.arange(tokens), indexing="ij")
    base = np.repeat(np.arange(layers) * heads * tokens * row, heads * tokens)
    return (np.tile(((h * tokens + t) * row).ravel(), layers) + base,
            np.tile(((t * heads + h) * row).ravel(), layers) + base)


def test_head_major_to_token_major_is_one_group_per_tile() -> None:
    s, d = transpose(8, 16, 6, 256)
    plan = template_plan(s, d)
    groups = AffineGroups.of(plan)
    assert len(groups) == 6
    assert groups.rows.tolist() == [128] * 6 and groups.inner.tolist() == [16] * 6
    assert (groups.src_inner.tolist(), groups.dst_inner.tolist()) == ([256] * 6, [2048] * 6)
    assert (groups.src_outer.tolist(), groups.dst_outer.tolist()) == ([4096] * 6, [256] * 6)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_groups_give_back_every_template_run(data: st.DataObject) -> None:
    """Random templates: affine pieces of random shapes and strides (some decreasing), runs of random lengths
    and regions, shuffled pieces; the groups name exactly the template's runs, in its order."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pieces = []
    for _ in range(int(rng.integers(1, 6))):
        rows, inner = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        si, di, so, do = (int(x) * 16 for x in rng.integers(-3, 40, 4))
        base_s, base_d = (int(x) * 16 for x in rng.integers(200, 400, 2))
        i, j = np.divmod(np.arange(rows * inner), inner)
        pieces.append((base_s + i * so + j * si, base_d + i * do + j * di,
                       np.full(rows * inner, int(rng.choice([16, 256, 4096]))),
                       np.full(rows * inner, int(rng.integers(0, 2)))))
    if data.draw(st.booleans()):
        rng.shuffle(pieces)
    s = np.concatenate([p[0] for p in pieces])
    d = np.concatenate([p[1] for p in pieces])
    nbytes = np.concatenate([p[2] for p in pieces])
    region = np.concatenate([p[3] for p in pieces])
    plan = template_plan(s, d, nbytes, region)
    groups = AffineGroups.of(plan)
    want = list(zip(s.tolist(), d.tolist(), nbytes.tolist(), region.tolist(), strict=True))
    assert runs_of(groups, plan) == want
    assert all(x >= 0 for col in (groups.src_inner, groups.dst_inner, groups.src_outer, groups.dst_outer)
               for x in col.tolist())


@pytest.mark.parametrize("change", ["src_inner", "dst_outer", "rows", "inner", "start"])
def test_check_refuses_groups_that_do_not_describe_the_template(change: str) -> None:
    s, d = transpose(4, 8, 3, 256)
    nbytes = np.full(s.size, 256)
    nbytes[40] = 128
    plan = template_plan(s, d, nbytes)
    groups = AffineGroups.of(plan)
    groups.check(plan)
    column = getattr(groups, change).copy()
    column[-1] += 1 if change != "inner" else column[-1]
    bad = dataclasses.replace(groups, **{change: column})
    with pytest.raises(PageTableError, match=r"affine groups do not (tile|reproduce).*(group \d+|run \d+)"):
        bad.check(plan)


def test_a_template_with_nothing_regular_is_one_group_per_run() -> None:
    rng = np.random.default_rng(5)
    s = rng.permutation(64) * 4096
    d = rng.permutation(64) * 4096
    nbytes = rng.choice([256, 512, 1024], 64)
    groups = AffineGroups.of(template_plan(s, d, nbytes))
    assert len(groups) >= 32
    assert runs_of(groups, template_plan(s, d, nbytes)) == list(
        zip(s.tolist(), d.tolist(), nbytes.tolist(), [0] * 64, strict=True))
