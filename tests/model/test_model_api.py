"""The public K/V access of the cache (``kvxfer.cache.kv_access``), the model seam's checks, and the exported
multi-rank planning helpers (``kvxfer.extractor.multirank``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvxfer.cache import KVCacheManager
from kvxfer.cache.kv_access import read_kv, write_kv
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.errors import CacheStateError, CapacityError, ConfigError, KVCacheError, LayoutError
from kvxfer.extractor import all_regions, plan_between, plan_transfer, region_offsets
from kvxfer.model import KVSpec, ModelConfig, ModelSource, ReferenceModel, model_source, preset

SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def open_cache(manager: KVCacheManager, tokens: int) -> object:
    cache = manager.create_kv_cache()
    cache.resume()
    assert cache.resize(tokens)
    return cache


def kv_tensors(tokens: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, 8, generator=g), torch.randn(tokens, heads, 8, generator=g)


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_write_lands_at_its_logical_position_and_reads_back_in_the_same_order(order: str) -> None:
    manager = KVCacheManager(SPEC.cache_config(4, 16, head_order=order))
    cache = open_cache(manager, 22)
    for view in (manager.buffer_view(1, "key"), manager.buffer_view(1, "value")):
        view.fill_(-7.0)   # poison: whatever the write does not touch keeps it
    key, value = kv_tensors(13, 4, seed=1)
    write_kv(manager, cache, 1, 5, key, value)
    # Independent check: locate (slot, offset) of every position by hand and index the raw views.
    blocks = cache.block_ids(0)
    kview, vview = manager.buffer_view(1, "key"), manager.buffer_view(1, "value")
    for t in range(13):
        pos = 5 + t
        slot, off = int(blocks[pos // 4]), pos % 4
        for h in range(4):
            got_k = kview[slot, h, off] if order == "HND" else kview[slot, off, h]
            got_v = vview[slot, h, off] if order == "HND" else vview[slot, off, h]
            assert torch.equal(got_k, key[t, h]) and torch.equal(got_v, value[t, h])
    assert int((kview != -7.0).any(-1).sum()) == 13 * 4       # nothing else was written
    got = read_kv(manager, cache, 1, 5, 18)
    assert torch.equal(got.key, key) and torch.equal(got.value, value)
    assert got.positions.tolist() == list(range(5, 18))
    part = read_kv(manager, cache, 1, 7, 9)
    assert torch.equal(part.key, key[2:4])
    assert read_kv(manager, cache, 0, 3, 3).key.shape == (0, 4, 8)


def test_a_tensor_parallel_rank_takes_and_returns_its_own_heads() -> None:
    manager = KVCacheManager(SPEC.cache_config(4, 8, tp_rank=1, tp_size=2))
    cache = open_cache(manager, 8)
    key, value = kv_tensors(6, 2, seed=2)
    write_kv(manager, cache, 0, 0, key, value)
    assert torch.equal(read_kv(manager, cache, 0, 0, 6).value, value)
    with pytest.raises(KVCacheError, match=r"\[tokens, 2, 8\]"):
        write_kv(manager, cache, 0, 0, *kv_tensors(6, 4, seed=2))


def test_bad_arguments_are_refused_with_what_was_wrong() -> None:
    manager = KVCacheManager(SPEC.cache_config(4, 8))
    other = KVCacheManager(SPEC.cache_config(4, 8))
    cache = open_cache(manager, 8)
    key, value = kv_tensors(4, 4, seed=3)
    with pytest.raises(CapacityError, match="capacity"):
        write_kv(manager, cache, 0, 6, key, value)
    with pytest.raises(CapacityError, match="start <= end"):
        read_kv(manager, cache, 0, 5, 2)
    with pytest.raises(KVCacheError, match="another manager"):
        write_kv(other, cache, 0, 0, key, value)
    with pytest.raises(LayoutError, match="layer 9"):
        read_kv(manager, cache, 9, 0, 4)
    with pytest.raises(KVCacheError, match="both be"):
        write_kv(manager, cache, 0, 0, key, value[:3])


def test_released_sliding_window_blocks_raise_or_are_skipped() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", windows=(None, 6))
    manager = KVCacheManager(spec.cache_config(4, 16))
    cache = manager.create_kv_cache()
    cache.resume()
    assert cache.resize(20)
    key, value = kv_tensors(20, 4, seed=4)
    for layer in range(2):
        write_kv(manager, cache, layer, 0, key, value)
    cache.commit(np.arange(20))   # the window layer keeps only the blocks token 20 can still see
    window_group = manager.layout.layer_group_of(1).layer_group_id
    assert (cache.block_ids(window_group) < 0).any()
    with pytest.raises(CacheStateError, match="released"):
        read_kv(manager, cache, 1, 0, 20)
    got = read_kv(manager, cache, 1, 0, 20, skip_released=True)
    kept = got.positions.numpy()
    assert kept[0] > 0 and kept[-1] == 19 and kept[0] <= 20 - 6 + 1
    assert torch.equal(got.key, key[kept])
    with pytest.raises(CacheStateError, match="no page"):
        write_kv(manager, cache, 1, 0, key[:2], value[:2])
    assert torch.equal(read_kv(manager, cache, 0, 0, 20).key, key)   # the full layer keeps everything


def test_model_sources_and_worker_model_checks() -> None:
    assert isinstance(preset("tiny"), ModelSource)
    assert model_source("tiny") == preset("tiny") == model_source("ref:tiny")
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        model_source("nope")
    model = ReferenceModel(preset("tiny"))
    assert isinstance(model, ModelSource) and model.load("cpu") is model
    cfg = WorkerConfig("w", model=model)          # a loaded model is a source too
    assert cfg.load_model() is model
    assert WorkerConfig("w").load_model(model) is model
    with pytest.raises(ConfigError, match="KV shape"):
        WorkerConfig("w", model=preset("tiny-swa")).load_model(model)
    with pytest.raises(ConfigError, match="ModelSource"):
        WorkerConfig("w", model="tiny")  # type: ignore[arg-type]
    assert ModelConfig().kv_spec.cache_config(16, 4) == ModelConfig().cache_config(16, 4)


def test_plan_between_concatenates_rank_pairs_in_shifted_region_indices() -> None:
    src = [KVCacheManager(SPEC.cache_config(4, 8))]
    dst = [KVCacheManager(SPEC.cache_config(2, 16, head_order="NHD", tp_rank=r, tp_size=2)) for r in range(2)]
    src_cache = open_cache(src[0], 8)
    dst_caches = [open_cache(m, 8) for m in dst]
    lay_s, lay_d = [m.layout for m in src], [m.layout for m in dst]
    ids_s = [src_cache.block_id_map()]
    ids_d = [c.block_id_map() for c in dst_caches]
    assert region_offsets(lay_d) == [0, len(all_regions(lay_d[:1]))]
    plan = plan_between(lay_s, ids_s, lay_d, ids_d, token_range=(0, 8))
    pairs = [plan_transfer(lay_s[0], ids_s[0], lay_d[j], ids_d[j], token_range=(0, 8)) for j in range(2)]
    assert len(plan) == sum(len(p) for p in pairs)
    assert int(plan.src.nbytes.sum()) == 8 * 2 * 2 * 4 * 8 * 4        # tokens x layers x roles x heads x dim x 4 B
    second = plan.dst.region[len(pairs[0]):]
    assert (second >= region_offsets(lay_d)[1]).all()                 # rank 1's entries use its shifted regions
    regions = all_regions(lay_d)
    for addr, n, r in zip(plan.dst.addr.tolist(), plan.dst.nbytes.tolist(), plan.dst.region.tolist(), strict=True):
        assert regions[r].base_address <= addr and addr + n <= regions[r].base_address + regions[r].nbytes


def test_the_cli_refuses_an_unknown_model_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.cli import build_parser
    for argv in (["serve", "prefill", "--model", "nope"], ["generate", "hi", "--decode", "tcp://x:1", "--model", "nope"],
                 ["demo", "--model", "hf:no-such-preset-or-dir"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
        assert "--model" in capsys.readouterr().err


def test_last_only_prefill_gives_the_last_rows_logits() -> None:
    model = ReferenceModel(preset("tiny"))
    manager = KVCacheManager(model.kv_spec.cache_config(16, 16, enable_prefix_reuse=False))
    tokens = np.random.default_rng(0).integers(0, 512, 40)
    rows = []
    for last_only in (False, True):
        cache = manager.create_kv_cache()
        cache.resume()
        kv = model.bind([(manager, cache)])
        rows.append(model.prefill(kv, tokens, 16, last_only=last_only))
        assert kv.length == 40
        cache.close()
    assert rows[0].shape == (40, 512) and rows[1].shape == (1, 512)
    torch.testing.assert_close(rows[1][0], rows[0][-1], rtol=1e-5, atol=1e-5)


def test_access_inside_and_outside_inference_mode() -> None:
    """The first call may come from a model under torch.inference_mode; later calls from anywhere."""
    manager = KVCacheManager(SPEC.cache_config(4, 8))
    cache = open_cache(manager, 8)
    key, value = kv_tensors(4, 4, seed=5)
    with torch.inference_mode():
        write_kv(manager, cache, 0, 0, key, value)
    write_kv(manager, cache, 0, 4, value, key)
    got = read_kv(manager, cache, 0, 0, 8)
    assert torch.equal(got.key, torch.cat([key, value])) and torch.equal(got.value, torch.cat([value, key]))
