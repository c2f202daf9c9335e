"""Storage tiers: pools with the primary tier's slot layout, their own slot allocators, byte addressing.

Every tier lays out one pool per PoolDesc of ``plan_layout(config, tier quota)``, so slot ``i`` of
pool ``p`` holds exactly the bytes slot ``j`` of the primary pool ``p`` holds: moving a block
between tiers is a copy of whole slots, never a reformat. Memory tiers (primary, host) address
slots by real virtual addresses; the disk tier maps its files into a private address space (one
disjoint range per file) so the copy engine handles every tier with one (address, nbytes) model.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.config import CacheConfig, DiskTier, HostTier
from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.cache.memory import MemoryRegion, allocate_pool
from kvxfer.errors import ConfigError, TierError

U64Array = npt.NDArray[np.uint64]
IntArray = npt.NDArray[np.int64]
TierT = TypeVar("TierT", HostTier, DiskTier)

#: Alignment of O_DIRECT offsets, lengths and buffers (the common logical block size of NVMe/ext4/xfs).
DIRECT_IO_ALIGNMENT = 4096
#: First address of the disk tier's private address space (0 means "unplaced" in a PoolDesc).
DISK_ADDRESS_BASE = 1 << 32
#: Unused bytes between two files' address ranges, so no coalesced run ever spans two files.
DISK_FILE_GAP = 1 << 20
#: Pool files whose owner is gone (no process holds their lock) and which are at least this old are
#: removed by the next disk tier made in the same directory: a killed process cannot remove its own.
ORPHAN_MIN_AGE_S = 10.0
_POOL_FILE = re.compile(r"kvxfer-[0-9]+-[0-9a-f]{12}-pg[0-9]+-pool[0-9]+\.kv")


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class TierStats:
    """Capacity and occupancy of one tier (per pool group)."""

    name: str
    memory_kind: str
    total_bytes: int
    slots_total: tuple[int, ...]
    slots_used: tuple[int, ...]

    @property
    def used_bytes_fraction(self) -> float:
        """Used slots over all slots, all pool groups together."""
        total = sum(self.slots_total)
        return sum(self.slots_used) / total if total else 0.0


class TierStorage:
    """Common part of every tier: a placed layout, one SlotAllocator per pool group, byte addressing.

    ``memory_kind`` is "cuda", "pinned", "cpu" (addresses are real pointers) or "disk" (addresses
    are in the tier's private file address space, resolved by DiskTierStorage.resolve).
    """

    def __init__(self, name: str, layout: CacheLayoutDesc, allocators: list[SlotAllocator] | None) -> None:
        self.name = name
        self._layout = layout
        self._allocators = allocators if allocators is not None else [
            SlotAllocator(pg.num_slots, f"{name} tier pool group {pg.pool_group_index}") for pg in layout.pool_groups]
        pools = [p for pg in layout.pool_groups for p in pg.pools]
        order = np.argsort(np.array([p.base_address for p in pools], dtype=np.uint64), kind="stable")
        self._span_pool = order.astype(np.int64)
        self._span_start = np.array([pools[i].base_address for i in order], dtype=np.uint64)
        self._span_end = np.array([pools[i].end_address for i in order], dtype=np.uint64)
        self._closed = False

    # --- description ----------------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayoutDesc:
        """This tier's layout: the primary tier's slot structure, placed at this tier's addresses."""
        return self._layout

    @property
    def memory_kind(self) -> str:
        """Where the bytes live: "cuda", "pinned", "cpu" or "disk"."""
        return self._layout.pool_groups[0].pools[0].memory_kind

    @property
    def device_id(self) -> int:
        """CUDA device index of a "cuda" tier (0 otherwise)."""
        return self._layout.pool_groups[0].pools[0].device_id

    @property
    def is_file(self) -> bool:
        """Whether the bytes live in files (read and written through the copy engine's staging ring)."""
        return self.memory_kind == "disk"

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def allocator(self, pool_group: int) -> SlotAllocator:
        """This tier's slot allocator of ``pool_group``."""
        if not 0 <= pool_group < len(self._allocators):
            raise TierError(f"{self.name} tier: no pool group {pool_group} (have 0..{len(self._allocators) - 1})")
        return self._allocators[pool_group]

    def stats(self) -> TierStats:
        """Capacity and current occupancy."""
        total = sum(p.nbytes for pg in self._layout.pool_groups for p in pg.pools)
        return TierStats(self.name, self.memory_kind, total,
                         tuple(a.usable for a in self._allocators), tuple(a.num_used for a in self._allocators))

    # --- addressing -----------------------------------------------------------------------------
    def slot_addresses(self, pool_group: int, pool: int, slots: npt.ArrayLike) -> U64Array:
        """Address of each slot of ``slots`` in pool ``pool`` of ``pool_group`` (vectorised)."""
        self._check_open()
        pg = self._layout.pool_groups[pool_group] if 0 <= pool_group < len(self._layout.pool_groups) else None
        if pg is None or not 0 <= pool < len(pg.pools):
            raise TierError(f"{self.name} tier: no pool {pool_group}.{pool}")
        ids = self.allocator(pool_group).check(slots, "slot id").astype(np.uint64)
        desc = pg.pools[pool]
        return np.uint64(desc.base_address) + ids * np.uint64(desc.slot_bytes)

    def pool_of(self, addr: U64Array, nbytes: U64Array, what: str = "range") -> IntArray:
        """Flat pool index (pools in (pool group, pool) order) of each range; TierError when any range
        is not inside one pool of this tier."""
        idx = np.searchsorted(self._span_start, addr, side="right").astype(np.int64) - 1
        inside = idx >= 0
        safe = np.where(inside, idx, 0)
        inside &= addr + nbytes <= self._span_end[safe]
        inside &= addr + nbytes >= addr  # no wrap-around of huge sizes
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise TierError(f"{self.name} tier: {what} {bad} [{int(addr[bad]):#x}, +{int(nbytes[bad])}) is not "
                            f"inside one pool of this tier")
        return self._span_pool[safe]

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name} tier is closed")

    def close(self) -> None:
        """Release the tier's storage (idempotent)."""
        self._closed = True

    def __enter__(self) -> TierStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryTierStorage(TierStorage):
    """A tier of torch byte tensors: the primary pools (CUDA or CPU) or the host tier (pinned or not)."""

    def __init__(self, name: str, layout: CacheLayoutDesc, pools: list[list[torch.Tensor]],
                 allocators: list[SlotAllocator] | None = None, *, owns_pools: bool = True) -> None:
        super().__init__(name, layout, allocators)
        self._pools = pools
        self._owns_pools = owns_pools

    def pool_tensor(self, pool_group: int, pool: int) -> torch.Tensor:
        """The raw byte tensor of one pool."""
        self._check_open()
        return self._pools[pool_group][pool]

    def memory_regions(self) -> list[MemoryRegion]:
        """One region per pool, in (pool group, pool) order."""
        self._check_open()
        return [MemoryRegion.of_tensor(t) for group in self._pools for t in group]

    def close(self) -> None:
        if self._owns_pools:
            self._pools = [[] for _ in self._pools]
        super().close()


