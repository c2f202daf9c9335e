"""Workers run one short generation on their compute thread before they serve (``WorkerConfig.warm_up``):
on a GPU a process's first forward sets up cuBLAS and loads kernels (over half a second on an H100),
which the first request would otherwise wait for. The warm-up leaves nothing behind in the caches."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvxfer.cache import KVCacheManager
from kvxfer.cache.events import Created
from kvxfer.disagg.worker import WorkerConfig, held_slots
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ConfigError
from kvxfer.model import PagedKV, ReferenceModel, preset

SECRET = "warm-up-test-secret-0123456789"
_names = iter(range(1_000_000))


def name(role: str) -> str:
    return f"warm-{role}-{next(_names)}"


class _Recording(ReferenceModel):
    """The reference model, noting the thread and the token count of every forward."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(preset("tiny"))
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def forward(self, kv: PagedKV, tokens: Sequence[int] | npt.ArrayLike, *, last_only: bool = False) -> torch.Tensor:
        self.calls.append((threading.current_thread().name, int(np.asarray(tokens).size)))
        if self.fail:
            raise torch.cuda.OutOfMemoryError("no memory for the warm-up")
        return super().forward(kv, tokens, last_only=last_only)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_warms_its_model_on_the_compute_thread_before_serving(role: str) -> None:
    model = _Recording()
    config = WorkerConfig(name(role), tokens_per_block=16, num_blocks=64)
    worker_type: Any = PrefillWorker if role == "prefill" else DecodeWorker
    with worker_type(config, SECRET, model=model) as worker:
        # Done before the constructor returned: a prompt of two blocks and a token, then one decode step,
        # on the thread that runs every request's compute (CUDA library handles are per thread).
        assert model.calls == [(f"kvxfer-compute-{config.name}", 33), (f"kvxfer-compute-{config.name}", 1)]
        assert worker.warm_up_s > 0
        # Nothing left behind in the worker's caches: no block held, no block stored (no event, no prefix).
        assert held_slots(worker.managers) == 0
        assert not [e for e in worker.managers[0].drain_events() if not isinstance(e, Created)]
        probe = worker.managers[0].create_kv_cache_for_prompt(np.arange(33) % model.vocab_size)
        assert probe.num_reused_tokens == 0
        probe.close()


def test_a_prefill_worker_serves_its_first_request_after_the_warm_up() -> None:
    """The first request computes on a model already run once: the worker's first forward is the warm-up's."""
    model = _Recording()
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET, model=model) as prefill, \
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address) as decode:
        warm = list(model.calls)
        tokens = np.random.default_rng(5).integers(0, model.vocab_size, 70)
        result = decode.generate(tokens, 4)
        assert model.calls[:len(warm)] == warm and len(model.calls) > len(warm)
        cfg = preset("tiny")   # and it is right: the tokens of one process generating alone
        assert result.tokens == ReferenceModel(cfg).generate(KVCacheManager(cfg.cache_config(16, 64)), tokens, 4)


def test_warm_up_off_runs_no_forward() -> None:
    model = _Recording()
    with PrefillWorker(WorkerConfig(name("prefill"), warm_up=False), SECRET, model=model) as prefill:
        assert model.calls == [] and prefill.warm_up_s == 0.0


def test_a_model_that_fails_its_warm_up_fails_the_start_and_releases_everything() -> None:
    model = _Recording(fail=True)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match=r"warm-up \(33-token prompt, 2 new tokens\) failed") as err:
        PrefillWorker(WorkerConfig(name("prefill")), SECRET, model=model)
    assert "no memory for the warm-up" in str(err.value)
    deadline = time.monotonic() + 5.0
    while (left := {t.name for t in threading.enumerate()} - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads left behind: {left}"


def test_warm_up_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="warm_up must be a bool"):
        WorkerConfig("w", warm_up="yes")  # type: ignore[arg-type]
