"""Position-keyed digests: each side hashes its own pages by (layer, role, head, token chunk).

A source request's KV is written logically (PagedKV), moved by a real plan into a destination with
another layout, and verified there. Every pairing-bug class (block swap, token shift, head ranges
swapped between TP ranks, a block of another request, a zeroed layer, a stale block) must fail
verification naming the coordinates; the same content in other layouts must pass.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvxfer.cache import CacheConfig, KVCacheManager
from kvxfer.cache.engine_layouts import vllm_flash_attn
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.memory import MemoryRegion
from kvxfer.disagg.worker import all_regions, plan_between
from kvxfer.errors import ConfigError, DecodeError, IntegrityError
from kvxfer.extractor import layout_regions, plan_transfer
from kvxfer.model import PagedKV
from kvxfer.transport.copy import copy_plan
from kvxfer.transport.integrity import (
    MAX_DIGEST_CELLS,
    ChecksumPolicy,
    KVDigest,
    _gather_rows,
    _splitmix64,
    digest_kv,
    verify_kv,
)
from tests.extractor.test_expanded import HEADS as EHEADS
from tests.extractor.test_expanded import Side as ExpandedSide
from tests.extractor.test_expanded import code as expanded_code

LAYERS, HEADS, DIM = 3, 4, 8
PROMPT = 70                      # not a multiple of any block size used here
FULL = ChecksumPolicy()
_ids = itertools.count()


@dataclasses.dataclass
class Side:
    """One worker: a manager per tensor-parallel rank and one request's caches on them."""

    managers: list[KVCacheManager]
    caches: list[KVCache]

    @property
    def layouts(self) -> list[Any]:
        return [m.layout for m in self.managers]

    @property
    def ids(self) -> list[dict[int, npt.NDArray[np.int32]]]:
        return [c.block_id_map() for c in self.caches]

    def close(self) -> None:
        for c in self.caches:
            c.close()
        for m in self.managers:
            m.shutdown()

    def kv(self) -> PagedKV:
        return PagedKV(list(zip(self.managers, self.caches, strict=True)), LAYERS, HEADS, DIM)


def side(tpb: int = 16, tp: int = 1, order: str = "HND", coalesce: bool = True, tokens: int = PROMPT,
         windows: Sequence[int | None] | None = None) -> Side:
    """A side holding one fresh request of ``tokens`` tokens (pools filled with noise first)."""
    managers = [KVCacheManager(CacheConfig.for_model(LAYERS, HEADS, DIM, tpb, "float32", 64, windows=windows,
                                                     head_order=order, tp_rank=r, tp_size=tp, coalesce=coalesce))
                for r in range(tp)]
    caches = []
    for m in managers:
        for t in (m.pool_tensor(pg.pool_group_index, p.pool_index) for pg in m.layout.pool_groups for p in pg.pools):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(next(_ids))))
        c = m.create_kv_cache(id=f"r{next(_ids)}")
        c.resume()
        c.resize(tokens)
        caches.append(c)
    return Side(managers, caches)


def fill(s: Side, seed: int, tokens: int = PROMPT) -> None:
    """Random KV for every layer, written by logical position."""
    gen = torch.Generator().manual_seed(seed)
    kv = s.kv()
    for layer in range(LAYERS):
        k, v = (torch.randn(tokens, HEADS, DIM, generator=gen) for _ in range(2))
        kv.write(layer, k, v, 0)


def move(src: Side, dst: Side, token_range: tuple[int, int] = (0, PROMPT), *, src_ids: Any = None,
         dst_ids: Any = None) -> None:
    """Copy ``token_range`` from src to dst by a real plan (block ids overridable to inject a pairing bug)."""
    plan = plan_between(src.layouts, src.ids if src_ids is None else src_ids, dst.layouts,
                        dst.ids if dst_ids is None else dst_ids, token_range=token_range)
    copy_plan(plan, all_regions(src.layouts), all_regions(dst.layouts))


