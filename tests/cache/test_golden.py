"""The cache manager's observable behaviour on a mixed workload (tests/support/cache_workload.py) is exactly the
golden one: every drained event (type, ids, contents, order), statistics, reference counts, free stacks,
tree contents and request pages after each step."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest

from kvxfer.cache import events
from kvxfer.cache.allocator import SlotAllocator
from tests.support.cache_workload import RANDOM_SEEDS, compact, digests, run_random_workloads, run_workload

GOLDEN = pathlib.Path(__file__).parents[1] / "data" / "cache_golden.json"
GOLDEN_RANDOM = pathlib.Path(__file__).parents[1] / "data" / "cache_golden_random.txt"


def _differences(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[str]:
    """Where ``got`` departs from ``want``: per step, the first differing event and each state section."""
    out = [] if len(got) == len(want) else [f"{len(got)} steps, golden has {len(want)}"]
    for g, w in zip(got, want, strict=False):
        where = f"{w['run']} / {w['step']}"
        if (g["run"], g["step"]) != (w["run"], w["step"]):
            out.append(f"step {g['run']} / {g['step']} where the golden has {where}")
            continue
        if g["events"] != w["events"]:
            n = min(len(g["events"]), len(w["events"]))
            i = next((i for i in range(n) if g["events"][i] != w["events"][i]), n)
            out.append(f"{where}: event {i} is {g['events'][i] if i < len(g['events']) else None}, golden "
                       f"{w['events'][i] if i < len(w['events']) else None}")
        out += [f"{where}: {section} differs" for section in w["state"] if g["state"].get(section) != w["state"][section]]
    return out


def test_workload_matches_golden() -> None:
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(compact(run_workload())))
    assert _differences(got, want) == []
    assert sum(len(step["events"]) for step in got) > 100


def test_random_workloads_match_golden() -> None:
    """Seeded random workloads (tiers, sliding windows, two pool groups; pins, shrinks, priorities):
    each recorded step's events and state digest as the golden's."""
    want = GOLDEN_RANDOM.read_text().splitlines()
    got = digests(run_random_workloads(RANDOM_SEEDS))
    assert len(got) == len(want) > 200
    assert [g for g, w in zip(got, want, strict=True) if g != w][:3] == []


def test_golden_sees_event_coalescing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: without coalescing the event stream differs."""
    monkeypatch.setattr(events, "_continues", lambda head, last, new: False)
    diffs = _differences(json.loads(json.dumps(compact(run_workload()))), json.loads(GOLDEN.read_text()))
    assert any("event" in d for d in diffs)


def test_golden_sees_free_stack_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: a free stack refilled in another order changes the slots handed out later."""
    decref = SlotAllocator.decref

    def reversed_push(self: SlotAllocator, ids: Any) -> Any:
        freed = decref(self, ids)
        if freed.size > 1:
            self._free[self._top - freed.size:self._top] = np.sort(freed)
        return freed

    monkeypatch.setattr(SlotAllocator, "decref", reversed_push)
    diffs = _differences(json.loads(json.dumps(compact(run_workload()))), json.loads(GOLDEN.read_text()))
    assert any("allocators differs" in d for d in diffs)
    got = digests(run_random_workloads(RANDOM_SEEDS))
    assert got != GOLDEN_RANDOM.read_text().splitlines()
