"""GPU conformance: every backend that can move device memory, across two processes on one GPU."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import PageTableError
from kvxfer.pagetable.table import PageTable
from kvxfer.transport import available_backends, create
from tests.support.transport_helpers.gpu_peer import serve_gpu
from tests.support.transport_helpers.plans import (
    PAGE,
    expected_after,
    expected_after_blocks,
    pair,
    random_block_plan,
    random_pages,
)

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
    posted = time.monotonic()
    handle = getattr(p.local, op)(p.name, plan, notify=f"{op}-{coalesced}".encode())
    handle.wait(60)
    assert posted < handle.finished_at <= time.monotonic()   # stamped when the copy was seen complete
    assert all(np.array_equal(a, b) for a, b in zip(_host(p.bufs), want_local, strict=True))
    got_peer = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    assert all(np.array_equal(a, b) for a, b in zip(got_peer, want_peer, strict=True))
    assert p.call("notifications", 1, 10.0) == {p.local.name: [f"{op}-{coalesced}".encode()]}


@pytest.mark.parametrize("op", ["write", "read"])
def test_device_block_plans_move_exact_bytes(gpu_peer: GpuPeer, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A BlockPlan over device memory (template over both regions of each side, random slot pairs) lands
    exactly, the expected bytes computed run by run from its definition; on cuda_ipc it goes to the GPU
    as slots + template (``expand`` is never called: mutation of the post path to expanding fails here)."""
    from kvxfer.pagetable import BlockPlan
    p = gpu_peer
    rng = np.random.default_rng(31)
    local_regions, peer_regions = list(p.local.regions), list(p.local.peer_regions(p.name))
    local_before = _host(p.bufs)
    peer_before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    if op == "write":
        plan = random_block_plan(rng, local_regions, peer_regions, 40, 6, PAGE + 16)
        want_peer = expected_after_blocks(plan, local_regions, local_before, peer_regions, peer_before)
        want_local = local_before
    else:
        plan = random_block_plan(rng, peer_regions, local_regions, 40, 6, PAGE + 16)
        want_local = expected_after_blocks(plan, peer_regions, peer_before, local_regions, local_before)
        want_peer = peer_before
    if p.local.backend == "cuda_ipc":
        def no_expand(self: BlockPlan) -> None:
            raise AssertionError("cuda_ipc expanded a block plan")
        monkeypatch.setattr(BlockPlan, "expand", no_expand)
    handle = getattr(p.local, op)(p.name, plan, notify=f"blocks-{op}".encode())
    handle.wait(60)
    assert all(np.array_equal(a, b) for a, b in zip(_host(p.bufs), want_local, strict=True))
    got_peer = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    assert all(np.array_equal(a, b) for a, b in zip(got_peer, want_peer, strict=True))
    assert p.call("notifications", 1, 10.0) == {p.local.name: [f"blocks-{op}".encode()]}