def check(src: Side, dst: Side, policy: ChecksumPolicy = FULL, token_range: tuple[int, int] = (0, PROMPT),
          **kw: Any) -> KVDigest:
    """Digest on src, round-trip the wire form, verify on dst."""
    digest = KVDigest.from_bytes(digest_kv(src.layouts, src.ids, token_range, policy, "req-1", **kw).to_bytes())
    verify_kv(dst.layouts, dst.ids, digest, token_range=token_range)
    return digest


@pytest.fixture
def pair() -> Any:
    made: list[Side] = []

    def make(src_kw: dict[str, Any] | None = None, dst_kw: dict[str, Any] | None = None) -> tuple[Side, Side]:
        src, dst = side(**(src_kw or {})), side(**(dst_kw or {}))
        made.extend((src, dst))
        fill(src, seed=1)
        return src, dst

    yield make
    for s in made:
        s.close()


# --- identical content in other layouts verifies -----------------------------------------------
@pytest.mark.parametrize(("src_kw", "dst_kw"), [
    ({}, {}),
    ({"tpb": 16}, {"tpb": 32}),
    ({"tpb": 32}, {"tpb": 8, "order": "NHD"}),
    ({"tp": 1}, {"tp": 2}),
    ({"tp": 2, "order": "NHD"}, {"tp": 1, "tpb": 32}),
    ({"coalesce": True}, {"coalesce": False, "order": "NHD", "tp": 4}),
], ids=["same", "tpb16-32", "tpb32-8-hnd-nhd", "tp1-2", "tp2-1-nhd-hnd", "coalesced-expanded-tp4"])
def test_same_kv_in_other_layouts_verifies(pair: Any, src_kw: dict[str, Any], dst_kw: dict[str, Any]) -> None:
    src, dst = pair(src_kw, dst_kw)
    move(src, dst)
    digest = check(src, dst)
    assert digest.num_cells == digest.checked_cells == LAYERS * 2 * HEADS * 3   # 70 tokens: chunks of 32
    for policy in (ChecksumPolicy.every(5, seed=2), ChecksumPolicy.sample(0.3, seed=7)):
        assert check(src, dst, policy).checked_cells < digest.num_cells


def test_prefix_range_and_chunks_that_cut_blocks(pair: Any) -> None:
    """Decode holding a prefix: only [skip, end) travels and is checked; chunks of 5 tokens cross blocks."""
    src, dst = pair({"tpb": 16}, {"tpb": 8, "order": "NHD"})
    move(src, dst, (21, PROMPT))
    digest = check(src, dst, token_range=(21, PROMPT), chunk_tokens=5)
    assert digest.buffers[0].spans == ((21, PROMPT),) and digest.chunk_tokens == 5
    with pytest.raises(IntegrityError, match=r"covers tokens \[21, 70\), the destination expects \[0, 70\)"):
        verify_kv(dst.layouts, dst.ids, digest, token_range=(0, PROMPT))


# --- every pairing bug fails, naming where ------------------------------------------------------
def _swap_blocks(ids: dict[int, Any], a: int, b: int) -> dict[int, Any]:
    out = {g: np.array(v, copy=True) for g, v in ids.items()}
    out[0][[a, b]] = out[0][[b, a]]
    return out


def test_swapped_blocks_fail_naming_layer_head_and_tokens(pair: Any) -> None:
    src, dst = pair({"tpb": 16}, {"tpb": 16})
    move(src, dst, dst_ids=[_swap_blocks(dst.ids[0], 1, 2)])
    with pytest.raises(IntegrityError, match=r"transfer 'req-1': KV differs from the source at layer 0 role 'key' "
                                             r"head 0 tokens \[0, 32\) \(destination rank 0\): blake3 tag [0-9a-f]{16} "
                                             r"!= source's [0-9a-f]{16}; \d+ of 72 checked cells differ"):
        check(src, dst)


