"""Shared fixtures: small real cache managers on the CPU (or the GPU where a test asks for one)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("kvxfer", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvxfer"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests with a reason on machines without CUDA. The suites run in collection order: none
    depends on running first (tests/faults passes alone, after the others and in reverse)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
