"""The pool auto-tuner on the colder levels: the host and disk tiers have their own target (the bytes an
average reused prefix takes), the gate opens on their drift, and adjust() re-splits each of them, the
surplus of a shrinking pool group moved one tier down or dropped from the coldest tier, every other page
kept with its bytes, the tier's layout and files replaced."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxfer.cache import (
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerId,
    _introspection,
)
from kvxfer.errors import ConfigError, ManagerBusyError, TierError

TPB = 32
KEY = DataRole("key")
BIG, SMALL = 8192, 2048          # bytes per block of the windowed layer and of the full-attention one
BLOCK = BIG + SMALL


def config(primary_blocks: int, host_blocks: int | None, disk_blocks: int | None, disk_dir: Path | None,
           **kw: Any) -> KVCacheManagerConfig:
    """A 256-token window of big blocks and a full-attention layer of small ones (two pool groups, at
    least 9 slots each: the window's blocks and the one being written); the primary split 80/20 by bytes
    (as many slots of each), the colder tiers planned with as many slots per pool group too."""
    tiers: list[Any] = [GpuCacheTierConfig(primary_blocks * BLOCK)]
    if host_blocks is not None:
        tiers.append(HostCacheTierConfig(host_blocks * BLOCK))
    if disk_blocks is not None:
        assert disk_dir is not None
        tiers.append(DiskCacheTierConfig(disk_blocks * BLOCK, str(disk_dir)))
    return KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=tiers,
        layers=[AttentionLayerConfig(LayerId(0), [BufferConfig(KEY, BIG)], sliding_window_size=8 * TPB,
                                     num_sink_tokens=0),
                AttentionLayerConfig(LayerId(1), [BufferConfig(KEY, SMALL)])],
        initial_pool_ratio=[0.8, 0.2], **kw)


def totals(mgr: KVCacheManager, level: int) -> list[int]:
    return [s.total for s in _introspection.storage_statistics(mgr, level)]


def used(mgr: KVCacheManager) -> list[int]:
    """Pages of each pool group over all tiers."""
    return [sum(mgr.storage_stats(t).slots_used[pg] for t in range(mgr.num_tiers)) for pg in range(2)]


_tokens = itertools.count(10_000)


def fill(mgr: KVCacheManager, prompts: int) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Commit ``prompts`` two-block prompts one after another, each block's pages filled with its own
    byte; the older ones go down the tiers as the primary fills. Returns each prompt's pages' bytes."""
    written = {}
    for i in range(prompts):
        prompt = tuple(next(_tokens) for _ in range(2 * TPB))
        kv = mgr.create_kv_cache(None, list(prompt))
        assert kv.resume() and kv.resize(len(prompt))
        pages = []
        for lg, layer in enumerate((0, 1)):
            view = mgr.buffer_view(layer, "key")
            for b, slot in enumerate(kv.page_locations(lg)[0].tolist()):
                view[slot].fill_((31 * i + 7 * lg + 3 * b + 1) % 251)
                pages.append(view[slot].clone())
        kv.commit(list(prompt))
        kv.close()
        written[prompt] = pages
    return written


def check_intact(mgr: KVCacheManager, written: dict[tuple[int, ...], list[torch.Tensor]]) -> None:
    """Every prompt still matches whole, and its pages, brought back to the primary, hold its bytes."""
    for prompt, pages in written.items():
        assert mgr.probe_reuse(None, list(prompt)) == len(prompt)
        kv = mgr.create_kv_cache(None, list(prompt))
        assert kv.resume() and kv.num_committed_tokens == len(prompt)
        got = []
        for lg, layer in enumerate((0, 1)):
            view = mgr.buffer_view(layer, "key")
            got += [view[slot].clone() for slot in kv.page_locations(lg)[0].tolist()]
        kv.close()
        assert len(got) == len(pages) and all(torch.equal(a, b) for a, b in zip(got, pages, strict=True))


def open_gates(mgr: KVCacheManager) -> None:
    _introspection.set_num_sampled_kv_caches(mgr, mgr.init_config.rebalance_min_sampled_kv_caches + 1)
    _introspection.set_last_adjustment_time(mgr, 0.0)


def test_the_colder_levels_start_on_target_and_their_drift_alone_opens_the_gate(tmp_path: Path) -> None:
    mgr = KVCacheManager(config(10, 20, 40, tmp_path))
    assert totals(mgr, 0) == [10, 10] and totals(mgr, 1) == [20, 20] and totals(mgr, 2) == [40, 40]
    assert _introspection.current_other_ratio(mgr) == pytest.approx([0.8, 0.2])
    open_gates(mgr)
    assert not mgr.need_adjustment                            # both targets start as the current splits
    _introspection.set_target_ratio_list_other(mgr, [0.6, 0.4])   # 2x off for pool group 1
    assert mgr.need_adjustment                                # the primary is on target all the same
    _introspection.set_target_ratio_list_other(mgr, [0.76, 0.24])  # 1.2x: within the 1.25x threshold
    assert not mgr.need_adjustment
    with pytest.raises(ConfigError, match="set_target_ratio_list_other: need 2 positive shares"):
        _introspection.set_target_ratio_list_other(mgr, [1.0, 0.0])
    mgr.shutdown()


def test_every_level_starts_split_by_the_initial_ratio(tmp_path: Path) -> None:
    """As the reference sizes every level by its initial ratio: equal bytes per pool group here, so the
    colder tiers hold four small slots per big one, byte-exact, floors kept."""
    cfg = config(10, 20, 40, tmp_path)
    cfg.initial_pool_ratio = [0.5, 0.5]
    mgr = KVCacheManager(cfg)
    assert totals(mgr, 0) == [9, 14]           # the big group held at its floor of 9, the small one the rest
    assert totals(mgr, 1) == [12, 50] and totals(mgr, 2) == [25, 100]
    assert _introspection.current_other_ratio(mgr) == pytest.approx([0.5, 0.5], abs=0.01)
    assert mgr.pool_tuner.target_other_ratio == _introspection.current_other_ratio(mgr)
    open_gates(mgr)
    assert not mgr.need_adjustment
    mgr.shutdown()


def test_without_colder_levels_the_other_target_is_the_primary_split() -> None:
    mgr = KVCacheManager(config(10, None, None, None))
    assert mgr.num_tiers == 1
    assert _introspection.current_other_ratio(mgr) == _introspection.current_gpu_ratio(mgr)
    open_gates(mgr)
    assert not mgr.need_adjustment
    mgr.adjust()                                               # nothing to re-split
    assert totals(mgr, 0) == [10, 10]
    mgr.shutdown()


def test_adjust_resplits_host_and_disk_and_keeps_every_page(tmp_path: Path) -> None:
    mgr = KVCacheManager(config(10, 20, 40, tmp_path))
    written = fill(mgr, 16)                                    # 32 blocks: 10 primary, 20 host, 2 disk
    assert used(mgr) == [32, 32]
    assert [mgr.storage_stats(t).slots_used for t in range(3)] == [(10, 10), (20, 20), (2, 2)]
    old_files = mgr.tier_layout(2), sorted(os.listdir(tmp_path))
    primary_layout = mgr.layout
    open_gates(mgr)
    _introspection.set_target_ratio_list_other(mgr, [0.5, 0.5])    # equal bytes: far fewer big slots
    assert mgr.need_adjustment
    mgr.adjust()
    assert totals(mgr, 0) == [10, 10] and mgr.layout is primary_layout       # the primary was on target
    # host 200 KiB: 12 big slots (96 KiB) and 50 small ones; disk 400 KiB: 25 and 100
    assert totals(mgr, 1) == [12, 50] and totals(mgr, 2) == [25, 100]
    assert mgr.get_quota(1) == 20 * BLOCK and mgr.get_quota(2) == 40 * BLOCK     # quotas kept
    assert _introspection.current_other_ratio(mgr) == pytest.approx([0.5, 0.5], abs=0.01)
    # the 8 big pages above host's 12 went down to disk; none was lost
    assert [mgr.storage_stats(t).slots_used for t in range(3)] == [(10, 10), (12, 20), (10, 2)]
    assert used(mgr) == [32, 32]
    for t in (1, 2):                                           # the tiers' layouts describe the new pools
        layout = mgr.tier_layout(t)
        assert [pg.num_slots for pg in layout.pool_groups] == totals(mgr, t)
        for pg in layout.pool_groups:
            assert all(p.num_slots == pg.num_slots for p in pg.pools)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and not set(files) & set(old_files[1])          # new pool files, old removed
    sizes = {f: os.path.getsize(tmp_path / f) for f in files}
    assert sorted(sizes.values()) == sorted([25 * BIG, 100 * SMALL])
    assert mgr.tier_layout(2) is not old_files[0]
    open_gates(mgr)
    assert not mgr.need_adjustment                             # on target now
    check_intact(mgr, written)
    mgr.shutdown()
    assert os.listdir(tmp_path) == []


def test_the_coldest_level_drops_its_surplus_oldest_first(tmp_path: Path) -> None:
    mgr = KVCacheManager(config(10, 10, 20, tmp_path))
    written = fill(mgr, 15)                                    # 30 blocks: 10 in each tier
    assert [mgr.storage_stats(t).slots_used for t in range(3)] == [(10, 10), (10, 10), (10, 10)]
    open_gates(mgr)
    _introspection.set_target_ratio_list_other(mgr, [0.2, 0.8])
    mgr.adjust()
    # big slots at their floor of 9 in both colder tiers, the rest small: host 14, disk 64
    assert totals(mgr, 1) == [9, 14] and totals(mgr, 2) == [9, 64]
    # host's one surplus big page went to disk, disk then held 11 of 9: two pages dropped, the oldest
    # prompt's (both its blocks, with their small pages)
    oldest, *rest = written
    assert mgr.probe_reuse(None, list(oldest)) == 0
    assert used(mgr) == [28, 28]
    assert [mgr.storage_stats(t).slots_used for t in range(3)] == [(10, 10), (9, 10), (9, 8)]
    assert all(mgr.probe_reuse(None, list(p)) == len(p) for p in rest)
    mgr.resize_quota(2, 100 * BLOCK)       # room below, so bringing pages up drops none of the others
    check_intact(mgr, {p: written[p] for p in rest})
    mgr.shutdown()


def test_adjust_is_refused_while_a_cache_is_active_and_changes_nothing(tmp_path: Path) -> None:
    mgr = KVCacheManager(config(10, 20, 40, tmp_path))
    kv = mgr.create_kv_cache()
    assert kv.resume()
    open_gates(mgr)
    _introspection.set_target_ratio_list_other(mgr, [0.5, 0.5])
    with pytest.raises(ManagerBusyError, match="adjust"):
        mgr.adjust()
    assert totals(mgr, 1) == [20, 20] and totals(mgr, 2) == [40, 40]
    kv.close()
    mgr.adjust()
    assert totals(mgr, 1) == [12, 50]
    mgr.shutdown()


def test_reused_prefixes_set_the_colder_target(tmp_path: Path) -> None:
    """Each created kv cache feeds its reused length at creation; at the next target update the colder
    levels' target becomes the byte shares of a request of that length (here the window keeps 9 of 43
    blocks, the full-attention layer all of them)."""
    mgr = KVCacheManager(config(200, 20, None, None, rebalance_target_ratio_update_interval=3))
    tuner = mgr.pool_tuner
    start = list(tuner.target_other_ratio)
    prompt = [next(_tokens) for _ in range(64 * TPB)]
    kv = mgr.create_kv_cache(None, prompt)                 # nothing to reuse: samples 0
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(prompt)
    kv.close()
    reusers = [mgr.create_kv_cache(None, prompt) for _ in range(2)]
    assert [r.history_length for r in reusers] == [len(prompt)] * 2
    assert tuner.avg_reused_length.value == pytest.approx(2 * len(prompt) / 3, rel=1e-3)
    assert tuner.target_other_ratio == start               # two samples closed: not yet an update
    for r in reusers:
        assert r.resume() and r.resize(len(prompt) + 1)
        r.close()
    avg = round(tuner.avg_reused_length.value)
    assert avg == 1365
    want = tuner.state.planner.ratio_from_length(avg, avg)
    assert tuner.target_other_ratio == pytest.approx(want)
    assert want == pytest.approx([9 * BIG / (9 * BIG + 43 * SMALL), 43 * SMALL / (9 * BIG + 43 * SMALL)])
    mgr.shutdown()


def test_held_pages_in_the_coldest_level_are_never_dropped(tmp_path: Path) -> None:
    """Pages of suspended requests that reached the disk tier cannot go anywhere: a re-split that would
    leave them no slot is refused (TierError) and the disk tier stays as it was, every page kept."""
    mgr = KVCacheManager(config(10, 10, 20, tmp_path))
    held = []
    for _ in range(15):                                        # 30 held blocks: 10 in each tier
        kv = mgr.create_kv_cache()
        assert kv.resume() and kv.resize(2 * TPB)
        kv.suspend()
        held.append(kv)
    assert [mgr.storage_stats(t).slots_used for t in range(3)] == [(10, 10), (10, 10), (10, 10)]
    open_gates(mgr)
    _introspection.set_target_ratio_list_other(mgr, [0.2, 0.8])
    with pytest.raises(TierError, match="adjust: the disk tier holds 11 pages of pool group 0"):
        mgr.adjust()
    assert totals(mgr, 2) == [20, 20]                          # host went first: its surplus page is on disk
    assert totals(mgr, 1) == [9, 14]
    assert used(mgr) == [30, 30]
    for kv in held:                                            # every request comes back whole
        assert kv.resume()
        assert all((kv.page_locations(lg)[0] >= 0).all() for lg in (0, 1))
        kv.close()
    mgr.shutdown()


def test_resize_of_a_colder_level_splits_it_by_the_colder_target(tmp_path: Path) -> None:
    """``resize`` of the host level is the reference's re-split at a new quota: by the colder target."""
    mgr = KVCacheManager(config(10, 20, 40, tmp_path))
    written = fill(mgr, 16)
    _introspection.set_target_ratio_list_other(mgr, [0.5, 0.5])
    assert mgr.resize(1, 40 * BLOCK)                           # 400 KiB split by bytes: 25 big, 100 small
    assert totals(mgr, 1) == [25, 100] and mgr.get_quota(1) == 40 * BLOCK
    assert totals(mgr, 2) == [40, 40]                          # the other levels stay
    assert not mgr.resize(1, 9 * BLOCK - 1)                    # below the floors (9 slots each)
    assert totals(mgr, 1) == [25, 100]
    assert used(mgr) == [32, 32]
    check_intact(mgr, written)
    mgr.shutdown()
