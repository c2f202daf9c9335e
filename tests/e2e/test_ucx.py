"""End to end across processes on 127.0.0.1 over the best installed UCX transport (nixl, else ucx): a
prefill process started with ``kvxfer serve prefill``, a decode worker in this process; a SIGKILLed
prefill fails the in-flight requests within the heartbeat deadline and decode serves on; ``kvxfer demo``;
a pairing bug tokens cannot see makes the demo exit non-zero (tests/e2e/test_ucx_mutations.py: every
mutation over UCX)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvxfer.cli.demo import TTFT_STAGES, WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.errors import BackendUnavailable, PeerUnreachable
from tests.e2e.test_loopback import (
    KV,
    NEW,
    _one_thread,  # noqa: F401 (autouse leak check)
    assert_matches_reference,
    prompts,
)
from tests.support.faulty_planner import PLUGIN_ENV

pytestmark = pytest.mark.ucx
SECRET = "e2e-ucx-secret-0123456789abcdef"
_names = itertools.count()


@pytest.fixture(scope="module")
def backend() -> str:
    try:
        return best_backend()
    except BackendUnavailable as exc:
        pytest.skip(f"needs a UCX transport: {exc}")



def faulty_planner_env(setting: str) -> dict[str, str]:
    """The environment of a process whose workers plan with ``tests/support/faulty_planner.py``'s ``setting``
    (through the test plugin ``tests/support/plugins/faulty_planner``, which Python imports at start-up)."""
    plugin = str(Path(__file__).resolve().parents[1] / "support" / "plugins" / "faulty_planner")
    return {PLUGIN_ENV: setting,
            "PYTHONPATH": os.pathsep.join([plugin, os.getcwd(), os.environ.get("PYTHONPATH", "")])}


def spawn_prefill(backend: str, *extra: str, env_extra: dict[str, str] | None = None) -> WorkerProcess:
    env = {**os.environ, "KVXFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]), **(env_extra or {})}
    return WorkerProcess(["prefill", "--backend", backend, "--name", f"ucx-prefill-{os.getpid()}-{next(_names)}",
                          *extra], env, 60.0)


@pytest.fixture
def prefill_process(backend: str) -> Iterator[WorkerProcess]:
    proc = spawn_prefill(backend)
    try:
        yield proc
    finally:
        proc.stop()


def test_push_pull_layerwise_prefix_hit_and_tp_across_processes(backend: str, prefill_process: WorkerProcess) -> None:
    cfg = WorkerConfig(f"ucx-decode-{os.getpid()}-{next(_names)}", backend=backend, tokens_per_block=8,
                       head_order="NHD", tp_size=2)
    with DecodeWorker(cfg, SECRET, prefill=prefill_process.address) as decode:
        cases = [("push", False), ("pull", False), ("push", True)]
        for (mode, layerwise), tokens in zip(cases, prompts(7, prefix=48, count=3), strict=True):
            res = decode.generate(tokens, NEW, timeout=60, mode=mode, layerwise=layerwise, return_kv=KV)
            assert_matches_reference(res, tokens, NEW)
            assert res.bytes_moved > 0
        assert res.reused_tokens_decode == 48     # the last two hit decode's prefix tree
        assert decode.held_slots() == 0 and decode.num_open_caches() == 0


def test_concurrent_connects_to_one_prefill_handshake_once(backend: str, prefill_process: WorkerProcess) -> None:
    """Connects racing each other (a caller and the automatic reconnect, as the soak found after a prefill
    restart) are serialised and the later ones find the connection made: two handshakes in flight
    presented the same transport metadata twice, which the prefill's NIXL agent refused, dropping the
    connection."""
    cfg = WorkerConfig(f"ucx-decode-{os.getpid()}-{next(_names)}", backend=backend)
    with DecodeWorker(cfg, SECRET) as decode:
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                decode.connect(prefill_process.address, timeout=30.0)
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=connect) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert decode.connected
        tokens = prompts(11, count=1)[0]
        assert_matches_reference(decode.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW)


def test_killed_prefill_fails_in_flight_requests_and_decode_serves_on(backend: str) -> None:
    first = spawn_prefill(backend)
    second: WorkerProcess | None = None
    lease = 1.0   # decode quarantines the lost prefill's push destinations for up to about two leases
    cfg = WorkerConfig(f"ucx-decode-{os.getpid()}-{next(_names)}", backend=backend, num_blocks=1024, deadline_s=60.0,
                       lease_s=lease)
    try:
        with DecodeWorker(cfg, SECRET, prefill=first.address) as decode:
            rng = np.random.default_rng(8)
            long_prompts = [rng.integers(0, 512, 3000) for _ in range(2)]
            futures = [decode.submit(p, 4) for p in long_prompts]
            time.sleep(0.3)                 # prefill is computing the first one
            t0 = time.monotonic()
            first.kill()
            for fut in futures:
                with pytest.raises(PeerUnreachable, match="lost"):
                    fut.result(timeout=30)
            detected = time.monotonic() - t0
            assert detected < 5.0, f"in-flight requests failed {detected:.1f} s after the kill"
            while decode.status()["zombies"] and time.monotonic() - t0 < detected + 2 * lease + 5.0:
                time.sleep(0.05)
            assert decode.held_slots() == 0 and decode.num_open_caches() == 0
            second = spawn_prefill(backend)
            decode.connect(second.address)
            tokens = prompts(9)[0]
            assert_matches_reference(decode.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW)
            assert decode.held_slots() == 0
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_demo_json_runs_two_processes_and_matches(backend: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--json", "--families", "2", "--per-family",
                           "2", "--max-new-tokens", str(NEW), "--mode", "pull", "--checksum", "full"], capture_output=True,
                          text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)                  # stdout holds the JSON object and nothing else
    assert {"schema", "requests", "mismatches", "transport", "mode", "bytes_moved", "reused_blocks_decode",
            "transfer_gb_per_s"} <= set(out)
    assert out["requests"] == 4 and out["mismatches"] == 0 and out["transport"] == backend and out["mode"] == "pull"
    assert out["kv_mismatches"] == 0 and all(row["kv_match"] and row["kv_compared"] > 0 for row in out["rows"])
    assert out["kv_max_error"] <= out["kv_tolerance"]
    assert out["worker_exit_statuses"] == {"decode": 0, "prefill": 0}   # both drained and exited on SIGTERM
    assert out["bytes_moved"] > 0 and out["reused_blocks_decode"] > 0
    assert out["checksum"] == "full" and all(row["verify_ms"] > 0 for row in out["rows"])   # every request checked
    for row in out["rows"]:   # the TTFT split names decode's stages; they add up to the KV's arrival <= TTFT
        split = row["ttft_split_ms"]
        assert tuple(split) == TTFT_STAGES and split["prefill"] > 0 and split["transfer"] > 0, split
        assert sum(split.values()) <= row["ttft_ms"] + 1.0, (split, row["ttft_ms"])


@pytest.mark.slow
def test_demo_exits_non_zero_on_a_block_swap_tokens_cannot_see(backend: str) -> None:
    env = {**os.environ, **faulty_planner_env("block_swap")}
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--json", "--families", "1", "--per-family",
                           "2"], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 1, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == 0 and out["kv_mismatches"] >= 1 and out["mismatches"] >= 1
    bad = [row for row in out["rows"] if not row["kv_match"]]
    assert all(row["kv_max_error"] > 100 * out["kv_tolerance"] for row in bad)

