"""``SwaScratchReuseConfig.max_rewind_len``: the last tokens a request may roll back keep real pages
(their blocks never get scratch slots)."""

from __future__ import annotations

import pytest

from kvxfer.cache import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    SwaScratchReuseConfig,
)
from kvxfer.errors import ConfigError

TPB = 4
WINDOW = 4


def manager(rewind: object) -> KVCacheManager:
    layers: list[LayerConfig] = [AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), 256)], WINDOW, 0)]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(64 << 10)], layers=layers,
        swa_scratch_reuse=SwaScratchReuseConfig(max_rewind_len=rewind)))  # type: ignore[arg-type]


@pytest.mark.parametrize(("rewind", "scratch_end"), [(0, 7), (1, 7), (2, 6), (8, 5), (9, 5), (10, 4), (32, None)])
def test_the_rewind_tail_keeps_its_pages(rewind: int, scratch_end: int | None) -> None:
    mgr = manager(rewind)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(32, 0)             # 8 blocks; at 32 tokens the window needs block 7 only
    desc = kv.get_scratch_desc(0)
    pages = list(kv.get_base_page_indices(mgr.get_layer_group_id(LayerId(0))))
    if scratch_end is None:
        assert desc is None and BAD_PAGE_INDEX not in pages
    else:
        # out of the window at (capacity - rewind) tokens: (32 - rewind - WINDOW + 1) // TPB blocks
        assert desc is not None and (desc.range.beg, desc.range.end) == (0, scratch_end)
        assert pages[:scratch_end] == [BAD_PAGE_INDEX] * scratch_end
        assert BAD_PAGE_INDEX not in pages[scratch_end:]
    kv.close()


@pytest.mark.parametrize("rewind", [-1, 1.5, True, "2"])
def test_a_bad_rewind_length_is_refused(rewind: object) -> None:
    with pytest.raises(ConfigError, match="max_rewind_len"):
        manager(rewind)
