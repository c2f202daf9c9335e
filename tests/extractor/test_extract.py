"""extract() and layout_regions() against a real CPU KVCacheManager."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.cache import BufferId, CacheConfig, KVCacheManager, RoleSpec
from kvxfer.errors import BlockIdError, LayoutError, PageTableError
from kvxfer.extractor import COORDS, extract, layout_regions, layout_roles, placements


@pytest.fixture(scope="module")
def mgr() -> KVCacheManager:
    """3 layers (layer 1 sliding window), key/value plus a small scale role in its own pool."""
    cfg = CacheConfig.for_model(3, 2, 4, 4, "float16", 12, windows=[None, 8],
                                roles=("key", "value", RoleSpec("scale", head_dim=1, dtype="float16")))
    return KVCacheManager(cfg)


def buffer_addr(m: KVCacheManager, layer: int, role: str, slot: int) -> int:
    return int(m.buffer_view(layer, role)[slot].data_ptr())


def test_layout_regions_match_the_managers_regions(mgr: KVCacheManager) -> None:
    ours = layout_regions(mgr.layout)
    theirs = mgr.memory_regions()
    assert [(r.base_address, r.nbytes) for r in ours] == [(r.base_address, r.nbytes) for r in theirs]
    assert len(ours) == sum(len(pg.pools) for pg in mgr.layout.pool_groups)


def test_whole_slot_entries_when_every_buffer_is_selected(mgr: KVCacheManager) -> None:
    ids = {0: np.array([5, 2, 7], np.int32), 1: np.array([-1, 3, 4], np.int32)}
    t = extract(mgr.layout, ids)
    regions = mgr.memory_regions()
    t.validate(regions)
    assert set(t.coords) == set(COORDS)
    # whole slots: -1 layer/role, and as many buffers as the slot holds (2 layers x 2 for key/value
    # of group 0, 2 layers x 1 for its scale pool; 2 and 1 for group 1's single layer)
    assert (t.coords["layer"] == -1).all() and (t.coords["role"] == -1).all()
    assert sorted(set(t.coords["buffers"].tolist())) == [1, 2, 4]
    # every selected byte exactly once: 2 valid blocks of group 1, 3 of group 0, every buffer
    fmt = dict(mgr.layout.formats)
    per_block = {g: sum(fmt[BufferId(lid, r)].nbytes for lid in mgr.layout.layer_groups[g].layer_ids
                        for r in ("key", "value", "scale")) for g in (0, 1)}
    assert t.total_bytes == 3 * per_block[0] + 2 * per_block[1]
    assert sorted(t.coords["block"][t.coords["layer_group"] == 1].tolist()) == [1, 1, 2, 2]   # two pools
    pg0 = mgr.layout.pool_groups[mgr.layout.layer_groups[0].pool_group_index]
    first = int(np.flatnonzero(t.coords["layer_group"] == 0)[0])
    assert int(t.addr[first]) == pg0.pools[0].base_address + 5 * pg0.pools[0].slot_bytes
    assert int(t.nbytes[first]) == pg0.pools[0].slot_bytes


def test_per_buffer_entries_point_at_the_buffers(mgr: KVCacheManager) -> None:
    ids = {0: np.array([5, 2, 7], np.int32), 1: np.array([-1, 3, 4], np.int32)}
    t = extract(mgr.layout, ids, layers=[1, 2], roles=["value"], first_block=1)
    roles = layout_roles(mgr.layout)
    assert roles == ("key", "scale", "value")
    got = sorted(zip(t.coords["layer"].tolist(), t.coords["block"].tolist(), t.addr.tolist(),
                     t.nbytes.tolist(), strict=True))
    want = sorted([(2, b, buffer_addr(mgr, 2, "value", s), 2 * 4 * 4 * 2) for b, s in ((1, 2), (2, 7))]
                  + [(1, b, buffer_addr(mgr, 1, "value", s), 2 * 4 * 4 * 2) for b, s in ((1, 3), (2, 4))])
    assert got == want
    assert (t.coords["role"] == roles.index("value")).all()
    assert (t.coords["token_start"] == t.coords["block"] * 4).all() and (t.coords["num_tokens"] == 4).all()
    assert (t.coords["head_start"] == 0).all() and (t.coords["num_heads"] == 2).all()
    assert (t.coords["buffers"] == 1).all()


def test_extract_takes_a_kv_cache(mgr: KVCacheManager) -> None:
    with mgr.create_kv_cache() as cache:
        cache.resume()
        cache.resize(10)
        t = extract(mgr.layout, cache, layers=[0], roles=["key"])
        ids = cache.block_ids(0)
        assert t.addr.tolist() == [buffer_addr(mgr, 0, "key", int(s)) for s in ids]
    # coalescing a layer's key over consecutive slots does not merge (other buffers sit in between)
    assert len(t.coalesce()) == len(t)


def test_extract_of_placements_is_consistent(mgr: KVCacheManager) -> None:
    place = placements(mgr.layout)
    for bid, p in place.items():
        assert p.base + 3 * p.slot_bytes == buffer_addr(mgr, bid.layer_id, bid.role, 3)


def test_extract_refusals(mgr: KVCacheManager) -> None:
    ids = {0: np.array([1]), 1: np.array([2])}
    with pytest.raises(LayoutError, match=r"layers \[9\] are not in this layout"):
        extract(mgr.layout, ids, layers=[9])
    with pytest.raises(LayoutError, match=r"roles \['query'\]"):
        extract(mgr.layout, ids, roles=["query"])
    with pytest.raises(PageTableError, match="first_block"):
        extract(mgr.layout, ids, first_block=-1)
    with pytest.raises(BlockIdError, match="layer group 1: position 0 holds 99"):
        extract(mgr.layout, {0: [1], 1: [99]})
    with pytest.raises(BlockIdError, match="expected a mapping"):
        extract(mgr.layout, [1, 2])
    # a group nobody selected needs no ids
    assert len(extract(mgr.layout, {0: [1]}, layers=[0, 2])) == 2
    assert len(extract(mgr.layout, ids, first_block=5)) == 0
