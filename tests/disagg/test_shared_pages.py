"""A destination never writes the pages it shares with its prefix tree.

The scenario: decode (two tensor-parallel ranks) holds 105 of a 140-token prompt from its
prefix tree (6 full blocks per rank shared with the tree, refcount 2, plus a copied partial block).
Planning without a token range used to move 294,912 bytes and rewrite all 12 shared slots instead of
the 71,680 bytes decode lacks. Now the default range is what the destination lacks, a range reaching
into a shared block is refused naming it, and the workers keep every plan out of those pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.cache import CacheConfig, KVCacheManager
from kvxfer.cache.kv_cache import KVCache
from kvxfer.disagg.worker import WorkerConfig, all_regions, plan_between
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ReadOnlyPageError
from kvxfer.extractor import check_writable, plan_transfer, writable_block_ids
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport.copy import copy_plan
from tests.e2e.test_loopback import SECRET, _one_thread, name, prompts, reference  # noqa: F401  (autouse fixture)
from tests.faults.conftest import assert_settled

BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4     # tiny: layers x (K, V) x kv heads x head_dim x float32


def manager(tp_rank: int = 0, tp_size: int = 1) -> KVCacheManager:
    return KVCacheManager(CacheConfig.for_model(4, 2, 32, 16, "float32", 64, tp_rank=tp_rank, tp_size=tp_size))


@pytest.fixture
def scenario() -> Iterator[tuple[KVCacheManager, KVCache, list[KVCacheManager], list[KVCache]]]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 512, 140)
    earlier = np.concatenate([prompt[:105], rng.integers(600, 700, 11)])
    src = manager()
    for pg in src.layout.pool_groups:
        for p in pg.pools:
            t = src.pool_tensor(pg.pool_group_index, p.pool_index)
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    src_cache = src.create_kv_cache_for_prompt(prompt, id="src")
    src_cache.resume()
    src_cache.resize(140)
    dst = [manager(r, 2) for r in range(2)]
    dst_caches = []
    for m in dst:
        with m.create_kv_cache_for_prompt(earlier, id="earlier") as first:
            first.resume()
            first.resize(earlier.size)
            first.commit(earlier)
        c = m.create_kv_cache_for_prompt(prompt, id="prompt")
        c.resume()
        c.resize(140)
        dst_caches.append(c)
    yield src, src_cache, dst, dst_caches
    for c in [src_cache, *dst_caches]:
        c.close()


def shared_bytes(dst: list[KVCacheManager], caches: list[KVCache]) -> list[torch.Tensor]:
    """A copy of every shared slot's bytes (blocks 0-5 of each rank)."""
    out = []
    for m, c in zip(dst, caches, strict=True):
        rows = m.pool_tensor(0, 0).view(m.layout.pool_groups[0].num_slots, -1)
        out.append(rows[torch.from_numpy(c.block_ids(0)[:6].astype(np.int64))].clone())
    return out


def test_the_issue_scenario_default_plan_moves_what_decode_lacks(scenario: Any) -> None:
    src, sc, dst, dcs = scenario
    assert [c.num_reused_tokens for c in dcs] == [105, 105]
    shared = [int(m.allocator(0).refcount[s]) for m, c in zip(dst, dcs, strict=True) for s in c.block_ids(0)[:6]]
    assert shared == [2] * 12                      # held by the request and by the prefix tree
    # What the block lists alone allow (the old default): all 9 blocks, the 12 shared slots included.
    blind = [plan_transfer(src.layout, sc.block_id_map(), m.layout, c.block_id_map()) for m, c in zip(dst, dcs, strict=True)]
    assert sum(p.total_bytes for p in blind) == 294_912
    for m, c, p in zip(dst, dcs, blind, strict=True):
        with pytest.raises(ReadOnlyPageError, match=r"writes rank 0 layer group 0 block [0-5] \(slot [0-5]\), a "
                                                    r"committed page the destination may share with its prefix tree; "
                                                    r"\d+ entries do"):
            check_writable(p.dst, [m.layout], [c])
    # The default with the caches themselves: the 35 tokens decode lacks, nothing shared touched.
    before = shared_bytes(dst, dcs)
    plans = [plan_transfer(src.layout, sc, m.layout, c) for m, c in zip(dst, dcs, strict=True)]
    assert sum(p.total_bytes for p in plans) == 71_680 == 35 * BYTES_PER_TOKEN
    for m, p in zip(dst, plans, strict=True):
        copy_plan(p, all_regions([src.layout]), all_regions([m.layout]))
    assert all(torch.equal(a, b) for a, b in zip(before, shared_bytes(dst, dcs), strict=True))
    combined = plan_between([src.layout], [sc], [m.layout for m in dst], dcs, token_range=(105, 140))
    check_writable(combined.dst, [m.layout for m in dst], dcs)
    assert combined.total_bytes == 71_680


