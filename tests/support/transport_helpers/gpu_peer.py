"""A transport peer over CUDA memory in its own process (GPU conformance tests)."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def serve_gpu(conn: Connection, backend: str, name: str, sizes: list[int], seed: int, site: str | None) -> None:
    """Allocate seeded CUDA regions, create a transport over them, then obey commands until exit."""
    if site:
        sys.path.insert(0, site)
    import torch

    from kvxfer.cache.memory import MemoryRegion
    from kvxfer.transport import create

    bufs = [torch.from_numpy(np.random.default_rng(seed * 1000 + i).integers(0, 256, n, dtype=np.uint8)).cuda()
            for i, n in enumerate(sizes)]
    transport = create(backend, name)
    transport.register([MemoryRegion.of_tensor(b) for b in bufs])
    conn.send(transport.metadata())
    while True:
        cmd, *args = conn.recv()
        reply: Any = None
        if cmd == "connect":
            transport.connect(args[0], args[1])
        elif cmd == "dump":
            torch.cuda.synchronize()
            reply = [b.cpu().numpy().tobytes() for b in bufs]
        elif cmd == "scramble":   # new random bytes in every region (seed args[0])
            for i, b in enumerate(bufs):
                rng = np.random.default_rng(args[0] * 1000 + i)
                b.copy_(torch.from_numpy(rng.integers(0, 256, b.numel(), dtype=np.uint8)).cuda())
            torch.cuda.synchronize()
        elif cmd == "notifications":
            import time
            got: dict[str, list[bytes]] = {}
            deadline = time.monotonic() + args[1]
            while sum(map(len, got.values())) < args[0] and time.monotonic() < deadline:
                for k, v in transport.notifications().items():
                    got.setdefault(k, []).extend(v)
                time.sleep(0.002)
            reply = got
        elif cmd == "exit":
            transport.close()
            conn.send(None)
            os._exit(0)
        conn.send(reply)
