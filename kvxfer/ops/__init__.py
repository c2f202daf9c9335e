"""Operating a worker: logging set-up (``ops.logs``), Prometheus metrics (``ops.metrics``), an HTTP
``/metrics`` + ``/health`` + ``/status`` server (``ops.http``) and the KV event pump (``ops.events``).

This layer sits above ``kvxfer.disagg`` (it reads a worker's public status) and below ``kvxfer.cli``,
which wires it into ``kvxfer serve`` (docs/operations.md). Nothing is imported here, so that
configuring logging does not load torch.
"""
