"""The batched copy engine: run arithmetic, exact bytes on every CPU path, the staging ring, errors."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.cache.config import CacheConfig, HostTier
from kvxfer.cache.copy_engine import (
    CopyEngine,
    CopyRuns,
    RingUser,
    StagingRing,
    as_runs,
    check_disjoint,
    coalesce_runs,
    split_runs,
)
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.tiers import (
    DiskTierStorage,
    MemoryTierStorage,
    TierStorage,
    open_host_tier,
    primary_tier_of,
)
from kvxfer.errors import LayoutMismatch, TierError, TransferTimeout
from tests.support.tier_helpers import fill_random, multi_pool_config, slot_bytes_of, whole_pool

U64 = np.uint64
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def u64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def byte_map(runs: CopyRuns) -> dict[int, int]:
    """dst byte -> src byte of every byte a set of runs copies."""
    out: dict[int, int] = {}
    for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.nbytes.tolist(), strict=True):
        for k in range(n):
            out[d + k] = s + k
    return out


# --- run arithmetic --------------------------------------------------------------------------------
def test_coalesce_merges_runs_adjacent_on_both_sides_only() -> None:
    runs = as_runs(u64([100, 0, 10, 20, 40, 50]), u64([900, 500, 510, 600, 640, 650]), u64([10, 10, 10, 20, 10, 0]))
    merged = coalesce_runs(runs)
    # 0->500 and 10->510 merge; 20->600 is adjacent in src (ends 20) but not in dst (520 != 600);
    # 40->640 follows 20->600 in dst but not in src; the zero-byte run is dropped
    assert merged.src.tolist() == [0, 20, 40, 100]
    assert merged.dst.tolist() == [500, 600, 640, 900]
    assert merged.nbytes.tolist() == [20, 20, 10, 10]


def test_coalesce_never_merges_across_pools() -> None:
    runs = as_runs(u64([0, 10]), u64([100, 110]), u64([10, 10]))
    assert len(coalesce_runs(runs)) == 1
    assert len(coalesce_runs(runs, src_pool=[0, 1])) == 2
    assert len(coalesce_runs(runs, dst_pool=[3, 4])) == 2


@FAST
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 4)), max_size=30))
def test_coalesce_preserves_the_byte_mapping(entries: list[tuple[int, int, int]]) -> None:
    # distinct destination slots of 4 bytes, arbitrary sources: the mapping must survive coalescing
    seen: set[int] = set()
    src, dst, n = [], [], []
    for s, d, k in entries:
        if d in seen:
            continue
        seen.add(d)
        src.append(s * 4)
        dst.append(d * 4)
        n.append(k)
    runs = as_runs(u64(src), u64(dst), u64(n))
    merged = coalesce_runs(runs)
    assert byte_map(merged) == byte_map(runs)
    assert (merged.nbytes > 0).all()
    assert len(merged) <= int((runs.nbytes > 0).sum())
    ends = merged.src[:-1] + merged.nbytes[:-1]
    assert not ((ends == merged.src[1:]) & (merged.dst[:-1] + merged.nbytes[:-1] == merged.dst[1:])).any()


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 17))
def test_split_runs_cuts_to_max_bytes_and_keeps_bytes(sizes: list[int], cap: int) -> None:
    src = np.cumsum([0, *sizes[:-1]]).astype(np.uint64) * U64(2)
    runs = as_runs(src, src + U64(10_000), u64(sizes))
    pieces = split_runs(runs, cap)
    assert (pieces.nbytes <= cap).all() and (pieces.nbytes > 0).all()
    assert len(pieces) == sum(-(-s // cap) for s in sizes)
    assert byte_map(pieces) == byte_map(runs)
    with pytest.raises(TierError, match="max_bytes must be > 0"):
        split_runs(runs, 0)


def test_check_disjoint() -> None:
    check_disjoint(u64([0, 10, 20]), u64([10, 10, 5]), "destination")  # touching is fine
    with pytest.raises(TierError, match=r"destination range \[0x9, \+2\) overlaps"):
        check_disjoint(u64([0, 9]), u64([10, 2]), "destination")
    with pytest.raises(TierError, match="overlaps"):  # a long range swallowing a later short one
        check_disjoint(u64([0, 50, 20]), u64([100, 1, 1]), "destination")
    check_disjoint(u64([0]), u64([10]), "destination", u64([10]), u64([10]))
    with pytest.raises(TierError, match="overlaps"):
        check_disjoint(u64([15]), u64([10]), "destination", u64([10]), u64([10]))
    with pytest.raises(TierError, match="overlaps"):
        check_disjoint(u64([5]), u64([10]), "destination", u64([10]), u64([10]))


def test_as_runs_rejects_malformed_batches() -> None:
    with pytest.raises(TierError, match="differ in length: 2, 1, 2"):
        as_runs([1, 2], [1], [1, 2])
    with pytest.raises(TierError, match="negative entry -3"):
        as_runs([1, -3], [1, 2], [1, 1])
    with pytest.raises(TierError, match="1-D integer array"):
        as_runs([[1]], [[1]], [[1]])
    with pytest.raises(TierError, match="1-D integer array"):
        as_runs([1.5], [1], [1])


# --- staging ring ----------------------------------------------------------------------------------
class _Recorder(RingUser):
    def __init__(self, log: list[RingUser]) -> None:
        super().__init__()
        self.log = log

    def finish(self) -> None:
        self.log.append(self)


@FAST
@given(st.integers(1, 4), st.lists(st.integers(-70, 70), min_size=1, max_size=40), st.booleans())
def test_ring_places_every_size_around_the_end_without_overwriting_live_data(
        pages: int, deltas: list[int], aligned: bool) -> None:
    capacity = pages * 4096 + 64 * (pages - 1)
    ring = StagingRing(capacity, pinned=False)
    finished: list[RingUser] = []
    user = _Recorder(finished)
    for delta in deltas:
        # sizes cluster around what is left before the ring's end, the full ring, and 1 byte
        left = capacity - ring.place(1)
        n = min(capacity, max(1, left + delta if delta % 3 else (capacity + delta if delta < 0 else 1 + delta)))
        pos = ring.place(n, 4096 if aligned and n % 4096 == 0 else 64)
        assert pos >= 0 and pos + n <= capacity
        if user.overlaps(pos, n):
            ring.submit(user)
            user = _Recorder(finished)
        ring.reserve(pos, n)
        live = ring.live_segments
        assert all(b <= pos or pos + n <= a for a, b in live), (pos, n, live)
        user.segments.append((pos, pos + n))
        if len(user.segments) == 3:
            ring.submit(user)
            user = _Recorder(finished)
    ring.submit(user)
    ring.drain()
    assert ring.live_segments == []
    assert len(finished) == len(set(map(id, finished)))  # each user finished exactly once


def test_ring_refuses_zero_and_oversized_reservations_and_counts_wraps() -> None:
    ring = StagingRing(8192, pinned=False)
    with pytest.raises(TierError, match=r"1\.\.8192 bytes, got 0"):
        ring.place(0)
    with pytest.raises(TierError, match="got 8193"):
        ring.place(8193)
    ring.reserve(ring.place(5000), 5000)
    assert ring.place(3000) == 5056  # 64-byte aligned after 5000
    assert ring.place(3200) == 0     # does not fit the tail: wraps, never a zero-size piece
    ring.reserve(0, 3200)
    assert ring.wraps == 1
    assert ring.base_address % 4096 == 0
    with pytest.raises(TierError, match="multiple of 64"):
        StagingRing(5000, pinned=False)


# --- exact bytes on every path ---------------------------------------------------------------------
@pytest.fixture
def tiers(tmp_path):  # type: ignore[no-untyped-def]
    cfg = multi_pool_config(str(tmp_path))
    manager = KVCacheManager(cfg)
    primary, host, disk = primary_tier_of(manager), open_host_tier(cfg), DiskTierStorage(cfg)
    for i, tier in enumerate((primary, host, disk)):
        fill_random(tier, 100 + i)
    yield {"primary": primary, "host": host, "disk": disk}
    host.close()
    disk.close()


def _slots(rng: np.random.Generator, n: int, total: int) -> np.ndarray:
    return rng.choice(total, size=n, replace=False).astype(np.int64)


def _check_slot_copy(engine: CopyEngine, src: TierStorage, dst: TierStorage, seed: int, count: int = 8) -> None:
    rng = np.random.default_rng(seed)
    for pg in src.layout.pool_groups:
        g = pg.pool_group_index
        s = _slots(rng, count, pg.num_slots)
        d = _slots(rng, count, dst.layout.pool_groups[g].num_slots)
        if src is dst:  # one tier: destinations must not overlap the sources
            perm = _slots(rng, 2 * count, pg.num_slots)
            s, d = perm[:count], perm[count:]
        before = [whole_pool(dst, g, p.pool_index) for p in pg.pools]
        expect = [slot_bytes_of(src, g, p.pool_index, s) for p in pg.pools]
        handle = engine.copy_slots(src, dst, g, s, d)
        handle.wait(10)
        assert handle.done() and handle.error is None
        assert handle.nbytes == count * sum(p.slot_bytes for p in pg.pools)
        for p, old, exp in zip(pg.pools, before, expect, strict=True):
            after = whole_pool(dst, g, p.pool_index)
            old[d] = exp
            assert np.array_equal(after, old), f"{src.name}->{dst.name} pool {g}.{p.pool_index}"


@pytest.mark.parametrize("pair", ["primary>host", "host>primary", "host>disk", "disk>host", "primary>disk",
                                  "disk>primary", "disk>disk", "host>host"])
@pytest.mark.parametrize("staging", [8192, 1 << 20])
def test_copy_slots_exact_bytes_on_every_path(tiers, pair, staging) -> None:  # type: ignore[no-untyped-def]
    a, b = pair.split(">")
    with CopyEngine(staging_bytes=staging) as engine:
        _check_slot_copy(engine, tiers[a], tiers[b], seed=len(pair) + staging)
        stats = engine.stats
    assert stats.batches == 2 and stats.runs_requested == 2 * 2 * 8
    if "disk" in pair:
        assert stats.ring_chunks > 0
        assert stats.ring_wraps > 0 if staging == 8192 else True


def test_disk_paths_without_o_direct_give_the_same_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = multi_pool_config(str(tmp_path))
    with open_host_tier(cfg) as host, DiskTierStorage(cfg, direct_io=False) as disk, \
            CopyEngine(staging_bytes=16384) as engine:
        fill_random(host, 1)
        fill_random(disk, 2)
        _check_slot_copy(engine, host, disk, seed=3)
        _check_slot_copy(engine, disk, host, seed=4)


def test_consecutive_slots_coalesce_into_one_run_per_pool(tiers) -> None:  # type: ignore[no-untyped-def]
    with CopyEngine() as engine:
        h = engine.copy_slots(tiers["primary"], tiers["host"], 0, np.arange(4, 12), np.arange(0, 8))
        h.wait(10)
        assert (h.num_requested, h.num_runs) == (16, 2)
        h = engine.copy_slots(tiers["primary"], tiers["host"], 0, [1, 2, 3, 9], [5, 6, 0, 1])
        h.wait(10)
        assert h.num_runs == 2 * 3  # {1,2}->{5,6}, 3->0, 9->1 per pool


@FAST
@given(st.data())
def test_arbitrary_byte_ranges_land_exactly_and_nothing_else_changes(tiers, data) -> None:  # type: ignore[no-untyped-def]
    pair = data.draw(st.sampled_from([("host", "disk"), ("disk", "host"), ("primary", "host"), ("disk", "primary")]))
    src, dst = tiers[pair[0]], tiers[pair[1]]
    pool = src.layout.pool_groups[0].pools[0]
    total = min(pool.nbytes, dst.layout.pool_groups[0].pools[0].nbytes)
    # disjoint destination ranges: cut the pool into pieces, pick some, map to random source offsets
    cuts = sorted(set(data.draw(st.lists(st.integers(1, total - 1), min_size=2, max_size=12))))
    bounds = [0, *cuts, total]
    picked = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if data.draw(st.booleans())]
    d_off = [a for a, _ in picked]
    n = [b - a for a, b in picked]
    s_off = [data.draw(st.integers(0, total - k)) for k in n]
    before_dst = whole_pool(dst, 0, 0).reshape(-1)
    src_bytes = whole_pool(src, 0, 0).reshape(-1)
    with CopyEngine(staging_bytes=8192) as engine:
        dst_base = dst.layout.pool_groups[0].pools[0].base_address
        h = engine.submit(src, dst, u64([pool.base_address + o for o in s_off]), u64([dst_base + o for o in d_off]),
                          u64(n))
        h.wait(10)
    expected = before_dst.copy()
    for so, do, k in zip(s_off, d_off, n, strict=True):
        expected[do:do + k] = src_bytes[so:so + k]
    assert np.array_equal(whole_pool(dst, 0, 0).reshape(-1), expected)


def test_batches_run_in_submission_order(tiers) -> None:  # type: ignore[no-untyped-def]
    primary, host, disk = tiers["primary"], tiers["host"], tiers["disk"]
    original = slot_bytes_of(primary, 1, 0, np.array([3]))
    with CopyEngine(staging_bytes=8192) as engine:
        handles = [engine.copy_slots(primary, host, 1, [3], [7]), engine.copy_slots(host, disk, 1, [7], [11]),
                   engine.copy_slots(disk, primary, 1, [11], [20])]
        handles[-1].wait(10)
        assert all(h.done() for h in handles)
    assert np.array_equal(slot_bytes_of(primary, 1, 0, np.array([20])), original)


def test_empty_batch_completes(tiers) -> None:  # type: ignore[no-untyped-def]
    with CopyEngine() as engine:
        h = engine.copy_slots(tiers["host"], tiers["disk"], 0, [], [])
        h.wait(5)
        assert h.nbytes == 0 and h.num_runs == 0


# --- errors ----------------------------------------------------------------------------------------
def test_bad_batches_raise_at_submit_and_copy_nothing(tiers) -> None:  # type: ignore[no-untyped-def]
    host, disk = tiers["host"], tiers["disk"]
    before = whole_pool(disk, 0, 0)
    p = host.layout.pool_groups[0].pools[0]
    d = disk.layout.pool_groups[0].pools[0]
    with CopyEngine() as engine:
        with pytest.raises(TierError, match=r"source range 1 .* not inside one pool of this tier"):
            engine.submit(host, disk, u64([p.base_address, p.end_address - 8]), u64([d.base_address, d.base_address + 64]),
                          u64([8, 16]))
        with pytest.raises(TierError, match="destination range 0"):
            engine.submit(host, disk, u64([p.base_address]), u64([d.end_address]), u64([8]))
        with pytest.raises(TierError, match=r"destination range .* overlaps"):
            engine.submit(host, disk, u64([p.base_address, p.base_address + 100]),
                          u64([d.base_address, d.base_address + 4]), u64([8, 8]))
        with pytest.raises(TierError, match=r"destination range .* overlaps"):
            engine.submit(host, host, u64([p.base_address]), u64([p.base_address + 4]), u64([8]))
        with pytest.raises(TierError, match="equal-length 1-D"):
            engine.copy_slots(host, disk, 0, [1, 2], [1])
        with pytest.raises(TierError, match="no pool group 5"):
            engine.copy_slots(host, disk, 5, [1], [1])
        assert engine.stats.batches == 0
    assert np.array_equal(whole_pool(disk, 0, 0), before)


def test_copy_slots_between_different_layouts_is_a_layout_mismatch(tiers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    other_cfg = CacheConfig.for_model(2, 2, 64, 16, "bfloat16", 8, host_blocks=8)
    other = open_host_tier(other_cfg)
    with CopyEngine() as engine, pytest.raises(LayoutMismatch, match="different slot layouts"):
        engine.copy_slots(tiers["host"], other, 0, [0], [0])
    other.close()


def test_closed_engine_and_closed_tier_are_refused(tiers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = CopyEngine()
    engine.close()
    engine.close()
    with pytest.raises(TierError, match="copy engine is closed"):
        engine.copy_slots(tiers["host"], tiers["disk"], 0, [0], [0])
    cfg = multi_pool_config(str(tmp_path))
    host = open_host_tier(cfg, HostTier(cfg.tiers[1].quota_bytes))
    host.close()
    with CopyEngine() as engine2, pytest.raises(TierError, match="host tier is closed"):
        engine2.copy_slots(host, tiers["disk"], 0, [0], [0])


def test_removed_disk_file_fails_the_copy_with_a_tier_error(tiers) -> None:  # type: ignore[no-untyped-def]
    disk = tiers["disk"]
    os.unlink(disk.file_paths[0])
    with CopyEngine() as engine:
        h = engine.copy_slots(disk, tiers["host"], 0, [0], [0])
        with pytest.raises(TierError, match="was removed while the tier is open"):
            h.wait(10)
        assert isinstance(h.error, TierError)
        # the engine keeps working for other tiers after a failed batch
        ok = engine.copy_slots(tiers["primary"], tiers["host"], 0, [0], [0])
        ok.wait(10)


def test_truncated_disk_file_fails_the_copy(tiers) -> None:  # type: ignore[no-untyped-def]
    disk = tiers["disk"]
    os.truncate(disk.file_paths[1], 4096)
    with CopyEngine() as engine:
        h = engine.copy_slots(tiers["host"], disk, 0, [0], [0])
        with pytest.raises(TierError, match="truncated to 4096 bytes"):
            h.wait(10)


def test_wait_times_out_while_the_worker_is_busy(tiers) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()

    class GatedHost(MemoryTierStorage):
        @property
        def closed(self) -> bool:  # the worker consults it before it copies: block it there
            if threading.current_thread().name == "kvxfer-copy-engine":
                gate.wait(10)
            return super().closed

    host = tiers["host"]
    gated = GatedHost("host", host.layout, [[host.pool_tensor(0, 0), host.pool_tensor(0, 1)],
                                            [host.pool_tensor(1, 0), host.pool_tensor(1, 1)]], owns_pools=False)
    with CopyEngine() as engine:
        h = engine.copy_slots(gated, tiers["primary"], 0, [0], [0])
        with pytest.raises(TransferTimeout, match=r"not done after 0.05 s"):
            h.wait(0.05)
        gate.set()
        h.wait(10)


@pytest.mark.parametrize("direction", ["offload", "onboard"])
def test_runs_of_every_size_around_the_ring_end_through_the_engine(tiers, direction) -> None:  # type: ignore[no-untyped-def]
    host, disk = tiers["host"], tiers["disk"]
    src, dst = (host, disk) if direction == "offload" else (disk, host)
    ring = 8192
    sizes = [1, 63, 64, 65, 4095, 4096, 4097, 8127, 8128, 8191, 8192, 8193, 12288, 3 * ring + 5, 7]
    offsets = np.cumsum([0, *sizes[:-1]]) + np.arange(len(sizes)) * 3  # 3-byte gaps: runs stay separate
    s_base = src.layout.pool_groups[0].pools[0].base_address
    d_base = dst.layout.pool_groups[0].pools[0].base_address
    before = whole_pool(dst, 0, 0).reshape(-1)
    src_bytes = whole_pool(src, 0, 0).reshape(-1)
    # destinations in reverse order, so no two runs coalesce
    d_off = np.cumsum([0, *[sizes[i] + 3 for i in range(len(sizes) - 1, 0, -1)]])[::-1]
    with CopyEngine(staging_bytes=ring) as engine:
        h = engine.submit(src, dst, offsets.astype(np.uint64) + U64(s_base), d_off.astype(np.uint64) + U64(d_base),
                          u64(sizes))
        h.wait(10)
        assert h.num_runs == len(sizes)
        assert engine.stats.ring_wraps > 0
        assert engine.ring is not None and engine.ring.live_segments == []
    expected = before.copy()
    for so, do, k in zip(offsets.tolist(), d_off.tolist(), sizes, strict=True):
        expected[do:do + k] = src_bytes[so:so + k]
    assert np.array_equal(whole_pool(dst, 0, 0).reshape(-1), expected)


def test_a_failing_stream_batch_waits_for_the_runs_it_queued(tiers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A stream batch whose enqueue fails part-way is reported failed only once the runs queued before
    the failure have completed: the caller frees the batch's slots on the error."""
    log: list[str] = []

    class FailingCopier:
        def enqueue(self, dst: object, src: object, nbytes: object) -> None:
            log.append("enqueue")
            raise TierError("cuMemcpyAsync failed")

        def synchronize(self) -> None:
            log.append("synchronize")

    with CopyEngine() as engine:
        monkeypatch.setattr(engine, "_copier_for", lambda *tiers: FailingCopier())
        handle = engine.copy_slots(tiers["host"], tiers["primary"], 0, [0], [0])
        with pytest.raises(TierError, match="cuMemcpyAsync failed"):
            handle.wait(10)
    assert log == ["enqueue", "synchronize"]


def test_an_engine_dropped_without_close_stops_its_worker(tiers) -> None:  # type: ignore[no-untyped-def]
    engine = CopyEngine()
    engine.copy_slots(tiers["host"], tiers["primary"], 0, [1], [2]).wait(10)
    worker = next(t for t in threading.enumerate() if t.name == "kvxfer-copy-engine" and t is engine._worker)
    del engine
    gc.collect()
    worker.join(10)
    assert not worker.is_alive()
