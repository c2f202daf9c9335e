"""The soak benchmark (``benchmarks/soak.py``): a short run in ``make test`` and the full 1,000-request run
(marker ``soak``), both asserting the JSON's invariants; and a defect the soak found (decode's engine
stalling on serial reconnect attempts while its prefill does not answer)."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import pathlib
import socket
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from kvxfer.cli.serve import best_backend
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import BackendUnavailable, PeerUnreachable, RequestCancelled
from tests.e2e.test_loopback import (
    KV,
    NEW,
    _one_thread,  # noqa: F401 (autouse leak check)
    assert_matches_reference,
)

SECRET = "soak-test-secret-0123456789abcdef"
_names = itertools.count()
EXPECTED_REASONS = {
    "PeerUnreachable: prefill lost",
    "PeerUnreachable: no prefill worker connected",
    "TransferTimeout: KV did not arrive within the deadline (no answer)",
    "TransferTimeout: KV did not arrive within the deadline (notifications missing)",
    "TransferTimeout: KV did not arrive within the deadline (read did not complete)",
    "TransferTimeout: KV did not arrive within the deadline (layer groups arrived, no kv_pushed)",
    "TransferTimeout: deadline passed in decode's queue (not sent)",
    "TransferFailed: peer disconnected during the transfer",
}
"""Failures a prefill kill or freeze may cause; anything else is a finding."""


def load_soak() -> ModuleType:
    """The soak benchmark (``benchmarks/soak.py``), imported when a test first needs it."""
    return importlib.import_module("benchmarks.soak")


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    try:
        best_backend()
    except BackendUnavailable as exc:
        pytest.skip(f"needs a UCX transport: {exc}")
    yield load_soak()


def check_invariants(s: dict[str, Any], requests: int, faults: int) -> None:
    """What every soak run must show, whatever the machine's load."""
    assert s["submitted"] == requests, "the run stopped at --max-seconds before submitting everything"
    assert s["completed"] + s["cancelled"] + s["failed"] == s["submitted"]
    assert s["hung"] == 0, "a request never got an answer"
    assert s["mismatches"] == 0, s["mismatch_examples"]
    assert s["kv_checked"] == s["completed"] and s["kv_mismatches"] == 0 and s["kv_max_error"] <= s["kv_tolerance"]
    assert all(r["new"] >= 8 for r in s["rows"])
    assert s["leaked"] == 0, s["leaks"]
    assert not s["engine_error"]
    assert s["completed"] > 0 and s["cancelled"] > 0
    assert set(s["failed_by_reason"]) <= EXPECTED_REASONS, s["failed_by_reason"]
    assert sum(s["failed_by_reason"].values()) == s["failed"]
    assert s["failed_outside_fault_windows"] == 0, [r for r in s["rows"] if r["outcome"] == "failed"]
    assert [(f["request_index"], f["kind"]) for f in s["faults"]] == \
        [(f["request_index"], f["kind"]) for f in s["faults_scheduled"]]
    assert sorted(f["kind"] for f in s["faults"]) == sorted(["kill", "stop"] * (faults // 2) + ["kill"] * (faults % 2))
    assert s["prefill_processes"] == 1 + sum(f["kind"] == "kill" for f in s["faults"])
    assert s["decode_peak_rss_mib"] > 0 and s["prefill_peak_rss_mib"] > 0
    assert 0 < s["latency_ms"]["p50"] <= s["latency_ms"]["p90"] <= s["latency_ms"]["p99"] <= s["latency_ms"]["max"]
    assert s["reused_tokens"]["decode"] > 0 and s["reused_tokens"]["prefill"] > 0
    assert {r["mode"] for r in s["rows"]} == {"push", "pull", "push+lw"}


def test_short_soak_with_a_kill_a_freeze_and_cancellations(soak: ModuleType, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(["--requests", "40", "--faults", "2", "--cancel-rate", "0.25", "--max-prompt", "512",
                    "--deadline", "4", "--lease", "6", "--max-seconds", "90", "--rss-mark", "10",
                    "--out", str(out)])
    s = json.loads(out.read_text())
    check_invariants(s, 40, 2)
    assert rc == 0
    assert s["cancel"]["sent_in_flight"] == s["cancelled"]
    stop = next(f for f in s["faults"] if f["kind"] == "stop")
    assert stop["end_t_s"] - stop["t_s"] == pytest.approx(stop["frozen_s"], abs=2.0), "the freeze was stretched"


@pytest.mark.soak
def test_full_soak(soak: ModuleType, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(["--requests", "1000", "--out", str(out)])
    s = json.loads(out.read_text())
    check_invariants(s, 1000, 3)
    assert rc == 0
    assert set(s["modes"]) == {"push", "pull", "push layer-wise"}, "every mode must have completed requests"


def test_requests_and_fault_schedule_are_seeded() -> None:
    soak = load_soak()
    a = soak.make_requests(200, 3, 8, 2048, 16, 0.1, 512)
    assert a == soak.make_requests(200, 3, 8, 2048, 16, 0.1, 512)
    assert a != soak.make_requests(200, 4, 8, 2048, 16, 0.1, 512)
    assert all(8 <= len(r.tokens) <= 2048 and 8 <= r.max_new_tokens <= 16 for r in a)
    assert {(r.mode, r.layerwise) for r in a} == set(soak.MODES)
    assert sum(r.family >= 0 for r in a) > 50 and sum(r.cancel_after is not None for r in a) > 5
    assert soak.fault_schedule(1000, 3, 0) == soak.fault_schedule(1000, 3, 0)
    assert [k for _, k in soak.fault_schedule(1000, 3, 0)] == ["kill", "stop", "kill"]
    assert all(100 <= i < 900 for i, _ in soak.fault_schedule(1000, 3, 0))


def test_reasons_group_failures_by_cause() -> None:
    soak = load_soak()
    assert soak.normalise_reason(PeerUnreachable("prefill 'prefill-41' lost: silent for 1.5 s")) == \
        "PeerUnreachable: prefill lost"
    assert soak.normalise_reason(PeerUnreachable("who 'x-12' at 3.5")) == "PeerUnreachable: who '_' at N"


# --- a defect the soak found ----------------------------------------------------------------------------------
def _silent_listener(address: str) -> socket.socket:
    """A TCP listener on ``address`` that never answers: a prefill host that is up but frozen."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(64)
    return sock


@contextlib.contextmanager
def decode_that_lost_its_prefill(tokens: np.ndarray, connect_timeout: float) -> Iterator[tuple[DecodeWorker, str]]:
    """A decode worker that served ``tokens`` through a prefill which then shut down; yields the decode
    (knowing the prefill's address, now closed) and that address."""
    prefill = PrefillWorker(WorkerConfig(f"soak-prefill-{next(_names)}", num_blocks=64), SECRET)
    address = prefill.address
    cfg = WorkerConfig(f"soak-decode-{next(_names)}", num_blocks=64)
    with DecodeWorker(cfg, SECRET, prefill=address, connect_timeout=connect_timeout) as decode:
        assert_matches_reference(decode.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW)
        prefill.close()
        deadline = time.monotonic() + 10
        while decode.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not decode.connected
        yield decode, address


def test_submits_while_prefill_is_unresponsive_do_not_stall_decode() -> None:
    """Each request submitted while the prefill peer is lost used to retry the connection on decode's
    engine thread, one after the other, each blocking ``connect_timeout``: with 8 queued requests the
    engine (and ``cancel``/``status``) stalled 8 x connect_timeout. Reconnects now pause after a failure."""
    tokens = np.arange(40) % 512
    with decode_that_lost_its_prefill(tokens, connect_timeout=1.0) as (decode, address):
        silent = _silent_listener(address)
        try:
            t0 = time.monotonic()
            futures = [decode.submit(tokens, 3) for _ in range(8)]
            for fut in futures:
                with pytest.raises(PeerUnreachable, match="no prefill worker connected"):
                    fut.result(timeout=60)
            elapsed = time.monotonic() - t0
            assert elapsed < 4.0, f"8 requests took {elapsed:.1f} s to fail: reconnect attempts were serialised"
            assert decode.status()["jobs"] == 0
        finally:
            silent.close()
        with PrefillWorker(WorkerConfig(f"soak-prefill-{next(_names)}", num_blocks=64), SECRET,
                           bind=address) as again:   # restarted at the same address: decode reconnects by itself
            deadline = time.monotonic() + 30
            while True:
                try:
                    res = decode.generate(tokens, NEW, timeout=60, return_kv=KV)
                    break
                except PeerUnreachable:
                    assert time.monotonic() < deadline, "decode never reconnected to the restarted prefill"
                    time.sleep(0.2)
            assert_matches_reference(res, tokens, NEW)
            assert decode.held_slots() == 0 and again.held_slots() == 0


def test_reconnect_runs_beside_the_engine_and_waiting_requests_follow_it() -> None:
    """While decode retries a silent prefill address, its engine still answers ``status`` and ``cancel``
    at once (the attempts run on a thread of their own); requests submitted during an attempt fail with
    its reason. Once a prefill listens there again, decode finds it by itself (attempts follow each other
    0.2 s apart, ZeroMQ retries the TCP connection every 0.1 s within one), without waiting for a request."""
    tokens = np.arange(30) % 512
    with decode_that_lost_its_prefill(tokens, connect_timeout=1.5) as (decode, address):
        silent = _silent_listener(address)
        try:
            t0 = time.monotonic()
            futures = [decode.submit(tokens, 3, request_id=f"w{i}") for i in range(3)]
            status = decode.status()
            cancelled = decode.cancel("w0", "changed my mind")
            assert time.monotonic() - t0 < 1.0, "status/cancel waited for the reconnect attempt"
            # Waiting for the first attempt since the loss, or failed at once after it failed.
            assert status["jobs"] in (0, 3) and status["held_slots"] == 0, status
            if cancelled:
                with pytest.raises(RequestCancelled, match="changed my mind"):
                    futures[0].result(timeout=10)
            for fut in futures[int(cancelled):]:
                with pytest.raises(PeerUnreachable, match="no prefill worker connected; reconnecting failed: "
                                                          "ControlTimeout"):
                    fut.result(timeout=30)
            assert time.monotonic() - t0 < 1.5 + 3.0
            with pytest.raises(PeerUnreachable, match="reconnecting failed"):   # at once, while attempts go on
                decode.generate(tokens, 3, timeout=10)
            assert decode.status()["jobs"] == 0
        finally:
            silent.close()
        with PrefillWorker(WorkerConfig(f"soak-prefill-{next(_names)}", num_blocks=64), SECRET,
                           bind=address) as again:
            deadline = time.monotonic() + 10
            while not decode.connected:   # no request needed: the reconnect loop finds it
                assert time.monotonic() < deadline, "decode never reconnected to the restarted prefill"
                time.sleep(0.01)
            res = decode.generate(tokens, NEW, timeout=60, return_kv=KV)
            assert_matches_reference(res, tokens, NEW)
            assert decode.connected
            assert decode.held_slots() == 0 and again.held_slots() == 0
