"""Reference model: paged attention against a dense reference, chunking, decode, layouts, KV copies."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache import BufferId, KVCacheManager
from kvxfer.errors import CapacityError, ConfigError, LayoutMismatch, OutOfSlotsError
from kvxfer.model import ByteTokenizer, ModelConfig, PagedKV, ReferenceModel, greedy, preset
from kvxfer.model.transformer import apply_rope, rms_norm

TINY = preset("tiny")
SWA = ModelConfig(windows=(None, 20), sink_tokens=3, seed=1)   # windows small enough to release blocks



def held_by_requests(manager: KVCacheManager) -> int:
    """Slots some request still holds (alone or shared with the prefix tree), over every pool group."""
    accts = [manager.slot_accounting(g) for g in range(len(manager.layout.pool_groups))]
    return sum(a.request_only + a.shared for a in accts)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model gains nothing from intra-op threads, and they thrash on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def new_kv(model: ReferenceModel, manager: KVCacheManager) -> PagedKV:
    cache = manager.create_kv_cache()
    cache.resume()
    return model.bind([(manager, cache)])


def close_all(kv: PagedKV) -> None:
    for _, cache in kv.shards:
        cache.close()


def dense_logits(model: ReferenceModel, tokens: list[int]) -> torch.Tensor:
    """The same network with plain tensors: full K/V, an explicit per-head, per-query attention loop."""
    c = model.config
    pos = torch.arange(len(tokens))
    x = model.embed[torch.tensor(tokens)]
    for i, w in enumerate(model.layers):
        hs = rms_norm(x, w["attn_norm"], c.norm_eps)
        q = apply_rope((hs @ w["wq"]).view(-1, c.num_heads, c.head_dim), pos, c.rope_theta)
        k = apply_rope((hs @ w["wk"]).view(-1, c.num_kv_heads, c.head_dim), pos, c.rope_theta)
        v = (hs @ w["wv"]).view(-1, c.num_kv_heads, c.head_dim)
        out = torch.zeros(len(tokens), c.num_heads, c.head_dim)
        window = c.window_of(i)
        for h in range(c.num_heads):
            kvh = h // (c.num_heads // c.num_kv_heads)
            for t in range(len(tokens)):
                visible = [j for j in range(t + 1)
                           if window is None or t - j < window or j < c.sink_tokens]
                s = torch.stack([q[t, h] @ k[j, kvh] for j in visible]) / math.sqrt(c.head_dim)
                out[t, h] = torch.softmax(s, 0) @ v[visible, kvh]
        x = x + out.reshape(len(tokens), -1) @ w["wo"]
        hs = rms_norm(x, w["mlp_norm"], c.norm_eps)
        x = x + (torch.nn.functional.silu(hs @ w["w_gate"]) * (hs @ w["w_up"])) @ w["w_down"]
    return rms_norm(x, model.final_norm, c.norm_eps) @ model.lm_head


@pytest.mark.parametrize(("config", "tpb", "order"), [(TINY, 16, "HND"), (TINY, 8, "NHD"), (SWA, 4, "HND"),
                                                     (SWA, 8, "NHD")])
def test_paged_attention_equals_dense_reference(config: ModelConfig, tpb: int, order: str) -> None:
    model = ReferenceModel(config)
    manager = KVCacheManager(config.cache_config(tpb, 32, head_order=order))
    tokens = prompt(45, seed=3)
    kv = new_kv(model, manager)
    paged = model.prefill(kv, tokens, chunk_size=13)   # chunks also cross block and window edges
    if config.windows != (None,):   # the sliding-window group really dropped pages
        assert (kv.shards[0][1].block_ids(1) == -1).sum() > 0
    close_all(kv)
    torch.testing.assert_close(paged, dense_logits(model, tokens), atol=2e-4, rtol=1e-4)


@settings(max_examples=6, deadline=None)
@given(chunk=st.integers(1, 50))
def test_chunked_prefill_equals_one_shot(chunk: int) -> None:
    model = ReferenceModel(SWA)
    manager = KVCacheManager(SWA.cache_config(8, 32))
    tokens = prompt(50, seed=5)
    kv_one, kv_chunked = new_kv(model, manager), new_kv(model, manager)
    one = model.prefill(kv_one, tokens)
    chunked = model.prefill(kv_chunked, tokens, chunk_size=chunk)
    assert chunked.shape == (50, SWA.vocab_size)
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=1e-4)
    assert np.array_equal(kv_one.shards[0][1].block_ids(1) >= 0, kv_chunked.shards[0][1].block_ids(1) >= 0)
    close_all(kv_one)
    close_all(kv_chunked)
    assert held_by_requests(manager) == 0


@pytest.mark.parametrize("config", [TINY, SWA])
def test_prefill_plus_decode_steps_equals_whole_prefill(config: ModelConfig) -> None:
    model = ReferenceModel(config)
    manager = KVCacheManager(config.cache_config(16, 16))
    tokens = prompt(40, seed=7)
    kv_whole, kv_steps = new_kv(model, manager), new_kv(model, manager)
    whole = model.prefill(kv_whole, tokens)
    model.prefill(kv_steps, tokens[:30])
    steps = torch.stack([model.decode_step(kv_steps, t) for t in tokens[30:]])
    torch.testing.assert_close(steps, whole[30:], atol=1e-4, rtol=1e-4)
    assert kv_steps.length == kv_whole.length == 40
    close_all(kv_whole)
    close_all(kv_steps)


@pytest.mark.parametrize("config", [TINY, SWA])
def test_generation_identical_across_block_sizes_and_head_orders(config: ModelConfig) -> None:
    model = ReferenceModel(config)
    tokens = prompt(50, seed=11)
    outs = {}
    for tpb in (16, 64):
        for order in ("HND", "NHD"):
            manager = KVCacheManager(config.cache_config(tpb, 8, head_order=order))
            outs[(tpb, order)] = model.generate(manager, tokens, 10)
            assert held_by_requests(manager) == 0   # nothing leaked (tree-only pages are evictable)
    assert len(set(map(tuple, outs.values()))) == 1
    assert len(outs[(16, "HND")]) == 10


@pytest.mark.parametrize("config", [TINY, SWA])
def test_kv_pages_copied_between_managers_continue_identically(config: ModelConfig) -> None:
    """What the transport does: copy the request's slot bytes, commit, decode on the other side."""
    model = ReferenceModel(config)
    tokens = prompt(57, seed=13)
    expected = model.generate(KVCacheManager(config.cache_config(16, 8)), tokens, 10)

    src = KVCacheManager(config.cache_config(16, 8))
    dst = KVCacheManager(config.cache_config(16, 12))
    dst_filler = dst.create_kv_cache()          # shifts dst's block ids so the copy is not an identity
    dst_filler.resume()
    dst_filler.resize(16 * 3)
    kv_src = new_kv(model, src)
    first = greedy(model.prefill(kv_src, tokens, chunk_size=20)[-1])

    dst_cache = dst.create_kv_cache()
    dst_cache.resume()
    assert dst_cache.resize(len(tokens))
    src_cache = kv_src.shards[0][1]
    for lg in src.layout.layer_groups:
        src_ids, dst_ids = src_cache.block_ids(lg.layer_group_id), dst_cache.block_ids(lg.layer_group_id)
        keep = src_ids >= 0
        assert not np.array_equal(src_ids[keep], dst_ids[keep])
        pg = lg.pool_group_index
        for pool in src.layout.pool_groups[pg].pools:
            s = src.pool_tensor(pg, pool.pool_index).view(pool.num_slots, pool.slot_bytes)
            d = dst.pool_tensor(pg, dst.layout.pool_groups[pg].pools[pool.pool_index].pool_index)
            d = d.view(-1, pool.slot_bytes)
            d[torch.from_numpy(dst_ids[keep].astype(np.int64))] = s[torch.from_numpy(src_ids[keep].astype(np.int64))]
    dst_cache.commit(tokens)
    close_all(kv_src)
    kv_dst = model.bind([(dst, dst_cache)])
    assert model.continue_greedy(kv_dst, first, 10) == expected
    close_all(kv_dst)
    dst_filler.close()
    assert held_by_requests(dst) == 0


