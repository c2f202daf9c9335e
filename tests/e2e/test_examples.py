"""Every example runs: ``--help`` everywhere, the CPU ones for real over loopback, the GPU one on a GPU."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> dict[str, Any]:
    return runpy.run_path(str(EXAMPLES / name))


@pytest.mark.parametrize("name", ["cpu_pair.py", "two_gpu_pair.py", "hetero_tp.py"])
def test_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load(name)["main"](["--help"])
    assert exc.value.code == 0
    assert "--backend" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--mode", "push"], ["--mode", "pull", "--layerwise"]])
def test_cpu_pair(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert load("cpu_pair.py")["main"](["--max-new-tokens", "6", *args]) == 0
    out = capsys.readouterr().out
    assert "tokens match single-process generation" in out


def test_hetero_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert load("hetero_tp.py")["main"](["--requests", "2", "--max-new-tokens", "6", "--mode", "pull"]) == 0
    out = capsys.readouterr().out
    assert out.count("-> match") == 2 and "heads [1, 2) of 2, 8 tokens/block, NHD" in out


def test_two_gpu_pair_says_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu-marked test runs the example")
    assert load("two_gpu_pair.py")["main"]([]) == 2
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl", "ucx"])
def test_two_gpu_pair(backend: str) -> None:
    # Run as a script: its worker processes are spawned, and spawn pickles functions by module name.
    done = subprocess.run([sys.executable, str(EXAMPLES / "two_gpu_pair.py"), "--backend", backend,
                           "--max-new-tokens", "8"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens match" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "checksum"), [("cuda_ipc", "off"), ("nixl", "off"), ("nixl", "full"),
                                                   ("cuda_ipc", "every:4")])
def test_demo_on_one_gpu(backend: str, checksum: str) -> None:
    """`kvxfer demo` with both worker processes on cuda:0, checked against one process on cuda:0; with a
    checksum, prefill digests and decode verifies the pages in GPU memory (the CUDA path of the digest)."""
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--device", "cuda:0", "--backend", backend,
                           "--families", "2", "--per-family", "2", "--checksum", checksum, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mismatches"] == 0 and summary["failed"] == 0 and summary["requests"] == 4
    assert summary["device"] == "cuda:0" and summary["transport"] == backend
    assert summary["checksum"] == checksum
    assert all((row["verify_ms"] > 0) == (checksum != "off") for row in summary["rows"])