def test_token_shift_by_one_fails(pair: Any) -> None:
    """The destination holds every token one position late (what an off-by-one token range does)."""
    src, dst = pair({"tpb": 16}, {"tpb": 32, "order": "NHD"})
    kv = dst.kv()
    for layer in range(LAYERS):
        got = src.kv().read(layer, 0, PROMPT)             # [tokens, heads, dim]
        kv.write(layer, got.key[:-1], got.value[:-1], 1)
    with pytest.raises(IntegrityError, match=r"layer 0 role 'key' head 0 tokens \[0, 32\).* 72 of 72 checked"):
        check(src, dst)


def test_head_ranges_swapped_between_tp_ranks_fail_on_the_rank_that_holds_them(pair: Any) -> None:
    src, dst = pair({"tp": 1}, {"tp": 2})
    move(src, dst)
    rank0, rank1 = (m.buffer_view(0, "key") for m in dst.managers)
    s0, s1 = (torch.from_numpy(c.block_ids(0).astype(np.int64)) for c in dst.caches)
    a, b = rank0[s0].clone(), rank1[s1].clone()
    rank0[s0], rank1[s1] = b, a          # rank 0 got heads 2-3, rank 1 heads 0-1 (layer 0 keys)
    with pytest.raises(IntegrityError, match=r"layer 0 role 'key' head 0 tokens \[0, 32\) \(destination rank 0\).*"
                                             r"12 of 72 checked cells differ"):
        check(src, dst)
    # A rank checks the heads it holds: rank 1 alone names head 2.
    digest = digest_kv(src.layouts, src.ids, (0, PROMPT), ChecksumPolicy(), "req-1")
    with pytest.raises(IntegrityError, match=r"head 2 tokens \[0, 32\) \(destination rank 0\).* 6 of 72"):
        verify_kv(dst.layouts[1:], dst.ids[1:], digest, token_range=(0, PROMPT))


def test_a_block_of_another_request_fails(pair: Any) -> None:
    """The source side of the plan read one block of another request held by the same worker."""
    src, dst = pair()
    other = src.managers[0].create_kv_cache(id="other")
    other.resume()
    other.resize(PROMPT)
    try:
        fill(Side(src.managers, [other]), seed=99)
        wrong = {g: np.array(v, copy=True) for g, v in src.ids[0].items()}
        wrong[0][3] = other.block_ids(0)[3]
        move(src, dst, src_ids=[wrong])
        with pytest.raises(IntegrityError, match=r"layer 0 role 'key' head 0 tokens \[32, 64\)"):
            check(src, dst)
    finally:
        other.close()


def test_one_layer_zeroed_fails_naming_the_layer(pair: Any) -> None:
    src, dst = pair({"tpb": 16}, {"tpb": 16, "order": "NHD"})
    move(src, dst)
    dst.managers[0].buffer_view(2, "value")[torch.from_numpy(dst.caches[0].block_ids(0).astype(np.int64))] = 0
    with pytest.raises(IntegrityError, match=r"at layer 2 role 'value' head 0 tokens \[0, 32\).* 12 of 72"):
        check(src, dst)


def test_stale_block_fails(pair: Any) -> None:
    """The last block is not written (stale bytes of an earlier request stay there)."""
    src, dst = pair({"tpb": 16}, {"tpb": 16})
    move(src, dst, (0, 64))
    with pytest.raises(IntegrityError, match=r"layer 0 role 'key' head 0 tokens \[64, 70\)"):
        check(src, dst)


def test_sampled_policy_sees_only_its_cells() -> None:
    """every:K checks the cells it selects; a corruption elsewhere passes by design (documented)."""
    src, dst = side(), side()
    try:
        fill(src, 3)
        move(src, dst)
        policy = ChecksumPolicy.every(2, seed=1)    # odd ordinals: chunk 1 of head 0 of layer 0 key, ...
        digest = digest_kv(src.layouts, src.ids, (0, PROMPT), policy, "r")
        dst.managers[0].buffer_view(0, "key")[int(dst.caches[0].block_ids(0)[0]), 0] += 1   # head 0, tokens 0-15
        verify_kv(dst.layouts, dst.ids, digest, token_range=(0, PROMPT))             # ordinal 0: not checked
        dst.managers[0].buffer_view(0, "key")[int(dst.caches[0].block_ids(0)[2]), 0] += 1   # tokens 32-47
        with pytest.raises(IntegrityError, match=r"layer 0 role 'key' head 0 tokens \[32, 64\)"):
            verify_kv(dst.layouts, dst.ids, digest, token_range=(0, PROMPT))
    finally:
        src.close()
        dst.close()


