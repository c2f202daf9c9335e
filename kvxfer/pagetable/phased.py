"""PhasedPlan: one transfer made of several BlockPlans, posted as one (one notification after all of it).

A transfer between two layouts that differ in tokens per block is a BlockPlan per segment shape, and one
between rank sets a plan per rank pair (``kvxfer.extractor.multirank``): several templates, each with
its own slot pairs. A PhasedPlan keeps them as they are, O(blocks + template runs) however finely the
layouts cut the bytes, where their expansion lists every run; a transport posts it as one transfer
(``expand`` where it cannot do better). Its check costs O(blocks + template) too when the phases' shapes
show that no two of them write one byte (the phases of a layout pair do), else it checks the expansion.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.errors import PageTableError
from kvxfer.memory_region import MemoryRegion
from kvxfer.pagetable.blocks import BlockPlan
from kvxfer.pagetable.plan import TransferPlan, regions_disjoint


@dataclass(frozen=True, eq=False)
class PhasedPlan:
    """The runs of every phase, phase after phase (``expand`` lists them in that order)."""

    phases: tuple[BlockPlan, ...]

    def __post_init__(self) -> None:
        phases = tuple(self.phases)
        bad = [type(p).__name__ for p in phases if not isinstance(p, BlockPlan)]
        if bad:
            raise PageTableError(f"PhasedPlan: phases must be BlockPlans, got {bad[:4]}")
        object.__setattr__(self, "phases", phases)

    def __len__(self) -> int:
        return sum(len(p) for p in self.phases)

    def __repr__(self) -> str:
        return f"PhasedPlan({len(self.phases)} phases, {len(self)} runs, {self.total_bytes} bytes)"

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return sum(p.total_bytes for p in self.phases)

    def expand(self) -> TransferPlan:
        """The equivalent TransferPlan: every phase's expansion, phase after phase."""
        plans = [p.expand() for p in self.phases if len(p)]
        if not plans:
            return TransferPlan.empty()
        return plans[0] if len(plans) == 1 else TransferPlan.concat(plans)

    def validate(self, src_regions: Sequence[MemoryRegion], dst_regions: Sequence[MemoryRegion]) -> None:
        """Raise PageTableError when a run lies outside its region on either side or two destination runs
        overlap (``TransferPlan.validate``'s contract): each phase checked as a BlockPlan, then the phases
        against each other in O(blocks + template) where their shapes allow (``_apart``), else through the
        expansion."""
        live = [p for p in self.phases if len(p)]
        for i, p in enumerate(live):
            try:
                p.validate(src_regions, dst_regions)
            except PageTableError as exc:
                raise PageTableError(f"{exc} (phase {i})") from None
        if len(live) > 1 and not _apart(live, dst_regions):
            self.expand().validate(src_regions, dst_regions)


def _apart(phases: list[BlockPlan], regions: Sequence[MemoryRegion]) -> bool:
    """True when no two of ``phases`` (each already checked on its own) write one byte: the regions they
    write share no byte, and in each region every run of every phase lies in one window of the one slot
    step they all use (so runs of different slots are apart), and two phases that write one slot write
    disjoint parts of it. False means "not shown" (the caller checks the expansion)."""
    used = np.unique(np.concatenate([p.dst_region[p.nbytes > 0] for p in phases]))
    if used.size > 1 and not regions_disjoint([regions[int(r)] for r in used]):
        return False
    for r in used.tolist():
        parts = []
        for p in phases:
            t = np.flatnonzero((p.dst_region == r) & (p.nbytes > 0))
            if t.size:
                parts.append((p.dst_slots, p.dst_step[t], p.dst_offset[t], p.nbytes[t]))
        if len(parts) < 2:
            continue
        steps = np.concatenate([x[1] for x in parts])
        start = np.concatenate([x[2] for x in parts])
        stop = start + np.concatenate([x[3] for x in parts])
        if int(steps.min()) != int(steps.max()) or int(stop.max()) - int(start.min()) > int(steps.max()):
            return False
        for a, b in itertools.combinations(parts, 2):
            if not np.intersect1d(a[0], b[0]).size:
                continue
            lo = np.concatenate([a[2], b[2]])
            hi = lo + np.concatenate([a[3], b[3]])
            order = np.argsort(lo, kind="stable")
            if bool((lo[order][1:] < np.maximum.accumulate(hi[order])[:-1]).any()):
                return False
    return True
