"""The one list of transport backends: their names, what each can do, why one cannot run here, and how
to build one. ``create``, ``available_backends`` and every command-line ``--backend`` read it.

A backend's binding is imported only when one is built (or when its availability check needs it), so
listing backends never loads both UCX bindings into one process.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvxfer.errors import BackendUnavailable, ConfigError
from kvxfer.transport.base import Transport


def _loopback_reason() -> str | None:
    return None


def _nixl_reason() -> str | None:
    from kvxfer.transport.nixl import nixl_unavailable_reason
    return nixl_unavailable_reason()


def _ucx_reason() -> str | None:
    from kvxfer.transport.ucx import ucx_unavailable_reason
    return ucx_unavailable_reason()


def _cuda_ipc_reason() -> str | None:
    from kvxfer.transport.cuda_ipc import cuda_ipc_unavailable_reason
    return cuda_ipc_unavailable_reason()


@dataclass(frozen=True)
class BackendSpec:
    """One transport backend: ``name`` (what ``--backend`` and ``create`` take), where its class lives,
    whether it moves bytes between processes, whether it needs CUDA memory, and its availability check."""

    name: str
    module: str
    class_name: str
    cross_process: bool
    cuda_only: bool
    summary: str
    unavailable_reason: Callable[[], str | None]

    def load(self) -> type[Transport]:
        """The backend's Transport class (imports its binding)."""
        cls = getattr(importlib.import_module(self.module), self.class_name)
        if not (isinstance(cls, type) and issubclass(cls, Transport)):
            raise ConfigError(f"backend {self.name!r}: {self.module}.{self.class_name} is not a Transport")
        return cls


_SPECS = (
    BackendSpec("loopback", "kvxfer.transport.loopback", "LoopbackTransport", cross_process=False, cuda_only=False,
                summary="in-process copies between transports of one process (fault hooks)",
                unavailable_reason=_loopback_reason),
    BackendSpec("nixl", "kvxfer.transport.nixl", "NixlTransport", cross_process=True, cuda_only=False,
                summary="NIXL over UCX: one-sided READ/WRITE", unavailable_reason=_nixl_reason),
    BackendSpec("ucx", "kvxfer.transport.ucx", "UcxTransport", cross_process=True, cuda_only=False,
                summary="ucxx: one-sided RMA (two-sided tagged messages as fallback)", unavailable_reason=_ucx_reason),
    BackendSpec("cuda_ipc", "kvxfer.transport.cuda_ipc", "CudaIpcTransport", cross_process=True, cuda_only=True,
                summary="one node: IPC-mapped GPU pools, one batched copy kernel per plan",
                unavailable_reason=_cuda_ipc_reason),
)

#: Every backend by name, in the order listings show them.
REGISTRY: Mapping[str, BackendSpec] = MappingProxyType({s.name: s for s in _SPECS})
#: Backend names (``create`` accepts exactly these).
BACKENDS: tuple[str, ...] = tuple(REGISTRY)
#: What ``auto`` picks between processes, best first (cuda_ipc is chosen explicitly: it needs GPU pools).
AUTO_PREFERENCE: tuple[str, ...] = ("nixl", "ucx")


def backend_names(*, cross_process: bool | None = None) -> tuple[str, ...]:
    """Backend names, optionally only those that do (True) or do not (False) cross processes."""
    return tuple(s.name for s in _SPECS if cross_process is None or s.cross_process == cross_process)


def host_backends() -> tuple[str, ...]:
    """Backends that move host (CPU) memory: every one but the CUDA-only ones."""
    return tuple(s.name for s in _SPECS if not s.cuda_only)


def spec(name: str) -> BackendSpec:
    """The registry entry of ``name`` (ConfigError naming the known ones otherwise)."""
    found = REGISTRY.get(name)
    if found is None:
        raise ConfigError(f"unknown transport backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return found


def available_backends() -> dict[str, str | None]:
    """Backend name -> None when usable here, else the reason it is not (a backend's check imports only
    its own binding)."""
    return {s.name: s.unavailable_reason() for s in _SPECS}


def check_backend(name: str, *, device: str = "cpu", cross_process: bool = False) -> None:
    """Raise (ConfigError for an unknown name, BackendUnavailable otherwise) when ``name`` cannot serve
    pools on ``device`` here, or cannot cross processes when that is asked for."""
    entry = spec(name)
    if cross_process and not entry.cross_process:
        raise BackendUnavailable(f"backend {name!r} moves bytes only within one process; two processes need one "
                                 f"of {', '.join(backend_names(cross_process=True))}")
    if entry.cuda_only and not device.startswith("cuda"):
        raise BackendUnavailable(f"backend {name!r} needs CUDA pools (--device cuda:N), got device {device!r}")
    reason = entry.unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {reason}")


def best_backend() -> str:
    """The best installed backend that crosses processes (``AUTO_PREFERENCE``); BackendUnavailable with
    every reason when none is."""
    reasons = available_backends()
    for name in AUTO_PREFERENCE:
        if reasons[name] is None:
            return name
    raise BackendUnavailable("no UCX transport is installed (" + "; ".join(f"{n}: {reasons[n]}" for n in AUTO_PREFERENCE)
                             + "); loopback cannot cross processes, so two worker processes cannot talk")


def create(backend: str, name: str, **options: Any) -> Transport:
    """A new transport of ``backend`` (one of ``BACKENDS``) named ``name`` (its peers use it)."""
    return spec(backend).load()(name, **options)