def open_host_tier(config: CacheConfig, tier: HostTier | None = None,
                   num_slots: Sequence[int] | None = None) -> MemoryTierStorage:
    """The host tier of ``config`` (or ``tier``): page-locked where CUDA exists unless ``pinned=False``;
    ``num_slots[pg]`` slots per pool group when given (else the quota split by ``plan_layout``)."""
    tier = tier if tier is not None else _tier_of(config, HostTier)
    pinned = torch.cuda.is_available() if tier.pinned is None else tier.pinned
    if pinned and not torch.cuda.is_available():
        raise TierError("HostTier.pinned=True needs CUDA (page-locking is a CUDA host allocation); "
                        "use pinned=None or False on this machine")
    plan = _plan(config, tier.quota_bytes, "HostTier", num_slots)
    pools = [[allocate_pool(p.nbytes, "cpu", pinned=pinned) for p in pg.pools] for pg in plan.pool_groups]
    bases = [[int(t.data_ptr()) for t in group] for group in pools]
    layout = place_layout(plan, bases, "pinned" if pinned else "cpu", 0)
    return MemoryTierStorage("host", layout, pools)


class PrimaryPools(Protocol):
    """What a primary-tier view needs of its owner (the KVCacheManager): the placed layout, the pool
    tensors and the slot allocators. A protocol, so this module never imports the manager."""

    @property
    def layout(self) -> CacheLayoutDesc: ...

    def pool_tensor(self, pool_group: int, pool: int) -> torch.Tensor: ...

    def allocator(self, pool_group: int, tier: int = 0) -> SlotAllocator: ...


