"""Per-request session state machine and the leases under which prefill holds source blocks.

States: INIT -> READY -> TRANSFERRING -> DONE | FAILED | CANCELLED. READY -> DONE is legal (every
block was a prefix hit on decode, nothing travels); FAILED and CANCELLED are reachable from every
non-terminal state; terminal states never change. Time comes from an injectable clock so that
lease expiry is tested without sleeping.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvxfer.errors import ConfigError, SessionError

Clock = Callable[[], float]


class SessionState(enum.Enum):
    """Where a request is in its transfer."""

    INIT = "init"
    READY = "ready"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for DONE, FAILED and CANCELLED."""
        return self in _TERMINAL


_TERMINAL = frozenset({SessionState.DONE, SessionState.FAILED, SessionState.CANCELLED})
LEGAL_TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.INIT: frozenset({SessionState.READY, SessionState.FAILED, SessionState.CANCELLED}),
    SessionState.READY: frozenset({SessionState.TRANSFERRING, SessionState.DONE, SessionState.FAILED,
                                   SessionState.CANCELLED}),
    SessionState.TRANSFERRING: frozenset({SessionState.DONE, SessionState.FAILED, SessionState.CANCELLED}),
    SessionState.DONE: frozenset(),
    SessionState.FAILED: frozenset(),
    SessionState.CANCELLED: frozenset(),
}


