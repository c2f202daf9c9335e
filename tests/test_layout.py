"""Layout construction and descriptor invariants, codecs and fingerprints."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.cache import (
    BufferId,
    CacheConfig,
    CacheLayoutDesc,
    LayerSpec,
    PrimaryTier,
    RoleSpec,
)
from kvxfer.cache.layout import buffer_formats, place_layout, plan_layout
from kvxfer.errors import ConfigError, DecodeError, LayoutError

SCALE = RoleSpec("key_scale", head_dim=1, dtype="float32")


def mixed_config(coalesce: bool = True, **kw: object) -> CacheConfig:
    """4 layers alternating window 128 / full, plus a float32 scale role of another size."""
    return CacheConfig.for_model(4, 8, 64, 16, "bfloat16", 10, windows=[128, None],
                                 roles=("key", "value", SCALE), coalesce=coalesce, **kw)  # type: ignore[arg-type]


def test_mixed_windows_group_layers_and_share_pool_group() -> None:
    layout = plan_layout(mixed_config())
    assert [(lg.layer_ids, lg.window) for lg in layout.layer_groups] == [((0, 2), 128), ((1, 3), None)]
    # Both layer groups have the same slot structure, so they share one pool group and allocator.
    assert len(layout.pool_groups) == 1
    pg = layout.pool_groups[0]
    assert pg.layer_group_ids == (0, 1)
    assert pg.num_slots == 20  # 10 blocks for each of the two layer groups
    kv_slot, scale_slot = pg.slots
    assert kv_slot.coalesced.single_buffer_size == 8 * 16 * 64 * 2
    assert kv_slot.slot_bytes == 4 * kv_slot.coalesced.single_buffer_size
    assert scale_slot.coalesced.single_buffer_size == 8 * 16 * 1 * 4
    assert scale_slot.slot_bytes == 2 * scale_slot.coalesced.single_buffer_size


def test_different_structures_get_different_pool_groups() -> None:
    layers = (LayerSpec(0, 8, 64, window=64), LayerSpec(1, 8, 64), LayerSpec(2, 8, 64), LayerSpec(3, 8, 128))
    cfg = CacheConfig(layers, 16, "float16", (PrimaryTier(1 << 24),))
    layout = plan_layout(cfg)
    assert [lg.layer_ids for lg in layout.layer_groups] == [(0,), (1, 2, 3)]
    assert len(layout.pool_groups) == 2
    full = layout.pool_groups[layout.layer_groups[1].pool_group_index]
    # layer 3's buffers are twice as large: a second pool in the same pool group
    assert sorted(s.coalesced.single_buffer_size for s in full.slots) == [16 * 8 * 64 * 2, 16 * 8 * 128 * 2]


@pytest.mark.parametrize("coalesce", [True, False])
def test_invariants_offsets_tile_slots_and_buffers_appear_once(coalesce: bool) -> None:
    layout = plan_layout(mixed_config(coalesce=coalesce))
    seen: list[BufferId] = []
    for pg in layout.pool_groups:
        for slot in pg.slots:
            per = slot.buffers_per_slot
            expanded = slot.expanded()
            for g in range(len(pg.layer_group_ids)):
                mine = expanded[g * per:(g + 1) * per]
                spans = sorted((e.offset, e.offset + e.size) for e in mine)
                assert spans[0][0] == 0 and spans[-1][1] == slot.slot_bytes
                assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            seen.extend(e.buffer_id for e in expanded)
    assert len(seen) == len(set(seen)) == 4 * 3
    assert set(seen) == set(buffer_formats(mixed_config()))
    if not coalesce:
        assert all(len(s.coalesced.buffer_ids) == len(pg.layer_group_ids)
                   for pg in layout.pool_groups for s in pg.slots)


def test_placed_pools_never_overlap() -> None:
    layout = plan_layout(mixed_config())
    pools = layout.pool_groups[0].pools
    ok = place_layout(layout, [[0x10000, 0x10000 + pools[0].nbytes]], "cpu")
    assert ok.pool_groups[0].pools[1].base_address == 0x10000 + pools[0].nbytes
    with pytest.raises(LayoutError, match="overlaps"):
        place_layout(layout, [[0x10000, 0x10000 + pools[0].nbytes - 1]], "cpu")


@pytest.mark.parametrize("coalesce", [True, False])
def test_codecs_round_trip(coalesce: bool) -> None:
    layout = place_layout(plan_layout(mixed_config(coalesce=coalesce)), [[0x1000, 0x900000]], "cuda", 3) \
        if coalesce else plan_layout(mixed_config(coalesce=coalesce))
    assert CacheLayoutDesc.from_msgpack(layout.to_msgpack()) == layout
    assert CacheLayoutDesc.from_json(layout.to_json()) == layout
    assert hash(CacheLayoutDesc.from_json(layout.to_json())) == hash(layout)


def test_fingerprint_ignores_addresses_and_sizes_but_not_shape() -> None:
    a = plan_layout(mixed_config())
    b = place_layout(plan_layout(mixed_config(), 1 << 26), [[0x5000, 0x10000000]], "cuda", 1)
    assert a.pool_groups[0].num_slots != b.pool_groups[0].num_slots
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 32
    assert plan_layout(mixed_config(head_order="NHD")).fingerprint != a.fingerprint
    assert plan_layout(mixed_config(tp_size=2, tp_rank=1)).fingerprint != a.fingerprint
    assert plan_layout(mixed_config(coalesce=False)).fingerprint != a.fingerprint


def test_tensor_parallel_head_ranges() -> None:
    for rank in range(4):
        fmts = buffer_formats(mixed_config(tp_size=4, tp_rank=rank))
        f = fmts[BufferId(1, "key")]
        assert (f.head_start, f.num_heads, f.total_heads) == (2 * rank, 2, 8)
    # fewer KV heads than ranks: heads are replicated
    cfg = CacheConfig.for_model(2, 2, 32, 16, "float16", 4, tp_size=4, tp_rank=3)
    f = buffer_formats(cfg)[BufferId(0, "value")]
    assert (f.head_start, f.num_heads) == (1, 1)


def test_config_validation_names_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"tokens_per_block must be > 0, got 0"):
        CacheConfig.for_model(2, 8, 64, 0, "bfloat16", 4)
    with pytest.raises(ConfigError, match=r"unknown dtype 'bfloat17'"):
        CacheConfig.for_model(2, 8, 64, 16, "bfloat17", 4)
    with pytest.raises(ConfigError, match=r"tp_rank=2 must be < tp_size=2"):
        CacheConfig.for_model(2, 8, 64, 16, "bf16", 4, tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError, match=r"duplicate layer ids"):
        CacheConfig((LayerSpec(0, 8, 64), LayerSpec(0, 8, 64)), 16, "bf16", (PrimaryTier(1 << 20),))
    with pytest.raises(ConfigError, match=r"head_order must be 'HND' or 'NHD', got 'XYZ'"):
        CacheConfig.for_model(2, 8, 64, 16, "bf16", 4, head_order="XYZ")
    with pytest.raises(ConfigError, match=r"sink_tokens=4 needs a window"):
        LayerSpec(0, 8, 64, sink_tokens=4)
    with pytest.raises(ConfigError, match=r"holds no block"):
        plan_layout(CacheConfig.for_model(2, 8, 64, 16, "bf16", 1), quota_bytes=100)
    assert CacheConfig.for_model(1, 1, 8, 4, torch.bfloat16, 1).dtype == "bfloat16"


def test_decoder_rejects_malformed_descriptors() -> None:
    good = plan_layout(mixed_config()).to_dict()
    bad_version = {**good, "version": 99}
    with pytest.raises(DecodeError, match="version 99"):
        CacheLayoutDesc.from_dict(bad_version)
    missing = {k: v for k, v in good.items() if k != "pool_groups"}
    with pytest.raises(DecodeError, match="missing field 'pool_groups'"):
        CacheLayoutDesc.from_dict(missing)
    tampered = dict(good, tokens_per_block=32)
    with pytest.raises(DecodeError):
        CacheLayoutDesc.from_dict(tampered)
    wrong_fp = dict(good, fingerprint="00" * 32)
    with pytest.raises(DecodeError, match="fingerprint"):
        CacheLayoutDesc.from_dict(wrong_fp)
    neg = msgpack.unpackb(plan_layout(mixed_config()).to_msgpack())
    neg["pool_groups"][0]["pools"][0][3] = -5
    with pytest.raises(DecodeError, match="num_slots"):
        CacheLayoutDesc.from_dict(neg)
    with pytest.raises(DecodeError):
        CacheLayoutDesc.from_msgpack(b"\xc1garbage")


@given(st.binary(max_size=300))
def test_layout_decoder_never_crashes_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(DecodeError, LayoutError):
        CacheLayoutDesc.from_msgpack(data)


@given(st.integers(0, 3), st.sampled_from(["key", "value", "key_scale"]), st.integers(0, 500))
def test_decoder_rejects_field_mutations(layer: int, role: str, junk: int) -> None:
    d = plan_layout(mixed_config()).to_dict()
    d["formats"][0][1][1] = junk  # head_dim of the first format
    original = plan_layout(mixed_config()).formats[0][1].head_dim
    if junk == original:
        assert CacheLayoutDesc.from_dict(d) == plan_layout(mixed_config())
    else:
        with pytest.raises((DecodeError, LayoutError)):
            CacheLayoutDesc.from_dict(d)
    assert dataclasses.is_dataclass(BufferId(layer, role))