def primary_tier_of(manager: PrimaryPools) -> MemoryTierStorage:
    """A tier view over the manager's primary pools and allocators (it owns neither)."""
    layout = manager.layout
    pools = [[manager.pool_tensor(pg.pool_group_index, p.pool_index) for p in pg.pools] for pg in layout.pool_groups]
    allocators = [manager.allocator(pg.pool_group_index) for pg in layout.pool_groups]
    return MemoryTierStorage("primary", layout, pools, allocators, owns_pools=False)


def _tier_of(config: CacheConfig, kind: type[TierT]) -> TierT:
    found = config.tier(kind)
    if not isinstance(found, kind):
        raise ConfigError(f"the cache config has no {kind.__name__} (tiers: {[type(t).__name__ for t in config.tiers]})")
    return found


def _plan(config: CacheConfig, quota_bytes: int, what: str, num_slots: Sequence[int] | None = None) -> CacheLayoutDesc:
    try:
        return plan_layout(config, quota_bytes, num_slots)
    except ConfigError as exc:
        raise TierError(f"{what}.quota_bytes={quota_bytes}: {exc}") from exc


@dataclass
class _PoolFile:
    path: str
    size: int
    fd: int
    direct_fd: int  # -1 when O_DIRECT is not used for this file


class DiskTierStorage(TierStorage):
    """The coldest tier: one preallocated file per pool under ``DiskTier.path``, removed on close.

    Reads and writes go through ``read_into``/``write_from``: O_DIRECT when the filesystem allows it
    and the range and buffer are aligned to DIRECT_IO_ALIGNMENT, ordinary buffered I/O otherwise.
    Checks happen at construction (missing, non-directory or unwritable path, no space), so a bad
    path fails at start, not at the first eviction.
    """

    def __init__(self, config: CacheConfig, tier: DiskTier | None = None, *, direct_io: bool | None = None,
                 num_slots: Sequence[int] | None = None) -> None:
        """``num_slots[pg]``: slots per pool group (default: the quota split by ``plan_layout``)."""
        tier = tier if tier is not None else _tier_of(config, DiskTier)
        _check_directory(tier.path)
        reclaim_orphan_files(tier.path)
        plan = _plan(config, tier.quota_bytes, "DiskTier", num_slots)
        self._files: list[_PoolFile] = []
        stem = f"kvxfer-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        bases: list[list[int]] = []
        cursor = DISK_ADDRESS_BASE
        try:
            for pg in plan.pool_groups:
                group_bases = []
                for pool in pg.pools:
                    path = os.path.join(tier.path, f"{stem}-pg{pg.pool_group_index}-pool{pool.pool_index}.kv")
                    self._files.append(_create_pool_file(path, pool.nbytes, direct_io))
                    group_bases.append(cursor)
                    cursor = _align_up(cursor + pool.nbytes + DISK_FILE_GAP, DISK_FILE_GAP)
                bases.append(group_bases)
        except BaseException:
            _remove_pool_files(self._files)
            raise
        # A tier collected without close (its manager dropped without shutdown) still removes its
        # files, as does one alive at interpreter exit; close runs the same call once.
        self._release_files = weakref.finalize(self, _remove_pool_files, self._files)
        super().__init__("disk", place_layout(plan, bases, "disk", 0), None)
        self.path = tier.path
        self._file_base = np.array([b for group in bases for b in group], dtype=np.uint64)

    # --- description ----------------------------------------------------------------------------
    @property
    def file_paths(self) -> tuple[str, ...]:
        """The pool files, in (pool group, pool) order."""
        return tuple(f.path for f in self._files)

    @property
    def direct_io(self) -> bool:
        """Whether aligned transfers use O_DIRECT (all files agree: they share a directory)."""
        return bool(self._files) and all(f.direct_fd >= 0 for f in self._files)

    def resolve(self, addr: U64Array, nbytes: U64Array) -> tuple[IntArray, U64Array]:
        """(file index, offset in that file) of each range; TierError when a range is outside the files."""
        self._check_open()
        pool = self.pool_of(addr, nbytes)
        return pool, addr - self._file_base[pool]

    def check_files(self) -> None:
        """Raise TierError when a pool file was removed or truncated behind the tier's back."""
        self._check_open()
        for f in self._files:
            try:
                st = os.fstat(f.fd)
            except OSError as exc:
                raise TierError(f"disk tier file {f.path}: {exc}") from exc
            if st.st_nlink == 0:
                raise TierError(f"disk tier file {f.path} was removed while the tier is open")
            if st.st_size < f.size:
                raise TierError(f"disk tier file {f.path} was truncated to {st.st_size} bytes (expected {f.size})")

    # --- I/O ------------------------------------------------------------------------------------
    def read_into(self, file_index: int, offset: int, buf: memoryview) -> None:
        """Read ``len(buf)`` bytes at ``offset`` of pool file ``file_index`` into ``buf``."""
        self._io(file_index, offset, buf, write=False)

    def write_from(self, file_index: int, offset: int, buf: memoryview) -> None:
        """Write ``buf`` at ``offset`` of pool file ``file_index``."""
        self._io(file_index, offset, buf, write=True)

    def _io(self, file_index: int, offset: int, buf: memoryview, *, write: bool) -> None:
        self._check_open()
        f = self._files[file_index]
        n = len(buf)
        if offset < 0 or offset + n > f.size:
            raise TierError(f"disk tier file {f.path}: range [{offset}, +{n}) outside its {f.size} bytes")
        fd = f.direct_fd if f.direct_fd >= 0 and _aligned(offset, n, buf) else f.fd
        done = 0
        while done < n:
            part = buf[done:]
            try:
                got = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
            except OSError as exc:
                verb = "write" if write else "read"
                raise TierError(f"disk tier file {f.path}: {verb} of {n - done} bytes at offset {offset + done} "
                                f"failed: {exc}") from exc
            if got == 0:
                raise TierError(f"disk tier file {f.path}: {'write' if write else 'read'} at offset "
                                f"{offset + done} made no progress (file truncated?)")
            done += got

    def close(self) -> None:
        """Close and remove the pool files (idempotent)."""
        self._release_files()
        super().close()


