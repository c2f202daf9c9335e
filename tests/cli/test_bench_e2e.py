"""`kvxfer bench e2e`: its one-process baseline does the prefill worker's work, and its rows are verified."""
from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from kvxfer.cache import KVCacheManager
from kvxfer.cli import bench_e2e
from kvxfer.model import ReferenceModel, greedy, preset

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
