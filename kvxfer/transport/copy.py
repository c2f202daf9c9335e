"""Copy the runs of a plan by address inside one process: host memory through numpy, CUDA through
cuda-python. Used by the loopback backend and as the memcpy baseline of the benchmark.

Adjacent runs are merged first (vectorised). Many small runs go through one numpy gather/scatter per
(source region, destination region) pair, where a call per run would cost more than the bytes; large
runs go through one ``memmove`` each (no staging copy).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import BackendUnavailable, TransferFailed
from kvxfer.pagetable import TransferPlan

U64 = npt.NDArray[np.uint64]

#: Runs at most this large, in plans of at least GATHER_MIN_RUNS, are copied by gather/scatter.
GATHER_MAX_RUN_BYTES = 4096
GATHER_MIN_RUNS = 256


def merge_adjacent(src: U64, dst: U64, nbytes: U64) -> tuple[U64, U64, U64]:
    """Merge run ``i+1`` into run ``i`` where both its source and destination follow on directly."""
    if src.size < 2:
        return src, dst, nbytes
    follows = (src[:-1] + nbytes[:-1] == src[1:]) & (dst[:-1] + nbytes[:-1] == dst[1:])
    if not follows.any():
        return src, dst, nbytes
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    sums = np.add.reduceat(nbytes, starts).astype(np.uint64)
    return src[starts], dst[starts], sums


def host_view(region: MemoryRegion) -> npt.NDArray[np.uint8]:
    """A writable uint8 numpy view of a host region's bytes (no copy)."""
    if region.memory_kind == "cuda":
        raise TransferFailed(f"region at {region.base_address:#x} is CUDA memory, not host memory")
    buf = (ctypes.c_uint8 * region.nbytes).from_address(region.base_address)
    view: npt.NDArray[np.uint8] = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return view


def copy_plan(plan: TransferPlan, src_regions: Sequence[MemoryRegion], dst_regions: Sequence[MemoryRegion]) -> None:
    """Copy every run of a validated plan (host or CUDA memory, both sides in this process)."""
    if not len(plan):
        return
    src_cuda = np.array([r.memory_kind == "cuda" for r in src_regions], dtype=bool)[plan.src.region]
    dst_cuda = np.array([r.memory_kind == "cuda" for r in dst_regions], dtype=bool)[plan.dst.region]
    on_gpu = src_cuda | dst_cuda
    if on_gpu.any():
        sel = np.flatnonzero(on_gpu)
        copy_cuda(plan.src.addr[sel], plan.dst.addr[sel], plan.dst.nbytes[sel])
    if on_gpu.all():
        return
    host = np.flatnonzero(~on_gpu)
    src_r, dst_r = plan.src.region[host], plan.dst.region[host]
    if host.size >= GATHER_MIN_RUNS and int(plan.src.nbytes[host].max()) <= GATHER_MAX_RUN_BYTES:
        pair = src_r.astype(np.uint64) << np.uint64(32) | dst_r.astype(np.uint64)
        for key in np.unique(pair):
            sel = host[pair == key]
            _gather_scatter(plan, sel, src_regions[int(key >> np.uint64(32))],
                            dst_regions[int(key & np.uint64(0xFFFFFFFF))])
        return
    copy_host_runs(plan.src.addr[host], plan.dst.addr[host], plan.src.nbytes[host])


def copy_host_runs(src: U64, dst: U64, nbytes: U64) -> None:
    """``memmove`` each (merged) run; the loop runs per contiguous run, not per page."""
    src, dst, nbytes = merge_adjacent(src, dst, nbytes)
    for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def _gather_scatter(plan: TransferPlan, sel: npt.NDArray[np.intp], src_region: MemoryRegion,
                    dst_region: MemoryRegion) -> None:
    """Copy runs ``sel`` (all inside one source and one destination region) with one numpy gather and
    one scatter over rows of the largest unit that divides every offset and length."""
    s_off = plan.src.addr[sel] - np.uint64(src_region.base_address)
    d_off = plan.dst.addr[sel] - np.uint64(dst_region.base_address)
    n = plan.src.nbytes[sel]
    unit = math.gcd(int(np.gcd.reduce(s_off)), int(np.gcd.reduce(d_off)), int(np.gcd.reduce(n)))
    unit = max(unit, 1)
    rows = (n // np.uint64(unit)).astype(np.int64)
    first = np.repeat(np.cumsum(rows) - rows, rows)
    within = np.arange(int(rows.sum()), dtype=np.int64) - first
    s_rows = np.repeat((s_off // np.uint64(unit)).astype(np.int64), rows) + within
    d_rows = np.repeat((d_off // np.uint64(unit)).astype(np.int64), rows) + within
    src_view = host_view(src_region)
    dst_view = host_view(dst_region)
    src2d = src_view[: src_view.size - src_view.size % unit].reshape(-1, unit)
    dst2d = dst_view[: dst_view.size - dst_view.size % unit].reshape(-1, unit)
    dst2d[d_rows] = src2d[s_rows]


def copy_cuda(src: U64, dst: U64, nbytes: U64) -> None:
    """Copy runs where either side is CUDA memory (unified addressing) on one stream, then sync."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise BackendUnavailable(f"CUDA copy needs cuda-python (cuda.bindings): {exc}") from exc
    src, dst, nbytes = merge_adjacent(src, dst, nbytes)
    err, stream = cudart.cudaStreamCreate()
    _check_cuda(err, "cudaStreamCreate")
    try:
        kind = cudart.cudaMemcpyKind.cudaMemcpyDefault
        for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
            (err,) = cudart.cudaMemcpyAsync(d, s, n, kind, stream)
            _check_cuda(err, f"cudaMemcpyAsync({d:#x} <- {s:#x}, {n})")
        (err,) = cudart.cudaStreamSynchronize(stream)
        _check_cuda(err, "cudaStreamSynchronize")
    finally:
        cudart.cudaStreamDestroy(stream)


def _check_cuda(err: object, what: str) -> None:
    if int(err) != 0:  # type: ignore[call-overload]
        raise TransferFailed(f"{what} failed: CUDA error {err}")