def test_tensor_parallel_shards_generate_like_one_manager() -> None:
    config = ModelConfig(num_kv_heads=4, num_heads=8, seed=2)
    model = ReferenceModel(config)
    tokens = prompt(33, seed=17)
    single = model.generate(KVCacheManager(config.cache_config(16, 8)), tokens, 8)
    ranks = [KVCacheManager(config.cache_config(16, 8, tp_rank=r, tp_size=2, head_order=o))
             for r, o in ((0, "HND"), (1, "NHD"))]
    assert [m.layout.format_of(BufferId(0, "key")).num_heads for m in ranks] == [2, 2]
    assert model.generate(ranks, tokens, 8) == single


def test_kv_written_only_into_the_requests_pages() -> None:
    model = ReferenceModel(TINY)
    manager = KVCacheManager(TINY.cache_config(16, 8))
    before = [manager.pool_tensor(0, p.pool_index).clone() for p in manager.pool_group_descs[0].pools]
    kv = new_kv(model, manager)
    model.prefill(kv, prompt(20))
    ids = set(kv.shards[0][1].block_ids(0).tolist())
    assert ids == {0, 1}
    for p, old in zip(manager.pool_group_descs[0].pools, before, strict=True):
        new = manager.pool_tensor(0, p.pool_index).view(p.num_slots, p.slot_bytes)
        untouched = [i for i in range(p.num_slots) if i not in ids]
        assert torch.equal(new[untouched], old.view(p.num_slots, p.slot_bytes)[untouched])
    close_all(kv)