def _remove_pool_files(files: list[_PoolFile]) -> None:
    """Close the descriptors of ``files``, remove the files, and empty the list."""
    for f in files:
        for fd in (f.fd, f.direct_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.path)
    files.clear()


def _aligned(offset: int, nbytes: int, buf: memoryview) -> bool:
    a = DIRECT_IO_ALIGNMENT
    address = np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0] if nbytes else 0
    return offset % a == 0 and nbytes % a == 0 and address % a == 0


def _check_directory(path: str) -> None:
    if not os.path.exists(path):
        raise TierError(f"DiskTier.path {path!r} does not exist")
    if not os.path.isdir(path):
        raise TierError(f"DiskTier.path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise TierError(f"DiskTier.path {path!r} is not writable by this process")


def _create_pool_file(path: str, size: int, direct_io: bool | None) -> _PoolFile:
    """Create and preallocate one pool file; open an O_DIRECT descriptor when allowed and working."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise TierError(f"DiskTier: cannot create pool file {path!r}: {exc}") from exc
    entry = _PoolFile(path, size, fd, -1)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # held while this process lives: see reclaim_orphan_files
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise TierError(f"DiskTier: cannot preallocate {size} bytes for {path!r}: {exc}") from exc
            os.ftruncate(fd, size)  # filesystems without fallocate: a sparse file of the right size
        if direct_io is not False:
            entry.direct_fd = _open_direct(path)
            if direct_io and entry.direct_fd < 0:
                raise TierError(f"DiskTier: direct_io=True but {os.path.dirname(path)!r} does not support O_DIRECT")
    except BaseException:
        os.close(fd)
        if entry.direct_fd >= 0:
            os.close(entry.direct_fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return entry


def reclaim_orphan_files(directory: str) -> list[str]:
    """Remove the pool files in ``directory`` that no live process owns (a disk tier holds an exclusive
    ``flock`` on each of its files until it closes them or its process ends, SIGKILL included) and that
    are at least ORPHAN_MIN_AGE_S old (a file being created is not locked yet). Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _POOL_FILE.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_ctime < ORPHAN_MIN_AGE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue   # its owner is alive
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _open_direct(path: str) -> int:
    """An O_DIRECT descriptor of ``path`` whose aligned reads work, or -1 (no O_DIRECT here)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        fd = os.open(path, os.O_RDWR | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1
    probe = mmap.mmap(-1, DIRECT_IO_ALIGNMENT)  # page-aligned scratch buffer
    try:
        os.preadv(fd, [probe], 0)
    except OSError:
        os.close(fd)
        return -1
    finally:
        probe.close()
    return fd
