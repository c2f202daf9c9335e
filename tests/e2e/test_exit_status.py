"""Exit statuses of real processes that load NIXL: a bare agent, ``kvxfer bench transport --backend nixl``
and ``kvxfer serve prefill|decode`` stopped by SIGTERM or SIGINT after serving requests.

On a host with the RDMA user libraries (``libibverbs1``; ``make test`` installs them when root) a process
that loaded NIXL's UCX EFA module crashed in a library destructor at exit (status 139) after doing its
work correctly; these cases run each process to its end and assert the status it meant to return.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.cli.demo import WorkerProcess
from kvxfer.disagg.worker_client import GenerateClient
from kvxfer.transport.nixl import nixl_unavailable_reason
from tests.e2e.test_loopback import KV, NEW, assert_matches_reference, prompts

pytestmark = [pytest.mark.ucx,
              pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason()))]
SECRET = "exit-status-secret-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """This checkout first on the path, one torch thread, the test secret."""
    return {**os.environ, "KVXFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


BARE_AGENT = """
from kvxfer.transport.ucx_env import load_nixl_api
api = load_nixl_api()
agent = api.nixl_agent("bare-exit", api.nixl_agent_config(enable_prog_thread=True, backends=[]))
agent.create_backend("UCX", {})
maps = open("/proc/self/maps").read().splitlines()
print(len({line.split()[-1] for line in maps if "libnl-route-3" in line}))
"""


def test_bare_nixl_agent_exits_zero_with_one_libnl_route() -> None:
    """An agent with a UCX backend, left to interpreter teardown: exit 0, and the process maps at most one
    copy of libnl-route (two copies are what crashes the teardown)."""
    out = subprocess.run([sys.executable, "-c", BARE_AGENT], env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"status {out.returncode}: {out.stderr[-2000:]}"
    assert int(out.stdout.strip().splitlines()[-1]) <= 1, out.stdout


def test_bench_transport_nixl_exits_zero_with_verified_json() -> None:
    """``kvxfer bench transport --backend nixl --json``: a verified result on stdout and exit 0."""
    out = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "transport", "--backend", "nixl", "--pages", "16",
                          "--iters", "2", "--json"], env=_env(), capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, f"status {out.returncode}: {out.stderr[-2000:]}"
    result = json.loads(out.stdout)
    assert result["verified"] is True, result


def _stop(worker: WorkerProcess, sig: signal.Signals) -> int:
    """Send ``sig`` and return the exit status (the test fails if the worker does not exit in time)."""
    worker.proc.send_signal(sig)
    try:
        return worker.proc.wait(60)
    except subprocess.TimeoutExpired:
        worker.proc.kill()
        worker.proc.wait(10)
        raise AssertionError(f"{worker.proc.args} did not exit within 60 s of {sig.name}") from None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_workers_exit_zero_on_signal_after_serving(sig: signal.Signals) -> None:
    """``kvxfer serve prefill`` and ``serve decode`` over NIXL serve exact requests, then each exits 0 on
    ``sig`` (decode first, then prefill), after saying it drains and that it stopped."""
    prefill = WorkerProcess(["prefill", "--backend", "nixl", "--name", f"exit-prefill-{sig.name}"], _env(), 120.0)
    decode: WorkerProcess | None = None
    try:
        decode = WorkerProcess(["decode", "--backend", "nixl", "--name", f"exit-decode-{sig.name}",
                                "--prefill", prefill.address], _env(), 120.0)
        client = GenerateClient(decode.address, SECRET, timeout=30.0)
        try:
            for tokens in prompts(31, count=2):
                assert_matches_reference(client.generate(tokens, NEW, timeout=120, return_kv=KV), tokens, NEW)
        finally:
            client.close()
        for worker in (decode, prefill):
            status = _stop(worker, sig)
            assert status == 0, f"{worker.proc.args[4:6]} exited {status}: {''.join(worker.stderr[-20:])}"
            assert any(f"{sig.name}: draining" in line for line in worker.stderr), worker.stderr[-5:]
            assert any(line.rstrip().endswith(": stopped") for line in worker.stderr), worker.stderr[-5:]
    finally:
        for w in (decode, prefill):
            if w is not None:
                w.stop()
