"""A consumer that reads only the manager's reference descriptors (``pool_group_descs``, ``layer_grouping``,
``init_config.layers[i].window_size``), as TensorRT-LLM's disaggregation page-table builder does, finds the
bytes ``extract()`` gives for the same requests: slot pointers per (layer group, pool), buffer offsets inside
a slot, windows and layer-to-group mapping (docs/extractor.md, "TensorRT-LLM's page table and kvxfer's")."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxfer.cache import KVCacheManager
from kvxfer.cache.config import CacheConfig, LayerSpec, PrimaryTier, RoleSpec
from kvxfer.extractor import extract, region_indices


def two_pool_groups() -> CacheConfig:
    """SWA layers with 2 heads and full layers with 8 (two pool groups), a small scale role (two pools)."""
    layers = tuple(LayerSpec(i, 2 if i % 2 else 8, 64, window=(24 if i % 2 else None),
                             roles=("key", "value", RoleSpec("kscale", head_dim=2, dtype="float32")))
                   for i in range(6))
    return CacheConfig(layers=layers, tokens_per_block=8, dtype="bfloat16", tiers=(PrimaryTier(32 << 20),))


def shared_pool_group() -> CacheConfig:
    return CacheConfig.for_model(6, 4, 32, 16, "float16", 128, windows=[32, None, 64], sink_tokens=4)


def descriptor_view(mgr: KVCacheManager) -> dict[int, dict[str, Any]]:
    """Per layer group: its layers, window, pool group and per pool (base, slot_bytes, [(layer, role, offset)])."""
    out: dict[int, dict[str, Any]] = {}
    for pg in mgr.pool_group_descs:
        for variant in pg.slot_desc.variants:
            lg = int(variant.layer_group_id)
            layers = [int(x) for x in mgr.layer_grouping[lg]]
            pools = []
            for pool, cb in zip(pg.pools, variant.coalesced_buffers, strict=True):
                offsets = [(int(b.layer_id), str(b.role), i * int(cb.single_buffer_size))
                           for i, b in enumerate(cb.buffer_ids)]
                pools.append((int(pool.base_address), int(pool.slot_bytes), int(cb.single_buffer_size), offsets))
            out[lg] = {"layers": layers, "window": mgr.init_config.layers[layers[0]].window_size,
                       "pool_group": int(pg.pool_group_index), "pools": pools}
    return out


@pytest.mark.parametrize("make", [two_pool_groups, shared_pool_group])
def test_reference_descriptors_address_what_extract_returns(make: Any) -> None:
    mgr = KVCacheManager(make())
    layout = mgr.layout
    view = descriptor_view(mgr)
    assert sorted(view) == list(range(len(mgr.layer_grouping)))
    for lg, desc in layout_groups(layout):
        assert view[lg]["layers"] == list(desc.layer_ids)
        assert view[lg]["window"] == desc.window
        assert view[lg]["pool_group"] == desc.pool_group_index
    regions = region_indices(layout)
    tpb = layout.tokens_per_block
    rng = np.random.default_rng(7)
    base = rng.integers(0, 30000, 9 * tpb + 3).tolist()
    caches = []
    for tokens in (base[:5 * tpb + 1], base, base[:3 * tpb] + rng.integers(0, 30000, 2 * tpb).tolist()):
        kv = mgr.create_kv_cache(None, tokens)
        assert kv.resume() and kv.resize(len(tokens) + 2)
        kv.commit(tokens[kv.num_committed_tokens:])
        caches.append(kv)
        table = extract(layout, kv)
        for lg, entry in view.items():
            ids = np.asarray(kv.get_base_page_indices(lg)[: kv.num_blocks], dtype=np.int64)
            valid = ids[ids >= 0]
            for p, (pool_base, slot_bytes, single, offsets) in enumerate(entry["pools"]):
                ptrs = pool_base + slot_bytes * valid
                sel = (table.coords["layer_group"] == lg) & (table.region == regions[entry["pool_group"]][p])
                assert table.addr[sel].astype(np.int64).tolist() == ptrs.tolist()
                assert set(table.nbytes[sel].tolist()) <= {slot_bytes}
                for layer, role, offset in offsets:
                    one = extract(layout, {lg: ids}, layers=[layer], roles=[role])
                    assert one.addr.astype(np.int64).tolist() == (ptrs + offset).tolist()
                    assert set(one.nbytes.tolist()) <= {single}
    assert any(int(x) < 0 for kv in caches for lg in view for x in kv.get_base_page_indices(lg)[: kv.num_blocks])
    for kv in caches:
        kv.close()
    mgr.shutdown()


def layout_groups(layout: Any) -> list[tuple[int, Any]]:
    return [(lg.layer_group_id, lg) for lg in layout.layer_groups]