# --- sliding windows -----------------------------------------------------------------------------
def test_sliding_window_covers_what_the_source_kept_and_the_destination_needs() -> None:
    src = side(tpb=16, windows=[None, 24])
    dst = side(tpb=8, windows=[None, 24], order="NHD")
    try:
        fill(src, 4)
        for c in src.caches:
            c.commit(list(range(PROMPT)))      # releases the window's old blocks on the source
        assert (src.caches[0].block_ids(1) < 0).any()
        move(src, dst)
        digest = check(src, dst)
        window = next(b for b in digest.buffers if b.layer_id == 1)
        assert window.spans == ((32, PROMPT),)
        short = dataclasses.replace(digest, buffers=tuple(
            dataclasses.replace(b, spans=((60, PROMPT),)) if b.layer_id == 1 else b for b in digest.buffers))
        with pytest.raises(IntegrityError, match=r"layer 1 role 'key' does not cover token 47"):
            verify_kv(dst.layouts, dst.ids, short, token_range=(0, PROMPT))
    finally:
        src.close()
        dst.close()


# --- digest shape, bounds, codec -----------------------------------------------------------------
def test_verifier_refuses_a_digest_of_other_buffers_or_a_tampered_root(pair: Any) -> None:
    src, dst = pair()
    move(src, dst)
    digest = digest_kv(src.layouts, src.ids, (0, PROMPT), ChecksumPolicy(), "req-1")
    with pytest.raises(IntegrityError, match=r"buffers differ from the destination's: missing \[\(2, 'key'\)"):
        verify_kv(dst.layouts, dst.ids, dataclasses.replace(digest, buffers=digest.buffers[:4]), token_range=(0, PROMPT))
    wrong = tuple(dataclasses.replace(b, head_dim=16) if b.layer_id == 1 else b for b in digest.buffers)
    with pytest.raises(IntegrityError, match="layer 1 role 'key' head_dim is 16 in the digest, 8 on the destination"):
        verify_kv(dst.layouts, dst.ids, dataclasses.replace(digest, buffers=wrong), token_range=(0, PROMPT))
    flipped = dataclasses.replace(digest, root=bytes([digest.root[0] ^ 1]) + digest.root[1:])
    with pytest.raises(IntegrityError, match="root differs although every cell tag matches"):
        verify_kv(dst.layouts, dst.ids, flipped, token_range=(0, PROMPT))
    verify_kv(dst.layouts, dst.ids, digest, token_range=(0, PROMPT))


def test_policy_choices_depend_only_on_the_grid() -> None:
    assert ChecksumPolicy().select(5).tolist() == [0, 1, 2, 3, 4]
    assert ChecksumPolicy.every(3, seed=4).select(10).tolist() == [1, 4, 7]
    sample = ChecksumPolicy.sample(0.25, seed=9)
    chosen = sample.select(4000)
    assert np.array_equal(chosen, sample.select(4000)) and 800 < chosen.size < 1200
    assert ChecksumPolicy.sample(1e-9, seed=1).select(10).size == 1
    for policy in (ChecksumPolicy(), ChecksumPolicy.every(7, seed=3), sample, ChecksumPolicy.sample(1e-9, seed=1)):
        for n in (0, 1, 10, 70_001):
            assert policy.count(n) == policy.select(n).size
    assert int(_splitmix64(np.array([0], np.uint64))[0]) == 0xE220A8397B1DCDAF   # the reference value
    for bad in ({"mode": "all"}, {"stride": 0}, {"fraction": 0.0}, {"seed": -1}, {"tag_bytes": 3}):
        with pytest.raises(ConfigError, match="ChecksumPolicy"):
            ChecksumPolicy(**bad)
    assert ChecksumPolicy.every(4, seed=1).describe() == "every:4 (seed=1)"


