"""WorkerHealth: whether a worker can serve, and why not; the worker sets it, ``/health`` reports it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class HealthState:
    """One reading: ``healthy``, and the reason when not (empty when healthy)."""

    healthy: bool
    reason: str = ""


class WorkerHealth:
    """Thread-safe healthy/unhealthy flag with a reason, settable by the worker (e.g. when its engine
    thread dies) and read by the health endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = HealthState(True)

    def set_healthy(self) -> None:
        """The worker can serve again."""
        with self._lock:
            self._state = HealthState(True)

    def set_unhealthy(self, reason: str) -> None:
        """The worker cannot serve: ``reason`` says why (shown by ``/health``)."""
        with self._lock:
            self._state = HealthState(False, reason or "unhealthy (no reason given)")

    def state(self) -> HealthState:
        """The current reading."""
        with self._lock:
            return self._state


class HealthSource(Protocol):
    """What ``/health``, metrics and the KV event pump need of a worker's health: a reading, and a way
    to report a failure of their own. ``WorkerHealth`` and a worker's ``Engine`` provide it."""

    def state(self) -> HealthState:
        """The current reading."""
        ...

    def set_unhealthy(self, reason: str) -> None:
        """The worker cannot serve: ``reason`` says why."""
        ...
