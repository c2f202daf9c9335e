"""TransferHandle: the caller's view of one posted transfer (completion, timeout, cancellation)."""

from __future__ import annotations

import _thread
import enum
import threading
import time
from collections.abc import Callable

from kvxfer.errors import PeerUnreachable, TransferCancelled, TransferFailed, TransferTimeout, TransportError


class TransferStatus(enum.Enum):
    """Lifecycle of one transfer: PENDING until exactly one terminal state is reached."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not TransferStatus.PENDING


#: How long ``wait`` sleeps between polls of a backend that completes only when polled.
_POLL_INTERVAL_S = 20e-6
_POLL_INTERVAL_MAX_S = 1e-3


class _Mutex(_thread.RLock):  # type: ignore[misc]  # final in typeshed, subclassable in CPython
    """The lock of a handle whose completion is polled: the Condition interface ``TransferHandle`` uses,
    on the C lock itself (``with`` costs no Python frame). No thread sleeps on it, so ``notify_all`` has
    no one to wake, and ``wait`` (unused by the polling ``TransferHandle.wait``) returns after at most a
    millisecond, as a spurious wake-up of a condition may."""

    __slots__ = ()

    def notify_all(self) -> None:
        """Nobody sleeps on a polled handle's lock."""

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock for a moment (at most a millisecond) and take it back."""
        self.release()
        try:
            time.sleep(min(1e-3, timeout) if timeout is not None else 1e-3)
        finally:
            self.acquire()
        return False


class TransferHandle:
    """One posted transfer. Backends finish it through ``_finish``; callers ``wait``/``done``/``cancel``.

    ``poll`` (optional) is called from ``done``/``wait`` for backends whose completion is observed by
    asking (NIXL); ``abort`` is called by ``cancel`` while the transfer is pending and returns False
    when it is too late to stop it (the transfer then completes normally).
    """

    def __init__(self, transfer_id: int, peer: str, nbytes: int, op: str, *,
                 poll: Callable[[TransferHandle], None] | None = None,
                 abort: Callable[[TransferHandle], bool] | None = None) -> None:
        self.id = transfer_id
        self.peer = peer
        self.nbytes = nbytes
        self.op = op
        self._poll = poll
        self._abort = abort
        # A polled handle's ``wait`` polls and never sleeps on the condition: a plain mutex serves it, and
        # costs a tenth of a Condition to make (a one-page post makes one per transfer).
        self._cond: threading.Condition | _Mutex = threading.Condition() if poll is None else _Mutex()
        self._status = TransferStatus.PENDING
        self._reason = ""
        self._error_type: type[TransportError] = TransferFailed
        self._callbacks: list[Callable[[TransferHandle], None]] = []
        #: ``time.monotonic()`` when the transfer reached its terminal state (0.0 before): when the
        #: backend saw it complete, not when someone looked (a busy engine may look much later).
        self.finished_at = 0.0

    @classmethod
    def completed(cls, transfer_id: int, peer: str, nbytes: int, op: str) -> TransferHandle:
        """A handle of a transfer that finished within its post (a backend saw it done before returning),
        made without the condition a pending one needs: nobody will wait on it."""
        handle = cls.__new__(cls)
        handle.id, handle.peer, handle.nbytes, handle.op = transfer_id, peer, nbytes, op
        handle._poll = handle._abort = None
        handle._cond = _Mutex()
        handle._status = TransferStatus.DONE
        handle._reason = ""
        handle._error_type = TransferFailed
        handle._callbacks = []
        handle.finished_at = time.monotonic()
        return handle

    def __repr__(self) -> str:
        return (f"TransferHandle(id={self.id}, op={self.op}, peer={self.peer!r}, nbytes={self.nbytes}, "
                f"status={self._status.value})")

    @property
    def status(self) -> TransferStatus:
        """Current state (polls the backend first when it completes only when asked)."""
        self._poll_once()
        return self._status

    @property
    def reason(self) -> str:
        """Why the transfer failed or was cancelled ("" while pending or done)."""
        return self._reason

    @property
    def completes_when_polled(self) -> bool:
        """True when the backend observes completion only when asked (``status``, ``done``, ``wait``):
        a caller waiting for it must poll; otherwise ``add_done_callback`` tells it."""
        return self._poll is not None

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call ``fn(handle)`` once the transfer is terminal (at once if it already is), from the thread
        that finishes it: ``fn`` must be quick and must not raise (to wake a waiting thread, say)."""
        with self._cond:
            if not self._status.terminal:
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        """Whether the transfer reached a terminal state (done, failed or cancelled)."""
        return self.status.terminal

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise TransferTimeout (still pending), TransferCancelled or the failure."""
        if self._status is TransferStatus.DONE:
            return
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if self._poll is None:
            with self._cond:
                while not self._status.terminal:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
        else:
            sleep = _POLL_INTERVAL_S
            while not self._poll_once().terminal:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(sleep)
                sleep = min(sleep * 2, _POLL_INTERVAL_MAX_S)
        self._raise_unless_done(timeout)

    def cancel(self) -> bool:
        """Cancel a pending transfer; True if it is now cancelled. No notification follows a cancel;
        bytes already moved into the destination stay (its content is unspecified after a cancel)."""
        with self._cond:
            if self._status.terminal:
                return self._status is TransferStatus.CANCELLED
        if self._abort is not None and not self._abort(self):
            return False
        self._finish(TransferStatus.CANCELLED, "cancelled by the caller", TransferCancelled)
        return self._status is TransferStatus.CANCELLED

    # --- for backends ------------------------------------------------------------------------------
    def _finish(self, status: TransferStatus, reason: str = "",
                error_type: type[TransportError] = TransferFailed, at: float | None = None) -> bool:
        """Move to a terminal state once; later calls are ignored. Returns whether this call won. ``at``:
        when the backend saw it happen (``time.monotonic()``), if earlier than now."""
        with self._cond:
            if self._status.terminal:
                return False
            self._status = status
            self.finished_at = time.monotonic() if at is None else at
            self._reason = reason
            self._error_type = error_type
            self._cond.notify_all()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True

    def _poll_once(self) -> TransferStatus:
        if self._poll is not None and not self._status.terminal:
            self._poll(self)
        return self._status

    def _raise_unless_done(self, timeout: float | None) -> None:
        status = self._status
        where = f"transfer {self.id} ({self.op} {self.nbytes} bytes) with peer {self.peer!r}"
        if status is TransferStatus.DONE:
            return
        if status is TransferStatus.PENDING:
            raise TransferTimeout(f"{where}: not complete after {timeout} s (peer stalled or gone?)")
        if status is TransferStatus.CANCELLED:
            raise TransferCancelled(f"{where}: {self._reason}")
        etype = self._error_type if self._error_type in (PeerUnreachable, TransferFailed) else TransferFailed
        raise etype(f"{where}: {self._reason}")
