"""`kvxfer bench e2e`: its one-process baseline does the prefill worker's work, and its rows are verified, also
when decode's cache layout (block size, head order) differs from prefill's."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.cache import KVCacheManager
from kvxfer.cache.config import HeadOrder
from kvxfer.cli import bench_e2e
from kvxfer.disagg.oracle import TOLERANCE
from kvxfer.errors import BackendUnavailable, ConfigError
from kvxfer.model import ReferenceModel, greedy, preset
from kvxfer.transport.registry import check_backend
from tests.e2e.test_ucx import faulty_planner_env

TOKENS_PER_BLOCK = bench_e2e.TOKENS_PER_BLOCK


class _Recording(ReferenceModel):
    """The reference model, noting how each prefill was asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_only: list[bool] = []

    def prefill(self, *args: Any, last_only: bool = False, **kwargs: Any) -> torch.Tensor:
        self.last_only.append(last_only)
        return super().prefill(*args, last_only=last_only, **kwargs)


def test_baseline_computes_only_the_last_logits_and_gets_the_full_prefills_token() -> None:
    cfg = preset("tiny")
    model = _Recording(cfg)
    manager = KVCacheManager(cfg.cache_config(TOKENS_PER_BLOCK, 32, "cpu"))
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, 100)
    took, first, kv = bench_e2e.single_process_ttft(model, manager, tokens, 32, np.array([0, 57, 99]))
    assert model.last_only == [True]          # a server computes the first token's logits only
    assert took > 0 and kv is not None
    # Independent of the baseline: every row's logits, on a manager of its own.
    other = KVCacheManager(cfg.cache_config(TOKENS_PER_BLOCK, 32, "cpu"))
    cache = other.create_kv_cache_for_prompt(tokens)
    cache.resume()
    reference = ReferenceModel(cfg)
    with torch.inference_mode():
        full = reference.prefill(reference.bind([(other, cache)]), tokens, 32)
    cache.close()
    assert full.shape[0] == tokens.size and first == greedy(full[-1])


def test_a_short_bench_run_verifies_every_request() -> None:
    result = bench_e2e.run([40, 100], "auto", "push", False, 2, 32, model_name="tiny")
    assert result["verified"] and [r["prompt_tokens"] for r in result["rows"]] == [40, 100]
    spec = preset("tiny").kv_spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.empty(0, dtype=getattr(
        torch, spec.dtype)).element_size()
    for row in result["rows"]:
        assert row["verified"] and row["kv_max_error"] <= 3e-2
        n = row["prompt_tokens"]   # whole blocks move: the prompt's tokens rounded up to a block
        assert n * per_token <= row["kv_bytes"] < (n + TOKENS_PER_BLOCK) * per_token
        assert 0 < row["prefill_compute_ms"] < row["disagg_ttft_ms"] and row["single_ttft_ms"] > 0
        each = row["per_iteration_ms"]   # the medians are of the iterations recorded, 2 per row here
        assert all(len(v) == 2 for v in each.values())
        assert row["disagg_ttft_ms"] == statistics.median(each["disagg_ttft"])
        assert row["single_ttft_ms"] == statistics.median(each["single_ttft"])
        assert row["ttft_ratio_paired"] == statistics.median(d / s for d, s in zip(each["disagg_ttft"],
                                                                                   each["single_ttft"], strict=True))


def _needs(backend: str) -> None:
    try:
        check_backend(backend, cross_process=True)
    except BackendUnavailable as exc:
        pytest.skip(f"needs backend {backend}: {exc}")


def _check_rows(result: dict[str, Any], tpb: int) -> None:
    """Every row verified, and whole blocks of the larger block size (at most) moved."""
    spec = preset("tiny").kv_spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4   # float32
    for row in result["rows"]:
        assert row["verified"] and row["kv_max_error"] <= 3e-2, row
        n = row["prompt_tokens"]
        assert n * per_token <= row["kv_bytes"] < (n + tpb) * per_token