def _check_duration(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or value == float("inf"):
        raise ConfigError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class Lease:
    """A time-limited hold: valid until ``deadline`` unless renewed; once expired or released it stays so."""

    def __init__(self, duration: float, clock: Clock = time.monotonic) -> None:
        self.duration = _check_duration(duration, "Lease.duration")
        self._clock = clock
        self._deadline = clock() + self.duration
        self._released = False
        self._lock = threading.Lock()

    @property
    def deadline(self) -> float:
        """Clock time at which the lease expires."""
        return self._deadline

    @property
    def expired(self) -> bool:
        """True once the deadline has passed or the lease was released."""
        return self._released or self._clock() >= self._deadline

    def remaining(self) -> float:
        """Seconds left (0.0 when expired)."""
        return 0.0 if self._released else max(0.0, self._deadline - self._clock())

    def renew(self, duration: float | None = None) -> float:
        """Extend to ``now + duration`` (default: the original duration); returns the new deadline.

        Raises SessionError when the lease already expired: its blocks may be freed, it cannot revive.
        """
        extra = self.duration if duration is None else _check_duration(duration, "Lease.renew duration")
        with self._lock:
            now = self._clock()
            if self._released or now >= self._deadline:
                raise SessionError(f"lease expired at {self._deadline:.3f} (now {now:.3f}"
                                   f"{', released' if self._released else ''}); it cannot be renewed")
            self._deadline = max(self._deadline, now + extra)
            return self._deadline

    def release(self) -> None:
        """End the lease now (its holder is done with it)."""
        with self._lock:
            self._released = True

    def __repr__(self) -> str:
        return f"Lease(deadline={self._deadline:.3f}, remaining={self.remaining():.3f}, released={self._released})"


class LeaseTable:
    """Leases by key (e.g. request id), so a worker can renew them and collect the expired ones."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[Hashable, Lease] = {}
        self._lock = threading.Lock()

    def grant(self, key: Hashable, duration: float) -> Lease:
        """A new lease for ``key``; SessionError if ``key`` already holds one."""
        with self._lock:
            if key in self._leases:
                raise SessionError(f"lease for {key!r} already granted")
            lease = Lease(duration, self._clock)
            self._leases[key] = lease
            return lease

    def renew(self, key: Hashable, duration: float | None = None) -> float:
        """Renew ``key``'s lease; SessionError if there is none or it expired."""
        with self._lock:
            lease = self._leases.get(key)
        if lease is None:
            raise SessionError(f"no lease for {key!r} (never granted, released or already collected)")
        return lease.renew(duration)

    def release(self, key: Hashable) -> bool:
        """Drop ``key``'s lease; False when it holds none."""
        with self._lock:
            lease = self._leases.pop(key, None)
        if lease is None:
            return False
        lease.release()
        return True

    def pop_expired(self) -> list[Hashable]:
        """Remove and return the keys whose leases expired (their holders must free what they hold)."""
        with self._lock:
            gone = [k for k, lease in self._leases.items() if lease.expired]
            for k in gone:
                del self._leases[k]
        return gone

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live lease (None when there is none): when to look again."""
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, key: object) -> bool:
        return key in self._leases


@dataclass(frozen=True)
class Transition:
    """One recorded state change."""

    state: SessionState
    at: float
    reason: str


class Session:
    """One request's transfer: its state, the reason it ended, and an optional source-block lease."""

    def __init__(self, request_id: str, clock: Clock = time.monotonic, lease: Lease | None = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise SessionError(f"Session.request_id must be a non-empty string, got {request_id!r}")
        self.request_id = request_id
        self.lease = lease
        self._clock = clock
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._callbacks: list[Callable[[Session], None]] = []
        self.history: list[Transition] = [Transition(SessionState.INIT, clock(), "created")]

    @property
    def state(self) -> SessionState:
        """The current state."""
        return self.history[-1].state

    @property
    def reason(self) -> str:
        """Why the session entered its current state."""
        return self.history[-1].reason

    @property
    def terminal(self) -> bool:
        """True once DONE, FAILED or CANCELLED."""
        return self.state.terminal

    def transition(self, to: SessionState, reason: str = "") -> None:
        """Move to ``to``; SessionError naming both states when the state machine does not allow it."""
        with self._lock:
            current = self.state
            if to not in LEGAL_TRANSITIONS[current]:
                raise SessionError(f"session {self.request_id}: illegal transition {current.name} -> {to.name}"
                                   f"{f' ({reason})' if reason else ''}; current reason: {self.reason or '-'}")
            if to in (SessionState.FAILED, SessionState.CANCELLED) and not reason:
                raise SessionError(f"session {self.request_id}: {to.name} needs a reason")
            self.history.append(Transition(to, self._clock(), reason))
            callbacks = list(self._callbacks) if to.terminal else []
        if to.terminal:
            if self.lease is not None:
                self.lease.release()
            self._finished.set()
            for cb in callbacks:
                cb(self)

    def ready(self, reason: str = "destination blocks allocated") -> None:
        """INIT -> READY."""
        self.transition(SessionState.READY, reason)

    def start_transfer(self, reason: str = "transfer posted") -> None:
        """READY -> TRANSFERRING."""
        self.transition(SessionState.TRANSFERRING, reason)

    def done(self, reason: str = "complete") -> None:
        """READY | TRANSFERRING -> DONE."""
        self.transition(SessionState.DONE, reason)

    def fail(self, reason: str) -> None:
        """Any non-terminal state -> FAILED with ``reason``."""
        self.transition(SessionState.FAILED, reason)

    def cancel(self, reason: str = "cancelled by the client") -> None:
        """Any non-terminal state -> CANCELLED."""
        self.transition(SessionState.CANCELLED, reason)

    def fail_if_lease_expired(self) -> bool:
        """FAILED ("lease expired") when the lease ran out before the session ended; True if it did."""
        if self.lease is None or not self.lease.expired:
            return False
        with self._lock:
            if self.state.terminal:
                return False
        try:
            self.fail(f"lease expired at {self.lease.deadline:.3f}")
        except SessionError:   # ended concurrently
            return False
        return True

    def add_done_callback(self, callback: Callable[[Session], None]) -> None:
        """Call ``callback(session)`` once the session is terminal (at once if it already is)."""
        with self._lock:
            if not self.state.terminal:
                self._callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a terminal state; True if reached."""
        return self._finished.wait(timeout)

    def __repr__(self) -> str:
        return f"Session({self.request_id!r}, {self.state.name}, reason={self.reason!r})"
