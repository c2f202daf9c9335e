"""GPU conformance: every backend that can move device memory, across two processes on one GPU."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transport_helpers.gpu_peer import serve_gpu
from transport_helpers.plans import PAGE, expected_after, pair, random_pages

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError
from kvxfer.pagetable.table import PageTable
from kvxfer.transport import available_backends, create

pytestmark = pytest.mark.gpu
AVAILABLE = available_backends() if torch.cuda.is_available() else {}
GPU_BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(AVAILABLE.get(b) is not None, reason=str(AVAILABLE.get(b))))
                for b in ("cuda_ipc", "nixl", "ucx")]
SIZES_LOCAL = [8 << 20, 4 << 20]
SIZES_PEER = [6 << 20, 6 << 20]


class GpuPeer:
    def __init__(self, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = f"gpeer-{backend}-{os.getpid()}"
        site = os.environ.get("KVXFER_SITE_NIXL" if backend == "nixl" else "KVXFER_SITE_UCXX") \
            if backend in ("nixl", "ucx") else None
        self.proc = ctx.Process(target=serve_gpu, args=(child, backend, self.name, SIZES_PEER, 3, site), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("GPU peer did not start in 120 s")
        md = self.conn.recv()
        rng = np.random.default_rng(4)
        self.bufs = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).cuda() for n in SIZES_LOCAL]
        self.local = create(backend, f"glocal-{backend}-{os.getpid()}")
        self.local.register([MemoryRegion.of_tensor(b) for b in self.bufs])
        self.local.connect(self.name, md)
        self.call("connect", self.local.name, self.local.metadata())

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"GPU peer did not answer {cmd[0]!r}")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                self.call("exit", timeout=20)
            self.proc.join(20)
            if self.proc.is_alive():
                self.proc.kill()
        self.local.close()


@pytest.fixture(scope="module", params=GPU_BACKENDS)
def gpu_peer(request: pytest.FixtureRequest) -> Iterator[GpuPeer]:
    peer = GpuPeer(request.param)
    yield peer
    peer.close()


def _host(bufs: list[torch.Tensor]) -> list[np.ndarray]:
    torch.cuda.synchronize()
    return [b.cpu().numpy().copy() for b in bufs]


@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "scattered"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_device_memory_moves_exact_bytes(gpu_peer: GpuPeer, op: str, coalesced: bool) -> None:
    p = gpu_peer
    rng = np.random.default_rng(11 if coalesced else 12)
    local_regions, peer_regions = list(p.local.regions), list(p.local.peer_regions(p.name))
    local_before = _host(p.bufs)
    peer_before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    pages = 300
    if op == "write":
        plan = pair(random_pages(rng, local_regions, pages, 4 * PAGE, coalesced),
                    random_pages(rng, peer_regions, pages, 4 * PAGE, coalesced))
        want_peer = expected_after(plan, local_regions, local_before, peer_regions, peer_before)
        want_local = local_before
    else:
        plan = pair(random_pages(rng, peer_regions, pages, 4 * PAGE, coalesced),
                    random_pages(rng, local_regions, pages, 4 * PAGE, coalesced))
        want_local = expected_after(plan, peer_regions, peer_before, local_regions, local_before)
        want_peer = peer_before
    getattr(p.local, op)(p.name, plan, notify=f"{op}-{coalesced}".encode()).wait(60)
    assert all(np.array_equal(a, b) for a, b in zip(_host(p.bufs), want_local, strict=True))
    got_peer = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    assert all(np.array_equal(a, b) for a, b in zip(got_peer, want_peer, strict=True))
    assert p.call("notifications", 1, 10.0) == {p.local.name: [f"{op}-{coalesced}".encode()]}


def test_device_plan_outside_peer_memory_is_refused(gpu_peer: GpuPeer) -> None:
    p = gpu_peer
    before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    peer_end = p.local.peer_regions(p.name)[0].end_address
    bad = PageTable(np.array([peer_end - PAGE], np.uint64), np.array([2 * PAGE], np.uint64), np.zeros(1, np.uint32))
    src = PageTable(np.array([p.local.regions[0].base_address], np.uint64), np.array([2 * PAGE], np.uint64),
                    np.zeros(1, np.uint32))
    from kvxfer.pagetable import TransferPlan
    with pytest.raises(PageTableError, match="outside region 0"):
        p.local.write(p.name, TransferPlan(src, bad))
    assert all(np.array_equal(np.frombuffer(a, np.uint8), b) for a, b in zip(p.call("dump"), before, strict=True))
