"""Shared by the fault-injection suite: every test here carries the ``faults`` marker, no worker thread
outlives a test, and ``assert_settled`` checks that the workers hold nothing and that the allocator
accounting of every rank balances."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.stats import SlotAccounting
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from tests.e2e.test_loopback import _one_thread  # noqa: F401  (autouse: one torch thread, no kvxfer-* thread left)

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this directory ``faults`` (``-m faults`` selects the suite)."""
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.faults)


def slot_accounting(managers: list[KVCacheManager]) -> list[tuple[int, SlotAccounting]]:
    """(rank, accounting) of every rank and pool group; each call cross-checks the free stack and the
    prefix tree against the reference counts (KVCacheError when they contradict each other)."""
    return [(rank, m.slot_accounting(pg)) for rank, m in enumerate(managers) for pg in range(len(m.layout.pool_groups))]


def _busy(w: PrefillWorker | DecodeWorker) -> bool:
    s = w.status()
    return bool(s["held_slots"] or s["open_caches"] or s["jobs"] or s.get("zombies", 0))


def wait_until(cond: Callable[[], bool], limit: float, what: str) -> float:
    """Poll ``cond`` until true; the seconds it took (AssertionError after ``limit`` s)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"{what}: not within {limit:.1f} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def assert_settled(*workers: PrefillWorker | DecodeWorker, timeout: float = 5.0) -> None:
    """Poll until no request holds a slot, a cache or a job on any of ``workers`` (a peer's cancel or
    release may still be on its way), then assert it together with the allocator accounting of every
    rank and pool group, read on each worker's engine thread: free + evictable == total, nothing
    held by a request, and the counts agree with the pool group's slot count."""
    deadline = time.monotonic() + timeout
    while any(_busy(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    for w in workers:
        who = w.config.name
        assert w.held_slots() == 0, f"{who}: slots still held by requests"
        assert w.num_open_caches() == 0, f"{who}: caches still open"
        status = w.status()
        assert status["jobs"] == 0 and status.get("zombies", 0) == 0, f"{who}: {status}"
        rows: list[tuple[int, SlotAccounting]] = w.engine.call(partial(slot_accounting, w.managers), 10.0)
        assert len(rows) == sum(len(m.layout.pool_groups) for m in w.managers)
        for rank, acc in rows:
            where = f"{who} rank {rank} pool group {acc.pool_group}: {acc}"
            assert acc.total == w.managers[rank].layout.pool_groups[acc.pool_group].num_slots, where
            assert acc.request_only == 0 and acc.shared == 0, where
            assert acc.free + acc.evictable == acc.total, where
