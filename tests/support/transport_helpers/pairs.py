"""Two transports in one process, registered over seeded buffers and connected both ways, and the
notifications one of them receives."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.transport import create
from kvxfer.transport.base import Transport
from tests.support.transport_helpers.plans import make_buffers, regions_of

Buffers = list[npt.NDArray[np.uint8]]


def connected_pair(backend: str, names: tuple[str, str], sizes: tuple[list[int], list[int]], seed: int,
                   a_opts: dict[str, Any] | None = None, b_opts: dict[str, Any] | None = None
                   ) -> tuple[Transport, Transport, Buffers, Buffers]:
    """(a, b, a's buffers, b's buffers): ``a`` over ``sizes[0]`` filled from ``seed``, ``b`` over
    ``sizes[1]`` from ``seed + 1``, each connected to the other."""
    a_bufs, b_bufs = make_buffers(sizes[0], seed), make_buffers(sizes[1], seed + 1)
    a, b = create(backend, names[0], **(a_opts or {})), create(backend, names[1], **(b_opts or {}))
    a.register(regions_of(a_bufs))
    b.register(regions_of(b_bufs))
    a.connect(b.name, b.metadata())
    b.connect(a.name, a.metadata())
    return a, b, a_bufs, b_bufs


def drain_notifications(t: Transport, want: int, timeout: float = 5.0) -> list[bytes]:
    """The notifications ``t`` receives until ``want`` came or ``timeout`` passed, then 50 ms more (so a
    test sees a duplicate that follows)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for v in t.notifications().values():
            got.extend(v)
        time.sleep(0.002)
    time.sleep(0.05)
    for v in t.notifications().values():
        got.extend(v)
    return got
