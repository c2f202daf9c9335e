"""The cuda_ipc copy kernels' logic on any machine: Triton's interpreter runs them on host memory
(``tests/support/kernel_interpreter.py``, in a process of its own since the interpreter is chosen when Triton
compiles), packed and launched as ``cuda_copy`` does, in both program orders; every byte of both buffers
is checked against the plan's runs copied by position, including runs the kernel must refuse (outside
their region, region out of the table). The GPU tests run the same kernels compiled (``-m gpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvxfer.transport.cuda_copy", reason="needs cuda-python (the ucx or cuda extra)")
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (the dev extra installs it): the kernels cannot be interpreted",
                allow_module_level=True)

CASES = [f"{kind} {op} {order}" for op in ("write", "read") for order in ("run-major", "2-D")
         for kind in ("runs", "blocks")] + [f"{kind} {op}" for kind in ("packed", "tiled", "grouped")
                                                           for op in ("write", "read")]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, int]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.support.kernel_interpreter"], env=env, capture_output=True,
                          text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_copies_exactly_the_plans_runs(results: dict[str, dict[str, int]], case: str) -> None:
    row = results[case]
    assert row["copied"] > 10_000
    assert row["wrong"] == 0, f"{case}: {row['wrong']} bytes differ from the runs copied by position"
