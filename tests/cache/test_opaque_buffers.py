"""Buffers the reference design sizes by bytes per page only: a size that is not a multiple of the
tokens per block (an opaque buffer: held, addressed and reused like any other, refused by everything
that maps bytes to tokens), and ``tokens_per_block_override`` (a buffer paged by fewer tokens: several
of its pages per slot)."""

from __future__ import annotations

import ctypes

import pytest

from kvxfer.cache import (
    AttentionLayerConfig,
    BufferConfig,
    CacheConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    LayerSpec,
    PageIndexMode,
    PrimaryTier,
    RoleSpec,
)
from kvxfer.cache.config import cache_config_of, manager_config_of
from kvxfer.cache.descriptors import BufferId, CacheLayoutDesc, plain
from kvxfer.errors import ConfigError, LayoutError
from kvxfer.extractor import extract, plan_transfer
from kvxfer.transport.integrity import ChecksumPolicy, digest_kv

TPB = 4
KEY, VALUE, SCALE = DataRole("key"), DataRole("value"), DataRole("scale")
ODD = 4 * 64 + 3          # bytes per page: not a multiple of the 4 tokens per block


def opaque_manager() -> KVCacheManager:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(KEY, 256), BufferConfig(VALUE, 256), BufferConfig(SCALE, ODD)])
        for i in range(2)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(64 << 10)],
                                               layers=layers))


def test_an_opaque_buffer_gets_exactly_its_bytes_per_slot() -> None:
    mgr = opaque_manager()
    fmt = mgr.layout.format_of(BufferId(0, "scale"))
    assert fmt.opaque and fmt.nbytes == ODD and not mgr.layout.format_of(BufferId(0, "key")).opaque
    assert sorted(p.slot_bytes for p in mgr.pool_group_descs[0].pools) == [2 * ODD, 4 * 256]
    assert mgr.get_page_stride(LayerId(1), SCALE) == ODD
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * TPB)
    indices = kv.get_base_page_indices(0)
    # every (layer, role, block) page is its own byte range: fill them all, then read each back
    pages: dict[tuple[int, str, int], tuple[int, int]] = {}
    for layer in range(2):
        for role in (KEY, VALUE, SCALE):
            base = mgr.get_mem_pool_base_address(LayerId(layer), role)
            stride = mgr.get_page_stride(LayerId(layer), role)
            for block, page in enumerate(mgr.get_page_index_converter(LayerId(layer), role)(indices)):
                pages[(layer, str(role), block)] = (base + stride * page, stride)
    for n, (addr, size) in enumerate(pages.values()):
        ctypes.memset(addr, n + 1, size)
    for n, (addr, size) in enumerate(pages.values()):
        assert ctypes.string_at(addr, size) == bytes([n + 1]) * size
    kv.close()


def test_the_extractor_and_views_refuse_an_opaque_buffer() -> None:
    mgr = opaque_manager()
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * TPB)
    with pytest.raises(LayoutError, match=r"buffer BufferId\(layer_id=0, role='scale'\) is opaque"):
        extract(mgr.layout, kv)
    table = extract(mgr.layout, kv, roles=["key", "value"])
    assert int(table.nbytes.sum()) == 2 * 2 * 2 * 256          # 2 layers x 2 roles x 2 blocks
    other = opaque_manager()
    dst = other.create_kv_cache()
    assert dst.resume() and dst.resize(2 * TPB)
    with pytest.raises(LayoutError, match=r"transfer plan .source.: buffer .* is opaque"):
        plan_transfer(mgr.layout, kv, other.layout, dst)
    with pytest.raises(LayoutError, match="opaque"):
        mgr.buffer_view(0, "scale")
    with pytest.raises(LayoutError, match=r"digest_kv: buffer .* is opaque"):
        digest_kv([mgr.layout], [kv], (0, 2 * TPB), ChecksumPolicy(), "r")
    kv.close()
    dst.close()


def test_opaque_formats_travel_and_structured_ones_keep_their_wire_form() -> None:
    layout = opaque_manager().layout
    assert CacheLayoutDesc.from_msgpack(layout.to_msgpack()) == layout
    wire = {tuple(plain(b).values()): plain(f) for b, f in layout.formats}
    assert wire[(0, "scale")]["block_bytes"] == ODD and "block_bytes" not in wire[(0, "key")]


def test_a_buffer_paged_by_fewer_tokens_has_several_pages_per_slot() -> None:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(0), [BufferConfig(KEY, 128)]),
        AttentionLayerConfig(LayerId(1), [BufferConfig(KEY, 64, tokens_per_block_override=TPB // 2)])]
    mgr = KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(16 << 10)],
                                              layers=layers))
    assert mgr.layout.expansion_of(BufferId(1, "key")) == 2
    assert mgr.get_page_stride(LayerId(1), KEY) == 64 and mgr.get_page_stride(LayerId(0), KEY) == 128
    assert manager_config_of(cache_config_of(mgr.init_config)).layers[1].buffers[0].tokens_per_block_override == 2
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * TPB)
    indices = list(kv.get_base_page_indices(0))
    conv = mgr.get_page_index_converter(LayerId(1), KEY)
    pages = conv(indices)
    assert len(pages) == 2 * len(indices) and pages[1::2] == [p + 1 for p in pages[0::2]]
    per = conv(indices, PageIndexMode.PER_LAYER)
    assert len(per) == len(pages)
    base = mgr.get_mem_pool_base_address(LayerId(1), KEY)
    shared = {base + 64 * p for p in pages}
    assert len(shared) == len(pages)                                # every half-block page its own bytes
    assert mgr.get_page_index_upper_bound(LayerId(1), KEY) > max(pages)
    with pytest.raises(LayoutError, match="paged by 2 of the cache's 4 tokens"):
        mgr.buffer_view(1, "key")
    kv.close()


def test_role_pages_are_checked_against_the_cache() -> None:
    with pytest.raises(ConfigError, match="tokens_per_block 3 does not divide the cache's 4"):
        CacheConfig(layers=(LayerSpec(0, 1, 8, roles=(RoleSpec("key", tokens_per_block=3),)),),
                    tokens_per_block=TPB, dtype="float16", tiers=(PrimaryTier(1 << 20),))
    with pytest.raises(ConfigError, match=r"opaque role .* num_kv_heads must be 1"):
        CacheConfig(layers=(LayerSpec(0, 2, 8, roles=(RoleSpec("key", block_bytes=ODD),)),),
                    tokens_per_block=TPB, dtype="float16", tiers=(PrimaryTier(1 << 20),))
