"""Transports: move the bytes of a TransferPlan between registered regions (docs/architecture.md).

``create(backend, name, **options)`` builds one; ``available_backends()`` says which can run here;
both read the one backend list, ``kvxfer.transport.registry``.
Optional backends import their binding lazily, on first use, after UCX defaults are applied.
"""

from __future__ import annotations

from kvxfer.transport.base import Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.loopback import LoopbackFaults, LoopbackTransport
from kvxfer.transport.metadata import TransportMetadata
from kvxfer.transport.prepared import PreparedTransfer
from kvxfer.transport.registry import (
    BACKENDS,
    REGISTRY,
    BackendSpec,
    available_backends,
    backend_names,
    best_backend,
    check_backend,
    create,
)

__all__ = [
    "BACKENDS",
    "REGISTRY",
    "BackendSpec",
    "LoopbackFaults",
    "LoopbackTransport",
    "PreparedTransfer",
    "TransferHandle",
    "TransferStatus",
    "Transport",
    "TransportMetadata",
    "available_backends",
    "backend_names",
    "best_backend",
    "check_backend",
    "create",
]
