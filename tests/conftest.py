"""Shared fixtures: small real cache managers on the CPU (or the GPU where a test asks for one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("kvxfer", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvxfer"))
_FAULTS = Path(__file__).parent / "faults"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the fault-injection suite first, as in the flat layout (its process-fault timings were tuned in a
    fresh test process: after the disagg and e2e suites, the layer-wise freeze in
    test_resumed_prefill_cannot_write_into_blocks_decode_gave_away lands too late); skip GPU tests with a
    reason on machines without CUDA."""
    items.sort(key=lambda item: _FAULTS not in item.path.parents)   # stable: the order within each part stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
