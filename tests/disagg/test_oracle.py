"""The KV oracle's parts: stratified position samples, the bounded PromptKV codec, reading K/V by logical
position through any layout (TP split, block size, head order), and a comparison that names the worst
(layer, role, token, head) -- and misses nothing outside its tolerance (its mutation tests are
tests/disagg/test_mutations.py and tests/e2e/test_ucx_mutations.py)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.oracle import PromptKV, ReferenceKV, compare_kv, read_prompt_kv, sample_positions
from kvxfer.errors import DecodeError
from kvxfer.model import ReferenceModel, preset

CFG = preset("tiny")


@pytest.fixture(scope="module")
def reference() -> ReferenceKV:
    torch.set_num_threads(1)
    return ReferenceKV(CFG)


def test_sample_positions_cover_every_stratum() -> None:
    assert sample_positions(10, 64).tolist() == list(range(10))
    pos = sample_positions(1000, 100, seed=3)
    assert pos.size == 100 and np.all(np.diff(pos) > 0) and pos[0] >= 0 and pos[-1] < 1000
    assert np.array_equal(pos // 10, np.arange(100))           # one position in each 10-token stratum
    assert np.array_equal(pos, sample_positions(1000, 100, seed=3))
    assert not np.array_equal(pos, sample_positions(1000, 100, seed=4))
    assert sample_positions(0, 5).size == 0


def test_prompt_kv_codec_round_trips_and_refuses_malformed_bytes(reference: ReferenceKV) -> None:
    kv = reference.prompt_kv(np.arange(40) % 512, [0, 7, 39])
    back = PromptKV.from_bytes(kv.to_bytes())
    assert np.array_equal(back.positions, kv.positions) and np.array_equal(back.key, kv.key)
    assert np.array_equal(back.value, kv.value) and np.array_equal(back.present, kv.present)
    raw = kv.to_bytes()
    lying = msgpack.unpackb(raw)
    lying["shape"][1] += 1                                      # more positions than the bytes hold
    for bad, what in [(raw[:-9], "msgpack"), (b"\x80", "version"), (msgpack.packb(lying), "must hold")]:
        with pytest.raises(DecodeError, match=what):
            PromptKV.from_bytes(bad)


def test_kv_read_by_logical_position_is_the_same_through_any_layout(reference: ReferenceKV) -> None:
    """TP 2, 8 tokens per block, NHD pages hold the same K/V by (layer, role, token, head) as the
    reference's TP 1, 16 tokens per block, HND pages."""
    tokens = np.random.default_rng(1).integers(0, 512, 53)
    managers = [KVCacheManager(CFG.cache_config(8, 32, head_order="NHD", tp_rank=r, tp_size=2,
                                                enable_prefix_reuse=False)) for r in range(2)]
    caches = [m.create_kv_cache() for m in managers]
    for c in caches:
        c.resume()
    model = ReferenceModel(CFG)
    with torch.inference_mode():
        model.prefill(model.bind(list(zip(managers, caches, strict=True))), tokens)
    got = read_prompt_kv(list(zip(managers, caches, strict=True)), np.arange(53), CFG.num_layers, CFG.num_kv_heads,
                         CFG.head_dim)
    report = compare_kv(got, reference.prompt_kv(tokens), 1e-4)
    assert report.ok and report.compared == 53 * 4 * 2 * 2, report.describe()


def test_comparison_names_the_worst_vector_and_honours_the_tolerance(reference: ReferenceKV) -> None:
    ref = reference.prompt_kv(np.arange(30) % 512)
    assert compare_kv(ref, ref, 1e-4).max_error == 0.0
    value = ref.value.copy()
    value[2, 5, 1] *= 1 + 5e-6                                   # rounding-sized: inside the tolerance
    value[3, 17, 0, 4] += 1.0                                    # one element of one vector: outside it
    report = compare_kv(dataclasses.replace(ref, value=value), ref, 1e-4)
    assert not report.ok and report.bad == 1 and report.worst == (3, "value", 17, 0)
    assert "layer 3 value token 17 head 0" in report.describe()
    swapped = dataclasses.replace(ref, key=ref.key[:, ::-1].copy())   # every position paired with another
    assert compare_kv(swapped, ref, 1e-4).bad > 0
    sub = reference.prompt_kv(np.arange(30) % 512, [1, 2])
    assert compare_kv(ref, sub, 1e-4).problem.startswith("positions [0, 3")
