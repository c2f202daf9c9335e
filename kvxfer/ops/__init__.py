"""Operating a worker: logging set-up, Prometheus metrics, an HTTP ``/metrics`` + ``/health`` server.

This layer sits above ``kvxfer.disagg`` (it reads a worker's public status) and below ``kvxfer.cli``,
which wires it into ``kvxfer serve`` (docs/operations.md).
"""

from kvxfer.ops.http import OpsServer
from kvxfer.ops.logs import configure_logging
from kvxfer.ops.metrics import WorkerMetrics

__all__ = ["OpsServer", "WorkerMetrics", "configure_logging"]