@pytest.mark.parametrize("kind", ["runs", "blocks"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_a_prepared_device_plan_lands_the_bytes_of_each_post(gpu_peer: GpuPeer, op: str, kind: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare`` once, two posts with new source bytes before each: every post lands what the source holds
    then, where the plan's definition says (expected run by run), and notifies. On cuda_ipc a post neither
    packs (the staging ring raises), checks nor expands the plan: one launch of the prepared table
    (mutation: a post that repacks fails here)."""
    from kvxfer.pagetable import BlockPlan, TransferPlan
    from kvxfer.transport import Transport
    p = gpu_peer
    rng = np.random.default_rng(61)
    local_regions, peer_regions = list(p.local.regions), list(p.local.peer_regions(p.name))
    src_regions, dst_regions = (local_regions, peer_regions) if op == "write" else (peer_regions, local_regions)
    plan: TransferPlan | BlockPlan = pair(random_pages(rng, src_regions, 300, 4 * PAGE, False),
                                          random_pages(rng, dst_regions, 300, 4 * PAGE, False)) if kind == "runs" \
        else random_block_plan(rng, src_regions, dst_regions, 40, 6, PAGE + 16)
    prepared = p.local.prepare(op, p.name, plan)
    if p.local.backend == "cuda_ipc":
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a prepared cuda_ipc post packed, checked or expanded its plan")
        monkeypatch.setattr(p.local._copier._staging, "take", refuse)  # type: ignore[attr-defined]
        monkeypatch.setattr(Transport, "_check_plan", refuse)
        monkeypatch.setattr(Transport, "_check_block_plan", refuse)
        monkeypatch.setattr(BlockPlan, "expand", refuse)
    for round_no in range(2):
        if op == "write":
            for b in p.bufs:
                b.copy_(torch.from_numpy(rng.integers(0, 256, b.numel(), dtype=np.uint8)).cuda())
        else:
            p.call("scramble", 70 + round_no)
        local_before = _host(p.bufs)
        peer_before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
        src_bytes, dst_bytes = (local_before, peer_before) if op == "write" else (peer_before, local_before)
        if isinstance(plan, BlockPlan):
            want = expected_after_blocks(plan, src_regions, src_bytes, dst_regions, dst_bytes)
        else:
            want = expected_after(plan, src_regions, src_bytes, dst_regions, dst_bytes)
        want_local, want_peer = (local_before, want) if op == "write" else (want, peer_before)
        handle = prepared.post(notify=f"prepared-{op}-{kind}-{round_no}".encode())
        handle.wait(60)
        assert all(np.array_equal(a, b) for a, b in zip(_host(p.bufs), want_local, strict=True))
        got_peer = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
        assert all(np.array_equal(a, b) for a, b in zip(got_peer, want_peer, strict=True))
        assert p.call("notifications", 1, 10.0) == {p.local.name: [f"prepared-{op}-{kind}-{round_no}".encode()]}
    prepared.release()


def test_a_device_block_plan_past_the_peer_is_refused(gpu_peer: GpuPeer) -> None:
    """A block plan with block 5 far past the peer's regions: PageTableError naming it, no notification, and
    no peer byte changes outside the plan's in-region destination runs (on cuda_ipc the kernel starts
    before the host's check and confines every run to its regions, as for a run list: block 5 is never
    copied)."""
    from kvxfer.pagetable import BlockPlan
    p = gpu_peer
    before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    peer_regions = list(p.local.peer_regions(p.name))
    good = random_block_plan(np.random.default_rng(32), list(p.local.regions), peer_regions, 8, 4, PAGE)
    far = good.dst_slots.copy()
    far[5] = 1 << 20
    bad = BlockPlan(good.src_slots, far, good.src_step, good.src_offset, good.dst_step, good.dst_offset, good.nbytes,
                    good.src_region, good.dst_region)
    with pytest.raises(PageTableError, match=r"remote .*block 5.*outside region"):
        p.local.write(p.name, bad, notify=b"never")
    allowed = [np.zeros(b.size, bool) for b in before]
    for b in range(bad.num_blocks):
        for t in range(bad.runs_per_block):
            region = peer_regions[int(bad.dst_region[t])]
            at = int(bad.dst_slots[b]) * int(bad.dst_step[t]) + int(bad.dst_offset[t]) - region.base_address
            if at >= 0 and at + int(bad.nbytes[t]) <= region.nbytes:
                allowed[int(bad.dst_region[t])][at: at + int(bad.nbytes[t])] = True
    after = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    assert all(np.array_equal(a[~ok], b[~ok]) for a, b, ok in zip(after, before, allowed, strict=True))
    assert p.call("notifications", 1, 0.3) == {}


def test_a_settled_write_is_done_when_posted_and_its_notice_follows(gpu_peer: GpuPeer) -> None:
    """``write(..., settled=True)`` with a notification (prefill's one write per request): exact bytes,
    the notification arrives, and on cuda_ipc the handle is already done when ``write`` returns (the
    posting thread waited on the copy and sent the notification itself). (Mutation: handing it to the
    completion thread instead leaves it pending at return on cuda_ipc.)"""
    p = gpu_peer
    rng = np.random.default_rng(13)
    local_regions, peer_regions = list(p.local.regions), list(p.local.peer_regions(p.name))
    local_before = _host(p.bufs)
    peer_before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    plan = pair(random_pages(rng, local_regions, 200, 4 * PAGE, False),
                random_pages(rng, peer_regions, 200, 4 * PAGE, False))
    want_peer = expected_after(plan, local_regions, local_before, peer_regions, peer_before)
    torch.cuda.synchronize()   # what "settled" promises: the pages' writers are done
    handle = p.local.write(p.name, plan, notify=b"settled-write", settled=True)
    if p.local.backend == "cuda_ipc":
        assert handle.status.terminal, "a settled cuda_ipc write with a notification returned unfinished"
    handle.wait(60)
    got_peer = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    assert all(np.array_equal(a, b) for a, b in zip(got_peer, want_peer, strict=True))
    assert p.call("notifications", 1, 10.0) == {p.local.name: [b"settled-write"]}


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


@pytest.mark.parametrize("settled", [False, True], ids=["ordered", "settled"])
@pytest.mark.parametrize("bad", ["outside", "overlap"])
def test_large_hostile_plan_is_refused_without_notification(gpu_peer: GpuPeer, bad: str, settled: bool) -> None:
    """A 64-entry write (the cuda_ipc kernel path, which starts copying before the host's check ends)
    with one entry past the peer's region, or two destinations sharing bytes: PageTableError naming
    it, no notification, and no peer byte changes outside the plan's in-region destinations."""
    p = gpu_peer
    rng = np.random.default_rng(21)
    local_regions, peer_regions = list(p.local.regions), list(p.local.peer_regions(p.name))
    before = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    src = random_pages(rng, local_regions[:1], 64, PAGE, False)
    dst = random_pages(rng, peer_regions[:1], 64, PAGE, False)
    addr = dst.addr.copy()
    if bad == "outside":
        addr[37] = np.uint64(peer_regions[0].end_address - PAGE // 2)
        words = "entry 37"
    else:
        addr[40] = addr[12] + np.uint64(PAGE // 2)
        words = "overlap"
    from kvxfer.pagetable import TransferPlan
    plan = TransferPlan(src, PageTable(addr, dst.nbytes, dst.region))
    with pytest.raises(PageTableError, match=words):
        p.local.write(p.name, plan, notify=b"must-not-arrive", settled=settled)
    after = [np.frombuffer(b, np.uint8) for b in p.call("dump")]
    allowed = np.zeros(before[0].size, bool)
    base = peer_regions[0].base_address
    for a in addr.tolist():
        if base <= a and a + PAGE <= peer_regions[0].end_address:
            allowed[a - base: a - base + PAGE] = True
    assert np.array_equal(after[0][~allowed], before[0][~allowed])
    assert all(np.array_equal(a, b) for a, b in zip(after[1:], before[1:], strict=True))
    assert p.call("notifications", 1, 0.5) == {}


# --- the cuda_ipc copy kernel, in one process (odd sizes, unaligned runs, many tiny runs, one huge run) ---
def _copier() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cuda_copy = pytest.importorskip("kvxfer.transport.cuda_copy")
    pytest.importorskip("triton")
    return cuda_copy, cuda_copy.BatchedCopier(0, "kernel")


@pytest.fixture(scope="module")
def kernel_copier() -> Iterator[Any]:
    """A kernel copier that runs every plan through the kernel (no cuMemcpyAsync for few runs)."""
    with pytest.MonkeyPatch.context() as mp:
        copier = _copier()
        mp.setattr(copier[0], "DIRECT_RUNS", 0)
        yield copier


def _disjoint_runs(rng: np.random.Generator, sizes: np.ndarray, space: int, align: int, skew: int) -> np.ndarray:
    """Start offsets (shuffled order) of non-overlapping runs of ``sizes`` inside ``space`` bytes."""
    order = rng.permutation(sizes.size)
    gaps = rng.integers(0, 64, sizes.size) * align
    padded = -(-sizes[order] // align) * align
    starts = np.cumsum(padded + gaps) - padded + skew
    assert starts[-1] + sizes[order][-1] <= space
    out = np.empty(sizes.size, dtype=np.int64)
    out[order] = starts
    return out


def _check_kernel(kernel_copier: Any, sizes: np.ndarray, align: int, src_skew: int, dst_skew: int,
                  remote_src: bool, seed: int) -> None:
    cuda_copy, copier = kernel_copier
    rng = np.random.default_rng(seed)
    space = int((-(-sizes // align) * align).sum() + sizes.size * 64 * align + 64)
    src = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8)).cuda()
    dst = torch.full((space,), 0xA5, dtype=torch.uint8, device="cuda")
    s_off = _disjoint_runs(rng, sizes, space, align, src_skew)
    d_off = _disjoint_runs(rng, sizes, space, align, dst_skew)
    # The remote side's addresses are "advertised" 1 MiB + 16 bytes away and translated on the GPU.
    shift = (1 << 20) + 16
    remote = src if remote_src else dst
    table = cuda_copy.RegionTable(np.array([remote.data_ptr() + shift], np.uint64), np.array([remote.data_ptr()], np.uint64), 0)
    s_addr = (src.data_ptr() + s_off).astype(np.uint64) + np.uint64(shift if remote_src else 0)
    d_addr = (dst.data_ptr() + d_off).astype(np.uint64) + np.uint64(0 if remote_src else shift)
    event = copier.copy(d_addr, s_addr, sizes.astype(np.uint64), np.zeros(sizes.size, np.uint32), table, remote_src)
    event.synchronize()
    got, want, src_h = dst.cpu().numpy(), np.full(space, 0xA5, np.uint8), src.cpu().numpy()
    for s, d, n in zip(s_off.tolist(), d_off.tolist(), sizes.tolist(), strict=True):
        want[d:d + n] = src_h[s:s + n]
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} wrong bytes, first at {bad[:5]}"


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_kernel_odd_sizes_aligned_starts(kernel_copier: Any, remote_src: bool) -> None:
    sizes = np.array([1, 3, 15, 16, 17, 31, 48 + 5, 4097, 32768, 32768 + 5, 65537, 3 << 20], np.int64)
    _check_kernel(kernel_copier, sizes, 16, 0, 0, remote_src, 1)


@pytest.mark.parametrize(("src_skew", "dst_skew"), [(1, 0), (0, 3), (5, 9), (8, 8)])
def test_kernel_unaligned_runs(kernel_copier: Any, src_skew: int, dst_skew: int) -> None:
    sizes = np.array([7, 16, 100, 4096, 40000, 70001], np.int64)
    _check_kernel(kernel_copier, sizes, 16, src_skew, dst_skew, False, 2)


def test_kernel_many_tiny_runs(kernel_copier: Any) -> None:
    sizes = np.random.default_rng(3).integers(1, 65, 20000)
    _check_kernel(kernel_copier, sizes, 16, 0, 0, True, 3)


def test_kernel_one_huge_run_among_tiny_ones(kernel_copier: Any) -> None:
    """Long runs among short ones are cut on the host (balanced grid); the result is the same."""
    sizes = np.array([(96 << 20) + 12] + [16] * 300 + [33], np.int64)
    _check_kernel(kernel_copier, sizes, 16, 0, 0, False, 4)


def test_kernel_runs_longer_than_one_grid_row(kernel_copier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_copy, _ = kernel_copier
    monkeypatch.setattr(cuda_copy, "_MAX_RUN_BYTES", 1 << 20)
    sizes = np.array([(5 << 20) + 3, 1 << 20, 4096], np.int64)
    _check_kernel(kernel_copier, sizes, 16, 0, 0, True, 5)


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_the_batch_method_copies_every_run_exactly(remote_src: bool) -> None:
    """``method="batch"`` (one cuMemcpyBatchAsync per plan, the remote side translated on the host) is
    there on a CUDA >= 13 driver and lands every byte of odd, unaligned runs, nothing else."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cuda_copy = pytest.importorskip("kvxfer.transport.cuda_copy")
    err, version = cuda_copy.cu.cuDriverGetVersion()
    assert int(err) == 0
    if version < 13000:
        pytest.skip(f"the batch method takes cuMemcpyBatchAsync's CUDA 13 ABI; this driver is {version}")
    copier = cuda_copy.BatchedCopier(0, "batch")
    assert copier.method == "batch" and not copier.bounds_on_device(100)
    sizes = np.array([1, 3, 15, 16, 17, 4097, 32768 + 5, 65537, 3 << 20] * 3, np.int64)
    _check_kernel((cuda_copy, copier), sizes, 16, 5, 9, remote_src, 6)


def _count_parts(copier: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Record (runs, on the upload stream) of every part the copier launches."""
    parts: list[tuple[int, bool]] = []
    launch_part = copier._launch_part

    def counted(dst: Any, *args: Any, **kw: Any) -> int:
        parts.append((int(dst.size), bool(kw["on_upload_stream"])))
        return int(launch_part(dst, *args, **kw))
    monkeypatch.setattr(copier, "_launch_part", counted)
    return parts


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_a_large_plan_goes_in_parts_and_lands_exactly(kernel_copier: Any, remote_src: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan of more than PIPELINE_RUNS runs is launched in parts of growing size (the first on the
    copier's stream, the rest uploaded on the second stream): every byte lands, nothing else changes."""
    cuda_copy, copier = kernel_copier
    monkeypatch.setattr(cuda_copy, "PIPELINE_RUNS", 16)
    monkeypatch.setattr(cuda_copy, "FIRST_PART_RUNS", 8)
    parts = _count_parts(copier, monkeypatch)
    sizes = np.random.default_rng(21).integers(1, 40, 300) * 16 + np.random.default_rng(22).integers(0, 2, 300)
    _check_kernel(kernel_copier, sizes, 16, 0, 0, remote_src, 21)
    assert parts == [(8, False), (32, True), (128, True), (132, True)]


def test_the_default_parts_of_a_plan_of_many_runs(kernel_copier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the shipped sizes a plan of 50,000 runs goes as 8,192 + 32,768 + 9,040 runs, exactly."""
    parts = _count_parts(kernel_copier[1], monkeypatch)
    sizes = np.random.default_rng(23).integers(1, 9, 50000) * 16
    _check_kernel(kernel_copier, sizes, 16, 0, 0, True, 23)
    assert parts == [(8192, False), (32768, True), (9040, True)]


def _check_block_kernel(kernel_copier: Any, nbytes: np.ndarray, blocks: int, remote_src: bool, seed: int,
                        offsets: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """``copy_blocks`` of a random block plan (template runs of ``nbytes``, shuffled places in 2x-sized
    slots, or the runs' source and destination ``offsets`` in their slots; the remote side advertised 1 MiB
    + 16 bytes away): every byte as the plan's definition says."""
    from kvxfer.pagetable import BlockPlan
    cuda_copy, copier = kernel_copier
    rng = np.random.default_rng(seed)
    padded = -(-nbytes // 16) * 16
    step = int(2 * padded.sum())
    slots = blocks + 3
    src = torch.from_numpy(rng.integers(0, 256, step * slots, dtype=np.uint8)).cuda()
    dst = torch.full((step * slots,), 0xA5, dtype=torch.uint8, device="cuda")

    def places() -> np.ndarray:
        order = rng.permutation(nbytes.size)
        starts = np.cumsum(2 * padded[order]) - 2 * padded[order] + rng.integers(0, 2, nbytes.size) * padded[order]
        out = np.empty(nbytes.size, np.int64)
        out[order] = starts
        return out
    s_off, d_off = offsets if offsets is not None else (places(), places())
    shift = (1 << 20) + 16
    remote = src if remote_src else dst
    table = cuda_copy.RegionTable(np.array([remote.data_ptr() + shift], np.uint64), np.array([remote.data_ptr()], np.uint64), 0)
    s_base = src.data_ptr() + (shift if remote_src else 0)
    d_base = dst.data_ptr() + (0 if remote_src else shift)
    t = nbytes.size
    plan = BlockPlan(rng.integers(0, slots, blocks).astype(np.uint64), rng.choice(slots, blocks, replace=False).astype(np.uint64),
                     np.full(t, step, np.uint64), (s_base + s_off).astype(np.uint64), np.full(t, step, np.uint64),
                     (d_base + d_off).astype(np.uint64), nbytes.astype(np.uint64), np.zeros(t, np.uint32),
                     np.zeros(t, np.uint32))
    copier.copy_blocks(plan, table, remote_src).synchronize()
    got, want, src_h = dst.cpu().numpy(), np.full(step * slots, 0xA5, np.uint8), src.cpu().numpy()
    for b in range(blocks):
        ss, ds = int(plan.src_slots[b]) * step, int(plan.dst_slots[b]) * step
        for so, do, n in zip(s_off.tolist(), d_off.tolist(), nbytes.tolist(), strict=True):
            want[ds + do: ds + do + n] = src_h[ss + so: ss + so + n]
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} wrong bytes, first at {bad[:5]}"


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_the_block_kernel_lands_exactly(kernel_copier: Any, remote_src: bool) -> None:
    """KV-like templates (64 runs of 32 KiB), odd lengths (byte tail and byte-wise runs), and one long
    run among short ones (the template cut into pieces on the host)."""
    _check_block_kernel(kernel_copier, np.full(64, 32 << 10), 40, remote_src, 41)
    _check_block_kernel(kernel_copier, np.array([1, 15, 16, 17, 4097, 32768 + 5, 70001]), 30, remote_src, 42)
    _check_block_kernel(kernel_copier, np.array([(3 << 20) + 4, 16, 48, 1024]), 6, remote_src, 43)


@pytest.mark.parametrize("tiled", [False, True], ids=["packed", "tiled"])
@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_short_aligned_runs_land_exactly(kernel_copier: Any, remote_src: bool, tiled: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-layout-like templates of short 16-byte aligned runs (256-byte head rows; 4 KiB and 16 KiB slices;
    mixed lengths; a template of fewer runs than a program's rows) go through the packed block kernels, in
    either program order, and land exactly."""
    cuda_copy, _ = kernel_copier
    monkeypatch.setattr(cuda_copy, "PACKED_TILED", tiled)
    _check_block_kernel(kernel_copier, np.full(512, 256), 20, remote_src, 51)
    _check_block_kernel(kernel_copier, np.array([4096] * 16 + [16384] * 4), 12, remote_src, 52)
    _check_block_kernel(kernel_copier, np.array([16, 48, 256, 1024, 4080]), 9, remote_src, 53)
    _check_block_kernel(kernel_copier, np.full(3, 256), 70, remote_src, 54)


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_grouped_runs_land_exactly(kernel_copier: Any, remote_src: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Templates that cut into affine groups go through ``copy_block_groups`` and land exactly: head-major to
    token-major 256-byte rows (8 heads x 16 tokens, 4 layers), the same with one row shorter and one moved
    (groups split around them), and more rows per group than one program takes."""
    cuda_copy, _ = kernel_copier
    monkeypatch.setattr(cuda_copy, "PACKED_GROUPS", True)
    launched: list[int] = []
    real = cuda_copy.BatchedCopier._launch_groups
    monkeypatch.setattr(cuda_copy.BatchedCopier, "_launch_groups",
                        lambda self, grouped, *a: (launched.append(len(launched)), real(self, grouped, *a))[1])

    def transpose(heads: int, tokens: int, layers: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        h, t = np.meshgrid(np.arange(heads), np.arange(tokens), indexing="ij")
        base = np.repeat(np.arange(layers) * heads * tokens * row, heads * tokens)
        return (np.tile(((h * tokens + t) * row).ravel(), layers) + base,
                np.tile(((t * heads + h) * row).ravel(), layers) + base)
    s_off, d_off = transpose(8, 16, 4, 256)
    _check_block_kernel(kernel_copier, np.full(s_off.size, 256), 20, remote_src, 61, (s_off, d_off))
    nbytes = np.full(s_off.size, 256)
    nbytes[37] = 128
    d_off = d_off.copy()
    d_off[70] = d_off.max() + 256
    _check_block_kernel(kernel_copier, nbytes, 9, remote_src, 62, (s_off, d_off))
    s_off, d_off = transpose(32, 64, 1, 64)      # 2,048 rows of 64 bytes per group: several programs each
    _check_block_kernel(kernel_copier, np.full(s_off.size, 64), 5, remote_src, 63, (s_off, d_off))
    assert len(launched) == 3, f"the group kernel ran {len(launched)} of 3 times"


def test_the_block_kernel_copies_no_run_outside_its_regions(kernel_copier: Any) -> None:
    """The kernel's own bounds (the region table): a block plan whose block 1 lies past the destination's
    region copies blocks 0 and 2 and nothing of block 1 (the transport checks first; this is the
    device's second line)."""
    from kvxfer.pagetable import BlockPlan
    cuda_copy, copier = kernel_copier
    src = torch.arange(3 * 4096, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(4 * 4096, dtype=torch.uint8, device="cuda")
    table = cuda_copy.RegionTable(np.array([dst.data_ptr()], np.uint64), np.array([dst.data_ptr()], np.uint64), 0,
                                  np.array([2 * 4096], np.uint64))   # only the first two slots are "registered"
    one = np.ones(1, np.uint64)
    plan = BlockPlan(np.arange(3, dtype=np.uint64), np.array([0, 3, 1], np.uint64), 4096 * one,
                     np.array([src.data_ptr()], np.uint64), 4096 * one, np.array([dst.data_ptr()], np.uint64),
                     4096 * one, np.zeros(1, np.uint32), np.zeros(1, np.uint32))
    copier.copy_blocks(plan, table, False).synchronize()
    got, src_h = dst.cpu().numpy(), src.cpu().numpy()
    assert np.array_equal(got[:4096], src_h[:4096]) and np.array_equal(got[4096:8192], src_h[8192:])
    assert not got[3 * 4096:].any(), "a run outside its region was copied"


def test_kernels_launch_through_the_driver(kernel_copier: Any) -> None:
    """On the target GPU every kernel variant is launched by cuLaunchKernel with packed arguments (the
    warm-up checked its copies); the kernel tests in this module then all run through that launch."""
    _, copier = kernel_copier
    assert copier.launcher == "driver", f"kernels launch through {copier.launcher!r}, not the driver"
    assert copier._compiled and all(type(k).__name__ == "_DriverLaunch" for k in copier._compiled.values())


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_triton_launcher_fallback_lands_exactly(remote_src: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the driver library's entry points the compiled kernel's own (Triton) launcher runs the
    same kernel: same bytes."""
    cuda_copy = pytest.importorskip("kvxfer.transport.cuda_copy")
    _copier()
    monkeypatch.setattr(cuda_copy, "_libcuda", lambda: None)
    monkeypatch.setattr(cuda_copy, "DIRECT_RUNS", 0)
    copier = cuda_copy.BatchedCopier(0, "kernel")
    assert copier.launcher == "triton"
    sizes = np.array([3, 16, 4097, 32768 + 5, 3 << 20], np.int64)
    _check_kernel((cuda_copy, copier), sizes, 16, 0, 0, remote_src, 9)


@pytest.mark.parametrize("runs", [1, 64], ids=["memcpy", "kernel"])
def test_copy_waits_for_the_models_stream(runs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages the model is still writing on the default stream are copied only after it has written them,
    and the copy's event can be waited on from another thread."""
    cuda_copy, copier = _copier()
    monkeypatch.setattr(cuda_copy, "DIRECT_RUNS", 8)
    page = 64 << 10
    src = torch.zeros(runs * page, dtype=torch.uint8, device="cuda")
    dst = torch.full_like(src, 0xA5)
    base = np.array([dst.data_ptr()], np.uint64)
    table = cuda_copy.RegionTable(base, base, 0)   # built now: its upload would wait for the model's stream
    offsets = np.arange(runs, dtype=np.uint64)[::-1] * np.uint64(page)
    torch.cuda.synchronize()
    # Tens of milliseconds of GPU time on the default stream, then the model's write.
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
    src.fill_(7)
    event = copier.copy(base + offsets, np.uint64(src.data_ptr()) + offsets[::-1], np.full(runs, page, np.uint64),
                        np.zeros(runs, np.uint32), table, False)
    assert event.query() is False          # still queued behind the model's work
    seen: list[bool] = []

    def wait() -> None:
        event.synchronize()
        seen.append(event.query())
    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(30)
    assert seen == [True]
    assert torch.equal(dst, torch.full_like(dst, 7)), "the copy read pages the model had not written yet"


@pytest.mark.parametrize("runs", [2, 64], ids=["memcpy", "kernel"])
def test_a_settled_copy_does_not_wait_for_the_models_stream(runs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``after_model=False`` (a write posted ``settled``: its pages were synchronized): the copy runs while
    tens of milliseconds of later model work are still queued on the default stream, and lands exactly.
    (Mutation: the copier ignoring the flag leaves the copy queued behind that work.)"""
    cuda_copy, copier = _copier()
    monkeypatch.setattr(cuda_copy, "DIRECT_RUNS", 8)
    page = 64 << 10
    src = torch.full((runs * page,), 9, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    base = np.array([dst.data_ptr()], np.uint64)
    table = cuda_copy.RegionTable(base, base, 0)
    offsets = np.arange(runs, dtype=np.uint64) * np.uint64(page)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]   # the next prompt's work, ~100 ms
    event = copier.copy(base + offsets, np.uint64(src.data_ptr()) + offsets, np.full(runs, page, np.uint64),
                        np.zeros(runs, np.uint32), table, False, after_model=False)
    event.synchronize()
    assert torch.cuda.default_stream().query() is False, "the copy waited for the model's later work"
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_few_runs_take_cuda_memcpy_and_land_exactly(remote_src: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans of at most DIRECT_RUNS runs skip the kernel (one cuMemcpyAsync each): same bytes, and the
    kernel is really not launched (its path would raise here)."""
    cuda_copy, copier = _copier()
    monkeypatch.setattr(cuda_copy, "DIRECT_RUNS", 8)   # the default (the kernel tests set it to 0)

    def no_kernel(*a: Any, **k: Any) -> None:
        raise AssertionError("the kernel ran for a plan of few runs")
    monkeypatch.setattr(copier, "_run_kernel", no_kernel)
    sizes = np.array([7, 16, 100, 4096, 40000, 4 << 20], np.int64)
    _check_kernel((cuda_copy, copier), sizes, 16, 3, 5, remote_src, 6)


def _two_regions_each_side(rng: np.random.Generator, space: int, remote_src: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    """Random source bytes and a 0xA5 destination of ``space`` bytes each, each side's buffer split into two
    regions of half its size: (src, dst, remote region bases, local region bases, region sizes)."""
    half = space // 2
    src = torch.from_numpy(rng.integers(0, 256, space, dtype=np.uint8)).cuda()
    dst = torch.full((space,), 0xA5, dtype=torch.uint8, device="cuda")
    remote, local = (src, dst) if remote_src else (dst, src)
    r_base = np.array([remote.data_ptr(), remote.data_ptr() + half], np.uint64)
    l_base = np.array([local.data_ptr(), local.data_ptr() + half], np.uint64)
    return src, dst, r_base, l_base, np.full(2, half, np.uint64)


@pytest.mark.parametrize("in_parts", [False, True], ids=["one-launch", "in-parts"])
@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_kernel_copies_no_run_outside_its_regions(kernel_copier: Any, remote_src: bool, in_parts: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With bounded region tables the kernel skips every run outside its region on either side
    (another region's bytes, straddling a region's end, a region the table lacks, a region id of
    2**32-1) and copies every other run exactly: the host may check a plan while it runs. In parts,
    each part carries its own runs' region ids (3 + 12 + 25 runs here)."""
    cuda_copy, copier = kernel_copier
    if in_parts:
        monkeypatch.setattr(cuda_copy, "PIPELINE_RUNS", 4)
        monkeypatch.setattr(cuda_copy, "FIRST_PART_RUNS", 3)
        parts = _count_parts(copier, monkeypatch)
    rng = np.random.default_rng(8)
    space, page = 1 << 20, 4096
    src, dst, r_base, l_base, sizes = _two_regions_each_side(rng, space, remote_src)
    shift = (1 << 20) + 16       # the remote side is advertised elsewhere and translated on the GPU
    remote_table = cuda_copy.RegionTable(r_base + np.uint64(shift), r_base, 0, sizes)
    local_table = cuda_copy.RegionTable(l_base, l_base, 0, sizes)
    slots = space // page
    count = 40
    r_slot = rng.permutation([s for s in range(slots) if s not in (127, 128)])[:count]
    l_slot = rng.permutation(slots)[:count]
    r_reg, l_reg = (r_slot >= slots // 2).astype(np.int64), (l_slot >= slots // 2).astype(np.int64)
    r_off, l_off = r_slot * page, l_slot * page
    r_off[3], r_reg[3] = 127 * page + page // 2, 0      # straddles the end of remote region 0
    r_reg[5] = 1 - r_reg[5]                             # remote address in the other region
    l_reg[7] = 1 - l_reg[7]                             # local address in the other region
    r_reg[9] = 2                                        # a remote region the table lacks
    l_reg[11] = 2**32 - 1                               # a local region id that is negative as int32
    bad = {3, 5, 7, 9, 11}
    remote_addr = r_base[0] + np.uint64(shift) + r_off.astype(np.uint64)
    local_addr = l_base[0] + l_off.astype(np.uint64)
    s_addr, d_addr = (remote_addr, local_addr) if remote_src else (local_addr, remote_addr)
    s_off, d_off = (r_off, l_off) if remote_src else (l_off, r_off)
    event = copier.copy(d_addr, s_addr, np.full(count, page, np.uint64), r_reg.astype(np.uint32), remote_table,
                        remote_src, l_reg.astype(np.uint32), local_table)
    event.synchronize()
    if in_parts:
        assert [runs for runs, _ in parts] == [3, 12, 25]
    got, want, src_h = dst.cpu().numpy(), np.full(space, 0xA5, np.uint8), src.cpu().numpy()
    for i, (so, do) in enumerate(zip(s_off.tolist(), d_off.tolist(), strict=True)):
        if i not in bad:
            want[do:do + page] = src_h[so:so + page]
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, f"{wrong.size} wrong bytes, first at {wrong[:5]}"


@pytest.mark.parametrize("remote_src", [False, True], ids=["write", "read"])
def test_a_new_copier_compiles_every_variant_before_its_first_transfer(remote_src: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh copier has compiled every run-list variant a plan can need, so a first plan over two regions
    on each side with a length per run (the variant the warm-up's own checked copies do not use) compiles
    nothing while it is posted, and lands exactly. A warm-up that compiles only the variants it checks fails
    both the set check and the post (such a compile inside a request costs tens of milliseconds once)."""
    cuda_copy, copier = _copier()
    monkeypatch.setattr(cuda_copy, "DIRECT_RUNS", 0)
    assert set(cuda_copy.run_variant_keys()) <= set(copier._compiled), "variants left for a transfer to compile"

    def no_compile(key: Any) -> Any:
        raise AssertionError(f"kernel variant {key} compiled during a transfer")
    monkeypatch.setattr(copier, "_compile", no_compile)
    rng = np.random.default_rng(61)
    space, page = 1 << 20, 4096
    src, dst, r_base, l_base, sizes = _two_regions_each_side(rng, space, remote_src)
    remote_table = cuda_copy.RegionTable(r_base, r_base, 0, sizes)
    local_table = cuda_copy.RegionTable(l_base, l_base, 0, sizes)
    count, slots = 24, space // page
    r_slot, l_slot = rng.permutation(slots)[:count], rng.permutation(slots)[:count]
    lengths = rng.integers(1, page + 1, count).astype(np.uint64)     # one length per run
    r_reg, l_reg = (r_slot >= slots // 2).astype(np.uint32), (l_slot >= slots // 2).astype(np.uint32)
    r_off, l_off = r_slot * page, l_slot * page
    remote_addr, local_addr = r_base[0] + r_off.astype(np.uint64), l_base[0] + l_off.astype(np.uint64)
    s_addr, d_addr = (remote_addr, local_addr) if remote_src else (local_addr, remote_addr)
    s_off, d_off = (r_off, l_off) if remote_src else (l_off, r_off)
    copier.copy(d_addr, s_addr, lengths, r_reg, remote_table, remote_src, l_reg, local_table).synchronize()
    got, want, src_h = dst.cpu().numpy(), np.full(space, 0xA5, np.uint8), src.cpu().numpy()
    for so, do, n in zip(s_off.tolist(), d_off.tolist(), lengths.tolist(), strict=True):
        want[do:do + n] = src_h[so:so + n]
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, f"{wrong.size} wrong bytes, first at {wrong[:5]}"
