"""Per-transfer blake3 checksums: digest the pages a plan reads on the source side, verify on arrival.

Both sides see the same byte stream: entry ``i`` of ``plan.src`` and entry ``i`` of ``plan.dst`` hold
the same bytes once the transfer completed, so the source digests ``plan.src`` before (or while)
the data moves and the destination checks ``plan.dst`` afterwards. A ``ChecksumPolicy`` chooses the
entries: all of them, every k-th, or a seeded random subset; the choice depends only on the policy
and the entry count, so both peers compute it alone (nothing but the digest travels).

A ``TransferDigest`` holds one 32-byte root (blake3 over the selected entries' full blake3 digests and
lengths) and a short tag per selected entry, so a mismatch names the first bad entry and its
address. It is a small msgpack blob for a control message; decoding it is bounded (DecodeError).
The checksum guards against accidental corruption (transport bugs, layout mismatches, stale pages):
a peer that writes the bytes can also write a matching digest, so it is not an authenticity proof.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import blake3
import msgpack
import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import BackendUnavailable, ConfigError, DecodeError, IntegrityError, PageTableError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport.copy import host_view

DIGEST_VERSION = 1
MAX_DIGEST_ENTRIES = 1 << 20
"""Most entries one digest checks (tags of 8 bytes: 8 MiB)."""
MAX_PLAN_ENTRIES = 1 << 22
"""Most entries of a plan a digest describes (bounds what a peer's digest makes the verifier allocate)."""
MAX_TRANSFER_NAME = 256
MAX_DIGEST_BYTES = 64 + MAX_TRANSFER_NAME + 32 + MAX_DIGEST_ENTRIES * 32 + 1024
#: Entries at least this long are hashed with blake3's multi-threaded mode.
PARALLEL_HASH_BYTES = 1 << 20
#: CUDA entries are staged to host in groups of at most this many bytes (one device gather each).
CUDA_STAGE_BYTES = 64 << 20

Mode = Literal["full", "stride", "random"]
MODES: tuple[Mode, ...] = ("full", "stride", "random")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class ChecksumPolicy:
    """Which entries of a plan are checksummed, and how long each entry's tag is.

    ``full``: every entry. ``stride``: entries ``i`` with ``i % stride == seed % stride``.
    ``random``: each entry with probability ``fraction``, decided by a seeded 64-bit mix of its
    index (at least one entry of a non-empty plan). ``tag_bytes`` (4..32) per selected entry lets
    the verifier name the first bad one; the 32-byte root always covers every selected byte.
    """

    mode: Mode = "full"
    stride: int = 1
    fraction: float = 1.0
    seed: int = 0
    tag_bytes: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"ChecksumPolicy.mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or not 1 <= self.stride <= 1 << 32:
            raise ConfigError(f"ChecksumPolicy.stride must be an int in [1, 2**32], got {self.stride!r}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float) \
                or not math.isfinite(self.fraction) or not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"ChecksumPolicy.fraction must be in (0, 1], got {self.fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 64:
            raise ConfigError(f"ChecksumPolicy.seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.tag_bytes, bool) or not isinstance(self.tag_bytes, int) or not 4 <= self.tag_bytes <= 32:
            raise ConfigError(f"ChecksumPolicy.tag_bytes must be an int in [4, 32], got {self.tag_bytes!r}")

    @classmethod
    def every(cls, stride: int, seed: int = 0) -> ChecksumPolicy:
        """Every ``stride``-th entry, starting at entry ``seed % stride``."""
        return cls("stride", stride=stride, seed=seed)

    @classmethod
    def sample(cls, fraction: float, seed: int) -> ChecksumPolicy:
        """A seeded random subset of about ``fraction`` of the entries."""
        return cls("random", fraction=fraction, seed=seed)

    def select(self, count: int) -> npt.NDArray[np.int64]:
        """Ascending indices of the checksummed entries of a ``count``-entry plan (same on both peers)."""
        if count < 0:
            raise ConfigError(f"ChecksumPolicy.select: entry count must be >= 0, got {count}")
        index = np.arange(count, dtype=np.int64)
        if self.mode == "full" or count == 0:
            return index
        if self.mode == "stride":
            return index[self.seed % self.stride::self.stride]
        mixed = _splitmix64(index.astype(np.uint64) ^ np.uint64(self.seed))
        threshold = self.fraction * 2.0**64
        chosen = index[mixed.astype(np.float64) < threshold] if self.fraction < 1.0 else index
        return chosen if chosen.size else index[[int(np.argmin(mixed))]]

    def describe(self) -> str:
        """Short text for tables and logs: ``full``, ``every:K`` or ``sample:F`` (seed and tag when not default)."""
        text = {"full": "full", "stride": f"every:{self.stride}", "random": f"sample:{self.fraction:g}"}[self.mode]
        extras = [f"seed={self.seed}"] * (self.seed != 0 and self.mode != "full")
        extras += [f"tag={self.tag_bytes}B"] * (self.tag_bytes != 8)
        return text + (f" ({', '.join(extras)})" if extras else "")

    def to_wire(self) -> list[Any]:
        """``[mode, stride, fraction, seed, tag_bytes]`` for the digest's encoding."""
        return [self.mode, self.stride, float(self.fraction), self.seed, self.tag_bytes]


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser, vectorised (fully specified, so both peers agree on any numpy)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class TransferDigest:
    """What the source sends next to a transfer: the policy, the plan's shape, a root and entry tags."""

    transfer: str
    policy: ChecksumPolicy
    entry_count: int
    checked_bytes: int
    root: bytes
    tags: bytes

    @property
    def checked_entries(self) -> int:
        """How many entries the digest covers."""
        return len(self.tags) // self.policy.tag_bytes

    def to_bytes(self) -> bytes:
        """Versioned msgpack form: ``[v, transfer, policy, entry_count, checked_bytes, root, tags]``."""
        return bytes(msgpack.packb([DIGEST_VERSION, self.transfer, self.policy.to_wire(), self.entry_count,
                                    self.checked_bytes, self.root, self.tags], use_bin_type=True))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TransferDigest:
        """Decode ``to_bytes`` output from a peer; anything malformed raises DecodeError naming the field."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError(f"transfer digest: expected bytes, got {type(data).__name__}")
        if len(data) > MAX_DIGEST_BYTES:
            raise DecodeError(f"transfer digest: {len(data)} bytes exceed the limit of {MAX_DIGEST_BYTES}")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                                  max_str_len=MAX_TRANSFER_NAME, max_bin_len=min(MAX_DIGEST_ENTRIES * 32, len(data)),
                                  max_array_len=8, max_map_len=0, max_ext_len=0)
        except (ValueError, TypeError, OverflowError, RecursionError, MemoryError, msgpack.UnpackException) as exc:
            raise DecodeError(f"transfer digest: invalid msgpack ({type(exc).__name__}: {str(exc)[:80]})") from exc
        if not isinstance(obj, list) or len(obj) != 7:
            raise DecodeError(f"transfer digest: expected a 7-item array, got {_show(obj)}")
        version, transfer, raw_policy, entry_count, checked_bytes, root, tags = obj
        if version != DIGEST_VERSION or isinstance(version, bool):
            raise DecodeError(f"transfer digest.version: unsupported {_show(version)} (expected {DIGEST_VERSION})")
        if not isinstance(transfer, str) or len(transfer) > MAX_TRANSFER_NAME:
            raise DecodeError(f"transfer digest.transfer: expected a str of <= {MAX_TRANSFER_NAME} chars, "
                              f"got {_show(transfer)}")
        if not isinstance(raw_policy, list) or len(raw_policy) != 5:
            raise DecodeError(f"transfer digest.policy: expected [mode, stride, fraction, seed, tag_bytes], "
                              f"got {_show(raw_policy)}")
        try:
            policy = ChecksumPolicy(*raw_policy)
        except ConfigError as exc:
            raise DecodeError(f"transfer digest.policy: {exc}") from exc
        for name, value, hi in (("entry_count", entry_count, MAX_PLAN_ENTRIES),
                                ("checked_bytes", checked_bytes, (1 << 64) - 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
                raise DecodeError(f"transfer digest.{name}: expected an int in [0, {hi}], got {_show(value)}")
        if not isinstance(root, bytes) or len(root) != 32:
            raise DecodeError(f"transfer digest.root: expected 32 bytes, got {_show(root)}")
        if not isinstance(tags, bytes) or len(tags) % policy.tag_bytes:
            raise DecodeError(f"transfer digest.tags: expected a multiple of {policy.tag_bytes} bytes, "
                              f"got {_show(tags)}")
        digest = cls(transfer, policy, entry_count, checked_bytes, root, tags)
        expected = policy.select(entry_count).size
        if digest.checked_entries != expected:
            raise DecodeError(f"transfer digest.tags: {digest.checked_entries} tags, the policy selects "
                              f"{expected} of {entry_count} entries")
        return digest


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- computing -----------------------------------------------------------------------------------
def digest_table(table: PageTable, regions: Sequence[MemoryRegion], policy: ChecksumPolicy,
                 transfer: str) -> TransferDigest:
    """The digest of ``table``'s selected entries, read from local ``regions`` (host or CUDA memory)."""
    if not isinstance(transfer, str) or len(transfer) > MAX_TRANSFER_NAME:
        raise ConfigError(f"transfer name must be a str of <= {MAX_TRANSFER_NAME} chars, got {transfer!r:.80}")
    selected = policy.select(len(table))
    if len(table) > MAX_PLAN_ENTRIES or selected.size > MAX_DIGEST_ENTRIES:
        raise ConfigError(f"transfer {transfer!r}: a digest covers plans of <= {MAX_PLAN_ENTRIES} entries and "
                          f"checks <= {MAX_DIGEST_ENTRIES}; this plan has {len(table)}, the policy selects "
                          f"{selected.size} (coalesce the plan or sample)")
    table.validate(regions)
    full = _entry_digests(table, regions, selected)
    tags = b"".join(d[:policy.tag_bytes] for d in full)
    checked = int(table.nbytes[selected].sum(dtype=np.uint64))
    return TransferDigest(transfer, policy, len(table), checked,
                          _root(policy, len(table), table.nbytes[selected], full), tags)


def digest_source(plan: TransferPlan, src_regions: Sequence[MemoryRegion], policy: ChecksumPolicy,
                  transfer: str) -> TransferDigest:
    """Source side: the digest of the bytes ``plan`` reads."""
    return digest_table(plan.src, src_regions, policy, transfer)


def verify_table(table: PageTable, regions: Sequence[MemoryRegion], digest: TransferDigest) -> None:
    """Raise IntegrityError unless ``table``'s selected entries hold the bytes ``digest`` describes;
    the message names the transfer, the first differing entry and its address."""
    where = f"transfer {digest.transfer!r}"
    if len(table) != digest.entry_count:
        raise IntegrityError(f"{where}: digest covers a plan of {digest.entry_count} entries, the "
                             f"destination table has {len(table)}")
    try:
        table.validate(regions)
    except PageTableError as exc:
        raise IntegrityError(f"{where}: destination table cannot be checked: {exc}") from exc
    policy = digest.policy
    selected = policy.select(len(table))
    sizes = table.nbytes[selected]
    if int(sizes.sum(dtype=np.uint64)) != digest.checked_bytes or selected.size != digest.checked_entries:
        raise IntegrityError(f"{where}: digest covers {digest.checked_entries} entries of "
                             f"{digest.checked_bytes} bytes, the destination selects {selected.size} entries "
                             f"of {int(sizes.sum(dtype=np.uint64))} bytes (plans differ)")
    full = _entry_digests(table, regions, selected)
    if _root(policy, len(table), sizes, full) == digest.root:
        return
    width = policy.tag_bytes
    for k, d in enumerate(full):
        if d[:width] != digest.tags[k * width:(k + 1) * width]:
            i = int(selected[k])
            raise IntegrityError(
                f"{where}: entry {i} (destination {int(table.addr[i]):#x}, {int(table.nbytes[i])} bytes, "
                f"region {int(table.region[i])}) differs from the source: blake3 tag {d[:width].hex()} != "
                f"{digest.tags[k * width:(k + 1) * width].hex()} ({selected.size} of {len(table)} entries checked)")
    raise IntegrityError(f"{where}: checksum root differs although every entry tag matches (a corruption "
                         f"past the {width}-byte tags; {selected.size} of {len(table)} entries checked)")


def verify_destination(plan: TransferPlan, dst_regions: Sequence[MemoryRegion], digest: TransferDigest) -> None:
    """Destination side: check the bytes ``plan`` wrote against the source's ``digest``."""
    verify_table(plan.dst, dst_regions, digest)


def _root(policy: ChecksumPolicy, count: int, sizes: npt.NDArray[np.uint64], full: list[bytes]) -> bytes:
    """blake3 over the policy, the plan size, the selected entries' lengths and full digests."""
    hasher = blake3.blake3(msgpack.packb([DIGEST_VERSION, policy.to_wire(), count], use_bin_type=True))
    hasher.update(np.ascontiguousarray(sizes, dtype="<u8").tobytes())
    hasher.update(b"".join(full))
    return hasher.digest()


def _entry_digests(table: PageTable, regions: Sequence[MemoryRegion],
                   selected: npt.NDArray[np.int64]) -> list[bytes]:
    """Full 32-byte blake3 of each selected entry, in order (one hash per entry: that is the unit a
    mismatch is reported in)."""
    if not selected.size:
        return []
    region = table.region[selected]
    cuda = np.array([r.memory_kind == "cuda" for r in regions], dtype=bool)[region]
    out: list[bytes] = [b""] * int(selected.size)
    host = np.flatnonzero(~cuda)
    if host.size:
        views = {int(r): host_view(regions[int(r)]).data for r in np.unique(region[host])}
        bases = np.array([r.base_address for r in regions], dtype=np.uint64)
        offsets = (table.addr[selected[host]] - bases[region[host]]).tolist()
        lengths = table.nbytes[selected[host]].tolist()
        for k, r, off, n in zip(host.tolist(), region[host].tolist(), offsets, lengths, strict=True):
            out[k] = _hash(views[r][off:off + n], n)
    dev = np.flatnonzero(cuda)
    if dev.size:
        for ks, staged, starts in _stage_cuda(table, regions, selected, dev):
            flat = staged.data
            ends = starts[1:].tolist()
            for k, a, b in zip(ks.tolist(), starts[:-1].tolist(), ends, strict=True):
                out[k] = _hash(flat[a:b], b - a)
    return out


def _hash(data: memoryview, n: int) -> bytes:
    """blake3 of one entry's bytes (a memoryview slice, no copy); long entries use blake3's threads."""
    if n >= PARALLEL_HASH_BYTES:
        return blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
    return blake3.blake3(data).digest()


def _stage_cuda(table: PageTable, regions: Sequence[MemoryRegion], selected: npt.NDArray[np.int64],
                dev: npt.NDArray[np.intp]) -> Iterator[tuple[npt.NDArray[np.intp], npt.NDArray[np.uint8],
                                                             npt.NDArray[np.int64]]]:
    """Copy the CUDA entries ``dev`` (positions in ``selected``) to host in groups of about
    CUDA_STAGE_BYTES: (positions, host bytes, entry start offsets with the end appended)."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise BackendUnavailable(f"checksums of CUDA memory need torch: {exc}") from exc
    if not torch.cuda.is_available():
        raise BackendUnavailable("checksums of CUDA memory need a CUDA device; torch sees none here")
    entries = selected[dev]
    lengths = table.nbytes[entries].astype(np.int64)
    group = np.cumsum(lengths) // CUDA_STAGE_BYTES
    tensors: dict[int, Any] = {}
    for g in np.unique(group).tolist():
        ks = dev[group == g]
        pieces = []
        for i in selected[ks].tolist():
            r = int(table.region[i])
            if r not in tensors:
                tensors[r] = _cuda_tensor(regions[r], torch)
            off = int(table.addr[i]) - regions[r].base_address
            pieces.append(tensors[r][off:off + int(table.nbytes[i])])
        staged = torch.cat(pieces).cpu().numpy() if pieces else np.empty(0, np.uint8)
        starts = np.concatenate(([0], np.cumsum(table.nbytes[selected[ks]].astype(np.int64))))
        yield ks, staged, starts


class _CudaBytes:
    """A ``__cuda_array_interface__`` over a CUDA region's bytes, so torch can view it without a copy."""

    def __init__(self, region: MemoryRegion) -> None:
        self.__cuda_array_interface__ = {"shape": (region.nbytes,), "typestr": "|u1",
                                         "data": (region.base_address, False), "version": 3, "strides": None}


def _cuda_tensor(region: MemoryRegion, torch: Any) -> Any:
    """A uint8 torch tensor viewing ``region`` on its device."""
    with torch.cuda.device(region.device_id):
        return torch.as_tensor(_CudaBytes(region), device=f"cuda:{region.device_id}")
