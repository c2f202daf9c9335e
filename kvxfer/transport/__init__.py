"""Transports: move the bytes of a TransferPlan between registered memory regions (DESIGN.md).

``create(backend, name, **options)`` builds one; ``available_backends()`` says which can run here.
Optional backends import their binding lazily, on first use, after UCX defaults are applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvxfer.errors import BackendUnavailable, ConfigError
from kvxfer.transport.base import Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.loopback import LoopbackFaults, LoopbackTransport
from kvxfer.transport.metadata import TransportMetadata

BACKENDS = ("loopback", "nixl", "ucx", "cuda_ipc")


def _nixl_reason() -> str | None:
    from kvxfer.transport.nixl import nixl_unavailable_reason
    return nixl_unavailable_reason()


def _ucx_reason() -> str | None:
    from kvxfer.transport.ucx import ucx_unavailable_reason
    return ucx_unavailable_reason()


def _cuda_ipc_reason() -> str | None:
    from kvxfer.transport.cuda_ipc import cuda_ipc_unavailable_reason
    return cuda_ipc_unavailable_reason()


_REASONS: dict[str, Callable[[], str | None]] = {
    "loopback": lambda: None,
    "nixl": _nixl_reason,
    "ucx": _ucx_reason,
    "cuda_ipc": _cuda_ipc_reason,
}


def available_backends() -> dict[str, str | None]:
    """Backend name -> None when usable here, else the reason it is not (without importing both
    UCX bindings into one process: a backend's check imports only its own binding)."""
    return {name: reason() for name, reason in _REASONS.items()}


def create(backend: str, name: str, **options: Any) -> Transport:
    """A new transport of ``backend`` ("loopback" | "nixl" | "ucx" | "cuda_ipc") named ``name`` (its peers use it)."""
    if backend == "loopback":
        return LoopbackTransport(name, **options)
    if backend == "nixl":
        from kvxfer.transport.nixl import NixlTransport
        return NixlTransport(name, **options)
    if backend == "ucx":
        from kvxfer.transport.ucx import UcxTransport
        return UcxTransport(name, **options)
    if backend == "cuda_ipc":
        from kvxfer.transport.cuda_ipc import CudaIpcTransport
        return CudaIpcTransport(name, **options)
    if backend in _REASONS:
        raise BackendUnavailable(f"transport backend {backend!r} has no implementation")
    raise ConfigError(f"unknown transport backend {backend!r}; expected one of {BACKENDS}")


__all__ = [
    "BACKENDS",
    "LoopbackFaults",
    "LoopbackTransport",
    "TransferHandle",
    "TransferStatus",
    "Transport",
    "TransportMetadata",
    "available_backends",
    "create",
]
