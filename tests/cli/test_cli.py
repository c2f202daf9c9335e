"""The `kvxfer` command line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvxfer
from kvxfer.cache import CacheLayoutDesc
from kvxfer.cli import main
from kvxfer.disagg.health import WorkerHealth
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import GenerateClient
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.ops.http import OpsServer
from kvxfer.ops.metrics import WorkerMetrics
from kvxfer.transport import BACKENDS, LoopbackFaults, available_backends, backend_names
from tests.ops.test_worker_ops import StubWorker

SECRET = "cli-test-secret-0123456789abcdef"


def test_inspect_json_is_a_decodable_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--layers", "6", "--window", "1024", "--scale-role", "--json"]) == 0
    out = capsys.readouterr().out
    layout = CacheLayoutDesc.from_json(out)
    assert [lg.window for lg in layout.layer_groups] == [1024, None]
    assert set(json.loads(out)) == {"version", "tokens_per_block", "layer_groups", "pool_groups", "formats",
                                    "fingerprint"}


def test_inspect_table_shows_llama3_8b_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "Layer groups" in out and "Pools" in out
    assert "65536" in out  # 8 heads x 32 tokens x 128 dims x 2 bytes per buffer
    assert "total pool memory: 4.000 GiB" in out  # 1024 blocks x 32 layers x 2 roles x 64 KiB


def test_inspect_reports_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--kv-heads", "3", "--tp-size", "2"]) == 2
    assert "num_kv_heads=3" in capsys.readouterr().err


# --- the command line as a user meets it: versions, errors, clean JSON -----------------------------------
def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m kvxfer ARGS`` in a fresh process (its stdout and stderr separately)."""
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=timeout)


def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"kvxfer {kvxfer.__version__}"


@pytest.mark.slow
def test_inspect_and_status_json_are_the_only_stdout() -> None:
    proc = run_cli("inspect", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens_per_block"] > 0
    worker, health = StubWorker(), WorkerHealth()
    server = OpsServer(worker, WorkerMetrics(worker, health), health, 0)
    try:
        proc = run_cli("status", f"http://127.0.0.1:{server.port}", "--json")
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["schema"] == "kvxfer.status/1" and out["status"]["completed"] == 2 and out["status"]["healthy"]


@pytest.mark.slow
def test_bench_transport_json_is_clean_with_nixl_installed() -> None:
    """NIXL logs INFO lines on creation; with --json they go to stderr, stdout stays one JSON object."""
    reason = available_backends()["nixl"]
    backend = "nixl" if reason is None else "loopback"
    proc = run_cli("bench", "transport", "--backend", backend, "--pages", "8", "--page-bytes", "4096",
                   "--iters", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["schema"] == "kvxfer.bench.transport/1" and out["verified"] is True and out["backend"] == backend
    assert {"gb_per_s", "memcpy_gb_per_s", "median_ms"} <= set(out) and "gbps" not in out
    if backend == "nixl":
        assert "Initialized NIXL agent" in proc.stderr          # NIXL did log: on stderr


def test_backend_choices_come_from_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "{auto," + ",".join(backend_names(cross_process=True)) + "}" in text and "loopback" not in text
    with pytest.raises(SystemExit):
        main(["serve", "prefill", "--help"])
    assert "{auto," + ",".join(BACKENDS) + "}" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_demo_on_cuda_without_cuda_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cuda:0"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "did not start" not in err


def test_missing_secret_names_the_option_and_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVXFER_SECRET", raising=False)
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    assert main(["generate", "hi", "--decode", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "no shared secret" in err and "--secret-file" in err and "$KVXFER_SECRET" in err


def test_generate_timeout_bounds_the_connection(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_SECRET", "cli-secret-0123456789abcdef")
    with socket.socket() as s:                 # a port nobody answers on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["generate", "hi", "--decode", f"tcp://127.0.0.1:{port}", "--timeout", "0.5"]) == 2
    assert "no reply within 0.500 s" in capsys.readouterr().err


def test_two_clients_get_their_own_names_and_cannot_cancel_each_other() -> None:
    stall = LoopbackFaults(never_complete=True)
    # Pull: decode's own reads stall (the faults of the transport that posts them), so every request
    # waits for its cancel however fast the machine is.
    with PrefillWorker(WorkerConfig(f"cli-prefill-{os.getpid()}"), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(f"cli-decode-{os.getpid()}", deadline_s=60.0), SECRET, prefill=prefill.address,
                         mode="pull", bind="tcp://127.0.0.1:0", transport_options={"faults": stall}) as decode:
        a, b = GenerateClient(decode.address, SECRET), GenerateClient(decode.address, SECRET)
        try:
            assert a.name != b.name
            rid = a.submit(np.arange(1, 20), 8)                 # stalls: the pull never completes
            assert b.submit(np.arange(1, 20), 8) == rid         # same request id, other client: both run
            b.cancel(rid)                                       # cancels b's request only
            res = b.recv(10)
            assert res.request_id == rid and "RequestCancelled" in (res.error or "")
            assert decode.status()["cancelled"] == 1
            a.cancel(rid)
            res = a.recv(10)
            assert res.request_id == rid and "RequestCancelled" in (res.error or "")
            assert decode.status()["cancelled"] == 2
        finally:
            a.close()
            b.close()
        c, d = GenerateClient(decode.address, SECRET, name="twin"), GenerateClient(decode.address, SECRET, name="twin")
        try:                                                    # even under one name, a cancel is per connection
            rid = c.submit(np.arange(1, 20), 8)
            d.cancel(rid)
            assert d.status()["cancelled"] == 2                 # answered after the cancel on d's connection
            c.cancel(rid)
            assert "RequestCancelled" in (c.recv(10).error or "")
        finally:
            c.close()
            d.close()
