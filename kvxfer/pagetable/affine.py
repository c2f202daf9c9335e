"""A BlockPlan template as 2-D affine groups: runs that share a length, steps and regions, and whose offsets
step by constant strides, described once per group instead of once per run.

A re-layout cuts each block into many short runs in regular patterns (HND->NHD: a head row per token, one
``heads x tokens`` grid per layer and K/V). Group ``g`` covers the template's consecutive runs
``[start[g], start[g] + rows[g])``; its run ``k`` is row ``i = k // inner[g]``, column ``j = k % inner[g]``,
at offsets ``src_offset[start] + i x src_outer + j x src_inner`` (the destination alike), so a device
kernel forms a group's addresses from a dozen numbers and checks its bounds once, on the group's extent
(every stride is >= 0, so the first run starts lowest and the last one ends highest).

The grouping is greedy, left to right, and vectorised (``O(T)`` numpy): first the longest 1-D progressions,
then consecutive progressions of equal shape whose starts step by constant strides. ``AffineGroups.of``
checks its result against the template, run by run, before returning it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError
from kvxfer.pagetable.blocks import BlockPlan

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


def greedy_progressions(linked: Bools, step: I64) -> tuple[I64, I64]:
    """(first, last) element of each progression of a greedy left-to-right cut of ``len(linked) + 1``
    elements: element ``e + 1`` joins the progression of element ``e`` when edge ``e`` is ``linked`` and
    its ``step`` (a row of int64 values) equals the progression's first edge's. Elements that join none
    and that none joins are progressions of one; all in order."""
    n, m = linked.size + 1, linked.size
    cont = np.zeros(m, bool)          # edge e continues the run of equal linked edges of edge e - 1
    if m > 1:
        cont[1:] = linked[1:] & linked[:-1] & np.all(step[1:] == step[:-1], axis=1)
    run_first = np.flatnonzero(linked & ~cont)
    run_last = np.flatnonzero(linked & ~np.r_[cont[1:], False])
    # A run of edges [a, b] spans elements a..b + 1. When element a still starts a progression of its own
    # ("open": nothing joined it yet), the run's progression is a..b + 1; when a ended the previous run's
    # progression, edge a is a jump and the progression is a + 1..b + 1 (one element, still open, when the
    # run has one edge). open_0 = True; open_k = True after a gap, False after a run of >= 2 edges, and the
    # opposite of open_(k-1) after a run of one edge.
    adjacent = np.r_[False, run_first[1:] == run_last[:-1] + 1]
    one_edge = np.r_[False, run_last[:-1] == run_first[:-1]]
    setter = ~adjacent | ~one_edge
    flips = np.cumsum(~setter)
    last_set = np.maximum.accumulate(np.where(setter, np.arange(setter.size), 0))
    is_open = ~adjacent[last_set] ^ ((flips - flips[last_set]) & 1).astype(bool)
    first = np.where(is_open, run_first, run_first + 1)
    last = run_last + 1
    keep = last > first
    first, last = first[keep], last[keep]
    covered = np.zeros(n + 1, np.int64)
    np.add.at(covered, first, 1)
    np.add.at(covered, last + 1, -1)
    alone = np.flatnonzero(np.cumsum(covered)[:n] == 0)
    firsts, lasts = np.concatenate([first, alone]), np.concatenate([last, alone])
    order = np.argsort(firsts, kind="stable")
    return firsts[order].astype(np.int64), lasts[order].astype(np.int64)


@dataclass(frozen=True, eq=False)
class AffineGroups:
    """The template of a BlockPlan as groups (see the module docstring); every column has one entry per group,
    strides and offsets in bytes (int64)."""

    start: I64
    rows: I64
    inner: I64
    src_inner: I64
    dst_inner: I64
    src_outer: I64
    dst_outer: I64

    def __len__(self) -> int:
        return int(self.start.size)

    @classmethod
    def of(cls, plan: BlockPlan) -> AffineGroups:
        """The groups of ``plan``'s template; raises PageTableError if they do not describe it run by run
        (a fault of the grouping, never of the plan)."""
        t = plan.runs_per_block
        so = plan.src_offset.astype(np.int64)
        do = plan.dst_offset.astype(np.int64)
        key = np.stack([plan.src_step.astype(np.int64), plan.dst_step.astype(np.int64), plan.nbytes.astype(np.int64),
                        plan.src_region.astype(np.int64), plan.dst_region.astype(np.int64)], axis=1)
        if t == 0:
            empty = np.zeros(0, np.int64)
            return cls(empty, empty, empty, empty, empty, empty, empty)
        same_key = np.all(key[1:] == key[:-1], axis=1)
        ds, dd = np.diff(so), np.diff(do)
        first, last = greedy_progressions(same_key & (ds >= 0) & (dd >= 0), np.stack([ds, dd], axis=1))
        count = last - first + 1
        s_in = np.where(count > 1, so[np.minimum(first + 1, t - 1)] - so[first], 0)
        d_in = np.where(count > 1, do[np.minimum(first + 1, t - 1)] - do[first], 0)
        # 2-D: consecutive progressions of one key, count and inner strides, starts stepping by constant strides
        pk = np.concatenate([key[first], np.stack([count, s_in, d_in], axis=1)], axis=1)
        ps, pd = np.diff(so[first]), np.diff(do[first])
        linked = np.all(pk[1:] == pk[:-1], axis=1) & (ps >= 0) & (pd >= 0)
        g_first, g_last = greedy_progressions(linked, np.stack([ps, pd], axis=1))
        outer = g_last - g_first + 1
        start = first[g_first]
        nxt = np.minimum(g_first + 1, first.size - 1)
        groups = cls(start, outer * count[g_first], count[g_first], s_in[g_first], d_in[g_first],
                     np.where(outer > 1, so[first[nxt]] - so[start], 0),
                     np.where(outer > 1, do[first[nxt]] - do[start], 0))
        groups.check(plan)
        return groups

    def run_offsets(self) -> tuple[I64, I64]:
        """Every template run's (source offset, destination offset) relative to its group's first run, in
        template order (the groups tile the template in order)."""
        g = np.repeat(np.arange(len(self)), self.rows)
        k = np.arange(g.size, dtype=np.int64) - np.repeat(self.start, self.rows)
        i, j = k // self.inner[g], k % self.inner[g]
        return i * self.src_outer[g] + j * self.src_inner[g], i * self.dst_outer[g] + j * self.dst_inner[g]

    def check(self, plan: BlockPlan) -> None:
        """Raise PageTableError unless the groups tile the template in order and give every run its offsets,
        and every run of a group shares the group's first run's length, steps and regions."""
        t = plan.runs_per_block
        if len(self):
            ends = np.r_[self.start[1:], t]
            bad = np.flatnonzero((self.start + self.rows != ends) | (self.inner < 1)
                                 | (self.rows % np.maximum(self.inner, 1) != 0) | (self.src_inner < 0)
                                 | (self.dst_inner < 0) | (self.src_outer < 0) | (self.dst_outer < 0))
            if self.start[0] != 0 or bad.size:
                g = int(bad[0]) if bad.size else 0
                raise PageTableError(f"affine groups do not tile the template of {t} runs: group {g} starts at run "
                                     f"{int(self.start[g])} with {int(self.rows[g])} runs of {int(self.inner[g])} "
                                     f"per row, strides in {int(self.src_inner[g])}/{int(self.src_outer[g])}, "
                                     f"out {int(self.dst_inner[g])}/{int(self.dst_outer[g])}")
        if not len(self):
            if t:
                raise PageTableError(f"no affine groups for a template of {t} runs")
            return
        g0 = np.repeat(self.start, self.rows)
        rel_s, rel_d = self.run_offsets()
        so, do = plan.src_offset.astype(np.int64), plan.dst_offset.astype(np.int64)
        same = [np.array_equal(col[g0], col) for col in (plan.src_step, plan.dst_step, plan.nbytes, plan.src_region,
                                                           plan.dst_region)]
        wrong = np.flatnonzero((so[g0] + rel_s != so) | (do[g0] + rel_d != do))
        if not all(same) or wrong.size:
            at = int(wrong[0]) if wrong.size else -1
            raise PageTableError("affine groups do not reproduce the template's runs: "
                                 + (f"run {at} at offsets {int(so[at])} -> {int(do[at])}, the groups say "
                                    f"{int(so[g0[at]] + rel_s[at])} -> {int(do[g0[at]] + rel_d[at])}" if wrong.size
                                    else "a group's runs differ in length, steps or regions"))
