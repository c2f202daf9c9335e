"""The batched copy engine: moves many (src, dst, nbytes) runs between storage tiers.

A batch is validated (every range inside one pool of its tier, destinations disjoint), coalesced
(runs adjacent in both source and destination merge; vectorised numpy) and executed in submission
order on one worker thread, so ``submit`` returns at once and ``handle.wait()`` is the completion:

- memory <-> memory: ``ctypes.memmove`` per coalesced run on CPU-only paths; with a CUDA side,
  cuda-python stream copies (``cuMemcpyBatchAsync`` where offered, else one ``cuMemcpyAsync`` per run);
- anything <-> disk: through a bounded staging ring in host memory (page-aligned, pinned where CUDA
  exists). Runs larger than half the ring are split; a chunk that does not fit the ring's tail wraps
  to the start, and space is reused only after the group that used it has completed.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.cuda_utils import CudaCopier, cuda_usable
from kvxfer.cache.tiers import DIRECT_IO_ALIGNMENT, DiskTierStorage, TierStorage
from kvxfer.errors import KvxferError, LayoutMismatch, TierError, TransferTimeout

U64Array = npt.NDArray[np.uint64]
IntArray = npt.NDArray[np.int64]

#: Default staging ring size: large enough for deep disk queues, small next to any host tier.
DEFAULT_STAGING_BYTES = 32 << 20
#: Largest single file request: big enough for full device bandwidth, small enough that one ring
#: group holds several requests for the I/O threads to run in parallel.
IO_CHUNK_BYTES = 2 << 20
#: Ring positions of small, unaligned chunks are rounded to this (cache-line) boundary.
SMALL_ALIGNMENT = 64


# --- run arithmetic (vectorised) -------------------------------------------------------------------
@dataclass(frozen=True)
class CopyRuns:
    """Parallel arrays: run ``i`` copies ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    src: U64Array
    dst: U64Array
    nbytes: U64Array

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        """Bytes over all runs."""
        return int(self.nbytes.sum(dtype=np.uint64))