@pytest.mark.parametrize(("backend", "mode", "layerwise", "decode_tpb", "decode_order"), [
    pytest.param("nixl", "push", False, 8, None, id="smaller-blocks-nixl-push"),
    pytest.param("ucx", "pull", False, 32, None, id="larger-blocks-ucx-pull"),
    pytest.param("ucx", "push", True, None, "NHD", id="nhd-ucx-push-layerwise"),
    pytest.param("nixl", "pull", False, 64, "NHD", id="larger-blocks-nhd-nixl-pull"),
])
def test_decode_in_another_layout_is_verified_by_logical_position(backend: str, mode: str, layerwise: bool,
                                                                  decode_tpb: int | None,
                                                                  decode_order: HeadOrder | None) -> None:
    """Decode's pages in another block size and/or head order than prefill's (and the baseline's): every
    request still matches the baseline by (layer, role, token, head); the result names both layouts as the
    workers published them."""
    _needs(backend)
    result = bench_e2e.run([100], backend, mode, layerwise, 1, 32, model_name="tiny",
                           decode_tokens_per_block=decode_tpb, decode_head_order=decode_order)
    assert result["verified"] and result["backend"] == backend and result["mode"] == mode
    assert result["prefill_layout"] == {"tokens_per_block": TOKENS_PER_BLOCK, "head_order": "HND"}
    assert result["decode_layout"] == {"tokens_per_block": decode_tpb or TOKENS_PER_BLOCK,
                                       "head_order": decode_order or "HND"}
    _check_rows(result, max(TOKENS_PER_BLOCK, decode_tpb or 0))


def test_the_command_takes_both_layouts_and_names_them(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--tokens-per-block``/``--head-order`` set prefill's layout, ``--decode-*`` decode's: an NHD prefill of
    32-token blocks feeding an HND decode of 16-token blocks exits 0, and the table and the JSON name both."""
    _needs("nixl")
    argv = ["--model", "tiny", "--lengths", "70", "--iters", "1", "--chunk-size", "32", "--backend", "nixl",
            "--tokens-per-block", "32", "--head-order", "NHD", "--decode-tokens-per-block", "16",
            "--decode-head-order", "HND", "--out", str(tmp_path / "e2e.json")]
    assert bench_e2e.main(argv) == 0
    table = capsys.readouterr().out
    assert "prefill 32 tokens/block NHD -> decode 16 tokens/block HND" in table and " ok " in table
    out = json.loads((tmp_path / "e2e.json").read_text())
    assert out["verified"] and out["rows"][0]["verified"]
    assert out["prefill_layout"] == {"tokens_per_block": 32, "head_order": "NHD"}
    assert out["decode_layout"] == {"tokens_per_block": 16, "head_order": "HND"}


def test_a_bad_decode_layout_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="--decode-tokens-per-block must be >= 1, got 0"):
        bench_e2e.main(["--decode-tokens-per-block", "0"])
    with pytest.raises(ConfigError, match="decode_head_order"):
        bench_e2e.run([40], "nixl", "push", False, 1, 32, decode_head_order="DHN")  # type: ignore[arg-type]


def test_a_block_swap_across_layouts_fails_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous across layouts: a prefill process whose plans swap the first two destination
    blocks (the test plugin's ``block_swap``) writes into a decode of 8-token NHD blocks; every request is
    reported unverified, with errors far above the tolerance."""
    _needs("nixl")
    for key, value in faulty_planner_env("block_swap").items():
        monkeypatch.setenv(key, value)
    result = bench_e2e.run([100], "nixl", "push", False, 1, 32, model_name="tiny", decode_tokens_per_block=8,
                           decode_head_order="NHD")
    assert not result["verified"] and result["decode_layout"] == {"tokens_per_block": 8, "head_order": "NHD"}
    far = 100 * TOLERANCE["float32"]
    assert all(not row["verified"] and row["kv_max_error"] > far for row in result["rows"]), result["rows"]