def test_bad_inputs_raise_and_leak_nothing() -> None:
    model = ReferenceModel(TINY)
    manager = KVCacheManager(TINY.cache_config(16, 4))
    with pytest.raises(CapacityError, match=r"token ids must be in \[0, 512\)"):
        model.generate(manager, [1, 512], 2)
    with pytest.raises(OutOfSlotsError, match="cannot grow to 65 tokens"):
        model.generate(manager, prompt(65), 2)
    with pytest.raises(CapacityError, match="max_new_tokens"):
        model.generate(manager, [1], -1)
    with pytest.raises(CapacityError, match="chunk_size"):
        model.prefill(new_kv(model, manager), [1, 2], chunk_size=0)
    assert manager.num_free_slots() == 4 and manager.open_caches[0].capacity == 0
    manager.open_caches[0].close()
    other = KVCacheManager(ModelConfig(head_dim=16).cache_config(16, 4))
    with pytest.raises(LayoutMismatch, match="head_dim 16"):
        model.generate(other, [1, 2], 1)
    assert other.num_free_slots() == 4


def test_config_validation_and_cache_config() -> None:
    with pytest.raises(ConfigError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="head_dim must be even"):
        ModelConfig(head_dim=33)
    with pytest.raises(ConfigError, match="needs a sliding-window layer"):
        ModelConfig(sink_tokens=2)
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        preset("huge")
    cfg = SWA.cache_config(32, 10, head_order="NHD")
    assert [layer.window for layer in cfg.layers] == [None, 20, None, 20]
    assert [layer.sink_tokens for layer in cfg.layers] == [0, 3, 0, 3]
    assert cfg.tokens_per_block == 32 and cfg.head_order == "NHD" and cfg.dtype == "float32"
    assert KVCacheManager(cfg).allocator(0).num_slots == 20   # 10 per layer group, two groups share it


def test_same_config_same_weights_and_byte_tokenizer() -> None:
    a, b = ReferenceModel(TINY), ReferenceModel(TINY)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[3]["w_down"], b.layers[3]["w_down"])
    assert not torch.equal(a.embed, ReferenceModel(ModelConfig(seed=9)).embed)
    tok = ByteTokenizer(512)
    assert tok.encode("héllo") == [104, 195, 169, 108, 108, 111]
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert ByteTokenizer(100).encode("e") == [1]


def test_weights_are_the_same_in_every_process_and_drawn_per_tensor() -> None:
    """Each weight has its own seeded generator (drawn in parallel threads): two models of one config are
    identical tensor by tensor whatever order the threads ran in, another seed gives other weights, and
    each weight has the scale it was drawn at (the norms around 1)."""
    cfg = preset("tiny")
    a, b, other = ReferenceModel(cfg), ReferenceModel(cfg), ReferenceModel(replace(cfg, seed=cfg.seed + 1))
    pairs = [(a.embed, b.embed), (a.final_norm, b.final_norm), (a.lm_head, b.lm_head),
             *[(la[k], lb[k]) for la, lb in zip(a.layers, b.layers, strict=True) for k in la]]
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not torch.equal(a.layers[0]["wq"], other.layers[0]["wq"])
    assert not torch.equal(a.layers[0]["wq"], a.layers[1]["wq"])      # per-tensor seeds differ
    h = cfg.hidden_size
    assert abs(float(a.layers[0]["wq"].float().std()) * h ** 0.5 - 1.0) < 0.1
    assert abs(float(a.final_norm.float().mean()) - 1.0) < 0.05
