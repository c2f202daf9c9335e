"""Engine-owned KV tensors (vLLM, FlashInfer, SGLang, TensorRT-LLM shapes) described as published
layouts and moved by plan_transfer + a real transport. The oracle indexes each engine's tensors in the
engine's own shape: the source holds a value encoding (layer, role, token, head, dim) at every logical
position, and every destination element is checked at its logical coordinates, untouched elements
keeping their sentinel."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvxfer.cache import CacheConfig, CacheLayoutDesc
from kvxfer.cache.engine_layouts import (
    EngineKV,
    block_ids_from_token_slots,
    flashinfer,
    paged_tensors,
    sglang_mha,
    trtllm_pools,
    vllm_flash_attn,
)
from kvxfer.cache.layout import plan_layout
from kvxfer.errors import LayoutError, LayoutMismatch
from kvxfer.extractor import extract, layout_regions, plan_transfer
from kvxfer.transport import available_backends, create

LAYERS, HEADS, DIM = 3, 4, 8
SENTINEL, NOISE = -5, -1
I64 = npt.NDArray[np.int64]
_names = itertools.count()

# (tensor, index) such that tensor[index] is the [tokens, local heads, dim] of (layer, role) at
# (block id, position in block) per token.
Access = Callable[[int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, tuple[object, ...]]]


@dataclass
class Engine:
    """One rank of an engine: its described KV, how to index its tensors logically, its block size."""

    kv: EngineKV
    access: Access
    tpb: int
    heads: tuple[int, int]          # global head range [start, stop)
    num_blocks: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.kv.tensors


def code(layer: int, role: int, tok: torch.Tensor, head: torch.Tensor, dim: torch.Tensor) -> torch.Tensor:
    return (((layer * 2 + role) * 1000 + tok) * 16 + head) * 256 + dim


def heads_of(tp: int, rank: int) -> tuple[int, int]:
    n = HEADS // tp
    return rank * n, (rank + 1) * n


# --- engines, each allocating real tensors of its shape -------------------------------------------
def vllm(tpb: int, blocks: int, tp: int = 1, rank: int = 0, hnd_strides: bool = False, device: str = "cpu") -> Engine:
    h0, h1 = heads_of(tp, rank)
    if hnd_strides:   # vLLM's HND stride order: logical [2, N, B, H, D], memory [2, N, H, B, D]
        ts = [torch.full((2, blocks, h1 - h0, tpb, DIM), SENTINEL, dtype=torch.int32, device=device).permute(0, 1, 3, 2, 4)
              for _ in range(LAYERS)]
    else:
        ts = [torch.full((2, blocks, tpb, h1 - h0, DIM), SENTINEL, dtype=torch.int32, device=device)
              for _ in range(LAYERS)]
    kv = vllm_flash_attn(ts, head_start=h0, total_heads=HEADS)
    return Engine(kv, lambda layer, role, blk, pos: (ts[layer], (role, blk, pos)), tpb, (h0, h1), blocks)


def flashinfer_engine(tpb: int, blocks: int, order: str, tp: int = 1, rank: int = 0, device: str = "cpu") -> Engine:
    h0, h1 = heads_of(tp, rank)
    shape = (blocks, 2, h1 - h0, tpb, DIM) if order == "HND" else (blocks, 2, tpb, h1 - h0, DIM)
    ts = [torch.full(shape, SENTINEL, dtype=torch.int32, device=device) for _ in range(LAYERS)]
    kv = flashinfer(ts, order=order, head_start=h0, total_heads=HEADS)
    if order == "HND":
        return Engine(kv, lambda layer, role, blk, pos: (ts[layer], (blk, role, slice(None), pos)), tpb, (h0, h1),
                      blocks)
    return Engine(kv, lambda layer, role, blk, pos: (ts[layer], (blk, role, pos)), tpb, (h0, h1), blocks)


def sglang(page: int, blocks: int, tp: int = 1, rank: int = 0, device: str = "cpu") -> Engine:
    h0, h1 = heads_of(tp, rank)
    ks = [torch.full((blocks * page, h1 - h0, DIM), SENTINEL, dtype=torch.int32, device=device) for _ in range(LAYERS)]
    vs = [torch.full((blocks * page, h1 - h0, DIM), SENTINEL, dtype=torch.int32, device=device) for _ in range(LAYERS)]
    kv = sglang_mha(ks, vs, page_size=page, head_start=h0, total_heads=HEADS)
    return Engine(kv, lambda layer, role, blk, pos: ((ks if role == 0 else vs)[layer], (blk * page + pos,)), page,
                  (h0, h1), blocks)


def trtllm(tpb: int, blocks: int, tp: int = 1, rank: int = 0, device: str = "cpu") -> Engine:
    """V2-style pools: one pool per pool group, slot = [layer0 K, layer0 V, layer1 K, ...] each
    [heads][tokens][dim] (HND), as the engine's kernels index them."""
    h0, h1 = heads_of(tp, rank)
    cfg = CacheConfig.for_model(LAYERS, HEADS, DIM, tpb, "int32", blocks, tp_size=tp, tp_rank=rank)
    plan = plan_layout(cfg)
    (pg,) = plan.pool_groups
    (pool,) = pg.pools
    raw = torch.full((pool.nbytes // 4,), SENTINEL, dtype=torch.int32, device=device)
    kv = trtllm_pools(plan, [[raw]])
    slots = raw.view(pool.num_slots, LAYERS * 2, h1 - h0, tpb, DIM)
    return Engine(kv, lambda layer, role, blk, pos: (slots, (blk, layer * 2 + role, slice(None), pos)), tpb,
                  (h0, h1), pool.num_slots)


# --- oracle ---------------------------------------------------------------------------------------
def logical(engine: Engine, ids: I64, tokens: torch.Tensor, layer: int, role: int) -> tuple[torch.Tensor, tuple[object, ...]]:
    blk = torch.as_tensor(ids, device=tokens.device)[tokens // engine.tpb]
    return engine.access(layer, role, blk, tokens % engine.tpb)


def fill_source(engine: Engine, ids: I64, n: int) -> None:
    for t in engine.tensors():
        t.fill_(NOISE)
    dev = engine.tensors()[0].device
    tok = torch.arange(n, device=dev)[:, None, None]
    head = torch.arange(*engine.heads, device=dev)[None, :, None]
    dim = torch.arange(DIM, device=dev)[None, None, :]
    for layer, role in itertools.product(range(LAYERS), range(2)):
        tensor, index = logical(engine, ids, torch.arange(n, device=dev), layer, role)
        tensor[index] = code(layer, role, tok, head, dim).to(torch.int32)


def check_destination(engine: Engine, ids: I64, n: int, lo: int = 0) -> None:
    """Every logical element of tokens [lo, n) holds its code; every other element its sentinel."""
    dev = engine.tensors()[0].device
    tok = torch.arange(lo, n, device=dev)
    head = torch.arange(*engine.heads, device=dev)[None, :, None]
    dim = torch.arange(DIM, device=dev)[None, None, :]
    written = 0
    for layer, role in itertools.product(range(LAYERS), range(2)):
        tensor, index = logical(engine, ids, tok, layer, role)
        got = tensor[index]
        want = code(layer, role, tok[:, None, None], head, dim).to(torch.int32)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (f"layer {layer} role {role}: token {int(tok[bad[0, 0]])} head "
                                  f"{engine.heads[0] + int(bad[0, 1])} dim {int(bad[0, 2])} holds "
                                  f"{int(got[tuple(bad[0])])}")
        written += got.numel()
    changed = sum(int((t != SENTINEL).sum()) for t in engine.tensors())
    assert changed == written, f"{changed - written} elements outside the request's tokens were written"


def block_ids(engine: Engine, n: int, seed: int) -> I64:
    rng = np.random.default_rng(seed)
    return rng.permutation(engine.num_blocks)[:-(-n // engine.tpb)].astype(np.int64)


def move(src: Engine, src_ids: I64, dsts: Sequence[tuple[Engine, I64]], backend: str = "loopback",
         token_range: tuple[int, int] = (0, 45)) -> None:
    """plan_transfer of ``token_range`` from the source to each destination rank, pushed through a real
    transport."""
    a = create(backend, f"engine-src-{next(_names)}")
    a.register(src.kv.regions)
    try:
        for dst, dst_ids in dsts:
            b = create(backend, f"engine-dst-{next(_names)}")
            try:
                b.register(dst.kv.regions)
                a.connect(b.name, b.metadata())
                b.connect(a.name, a.metadata())
                plan = plan_transfer(src.kv.layout, {0: src_ids}, dst.kv.layout, {0: dst_ids}, token_range=token_range)
                plan.validate(src.kv.regions, dst.kv.regions)
                a.write(b.name, plan, notify=b"kv").wait(10.0)
            finally:
                b.close()
    finally:
        a.close()


N = 45   # tokens: not a multiple of any block size used


@pytest.mark.parametrize("pair", [
    "vllm16->sglang1", "vllm16->sglang4_tp2", "flashinfer_hnd8->vllm16", "trtllm32->flashinfer_nhd16",
    "sglang1->vllm_hnd16", "vllm8->trtllm16_tp2", "flashinfer_nhd16->flashinfer_hnd4_tp2",
    "vllm16->vllm16_more_blocks",   # equal fingerprints: the extractor's whole-slot fast path
])
def test_engine_pairs_are_byte_exact_by_logical_position(pair: str) -> None:
    makers: dict[str, Callable[[], Engine | list[Engine]]] = {
        "vllm16": lambda: vllm(16, 8), "vllm16_more_blocks": lambda: vllm(16, 11), "vllm8": lambda: vllm(8, 9), "vllm_hnd16": lambda: vllm(16, 5, hnd_strides=True),
        "sglang1": lambda: sglang(1, 64), "sglang4_tp2": lambda: [sglang(4, 16, 2, r) for r in range(2)],
        "flashinfer_hnd8": lambda: flashinfer_engine(8, 7, "HND"), "flashinfer_nhd16": lambda: flashinfer_engine(16, 4, "NHD"),
        "flashinfer_hnd4_tp2": lambda: [flashinfer_engine(4, 16, "HND", 2, r) for r in range(2)],
        "trtllm32": lambda: trtllm(32, 3), "trtllm16_tp2": lambda: [trtllm(16, 5, 2, r) for r in range(2)],
    }
    src_name, dst_name = pair.split("->")
    src = makers[src_name]()
    assert isinstance(src, Engine)
    made = makers[dst_name]()
    dsts = made if isinstance(made, list) else [made]
    src_ids = block_ids(src, N, 1)
    dst_ids = [block_ids(d, N, 2 + i) for i, d in enumerate(dsts)]
    fill_source(src, src_ids, N)
    move(src, src_ids, list(zip(dsts, dst_ids, strict=True)))
    for d, ids in zip(dsts, dst_ids, strict=True):
        check_destination(d, ids, N)


def test_token_range_moves_only_those_tokens() -> None:
    src, dst = vllm(16, 8), sglang(4, 16)
    src_ids, dst_ids = block_ids(src, N, 3), block_ids(dst, N, 4)
    fill_source(src, src_ids, N)
    move(src, src_ids, [(dst, dst_ids)], token_range=(16, N))
    check_destination(dst, dst_ids, N, lo=16)


@pytest.mark.ucx
@pytest.mark.skipif(available_backends()["nixl"] is not None, reason=str(available_backends()["nixl"]))
def test_vllm_to_sglang_over_nixl() -> None:
    src, dst = vllm(16, 8), sglang(1, 64)
    src_ids, dst_ids = block_ids(src, N, 5), block_ids(dst, N, 6)
    fill_source(src, src_ids, N)
    move(src, src_ids, [(dst, dst_ids)], backend="nixl")
    check_destination(dst, dst_ids, N)


@pytest.mark.gpu
def test_vllm_to_sglang_tp2_on_cuda() -> None:
    src = vllm(16, 8, device="cuda:0")
    dsts = [sglang(4, 16, 2, r, device="cuda:0") for r in range(2)]
    assert src.kv.layout.pool_groups[0].pools[0].memory_kind == "cuda"
    src_ids = block_ids(src, N, 7)
    dst_ids = [block_ids(d, N, 8 + i) for i, d in enumerate(dsts)]
    fill_source(src, src_ids, N)
    torch.cuda.synchronize()
    move(src, src_ids, list(zip(dsts, dst_ids, strict=True)))
    torch.cuda.synchronize()
    for d, ids in zip(dsts, dst_ids, strict=True):
        check_destination(d, ids, N)


# --- descriptions ---------------------------------------------------------------------------------
def test_vllm_flash_attn_has_a_pool_per_layer_and_role() -> None:
    e = vllm(16, 8)
    (pg,) = e.kv.layout.pool_groups
    assert len(pg.pools) == 2 * LAYERS and pg.num_slots == 8
    ts = e.tensors()
    assert [p.base_address for p in pg.pools[:2]] == [ts[0][0].data_ptr(), ts[0][1].data_ptr()]
    assert {f.order for _, f in e.kv.layout.formats} == {"NHD"}
    assert {f.order for _, f in vllm(16, 5, hnd_strides=True).kv.layout.formats} == {"HND"}
    assert list(e.kv.regions) == layout_regions(e.kv.layout)
    table = extract(e.kv.layout, {0: np.array([3, 0, 7])})
    table.validate(list(e.kv.regions))
    assert table.total_bytes == 3 * 2 * LAYERS * 16 * HEADS * DIM * 4


def test_flashinfer_coalesces_key_and_value_of_a_layer() -> None:
    e = flashinfer_engine(8, 7, "HND")
    (pg,) = e.kv.layout.pool_groups
    (variant,) = pg.slot_desc.variants
    assert [(c.num_buffers, c.single_buffer_size) for c in variant.coalesced_buffers] == [(2, HEADS * 8 * DIM * 4)] * LAYERS
    assert {f.order for _, f in e.kv.layout.formats} == {"HND"}


def test_trtllm_pools_fingerprint_matches_kvxfers_own_manager() -> None:
    cfg = CacheConfig.for_model(LAYERS, HEADS, DIM, 16, "int32", 5)
    e = trtllm(16, 5)
    assert e.kv.layout.fingerprint == plan_layout(cfg).fingerprint
    assert e.kv.regions[0].nbytes == plan_layout(cfg).pool_groups[0].pools[0].nbytes


def test_windows_make_layer_groups_with_their_own_block_ids() -> None:
    ts = [torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16) for _ in range(4)]
    lay = vllm_flash_attn(ts, windows=[32, None, 32, None], sink_tokens=4).layout
    assert [(lg.layer_ids, lg.window, lg.sink_tokens, lg.pool_group_index) for lg in lay.layer_groups] == \
        [((0, 2), 32, 4, 0), ((1, 3), None, 0, 1)]


def test_mla_style_single_role_cache() -> None:
    ts = [torch.zeros(10, 16, 576, dtype=torch.bfloat16) for _ in range(2)]
    lay = paged_tensors(ts, "NBD", roles=("kv",)).layout
    assert [(b.layer_id, b.role, f.num_heads, f.tokens_per_block) for b, f in lay.formats] == \
        [(0, "kv", 1, 16), (1, "kv", 1, 16)]


def test_sglang_pipeline_stage_layer_ids() -> None:
    ks = [torch.zeros(8, 2, 4, dtype=torch.float16) for _ in range(2)]
    lay = sglang_mha(ks, [k.clone() for k in ks], layer_ids=[16, 17]).layout
    assert lay.layer_ids == (16, 17)


def test_sglang_token_slots_to_block_ids() -> None:
    np.testing.assert_array_equal(block_ids_from_token_slots([12, 13, 14, 15, 4, 5], 4), [3, 1])
    np.testing.assert_array_equal(block_ids_from_token_slots([9, 2, 7], 1), [9, 2, 7])
    with pytest.raises(LayoutError, match=r"token 2 is in slot 9, expected 14"):
        block_ids_from_token_slots([12, 13, 9], 4)


def test_inputs_are_validated_with_clear_errors() -> None:
    def kv(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: vllm_flash_attn([kv(2, 4, 16, 2)]), r"layer 0: expected 5 dimensions, got shape \(2, 4, 16, 2\)"),
        (lambda: vllm_flash_attn([kv(3, 4, 16, 2, 8)]), "K/V axis must have size 2"),
        (lambda: vllm_flash_attn([kv(2, 4, 16, 2, 8), kv(2, 5, 16, 2, 8)]),
         r"layer 1 key has shape \(2, 5, 16, 2, 8\).*layer 0 has \(2, 4, 16, 2, 8\)"),
        (lambda: vllm_flash_attn([kv(2, 4, 16, 2, 8, dtype=torch.int64)]), "unsupported torch dtype"),
        (lambda: vllm_flash_attn([kv(2, 4, 16, 2, 16)[..., :8]]), "not densely packed"),
        (lambda: vllm_flash_attn([kv(2, 4, 8, 16, 2).transpose(3, 4)]), "head_dim must be innermost"),
        (lambda: vllm_flash_attn([kv(4, 16, 2, 2, 8).permute(2, 0, 1, 3, 4)]), "heads x tokens must be contiguous"),
        (lambda: vllm_flash_attn([kv(2, 4, 16, 2, 8), torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16, device="meta")]),
         "CPU or a CUDA device"),
        (lambda: vllm_flash_attn([kv(2, 4, 16, 2, 8)], head_start=3, total_heads=4), r"heads \[3, 5\) exceed total_heads=4"),
        (lambda: vllm_flash_attn([]), "no layers given"),
        (lambda: flashinfer([kv(4, 2, 2, 16, 8)], order="XYZ"), "order must be 'HND' or 'NHD'"),
        (lambda: sglang_mha([kv(64, 2, 8)], [kv(60, 2, 8)]), r"layer 0 K has shape \(64, 2, 8\), V has \(60, 2, 8\)"),
        (lambda: sglang_mha([kv(62, 2, 8)], [kv(62, 2, 8)], page_size=4), "62 token slots, not a multiple of page_size=4"),
        (lambda: sglang_mha([kv(64, 2, 8)], []), "1 K buffers but 0 V buffers"),
        (lambda: sglang_mha([kv(64, 2, 8)] * 2, [kv(64, 2, 8)] * 2, layer_ids=[5, 5]), "name each of the 2 layers once"),
        (lambda: sglang_mha([kv(64, 2, 16)[..., :8]], [kv(64, 2, 8)]), "must be contiguous"),
        (lambda: trtllm_pools(plan_layout(CacheConfig.for_model(2, 2, 8, 16, "float16", 4)), [[torch.zeros(100, dtype=torch.uint8)]]),
         "100 bytes is not a whole number of"),
        (lambda: trtllm_pools(plan_layout(CacheConfig.for_model(2, 2, 8, 16, "float16", 4)), []), "0 pool-group tensor lists"),
        (lambda: paged_tensors([kv(4, 16, 8)], "NBBD"), "each of KNBHD at most once"),
    ]
    for build, message in cases:
        with pytest.raises(LayoutError, match=message):
            build()


def test_incompatible_engines_are_refused_by_the_extractor() -> None:
    a = vllm_flash_attn([torch.zeros(2, 4, 16, HEADS, DIM, dtype=torch.float16) for _ in range(LAYERS)])
    b = sglang_mha([torch.zeros(64, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)],
                   [torch.zeros(64, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)])
    with pytest.raises(LayoutMismatch, match="dtype"):
        plan_transfer(a.layout, {0: [0]}, b.layout, {0: list(range(16))})


def test_the_oracle_catches_a_wrong_description() -> None:
    """Mutations of a correct description (K and V pools swapped; heads/tokens order flipped) must
    fail the logical-position check: the oracle does not trust the layout it checks."""
    def swapped_roles(layout: CacheLayoutDesc) -> CacheLayoutDesc:
        (pg,) = layout.pool_groups
        pools = list(pg.pools)
        pools[0], pools[1] = (dataclasses.replace(pools[0], base_address=pools[1].base_address),
                              dataclasses.replace(pools[1], base_address=pools[0].base_address))
        return dataclasses.replace(layout, pool_groups=(dataclasses.replace(pg, pools=tuple(pools)),), fingerprint=b"")

    def flipped_order(layout: CacheLayoutDesc) -> CacheLayoutDesc:
        formats = tuple((b, dataclasses.replace(f, order="NHD" if f.order == "HND" else "HND")) for b, f in layout.formats)
        return dataclasses.replace(layout, formats=formats, fingerprint=b"")

    for mutate in (swapped_roles, flipped_order):
        src, dst = vllm(16, 8), sglang(1, 64)
        wrong = mutate(src.kv.layout)
        src.kv = EngineKV(wrong, tuple(layout_regions(wrong)), src.kv.tensors)
        src_ids, dst_ids = block_ids(src, N, 9), block_ids(dst, N, 10)
        fill_source(src, src_ids, N)
        move(src, src_ids, [(dst, dst_ids)])
        with pytest.raises(AssertionError, match="layer 0 role 0"):
            check_destination(dst, dst_ids, N)


def test_readme_engine_example_runs() -> None:
    """README's first-look example (vLLM-shaped prefill -> SGLang-shaped decode) runs as written."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code_text = text.split("### An engine's own KV tensors", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "vllm_flash_attn" in code_text and "plan_transfer" in code_text
    scope: dict[str, object] = {}
    exec(compile(code_text, "README.md", "exec"), scope)
    for t in ("prefill", "decode"):
        scope[t].close()  # type: ignore[attr-defined]
