"""Layout construction and descriptor invariants, codecs and fingerprints."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.cache import (
    BufferId,
    CacheConfig,
    CacheLayoutDesc,
    CoalescedBuffer,
    ExpandedBuffer,
    LayerSpec,
    PrimaryTier,
    RoleSpec,
    SlotDesc,
    SlotDescVariant,
)
from kvxfer.cache.layout import buffer_formats, check_placed, place_layout, plan_layout
from kvxfer.cli.inspect import describe
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
    assert [v.layer_group_id for v in pg.slot_desc.variants] == [0, 1]
    for variant in pg.slot_desc.variants:
        kv, scale = variant.coalesced_buffers
        assert (kv.single_buffer_size, kv.num_buffers, kv.size) == (8 * 16 * 64 * 2, 4, 4 * 8 * 16 * 64 * 2)
        assert (scale.single_buffer_size, scale.num_buffers) == (8 * 16 * 1 * 4, 2)
        assert variant.slot_size_list == (kv.size, scale.size) == pg.slot_desc.slot_size_list
    assert [p.slot_bytes for p in pg.pools] == list(pg.slot_desc.slot_size_list)


def test_variants_with_equal_slot_sizes_share_a_pool_group() -> None:
    """4 x 4096 B buffers (two windowed layers) and 2 x 8192 B (one full layer of twice the head dim)
    both make 16 KiB slots: one pool group with two variants, as the reference design groups them."""
    layers = (LayerSpec(0, 2, 64, window=64), LayerSpec(1, 2, 64, window=64), LayerSpec(2, 2, 128))
    layout = plan_layout(CacheConfig(layers, 16, "float16", (PrimaryTier(1 << 20),)))
    assert len(layout.pool_groups) == 1
    (pg,) = layout.pool_groups
    small, large = pg.slot_desc.variants
    assert [(c.single_buffer_size, c.num_buffers) for c in small.coalesced_buffers] == [(4096, 4)]
    assert [(c.single_buffer_size, c.num_buffers) for c in large.coalesced_buffers] == [(8192, 2)]
    assert pg.slot_desc.slot_size_list == (16384,) and pg.pools[0].slot_bytes == 16384
    assert [lg.pool_group_index for lg in layout.layer_groups] == [0, 0]
    # each layer group's buffers tile the shared slot
    assert [(s.offset, s.size) for s in large.buffer_spans()] == [(0, 8192), (8192, 8192)]
    assert CacheLayoutDesc.from_msgpack(layout.to_msgpack()) == layout


def test_slot_desc_validation_names_the_bad_variant() -> None:
    a = SlotDescVariant(0, (CoalescedBuffer(4096, (BufferId(0, "key"), BufferId(0, "value"))),))
    b = SlotDescVariant(1, (CoalescedBuffer(4096, (BufferId(1, "key"),)),))
    with pytest.raises(LayoutError, match=r"layer group 1 has slot sizes \[4096\], layer group 0 has \[8192\]"):
        SlotDesc((a, b))
    with pytest.raises(LayoutError, match="name a layer group twice"):
        SlotDesc((a, a))
    with pytest.raises(LayoutError, match="sorted by size, largest first"):
        SlotDescVariant(0, (CoalescedBuffer(64, (BufferId(0, "scale"),)), CoalescedBuffer(4096, (BufferId(0, "key"),))))
    with pytest.raises(LayoutError, match="expansion must be an int >= 1"):
        ExpandedBuffer(BufferId(0, "key"), 0)


def test_different_structures_get_different_pool_groups() -> None:
    layers = (LayerSpec(0, 8, 64, window=64), LayerSpec(1, 8, 64), LayerSpec(2, 8, 64), LayerSpec(3, 8, 128))
    cfg = CacheConfig(layers, 16, "float16", (PrimaryTier(1 << 24),))
    layout = plan_layout(cfg)
    assert [lg.layer_ids for lg in layout.layer_groups] == [(0,), (1, 2, 3)]
    assert len(layout.pool_groups) == 2
    full = layout.pool_groups[layout.layer_groups[1].pool_group_index]
    # layer 3's buffers are twice as large: a second pool in the same pool group
    (variant,) = full.slot_desc.variants
    assert sorted(c.single_buffer_size for c in variant.coalesced_buffers) == [16 * 8 * 64 * 2, 16 * 8 * 128 * 2]


@pytest.mark.parametrize("coalesce", [True, False])
def test_invariants_offsets_tile_slots_and_buffers_appear_once(coalesce: bool) -> None:
    layout = plan_layout(mixed_config(coalesce=coalesce))
    seen: list[BufferId] = []
    for pg in layout.pool_groups:
        for variant in pg.slot_desc.variants:
            for p, pool in enumerate(pg.pools):
                spans = sorted((s.offset, s.offset + s.size) for s in variant.buffer_spans() if s.pool_index == p)
                assert spans[0][0] == 0 and spans[-1][1] == pool.slot_bytes
                assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            seen.extend(s.buffer_id for s in variant.buffer_spans())
    assert len(seen) == len(set(seen)) == 4 * 3
    assert set(seen) == set(buffer_formats(mixed_config()))
    if not coalesce:
        assert all(c.num_buffers == 1 for pg in layout.pool_groups for v in pg.slot_desc.variants
                   for c in v.coalesced_buffers)


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
    with pytest.raises(DecodeError, match="missing required field `pool_groups`"):
        CacheLayoutDesc.from_dict(missing)
    tampered = dict(good, tokens_per_block=32)
    with pytest.raises(DecodeError):
        CacheLayoutDesc.from_dict(tampered)
    wrong_fp = dict(good, fingerprint="00" * 32)
    with pytest.raises(DecodeError, match="fingerprint"):
        CacheLayoutDesc.from_dict(wrong_fp)
    neg = msgpack.unpackb(plan_layout(mixed_config()).to_msgpack())
    neg["pool_groups"][0]["pools"][0]["num_slots"] = -5
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
    d["formats"][0]["format"]["head_dim"] = junk
    original = plan_layout(mixed_config()).formats[0][1].head_dim
    if junk == original:
        assert CacheLayoutDesc.from_dict(d) == plan_layout(mixed_config())
    else:
        with pytest.raises((DecodeError, LayoutError)):
            CacheLayoutDesc.from_dict(d)
    assert BufferId(layer, role) == (layer, role)   # a tuple, as in the reference design


def test_reference_descriptor_walk_in_docs_runs() -> None:
    """docs/cache.md's example, written against the reference design's descriptor API, runs here."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cache.md").read_text()
    section = text.split("## Published descriptors: the reference design's shapes", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "pool_group_descs" in code and "slot_desc.variants" in code and "get_aggregated_pages" in code
    scope: dict[str, object] = {}
    exec(compile(code, "docs/cache.md", "exec"), scope)
    assert scope["where"]


def test_inspect_json_names_every_field() -> None:
    """`kvxfer inspect --json`: every list holds scalars or named objects (never a positional record),
    the derived values are there, and the output decodes back to the layout."""
    layout = plan_layout(mixed_config())
    text = json.dumps(describe(layout))

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            kinds = {type(x) for x in node}
            assert kinds <= {int} or kinds <= {dict}, f"positional list {node!r:.80}"
            for value in node:
                walk(value)

    decoded = json.loads(text)
    walk(decoded)
    cb = decoded["pool_groups"][0]["slot_desc"]["variants"][0]["coalesced_buffers"][0]
    assert (cb["size"], cb["num_buffers"]) == (4 * cb["single_buffer_size"], 4)
    assert decoded["pool_groups"][0]["slot_desc"]["slot_size_list"] == list(layout.pool_groups[0].slot_desc.slot_size_list)
    span = decoded["pool_groups"][0]["slot_desc"]["variants"][0]["buffer_spans"][1]
    assert span == {"buffer_id": {"layer_id": 0, "role": "value"}, "pool_index": 0, "offset": cb["single_buffer_size"],
                    "size": cb["single_buffer_size"], "expansion": 1}
    assert CacheLayoutDesc.from_json(text) == layout


def test_check_placed_accepts_live_pools_and_names_a_stale_descriptor() -> None:
    plan = plan_layout(mixed_config())
    tensors = [[torch.zeros(p.nbytes, dtype=torch.uint8) for p in pg.pools] for pg in plan.pool_groups]
    placed = place_layout(plan, [[t.data_ptr() for t in group] for group in tensors], "cpu")
    check_placed(placed, tensors)
    smaller = [[t[:t.numel() // 2] for t in group] for group in tensors]    # same base, half the bytes
    with pytest.raises(LayoutError, match=r"pool 0\.0: the descriptor names .* the live pool is"):
        check_placed(placed, smaller)
    moved = [[torch.zeros(t.numel(), dtype=torch.uint8) for t in group] for group in tensors]
    with pytest.raises(LayoutError, match=r"pool 0\.0"):
        check_placed(placed, moved)
    with pytest.raises(LayoutError, match="2 tensor lists for 1 pool groups"):
        check_placed(placed, [*tensors, []])
