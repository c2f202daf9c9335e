"""Operating a worker: ``kvxfer serve --metrics-port --kv-events`` scraped over HTTP and subscribed over
ZeroMQ, ``/health`` driven by WorkerHealth, the read-only ``/status``, metrics fed by decode results."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.cli import main as cli_main
from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.health import WorkerHealth
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.errors import BackendUnavailable, PeerUnreachable
from kvxfer.ops.http import OpsServer
from kvxfer.ops.metrics import WorkerMetrics
from tests.cache.test_events import VLLM, replay_all
from tests.support.reuse_support import make_manager, prefill

SECRET = "cli-ops-secret-0123456789abcdef"
_names = itertools.count()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, keyed by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class StubWorker:
    """A worker's observable surface over a real cache manager."""

    def __init__(self, status: dict[str, Any] | None = None) -> None:
        self.managers = [make_manager(8)]
        self._status = status or {"role": "decode", "name": "d", "held_slots": 0, "open_caches": 0, "jobs": 0,
                                  "requests": 3, "completed": 2, "failed": 1, "cancelled": 0,
                                  "integrity_failures": 1, "bad_notices": 4, "peer_losses": 2}
        self.fail: Exception | None = None

    def status(self) -> dict[str, Any]:
        if self.fail is not None:
            raise self.fail
        return dict(self._status)