def test_digest_grid_is_bounded_and_the_chunk_grows_to_fit(pair: Any) -> None:
    src, _ = pair()
    digest = digest_kv(src.layouts, src.ids, (0, PROMPT), ChecksumPolicy(), "r", chunk_tokens=1)
    assert digest.num_cells == LAYERS * 2 * HEADS * PROMPT <= MAX_DIGEST_CELLS
    with pytest.raises(ConfigError, match="transfer name"):
        digest_kv(src.layouts, src.ids, (0, PROMPT), ChecksumPolicy(), "x" * 300)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        digest_kv(src.layouts, src.ids, (0, PROMPT), ChecksumPolicy(), "r", chunk_tokens=0)
    with pytest.raises(ConfigError, match="heads \\[2, 3\\] of layer 0 role 'key' are held by no rank"):
        half = side(tp=2)
        try:
            digest_kv(half.layouts[:1], half.ids[:1], (0, PROMPT), ChecksumPolicy(), "r")
        finally:
            half.close()


def test_digest_decoder_names_the_bad_field(pair: Any) -> None:
    src, _ = pair()
    good = digest_kv(src.layouts, src.ids, (0, 40), ChecksumPolicy.every(2), "t").to_bytes()
    assert KVDigest.from_bytes(good).to_bytes() == good
    obj = msgpack.unpackb(good)
    buf = obj[5][0]
    cases = {
        "version": [1, *obj[1:]],
        "transfer": [obj[0], 5, *obj[2:]],
        "policy": [*obj[:2], ["full", 1, 1.0, 0], *obj[3:]],
        "policy: ChecksumPolicy.stride": [*obj[:2], ["stride", 0, 1.0, 0, 8], *obj[3:]],
        "chunk_tokens": [*obj[:3], 0, *obj[4:]],
        "token_range stop": [*obj[:4], [10, 5], *obj[5:]],
        r"buffers\[0\].dtype": [*obj[:5], [[*buf[:2], "float99", *buf[3:]], *obj[5][1:]], *obj[6:]],
        r"buffers\[0\].spans start": [*obj[:5], [[*buf[:5], [[50, 60]]], *obj[5][1:]], *obj[6:]],
        "buffers: expected distinct": [*obj[:5], [buf, buf], *obj[6:]],
        "root": [*obj[:6], b"short", obj[7]],
        "tags: 1 tags, the policy selects": [*obj[:7], b"12345678"],
    }
    for field, value in cases.items():
        with pytest.raises(DecodeError, match=f"kv digest.{field}"):
            KVDigest.from_bytes(msgpack.packb(value))
    with pytest.raises(DecodeError, match="invalid msgpack"):
        KVDigest.from_bytes(b"\xc1")
    huge = [*obj[:4], [0, 1 << 30], [[*buf[:4], 1 << 16, [[0, 1 << 30]]]], *obj[6:]]
    with pytest.raises(DecodeError, match="cells exceed the limit"):
        KVDigest.from_bytes(msgpack.packb(huge))


def test_row_gather_on_and_off_the_row_grid() -> None:
    """Rows at multiples of their size take the plain gather; any other offset the byte-strided one."""
    buf = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    region = MemoryRegion(int(buf.ctypes.data), buf.size)
    for offsets in (np.array([64, 0, 4032], np.int64), np.array([3, 1000, 4032 + 31], np.int64)):
        got = _gather_rows(region, offsets, 32)
        assert np.array_equal(got, np.concatenate([buf[o:o + 32] for o in offsets.tolist()]))
    with pytest.raises(IntegrityError, match="outside the region"):
        _gather_rows(region, np.array([4090], np.int64), 32)