def test_a_range_reaching_into_a_shared_block_is_refused_naming_it(scenario: Any) -> None:
    src, sc, dst, dcs = scenario
    slot = int(dcs[1].block_ids(0)[5])
    with pytest.raises(ReadOnlyPageError, match=rf"destination layer group 0 block 5 \(slot {slot}\) is committed .*"
                                                r"writes tokens \[80, 96\) there \(1 segments do"):
        plan_transfer(src.layout, sc, dst[1].layout, dcs[1], token_range=(80, 140))
    with pytest.raises(ReadOnlyPageError, match=r"block 0 \(slot 0\)"):
        plan_transfer(src.layout, sc.block_id_map(), dst[0].layout, dcs[0].block_id_map(), dst_committed=105,
                      token_range=(0, 140))
    # The partially reused block (6) is the request's own copy: writing from token 96 on is allowed.
    assert plan_transfer(src.layout, sc, dst[0].layout, dcs[0], token_range=(96, 140)).total_bytes == 44 * 1024


def test_hidden_shared_blocks_cannot_be_planned_into(scenario: Any) -> None:
    """What decode sends prefill: its block ids with the shared ones as -1 (no page)."""
    src, sc, dst, dcs = scenario
    hidden = [writable_block_ids(m.layout, c) for m, c in zip(dst, dcs, strict=True)]
    assert all((h[0][:6] == -1).all() and (h[0][6:] >= 0).all() for h in hidden)
    blind = plan_between([src.layout], [sc.block_id_map()], [m.layout for m in dst], hidden, token_range=(0, 140))
    check_writable(blind.dst, [m.layout for m in dst], dcs)
    assert blind.total_bytes == (140 - 96) * BYTES_PER_TOKEN    # blocks 6-8 only, shared blocks untouched


# --- the workers -----------------------------------------------------------------------------------
def _used_slots(decode: DecodeWorker) -> dict[int, Any]:
    """Slots decode holds while idle (its prefix tree's pages), as a read-only block list."""
    rc = decode.engine.call(lambda: decode.managers[0].allocator(0).refcount.copy(), 10.0)
    return {0: np.flatnonzero(rc > 0)}


def _tree_guard(decode: DecodeWorker) -> Callable[[PageTable], None]:
    """Raises ReadOnlyPageError for a destination table touching a page of decode's prefix tree now."""
    slots = _used_slots(decode)
    n = int(slots[0].size) * decode.layouts[0].tokens_per_block
    return lambda table: check_writable(table, decode.layouts, [slots], [n])


def test_push_prefill_planning_without_skip_cannot_write_decodes_shared_pages() -> None:
    first, second = prompts(2, prefix=64, count=2)
    written: list[PageTable] = []
    careless_on: list[bool] = []

    def careless(*args: Any, token_range: tuple[int, int], **kw: Any) -> TransferPlan:
        if not careless_on:
            return plan_between(*args, token_range=token_range, **kw)
        plan = plan_between(*args, token_range=(0, token_range[1]), **kw)   # ignores what decode holds
        written.append(plan.dst)
        return plan

    with PrefillWorker(WorkerConfig(name("prefill"), planner=careless), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address) as decode:
        assert decode.generate(first, 8, timeout=60).tokens == reference(first, 8)
        guard = _tree_guard(decode)
        careless_on.append(True)
        res = decode.generate(second, 8, timeout=60)
        assert res.reused_tokens_decode == 64 and res.tokens == reference(second, 8)
        assert written
        for table in written:
            guard(table)                   # no entry lands in a page decode's tree held before
        assert_settled(prefill, decode)


@pytest.mark.parametrize("how", ["range", "block ids"])
def test_pull_plan_into_shared_pages_is_refused_before_the_read(how: str) -> None:
    first, second = prompts(3, prefix=64, count=2)
    careless_on: list[bool] = []

    def careless(src_layouts: Any, src_ids: Any, dst_layouts: Any, dst_ids: Any, *, token_range: tuple[int, int],
                 layers: Sequence[int] | None = None, dst_committed: Sequence[int | None] | None = None,
                 request_id: str = "") -> TransferPlan:
        kw: dict[str, Any] = {"layers": layers, "dst_committed": dst_committed, "request_id": request_id}
        if not careless_on:
            return plan_between(src_layouts, src_ids, dst_layouts, dst_ids, token_range=token_range, **kw)
        if how == "block ids":         # bypass the planner's check: only the one before posting remains
            dst_ids = [c.block_id_map() for c in dst_ids]
        return plan_between(src_layouts, src_ids, dst_layouts, dst_ids, token_range=(0, token_range[1]), **kw)

    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), planner=careless), SECRET, prefill=prefill.address,
                         mode="pull") as decode:
        assert decode.generate(first, 8, timeout=60).tokens == reference(first, 8)
        careless_on.append(True)
        match = r"layer group 0 block 0 \(slot \d+\) is committed" if how == "range" else \
            r"writes rank 0 layer group 0 block 0 \(slot \d+\), a committed page"
        with pytest.raises(ReadOnlyPageError, match=match):
            decode.generate(second, 8, timeout=60)
        careless_on.clear()
        assert decode.generate(second, 8, timeout=60).tokens == reference(second, 8)   # the tree is intact
        assert_settled(prefill, decode)
