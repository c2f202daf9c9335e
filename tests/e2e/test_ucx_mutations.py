"""Every pairing mutation (``tests/support/faulty_planner.py``) through real workers over UCX (NIXL, else ucxx, on
127.0.0.1): one prefill process that mutates the requests whose id names a mutation (the test plugin
``tests/support/plugins/faulty_planner``), and a TP 1 -> 2
decode (8 tokens/block, NHD) in this process per checksum setting, in push, pull and layer-wise. The KV
oracle must catch each, ``--checksum full`` must refuse each, the unmutated requests pass both. The
workers live for the whole module (no per-test leak check here: tests/e2e/test_ucx.py has those)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
import torch

from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.errors import BackendUnavailable
from kvxfer.transport.integrity import ChecksumPolicy
from tests.disagg.test_mutations import run_mutation_case
from tests.e2e.test_ucx import SECRET, faulty_planner_env, spawn_prefill
from tests.support.faulty_planner import MUTATIONS, PER_REQUEST, FaultyPlanner

pytestmark = pytest.mark.ucx
_names = itertools.count()


@pytest.fixture(scope="module")
def backend() -> str:
    try:
        return best_backend()
    except BackendUnavailable as exc:
        pytest.skip(f"needs a UCX transport: {exc}")


@pytest.fixture(scope="module")
def mutating_prefill(backend: str) -> Iterator[WorkerProcess]:
    """A prefill process that applies the mutation a request's id names (``mutate=NAME``)."""
    torch.set_num_threads(1)
    proc = spawn_prefill(backend, env_extra=faulty_planner_env(PER_REQUEST))
    try:
        yield proc
    finally:
        proc.stop()


_ucx_decodes: dict[str, DecodeWorker] = {}


@pytest.fixture(scope="module")
def decodes() -> Iterator[dict[str, DecodeWorker]]:
    try:
        yield _ucx_decodes
    finally:
        for d in _ucx_decodes.values():
            d.close()
        _ucx_decodes.clear()


def _ucx_cases() -> list[object]:
    out: list[object] = []
    for checksum in ("off", "full"):
        for mode in ("push", "pull", "layerwise"):
            for mutation in (None, *MUTATIONS):
                out.append(pytest.param(checksum, mode, mutation,
                                        id=f"checksum_{checksum}-{mode}-{mutation or 'none'}"))
    return out


@pytest.mark.parametrize(("checksum", "mode", "mutation"), _ucx_cases())
def test_every_mutation_is_caught_over_ucx(backend: str, mutating_prefill: WorkerProcess,
                                           decodes: dict[str, DecodeWorker], checksum: str, mode: str,
                                           mutation: str | None) -> None:
    """One prefill process, a TP 1 -> 2 decode (8 tokens/block, NHD) per checksum setting in this process."""
    if checksum not in decodes:
        cfg = WorkerConfig(f"ucx-mut-decode-{checksum}-{os.getpid()}-{next(_names)}", backend=backend,
                           tokens_per_block=8, head_order="NHD", tp_size=2,
                           checksum=ChecksumPolicy() if checksum == "full" else None,
                           planner=FaultyPlanner(PER_REQUEST))   # pull plans are built here
        decodes[checksum] = DecodeWorker(cfg, SECRET, prefill=mutating_prefill.address)
    decode = decodes[checksum]
    run_mutation_case(decode, f"u{next(_names)}", f"ucx-{checksum}-{mode}-{mutation}", checksum, mode, mutation)