def test_metrics_health_and_public_status_over_http() -> None:
    worker, health = StubWorker(), WorkerHealth()
    prefill(worker.managers[0], np.arange(9))                # 2 tree blocks: evictable slots
    metrics = WorkerMetrics(worker, health)
    metrics.observe({"bytes_moved": 1 << 20, "transfer_s": 0.004, "ttft_s": 0.02, "reused_tokens_decode": 16,
                     "request_s": 0.001, "queued_s": 0.0005, "prefill_s": 0.01, "post_s": 0.0005, "verify_s": 0.0,
                     "commit_s": 0.002, "messages_s": 0.002, "allocate_s": 0.003})
    metrics.observe({"bytes_moved": 1 << 21, "transfer_s": 0.008, "ttft_s": 0.03, "reused_tokens_decode": 0})
    server = OpsServer(worker, metrics, health, 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        code, text = get(base + "/metrics")
        assert code == 200
        got = samples(text)
        assert got[("kvxfer_requests_total", (("outcome", "completed"), ("role", "decode")))] == 2
        assert got[("kvxfer_requests_total", (("outcome", "failed"), ("role", "decode")))] == 1
        assert got[("kvxfer_integrity_failures_total", (("role", "decode"),))] == 1
        assert got[("kvxfer_bad_notices_total", (("role", "decode"),))] == 4
        assert got[("kvxfer_peer_losses_total", (("role", "decode"),))] == 2
        assert got[("kvxfer_transfer_size_bytes_count", ())] == 2
        assert got[("kvxfer_transfer_size_bytes_sum", ())] == 3 << 20
        assert got[("kvxfer_transfer_seconds_bucket", (("le", "0.005"),))] == 1
        assert got[("kvxfer_ttft_seconds_count", ())] == 2
        stage = {dict(k[1])["stage"]: v for k, v in got.items() if k[0] == "kvxfer_ttft_stage_seconds_sum"}
        assert stage == pytest.approx({"request": 0.001, "queued": 0.0005, "prefill": 0.01, "post": 0.0005,
                                       "transfer": 0.012, "verify": 0.0, "commit": 0.002, "messages": 0.002,
                                       "allocate": 0.003})
        assert got[("kvxfer_reuse_hits_total", ())] == 1 and got[("kvxfer_decode_reused_tokens_total", ())] == 16
        slot = {k[1]: v for k, v in got.items() if k[0] == "kvxfer_slots"}
        primary = (("pool_group", "0"), ("rank", "0"), ("state", "{}"), ("tier", "primary"))
        assert {s: slot[tuple((k, v.format(s) if k == "state" else v) for k, v in primary)]
                for s in ("free", "evictable", "request_only", "shared")} == {
            "free": 6, "evictable": 2, "request_only": 0, "shared": 0}
        assert got[("kvxfer_healthy", ())] == 1 and got[("kvxfer_status_ok", ())] == 1

        assert get(base + "/health") == (200, json.dumps({"status": "ok"}))
        health.set_unhealthy("engine thread died: boom")
        code, body = get(base + "/health")
        assert code == 503 and json.loads(body) == {"status": "unhealthy", "reason": "engine thread died: boom"}
        assert samples(get(base + "/metrics")[1])[("kvxfer_healthy", ())] == 0
        health.set_healthy()
        assert get(base + "/health")[0] == 200

        code, body = get(base + "/status")
        status = json.loads(body)
        assert code == 200 and status["healthy"] is True and status["completed"] == 2
        worker._status["secret_thing"] = "request r1 of client-7"
        assert "secret_thing" not in json.loads(get(base + "/status")[1])   # only the public keys

        worker.fail = PeerUnreachable("engine gone")                         # a worker that cannot answer
        got = samples(get(base + "/metrics")[1])
        assert got[("kvxfer_status_ok", ())] == 0
        assert not any(k[0] == "kvxfer_requests_total" for k in got)
        assert get(base + "/nope")[0] == 404
    finally:
        server.close()


def test_a_failing_observer_cannot_be_mistaken_for_counts() -> None:
    """Mutation check: the histogram counts what was observed, not the worker's request counter."""
    worker, health = StubWorker(), WorkerHealth()
    metrics = WorkerMetrics(worker, health)
    metrics.observe({"bytes_moved": 10, "transfer_s": 0.1, "ttft_s": 0.1})
    from prometheus_client import generate_latest
    got = samples(generate_latest(metrics.registry).decode())
    assert got[("kvxfer_transfer_size_bytes_count", ())] == 1
    assert got[("kvxfer_requests_total", (("outcome", "completed"), ("role", "decode")))] == 2


@pytest.fixture(scope="module")
def backend() -> str:
    try:
        return best_backend()
    except BackendUnavailable as exc:
        pytest.skip(f"needs a UCX transport: {exc}")


def _line(proc: WorkerProcess, marker: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for text in list(proc.stderr):
            if marker in text:
                return text
        time.sleep(0.02)
    raise AssertionError(f"no line with {marker!r}: {''.join(proc.stderr)[-2000:]}")


@pytest.mark.ucx
def test_serve_publishes_metrics_health_status_and_kv_events(backend: str, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvxfer serve prefill --metrics-port 0 --kv-events ...`` in its own process; a decode worker here
    sends one request; the scrape shows it, the events decode with vLLM's classes, ``kvxfer status`` works
    without the secret."""
    env = {**os.environ, "KVXFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = WorkerProcess(["prefill", "--backend", backend, "--name", f"ops-prefill-{os.getpid()}-{next(_names)}",
                          "--tokens-per-block", "8", "--metrics-port", "0", "--kv-events", "tcp://127.0.0.1:*",
                          "--kv-events-replay", "tcp://127.0.0.1:*"], env, 60.0)
    zctx = zmq.Context()
    try:
        metrics_url = _line(proc, "metrics on ").split("metrics on ", 1)[1].split()[0].removesuffix("/metrics")
        events_line = _line(proc, "KV events on ")
        replay = events_line.split("replay on ", 1)[1].split()[0]
        tokens = np.arange(1, 42)
        cfg = WorkerConfig(f"ops-decode-{os.getpid()}-{next(_names)}", backend=backend, tokens_per_block=8)
        with DecodeWorker(cfg, SECRET, prefill=proc.address, bind="tcp://127.0.0.1:0") as decode:
            seen: list[dict[str, Any]] = []
            decode.result_observers.append(lambda r: seen.append(r.stats()))
            assert len(decode.generate(tokens, 8, timeout=60).tokens) == 8
            assert len(seen) == 1 and seen[0]["bytes_moved"] > 0
            monkeypatch.setenv("KVXFER_SECRET", SECRET)
            capsys.readouterr()
            assert cli_main(["generate", "hello", "--decode", decode.address or "", "--max-new-tokens", "8",
                             "--json", "--timeout", "60"]) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["schema"] == "kvxfer.generate/1" and len(out["tokens"]) == 8
            assert out["ttft_ms"] > 0 and "ttft_s" not in out and "transfer_ms" in out
        code, text = get(metrics_url + "/metrics")
        got = samples(text)
        assert code == 200
        assert got[("kvxfer_requests_total", (("outcome", "completed"), ("role", "prefill")))] == 2   # the two requests above
        assert got[("kvxfer_sent_bytes_total", (("role", "prefill"),))] > 0
        assert get(metrics_url + "/health")[0] == 200
        deadline = time.monotonic() + 10
        batches: list[tuple[int, bytes]] = []
        while not batches and time.monotonic() < deadline:     # the pump publishes every 50 ms
            batches = replay_all(replay, zctx)
        stored = [e for _, p in batches for e in msgspec.msgpack.decode(p, type=VLLM.ReleaseKVEventBatch).events
                  if isinstance(e, VLLM.BlockStored)]
        assert stored and stored[0].token_ids == list(range(1, 41)) and stored[0].block_size == 8
        assert cli_main(["status", metrics_url, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["schema"] == "kvxfer.status/1" and status["status"]["completed"] == 2
    finally:
        zctx.term()
        proc.stop()


def test_status_without_secret_names_both_ways(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVXFER_SECRET", raising=False)
    monkeypatch.delenv("KVXFER_SECRET_FILE", raising=False)
    assert cli_main(["status", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--secret-file" in err and "$KVXFER_SECRET" in err


def test_clean_disconnects_are_debug_not_warnings(caplog: pytest.LogCaptureFixture) -> None:
    from kvxfer.disagg.worker_client import query_status
    from kvxfer.disagg.worker_prefill import PrefillWorker
    caplog.set_level(logging.DEBUG, logger="kvxfer")
    with PrefillWorker(WorkerConfig(f"ops-quiet-{os.getpid()}-{next(_names)}"), SECRET) as prefill:
        for _ in range(2):                        # status clients connect, ask and say goodbye
            assert query_status(prefill.address, SECRET)["role"] == "prefill"
    ended = [r for r in caplog.records if "connection to" in r.getMessage() and "ended" in r.getMessage()]
    assert ended and all(r.levelno == logging.DEBUG for r in ended), [(r.levelname, r.getMessage()) for r in ended]


def test_event_pump_failure_marks_the_worker_unhealthy() -> None:
    from kvxfer.cache import KVEventPublisher
    from kvxfer.errors import KVCacheError
    from kvxfer.ops.events import EventPump

    class BrokenSource:
        def drain_events(self) -> list[Any]:
            raise KVCacheError("manager shut down")

    health = WorkerHealth()
    zctx = zmq.Context()
    pump = EventPump(KVEventPublisher("tcp://127.0.0.1:*", zmq_context=zctx), BrokenSource(), health, 0.01)
    try:
        deadline = time.monotonic() + 10
        while health.state().healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        state = health.state()
        assert not state.healthy and "manager shut down" in state.reason
        assert isinstance(pump.error, KVCacheError)
    finally:
        pump.close()
        zctx.term()


def test_replay_ignores_malformed_requests_and_keeps_serving() -> None:
    from kvxfer.cache import AllCleared, KVEventPublisher
    from kvxfer.cache.event_publisher import END_SEQ
    zctx = zmq.Context()
    try:
        with KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", zmq_context=zctx) as pub:
            assert pub.publish([AllCleared()]) == 0 and pub.publish([AllCleared()]) == 1
            sock = zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pub.replay_endpoint or "")
            sock.send_multipart([b"", b"\x00\x01"])                  # not 8 bytes: ignored, no answer
            sock.send_multipart([b"", (1).to_bytes(8, "big")])
            assert sock.poll(5000)
            assert sock.recv_multipart()[1] == (1).to_bytes(8, "big")
            assert sock.poll(5000) and sock.recv_multipart()[1] == END_SEQ
            sock.close()
            assert pub.replay_error is None
    finally:
        zctx.term()
