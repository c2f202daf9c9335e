"""Stream ordering of slot reuse: a request's kernels run on its CUDA stream, so a slot it lets go
of (or a page it commits) may still be in use on that stream when another request takes the slot.

Each primary slot remembers the event recorded on the stream of its last user when that user let go
of it or published it; a request taking the slot on another stream makes its stream wait on that
event (device-side, no host stall), and host-side copies (offloads) synchronise on it. On a CPU
primary tier there are no streams and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

IntArray = npt.NDArray[np.int32]

#: Events kept before unreferenced ones are forgotten (the table then keeps twice what is live).
_GC_THRESHOLD = 1024


class StreamOps(Protocol):
    """The three stream primitives slot readiness needs (CUDA through torch, or a test double)."""

    def record(self, stream: Any) -> Any:
        """An event recorded now on ``stream``."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make work queued later on ``stream`` wait for ``event`` (device side)."""

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed."""


class TorchStreamOps:
    """StreamOps over torch.cuda streams and events."""

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream``."""
        event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)``."""
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        """``event.synchronize()``."""
        event.synchronize()


class SlotReadiness:
    """Per pool group and slot: the event (and its stream) after which the slot's last user is done.

    Stamps are kept as an event index per slot (numpy), so stamping and waiting cost one vectorised
    step plus one call per distinct event.
    """

    def __init__(self, num_slots: Sequence[int], ops: StreamOps) -> None:
        self._ops = ops
        self._ids = [np.full(n, -1, dtype=np.int64) for n in num_slots]
        self._events: dict[int, tuple[Any, Any]] = {}
        self._next = 0
        self._gc_at = _GC_THRESHOLD

    def grow(self, pool_group: int, num_slots: int) -> None:
        """Track ``num_slots`` slots of a pool group that grew (the new ones have no last user)."""
        ids = self._ids[pool_group]
        if num_slots > ids.size:
            self._ids[pool_group] = np.concatenate([ids, np.full(num_slots - ids.size, -1, dtype=np.int64)])

    def stamp(self, pool_group: int, slots: npt.ArrayLike, stream: Any) -> None:
        """Record an event on ``stream`` now and make it the readiness of ``slots`` (ids < 0 ignored)."""
        ids = np.asarray(slots, dtype=np.int64)
        ids = ids[ids >= 0]
        if not ids.size:
            return
        event = self._ops.record(stream)
        self._events[self._next] = (stream, event)
        self._ids[pool_group][ids] = self._next
        self._next += 1
        if len(self._events) > self._gc_at:
            self._forget_unreferenced()

    def wait_for(self, pool_group: int, slots: npt.ArrayLike, stream: Any) -> int:
        """Make ``stream`` wait for the events of ``slots`` recorded on other streams; returns how many
        events it waits on."""
        waited = 0
        for stamp in self._stamps(pool_group, slots):
            other, event = self._events[stamp]
            if other != stream:
                self._ops.wait(stream, event)
                waited += 1
        return waited

    def synchronize(self, pool_group: int, slots: npt.ArrayLike) -> None:
        """Block until every event of ``slots`` has completed (before a host-driven copy reads them)."""
        for stamp in self._stamps(pool_group, slots):
            self._ops.synchronize(self._events[stamp][1])

    def _stamps(self, pool_group: int, slots: npt.ArrayLike) -> list[int]:
        ids = np.asarray(slots, dtype=np.int64)
        ids = ids[ids >= 0]
        if not ids.size:
            return []
        stamps = np.unique(self._ids[pool_group][ids])
        return [int(s) for s in stamps[stamps >= 0].tolist()]

    def _forget_unreferenced(self) -> None:
        live = set(np.unique(np.concatenate([ids[ids >= 0] for ids in self._ids])).tolist())
        self._events = {k: v for k, v in self._events.items() if k in live}
        self._gc_at = max(_GC_THRESHOLD, 2 * len(self._events))
