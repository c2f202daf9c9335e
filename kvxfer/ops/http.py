"""One small HTTP server per worker, unauthenticated and read-only: ``GET /metrics`` (Prometheus text
format), ``GET /health`` (200 ``{"status": "ok"}`` or 503 ``{"status": "unhealthy", "reason": ...}``) and
``GET /status`` (the worker's counters and slot totals, ``PUBLIC_STATUS_KEYS`` only: no request ids,
prompts or peer names)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvxfer.disagg.health import HealthSource
from kvxfer.errors import ConfigError
from kvxfer.ops.metrics import ObservedWorker, WorkerMetrics

log = logging.getLogger(__name__)

#: What ``/status`` shows of a worker's ``status()``: its role and name, totals and counters.
PUBLIC_STATUS_KEYS = ("role", "name", "held_slots", "open_caches", "jobs", "connected", "peers", "requests",
                      "completed", "failed", "cancelled", "integrity_failures", "bad_notices", "peer_losses", "bytes_sent",
                      "reused_tokens", "failovers", "draining")


def public_status(worker: ObservedWorker, health: HealthSource) -> dict[str, object]:
    """The read-only status anyone who can reach the metrics port may see."""
    status = worker.status()
    state = health.state()
    return {"healthy": state.healthy, "reason": state.reason,
            **{k: status[k] for k in PUBLIC_STATUS_KEYS if k in status}}


class OpsServer:
    """Serves ``metrics`` and ``health`` on ``host:port`` (port 0: any free port; see ``port``) from a
    daemon thread until ``close``."""

    def __init__(self, worker: ObservedWorker, metrics: WorkerMetrics, health: HealthSource, port: int,
                 host: str = "127.0.0.1") -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be an int in [0, 65535], got {port!r}")
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("ops http: " + format, *args)

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self._httpd.daemon_threads = True
        self.worker = worker
        self.metrics = metrics
        self.health = health
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kvxfer-ops-http", daemon=True)
        self._thread.start()

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        """Answer one GET."""
        path = req.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(req, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                state = self.health.state()
                body = {"status": "ok"} if state.healthy else {"status": "unhealthy", "reason": state.reason}
                self._send(req, 200 if state.healthy else 503, json.dumps(body).encode(), "application/json")
            elif path == "/status":
                self._send(req, 200, json.dumps(public_status(self.worker, self.health)).encode(), "application/json")
            else:
                self._send(req, 404, b'{"error": "not found: try /metrics, /health or /status"}', "application/json")
        except Exception as exc:   # reported to the scraper and the log; the server keeps serving
            log.exception("ops http: %s failed", path)
            self._send(req, 500, json.dumps({"error": str(exc)}).encode(), "application/json")

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
        req.send_response(code)
        req.send_header("Content-Type", content_type)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def close(self) -> None:
        """Stop serving."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