@pytest.mark.gpu
def test_cuda_pages_verify_and_detect_a_swapped_block() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: digests of device pages stage them through torch")
    def cuda_side(tpb: int, order: str) -> Side:
        m = KVCacheManager(CacheConfig.for_model(LAYERS, HEADS, DIM, tpb, "float32", 64, "cuda", head_order=order))
        c = m.create_kv_cache(id=f"g{next(_ids)}")
        c.resume()
        c.resize(PROMPT)
        return Side([m], [c])
    src, dst = cuda_side(16, "HND"), cuda_side(32, "NHD")
    try:
        fill(src, 5)
        move(src, dst)
        torch.cuda.synchronize()
        check(src, dst)
        move(src, dst, dst_ids=[_swap_blocks(dst.ids[0], 0, 1)])
        torch.cuda.synchronize()
        with pytest.raises(IntegrityError, match=r"tokens \[0, 32\)"):
            check(src, dst)
    finally:
        src.close()
        dst.close()


def test_expanded_buffers_against_plain_ones() -> None:
    """Buffers whose own pages hold fewer tokens than a block (several pages per slot) on either side:
    the same logical KV verifies, a swapped block does not."""
    src = ExpandedSide(16, {"key": 4, "value": 16}, "HND", (0, EHEADS), 8)
    dst = ExpandedSide(8, {"key": 8, "value": 2}, "NHD", (0, EHEADS), 12)
    n = 37
    rng = np.random.default_rng(4)
    src_ids = rng.permutation(8)[:3]
    dst_ids = rng.permutation(12)[:5]
    for bid, _ in src.layout.formats:
        pool, idx, tok, head, dim = src.cells(bid, src_ids, np.arange(n))
        src.arrays[pool][idx] = expanded_code(bid.layer_id, bid.role, tok, head, dim)
    plan = plan_transfer(src.layout, {0: src_ids}, dst.layout, {0: dst_ids}, token_range=(0, n))
    copy_plan(plan, layout_regions(src.layout), layout_regions(dst.layout))
    digest = digest_kv([src.layout], [{0: src_ids}], (0, n), FULL, "x", chunk_tokens=8)
    verify_kv([dst.layout], [{0: dst_ids}], digest, token_range=(0, n))
    swapped = dst_ids[[1, 0, 2, 3, 4]]
    with pytest.raises(IntegrityError, match=r"layer 0 role 'key' head 0 tokens \[0, 8\)"):
        verify_kv([dst.layout], [{0: swapped}], digest, token_range=(0, n))


def test_engine_owned_vllm_pages_against_a_kvxfer_cache() -> None:
    """A vLLM FlashAttention cache ([2, blocks, block_size, heads, dim] per layer, engine-owned) digested
    as the source, a kvxfer cache (tpb 32, HND, TP 2) verified as the destination."""
    gen = torch.Generator().manual_seed(8)
    tensors = [torch.zeros(2, 10, 16, HEADS, DIM) for _ in range(LAYERS)]
    engine = vllm_flash_attn(tensors)
    table = np.array([7, 2, 5, 0, 9], np.int64)
    for t in tensors:      # logical KV at tokens 0..69 through the engine's block table
        kv = torch.randn(2, PROMPT, HEADS, DIM, generator=gen)
        pos = np.arange(PROMPT)
        t[:, torch.from_numpy(table[pos // 16]), torch.from_numpy(pos % 16)] = kv
    dst = side(tpb=32, tp=2)
    try:
        ids = [{0: table}]
        plan = plan_between([engine.layout], ids, dst.layouts, dst.ids, token_range=(0, PROMPT))
        copy_plan(plan, list(engine.regions), all_regions(dst.layouts))
        digest = digest_kv([engine.layout], ids, (0, PROMPT), FULL, "engine")
        verify_kv(dst.layouts, dst.ids, digest, token_range=(0, PROMPT))
        tensors[1][1, 2, 3] += 1.0          # layer 1, value, block 2 = tokens 16-31, token 19
        with pytest.raises(IntegrityError, match=r"layer 1 role 'value' head 0 tokens \[0, 32\)"):
            verify_kv(dst.layouts, dst.ids, digest_kv([engine.layout], ids, (0, PROMPT), FULL, "engine"),
                      token_range=(0, PROMPT))
    finally:
        dst.close()