def as_runs(src: npt.ArrayLike, dst: npt.ArrayLike, nbytes: npt.ArrayLike) -> CopyRuns:
    """Check and convert three equal-length 1-D arrays of non-negative integers to a CopyRuns."""
    arrays = []
    for name, value in (("src", src), ("dst", dst), ("nbytes", nbytes)):
        arr = np.asarray(value)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TierError(f"copy batch: {name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise TierError(f"copy batch: {name} has a negative entry {int(arr.min())} at {int(arr.argmin())}")
        arrays.append(arr.astype(np.uint64, copy=False))
    if not len(arrays[0]) == len(arrays[1]) == len(arrays[2]):
        raise TierError(f"copy batch: src, dst and nbytes differ in length: "
                        f"{len(arrays[0])}, {len(arrays[1])}, {len(arrays[2])}")
    return CopyRuns(arrays[0], arrays[1], arrays[2])


def coalesce_runs(runs: CopyRuns, src_pool: npt.ArrayLike | None = None,
                  dst_pool: npt.ArrayLike | None = None) -> CopyRuns:
    """Merge runs adjacent in both source and destination (never across pools), sorted by source.

    Zero-byte runs are dropped. ``src_pool``/``dst_pool`` give each run's pool, so a merge never
    spans two allocations that happen to be neighbours in the address space.
    """
    keep = runs.nbytes > 0
    src, dst, n = runs.src[keep], runs.dst[keep], runs.nbytes[keep]
    if not len(n):
        return CopyRuns(src, dst, n)
    order = np.argsort(src, kind="stable")
    src, dst, n = src[order], dst[order], n[order]
    follows = (src[:-1] + n[:-1] == src[1:]) & (dst[:-1] + n[:-1] == dst[1:])
    for pools in (src_pool, dst_pool):
        if pools is not None:
            p = np.asarray(pools)[keep][order]
            follows &= p[:-1] == p[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return CopyRuns(src[starts], dst[starts], np.add.reduceat(n, starts).astype(np.uint64))


def split_runs(runs: CopyRuns, max_bytes: int) -> CopyRuns:
    """Cut every run into pieces of at most ``max_bytes`` (in order; vectorised)."""
    if max_bytes <= 0:
        raise TierError(f"split_runs: max_bytes must be > 0, got {max_bytes}")
    cap = np.uint64(max_bytes)
    pieces = ((runs.nbytes + cap - np.uint64(1)) // cap).astype(np.int64)
    if not len(runs) or int(pieces.max()) == 1:
        return runs
    owner = np.repeat(np.arange(len(runs)), pieces)
    first = np.cumsum(pieces) - pieces
    k = (np.arange(int(pieces.sum())) - first[owner]).astype(np.uint64)
    offset = k * cap
    size = np.minimum(cap, runs.nbytes[owner] - offset)
    return CopyRuns(runs.src[owner] + offset, runs.dst[owner] + offset, size)


def check_disjoint(starts: U64Array, nbytes: U64Array, what: str,
                   other_starts: U64Array | None = None, other_nbytes: U64Array | None = None) -> None:
    """TierError when two ranges of ``starts`` overlap, or (given) one overlaps a range of ``other``."""
    label = np.zeros(len(starts), dtype=bool)
    s, e = starts, starts + nbytes
    if other_starts is not None and other_nbytes is not None:
        s = np.concatenate([s, other_starts])
        e = np.concatenate([e, other_starts + other_nbytes])
        label = np.concatenate([label, np.ones(len(other_starts), dtype=bool)])
    if len(s) < 2:
        return
    order = np.argsort(s, kind="stable")
    s, e, label = s[order], e[order], label[order]

    def prior_max_end(mask: npt.NDArray[np.bool_]) -> U64Array:
        ends = np.where(mask, e, np.uint64(0))
        return np.concatenate([[np.uint64(0)], np.maximum.accumulate(ends)[:-1]]).astype(np.uint64)

    mine, theirs = prior_max_end(~label), prior_max_end(label)
    clash = (~label & (s < mine)) | (~label & (s < theirs)) | (label & (s < mine))
    if clash.any():
        i = int(np.flatnonzero(clash)[0])
        kind = "source" if label[i] else what
        raise TierError(f"copy batch: {kind} range [{int(s[i]):#x}, +{int(e[i] - s[i])}) overlaps another range")


# --- staging ring ----------------------------------------------------------------------------------
class RingUser:
    """A group of ring segments whose space becomes reusable once ``finish()`` returns."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int]] = []

    def overlaps(self, pos: int, n: int) -> bool:
        """Whether any segment intersects [pos, pos + n)."""
        return any(a < pos + n and pos < b for a, b in self.segments)

    def finish(self) -> None:
        """Complete all work touching the segments (subclasses wait for their copies)."""


class StagingRing:
    """A bounded FIFO ring of host memory for disk transfers.

    ``place`` says where the next chunk goes: right after the previous one, or at offset 0 when it
    does not fit the tail (it wraps; the tail's few bytes stay unused until the next lap). Before a
    position is handed out, ``retire`` finishes every submitted user whose segments it overlaps,
    oldest first, so live data is never overwritten. Sizes must be in (0, capacity]: a zero-size
    reservation is refused rather than allowed to spin.
    """

    def __init__(self, capacity: int, *, pinned: bool | None = None) -> None:
        if capacity < DIRECT_IO_ALIGNMENT or capacity % SMALL_ALIGNMENT:
            raise TierError(f"staging ring capacity must be >= {DIRECT_IO_ALIGNMENT} and a multiple of "
                            f"{SMALL_ALIGNMENT} bytes, got {capacity}")
        pin = torch.cuda.is_available() if pinned is None else pinned
        raw = torch.empty(capacity + DIRECT_IO_ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
        skew = (-int(raw.data_ptr())) % DIRECT_IO_ALIGNMENT
        self._raw = raw
        self.buffer = raw[skew:skew + capacity]
        self._array = self.buffer.numpy()
        self.capacity = capacity
        self.base_address = int(self.buffer.data_ptr())
        self.pinned = pin
        self._head = 0
        self._pending: deque[RingUser] = deque()
        self.wraps = 0
        self.reservations = 0

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of ring bytes [offset, offset + nbytes)."""
        return self._array[offset:offset + nbytes].data

    def place(self, nbytes: int, alignment: int = SMALL_ALIGNMENT) -> int:
        """Where the next ``nbytes`` go (pure: nothing is reserved yet)."""
        if nbytes <= 0 or nbytes > self.capacity:
            raise TierError(f"staging ring: a reservation must be 1..{self.capacity} bytes, got {nbytes}")
        pos = -(-self._head // alignment) * alignment
        return 0 if pos + nbytes > self.capacity else pos

    def reserve(self, pos: int, nbytes: int) -> None:
        """Take [pos, pos + nbytes) (from ``place``): finish the submitted users overlapping it first."""
        if pos < self._head:
            self.wraps += 1
        while any(user.overlaps(pos, nbytes) for user in self._pending):
            self._pending.popleft().finish()
        self._head = pos + nbytes
        self.reservations += 1

    def submit(self, user: RingUser) -> None:
        """Queue a user whose segments are in flight; its space is reclaimed after ``finish``."""
        if user.segments:
            self._pending.append(user)

    def drain(self) -> None:
        """Finish every submitted user (oldest first)."""
        while self._pending:
            self._pending.popleft().finish()

    @property
    def live_segments(self) -> list[tuple[int, int]]:
        """[start, end) of every segment still in flight, oldest first (for tests and statistics)."""
        return [seg for user in self._pending for seg in user.segments]


# --- handles and statistics ------------------------------------------------------------------------
class CopyHandle:
    """Completion of one submitted batch: ``wait()`` returns once every byte is at its destination."""

    def __init__(self, nbytes: int, num_runs: int, num_requested: int) -> None:
        self.nbytes = nbytes
        self.num_runs = num_runs
        self.num_requested = num_requested
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the batch has finished (successfully or not)."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """The failure, once done; None on success or while running."""
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise TransferTimeout after ``timeout`` seconds, the batch's error if it failed."""
        if not self._done.wait(timeout):
            raise TransferTimeout(f"copy of {self.nbytes} bytes in {self.num_runs} runs not done after {timeout} s")
        if self._error is not None:
            if isinstance(self._error, KvxferError):
                raise self._error
            raise TierError(f"copy of {self.nbytes} bytes failed: {self._error!r}") from self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


@dataclass
class CopyStats:
    """Counters of one engine (cumulative)."""

    batches: int = 0
    runs_requested: int = 0
    runs_coalesced: int = 0
    bytes_copied: int = 0
    ring_chunks: int = 0
    ring_wraps: int = 0
    cuda_batch_calls: int = 0
    cuda_single_calls: int = 0
    cuda_fallback_reason: str | None = None
    cuda_batch_supported: bool | None = None  # None until a CUDA copy ran
    paths: dict[str, int] = field(default_factory=dict)


@dataclass
class _Job:
    src: TierStorage
    dst: TierStorage
    runs: CopyRuns
    handle: CopyHandle


# --- the engine ------------------------------------------------------------------------------------
class CopyEngine:
    """Moves batches of runs between tiers on one worker thread, in submission order.

    ``staging_bytes``: size of the host staging ring used for disk transfers (allocated on first
    use; pinned where CUDA exists unless ``pinned_staging=False``). ``cuda_batch``: None = use
    cuMemcpyBatchAsync when offered, False = one cuMemcpyAsync per run, True = require the batch API.
    ``io_threads``: file requests in flight per ring group (0 or 1: one at a time).
    """

    def __init__(self, *, staging_bytes: int = DEFAULT_STAGING_BYTES, pinned_staging: bool | None = None,
                 cuda_batch: bool | None = None, io_threads: int = 4) -> None:
        if staging_bytes < DIRECT_IO_ALIGNMENT or staging_bytes % SMALL_ALIGNMENT:
            raise TierError(f"CopyEngine.staging_bytes must be >= {DIRECT_IO_ALIGNMENT} and a multiple of "
                            f"{SMALL_ALIGNMENT}, got {staging_bytes}")
        if io_threads < 0:
            raise TierError(f"CopyEngine.io_threads must be >= 0, got {io_threads}")
        self.staging_bytes = staging_bytes
        self._io_pool = ThreadPoolExecutor(io_threads, "kvxfer-disk-io") if io_threads > 1 else None
        self._pinned_staging = pinned_staging
        self._cuda_batch = cuda_batch
        self._ring: StagingRing | None = None
        self._copiers: dict[int, CudaCopier] = {}
        self._stats = CopyStats()
        self._stats_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        # The worker holds the engine weakly between batches, so an engine dropped without close is
        # collected; its finalizer then stops the worker, which releases the CUDA copiers.
        self._worker = threading.Thread(target=CopyEngine._serve, args=(weakref.ref(self), self._queue, self._copiers),
                                        name="kvxfer-copy-engine", daemon=True)
        self._stop_worker = weakref.finalize(self, self._queue.put, None)
        self._worker.start()

    # --- public API -------------------------------------------------------------------------------
    @property
    def stats(self) -> CopyStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            snap = CopyStats(**{k: getattr(self._stats, k) for k in self._stats.__dataclass_fields__})
            snap.paths = dict(self._stats.paths)
            return snap

    @property
    def ring(self) -> StagingRing | None:
        """The staging ring, once a disk transfer has created it."""
        return self._ring

    def submit(self, src: TierStorage, dst: TierStorage, src_addr: npt.ArrayLike, dst_addr: npt.ArrayLike,
               nbytes: npt.ArrayLike) -> CopyHandle:
        """Queue copies of ``nbytes[i]`` bytes from ``src_addr[i]`` of tier ``src`` to ``dst_addr[i]`` of ``dst``.

        Checks happen here (a bad batch raises at once, nothing is copied): every range lies inside
        one pool of its tier, destination ranges are disjoint (and disjoint from the sources when
        both are one tier), and a CUDA tier is only used where CUDA and cuda-python exist.
        """
        if self._closed:
            raise TierError("copy engine is closed")
        for tier in (src, dst):
            if tier.closed:
                raise TierError(f"copy engine: the {tier.name} tier is closed")
            if tier.memory_kind == "cuda" and not cuda_usable():
                raise TierError(f"copy engine: the {tier.name} tier is on CUDA but CUDA or cuda-python is unavailable")
        runs = as_runs(src_addr, dst_addr, nbytes)
        requested = len(runs)
        src_pool = src.pool_of(runs.src, runs.nbytes, "source range")
        dst_pool = dst.pool_of(runs.dst, runs.nbytes, "destination range")
        live = runs.nbytes > 0
        if src is dst:
            check_disjoint(runs.dst[live], runs.nbytes[live], "destination", runs.src[live], runs.nbytes[live])
        else:
            check_disjoint(runs.dst[live], runs.nbytes[live], "destination")
        merged = coalesce_runs(runs, src_pool, dst_pool)
        handle = CopyHandle(merged.total_bytes, len(merged), requested)
        with self._stats_lock:
            self._stats.batches += 1
            self._stats.runs_requested += requested
            self._stats.runs_coalesced += len(merged)
        self._queue.put(_Job(src, dst, merged, handle))
        return handle

    def copy_slots(self, src: TierStorage, dst: TierStorage, pool_group: int, src_slots: npt.ArrayLike,
                   dst_slots: npt.ArrayLike) -> CopyHandle:
        """Copy whole slots (every pool of ``pool_group``): slot ``src_slots[i]`` of ``src`` to
        ``dst_slots[i]`` of ``dst``. Both tiers must have the same slot layout."""
        if src.layout.fingerprint != dst.layout.fingerprint:
            raise LayoutMismatch(f"copy_slots: {src.name} and {dst.name} tiers have different slot layouts "
                                 f"({src.layout.fingerprint.hex()[:12]} vs {dst.layout.fingerprint.hex()[:12]})")
        s, d = np.asarray(src_slots), np.asarray(dst_slots)
        if s.shape != d.shape or s.ndim != 1:
            raise TierError(f"copy_slots: src_slots {s.shape} and dst_slots {d.shape} must be equal-length 1-D")
        pools = src.layout.pool_groups[pool_group].pools if 0 <= pool_group < len(src.layout.pool_groups) else ()
        if not pools:
            raise TierError(f"copy_slots: no pool group {pool_group} in the {src.name} tier")
        src_addr = np.concatenate([src.slot_addresses(pool_group, p.pool_index, s) for p in pools])
        dst_addr = np.concatenate([dst.slot_addresses(pool_group, p.pool_index, d) for p in pools])
        sizes = np.repeat(np.array([p.slot_bytes for p in pools], dtype=np.uint64), len(s))
        return self.submit(src, dst, src_addr, dst_addr, sizes)

    def close(self) -> None:
        """Finish queued batches, stop the worker, release CUDA streams (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop_worker()
        if self._worker is not threading.current_thread():
            self._worker.join()
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=True)

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- worker -----------------------------------------------------------------------------------
    @staticmethod
    def _serve(engine_ref: weakref.ref[CopyEngine], jobs: queue.Queue[_Job | None],
               copiers: dict[int, CudaCopier]) -> None:
        """The worker: run jobs in order until the stop marker, then release the CUDA copiers."""
        try:
            while True:
                job = jobs.get()
                if job is None:
                    return
                engine = engine_ref()
                try:
                    if engine is None:
                        raise TierError("copy engine was garbage-collected before the copy ran")
                    engine._execute(job)
                except BaseException as exc:  # the handle carries every failure to its waiter
                    job.handle._finish(exc)
                else:
                    job.handle._finish(None)
                del engine
        finally:
            for copier in copiers.values():
                copier.close()
            copiers.clear()

    def _count(self, path: str, nbytes: int) -> None:
        with self._stats_lock:
            self._stats.paths[path] = self._stats.paths.get(path, 0) + 1
            self._stats.bytes_copied += nbytes
            if self._ring is not None:
                self._stats.ring_wraps = self._ring.wraps
            cuda = list(self._copiers.values())
            self._stats.cuda_batch_calls = sum(c.batch_calls for c in cuda)
            self._stats.cuda_single_calls = sum(c.single_calls for c in cuda)
            reasons = [c.fallback_reason for c in cuda if c.fallback_reason]
            self._stats.cuda_fallback_reason = reasons[0] if reasons else None
            if cuda:
                self._stats.cuda_batch_supported = all(c.batch_supported for c in cuda)

    def _execute(self, job: _Job) -> None:
        for tier in (job.src, job.dst):
            if tier.closed:
                raise TierError(f"copy engine: the {tier.name} tier was closed before the copy ran")
            if isinstance(tier, DiskTierStorage):
                tier.check_files()
        if not len(job.runs):
            self._count("empty", 0)
            return
        if job.src.is_file or job.dst.is_file:
            self._staged(job)
            self._count(f"{job.src.memory_kind}->{job.dst.memory_kind} (staged)", job.runs.total_bytes)
            return
        copier = self._copier_for(job.src, job.dst)
        if copier is None:
            _memmove_runs(job.runs.dst, job.runs.src, job.runs.nbytes)
        else:
            try:
                copier.enqueue(job.runs.dst, job.runs.src, job.runs.nbytes)
            finally:   # runs queued before a failing one finish before the batch is reported done
                copier.synchronize()
        self._count(f"{job.src.memory_kind}->{job.dst.memory_kind}", job.runs.total_bytes)

    def _copier_for(self, *tiers: TierStorage) -> CudaCopier | None:
        """The CUDA copier of the first CUDA tier among ``tiers`` (created on this worker thread)."""
        for tier in tiers:
            if tier.memory_kind == "cuda":
                dev = tier.device_id
                if dev not in self._copiers:
                    self._copiers[dev] = CudaCopier(dev, batch=self._cuda_batch)
                copier = self._copiers[dev]
                copier.make_current()
                return copier
        return None

    def _memory_mover(self, tier: TierStorage) -> _Mover:
        """The mover between ring addresses and ``tier``'s memory (CUDA stream copies or memmove)."""
        copier = self._copier_for(tier)
        return _Mover(copier)

    def _staged(self, job: _Job) -> None:
        """Disk transfers: chunk the runs, pass every chunk through the ring in groups."""
        if self._ring is None:
            self._ring = StagingRing(self.staging_bytes, pinned=self._pinned_staging)
        ring = self._ring
        limit = max(ring.capacity // 2 // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT, DIRECT_IO_ALIGNMENT)
        chunks = split_runs(job.runs, min(limit, IO_CHUNK_BYTES))
        sides: list[DiskTierStorage | _Mover] = []
        ends: list[list[Endpoint]] = []
        for tier, addr in ((job.src, chunks.src), (job.dst, chunks.dst)):
            if isinstance(tier, DiskTierStorage):
                file_index, offset = tier.resolve(addr, chunks.nbytes)
                sides.append(tier)
                ends.append(list(zip(file_index.tolist(), offset.tolist(), strict=True)))
            else:
                sides.append(self._memory_mover(tier))
                ends.append(addr.tolist())
        group = _StagedGroup(ring, sides[0], sides[1], self._io_pool)
        aligned = (chunks.nbytes % np.uint64(DIRECT_IO_ALIGNMENT) == 0).tolist()
        try:
            for i, n in enumerate(chunks.nbytes.tolist()):
                pos = ring.place(n, DIRECT_IO_ALIGNMENT if aligned[i] else SMALL_ALIGNMENT)
                if group.nbytes + n > limit or group.overlaps(pos, n):
                    # Full, or the ring lapped the open group: send it before its space is reused.
                    group.flush()
                    ring.submit(group)
                    group = _StagedGroup(ring, sides[0], sides[1], self._io_pool)
                ring.reserve(pos, n)
                group.add(pos, n, ends[0][i], ends[1][i])
            group.flush()
            ring.submit(group)
        finally:
            ring.drain()
        with self._stats_lock:
            self._stats.ring_chunks += len(chunks)


def _memmove_runs(dst: U64Array, src: U64Array, nbytes: U64Array) -> None:
    """CPU copies, one memmove per (already coalesced) run; memmove releases the GIL."""
    move = ctypes.memmove
    for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
        move(d, s, n)


class _Mover:
    """Copies between ring addresses and a memory tier: ``copy`` may return early, ``wait`` completes it."""

    def __init__(self, copier: CudaCopier | None) -> None:
        self._copier = copier

    def copy(self, dst: U64Array, src: U64Array, nbytes: U64Array) -> None:
        if self._copier is None:
            _memmove_runs(dst, src, nbytes)
        else:
            self._copier.enqueue(dst, src, nbytes)

    def wait(self) -> None:
        if self._copier is not None:
            self._copier.synchronize()


Endpoint = int | tuple[int, int]  # a memory address, or (file index, file offset)


class _StagedGroup(RingUser):
    """Chunks sharing one pass through the ring: source -> ring (complete), then ring -> destination.

    ``flush`` reads files synchronously and fills from memory to completion, then writes files or
    queues the copies to memory; ``finish`` waits for those queued copies, so a disk -> CUDA
    transfer overlaps the next group's file reads with this group's host-to-device copies.
    """

    def __init__(self, ring: StagingRing, src: DiskTierStorage | _Mover, dst: DiskTierStorage | _Mover,
                 io_pool: ThreadPoolExecutor | None) -> None:
        super().__init__()
        self._ring, self._src_side, self._dst_side, self._io_pool = ring, src, dst, io_pool
        self._src: list[Endpoint] = []
        self._dst: list[Endpoint] = []
        self.nbytes = 0

    def add(self, pos: int, n: int, src: Endpoint, dst: Endpoint) -> None:
        """Append one chunk at ring offset ``pos``."""
        self.segments.append((pos, pos + n))
        self._src.append(src)
        self._dst.append(dst)
        self.nbytes += n

    def flush(self) -> None:
        """Move every chunk into the ring, then out of it (out: possibly still in flight)."""
        if not self.segments:
            return
        ring = self._ring
        pos = np.array([a for a, _ in self.segments], dtype=np.uint64)
        size = np.array([b - a for a, b in self.segments], dtype=np.uint64)
        ring_addr = pos + np.uint64(ring.base_address)
        if isinstance(self._src_side, DiskTierStorage):
            self._file_io(self._src_side.read_into, self._src)
        else:
            self._src_side.copy(ring_addr, np.array(self._src, dtype=np.uint64), size)
            self._src_side.wait()
        if isinstance(self._dst_side, DiskTierStorage):
            self._file_io(self._dst_side.write_from, self._dst)
        else:
            self._dst_side.copy(np.array(self._dst, dtype=np.uint64), ring_addr, size)

    def _file_io(self, op: Callable[[int, int, memoryview], None], ends: list[Endpoint]) -> None:
        """Run ``op(file, offset, ring view)`` for every chunk: on the I/O threads (several requests in
        flight keep an NVMe queue busy; preadv/pwritev release the GIL), else one by one."""
        calls = []
        for (a, b), end in zip(self.segments, ends, strict=True):
            assert isinstance(end, tuple)
            calls.append((end[0], end[1], self._ring.view(a, b - a)))
        if self._io_pool is None or len(calls) == 1:
            for call in calls:
                op(*call)
            return
        futures = [self._io_pool.submit(op, *call) for call in calls]
        errors = [f.exception() for f in futures]  # wait for all before the ring space is reused
        for err in errors:
            if err is not None:
                raise err

    def finish(self) -> None:
        """Wait for the copies out of the ring to complete."""
        if isinstance(self._dst_side, _Mover):
            self._dst_side.wait()
