"""A transport peer in its own process, driven over a multiprocessing Pipe by the test process."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import TransportError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import create
from tests.support.transport_helpers.plans import make_buffers, regions_of


def _table(arrays: tuple[bytes, bytes, bytes]) -> PageTable:
    return PageTable(np.frombuffer(arrays[0], np.uint64), np.frombuffer(arrays[1], np.uint64),
                     np.frombuffer(arrays[2], np.uint32))


def table_wire(t: PageTable) -> tuple[bytes, bytes, bytes]:
    return t.addr.tobytes(), t.nbytes.tobytes(), t.region.tobytes()


def serve(conn: Connection, backend: str, name: str, sizes: list[int], seed: int,
          options: dict[str, Any] | None = None) -> None:
    """Create a transport with seeded regions (``options`` passed to ``create``), hand out its metadata,
    then obey commands until exit."""
    bufs = make_buffers(sizes, seed)
    transport = create(backend, name, **(options or {}))
    transport.register(regions_of(bufs))
    conn.send((transport.metadata(), [(r.base_address, r.nbytes) for r in transport.regions]))
    while True:
        cmd, *args = conn.recv()
        reply: Any = None
        if cmd == "connect":
            transport.connect(args[0], args[1])
        elif cmd == "dump":
            reply = [b.tobytes() for b in bufs]
        elif cmd == "fill":
            for i, b in enumerate(bufs):
                b[:] = np.random.default_rng(args[0] * 1000 + i).integers(0, 256, b.size, dtype=np.uint8)
        elif cmd == "notifications":
            want, timeout = args
            got: dict[str, list[bytes]] = {}
            deadline = time.monotonic() + timeout
            while True:
                for k, v in transport.notifications().items():
                    got.setdefault(k, []).extend(v)
                if sum(map(len, got.values())) >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            reply = got
        elif cmd in ("write", "read"):
            peer, src, dst, notify, timeout = args
            plan = TransferPlan(_table(src), _table(dst))
            try:
                getattr(transport, cmd)(peer, plan, notify).wait(timeout)
                reply = "done"
            except TransportError as exc:
                reply = f"{type(exc).__name__}: {exc}"
        elif cmd == "exit":
            transport.close()
            conn.send(None)
            return
        conn.send(reply)


_peer_names = itertools.count()


class RemotePeer:
    """A transport in a spawned process (``serve``, over ``remote_sizes`` seeded with ``seed``) and one of
    the same backend here (over ``local_sizes`` seeded with ``seed + 1``), connected both ways."""

    def __init__(self, backend: str, seed: int, local_sizes: list[int], remote_sizes: list[int],
                 options: dict[str, Any] | None = None) -> None:
        n = next(_peer_names)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = f"peer{n}-{os.getpid()}"
        self.proc = ctx.Process(target=serve, args=(child, backend, self.name, remote_sizes, seed, options),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("peer process did not start in 60 s")
        md, _regs = self.conn.recv()
        self.bufs = make_buffers(local_sizes, seed + 1)
        self.local = create(backend, f"local{n}-{os.getpid()}", **(options or {}))
        self.local.register(regions_of(self.bufs))
        self.local.connect(self.name, md)
        self.call("connect", self.local.name, self.local.metadata())

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]!r} in {timeout} s")
        return self.conn.recv()

    def remote_bytes(self) -> list[npt.NDArray[np.uint8]]:
        return [np.frombuffer(b, np.uint8) for b in self.call("dump")]

    def close(self) -> int | None:
        """Stop the peer and close the local transport; the peer's exit status (None if it was killed)."""
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, OSError, EOFError):
                self.call("exit", timeout=10)
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
                self.local.close()
                return None
        self.local.close()
        return self.proc.exitcode
