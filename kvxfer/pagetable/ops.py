"""Vectorised array operations shared by PageTable and TransferPlan: runs, pieces, balanced cuts."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]


def joins_previous(addr: U64, nbytes: U64, region: U32) -> npt.NDArray[np.bool_]:
    """``out[i]``: entry ``i`` starts where entry ``i - 1`` ends, in the same region (``out[0]`` False)."""
    out = np.zeros(addr.size, dtype=bool)
    if addr.size > 1:
        out[1:] = (addr[:-1] + nbytes[:-1] == addr[1:]) & (region[:-1] == region[1:])
    return out


def run_starts(joins: npt.NDArray[np.bool_]) -> I64:
    """Indices of the entries that start a run (those that do not join their predecessor)."""
    return np.flatnonzero(~joins).astype(np.int64)


def run_lengths(nbytes: U64, starts: I64) -> U64:
    """Bytes of each run whose first entries are ``starts``."""
    if not starts.size:
        return np.empty(0, dtype=np.uint64)
    return np.add.reduceat(nbytes, starts).astype(np.uint64)


def check_max_bytes(max_bytes: int) -> int:
    """``max_bytes`` as an int > 0, or PageTableError."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int | np.integer) or max_bytes <= 0:
        raise PageTableError(f"split: max_bytes must be an int > 0, got {max_bytes!r}")
    return int(max_bytes)


def split_pieces(nbytes: U64, max_bytes: int) -> tuple[I64, U64, U64]:
    """Cut every entry into pieces of at most ``max_bytes``: (source entry, byte offset, length) of each
    piece, in order. A zero-length entry stays one zero-length piece."""
    step = np.uint64(check_max_bytes(max_bytes))
    pieces = np.maximum((nbytes + (step - np.uint64(1))) // step, np.uint64(1)).astype(np.int64)
    entry = np.repeat(np.arange(nbytes.size, dtype=np.int64), pieces)
    first = np.cumsum(pieces) - pieces
    k = (np.arange(entry.size, dtype=np.int64) - np.repeat(first, pieces)).astype(np.uint64)
    offset = k * step
    length = np.minimum(step, nbytes[entry] - offset)
    return entry, offset, length


def balanced_cuts(nbytes: U64, n: int) -> list[tuple[int, int]]:
    """At most ``n`` consecutive, non-empty ``[start, stop)`` entry ranges of nearly equal bytes; no entry
    is cut (split first to get finer parts)."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise PageTableError(f"chunks: n must be an int >= 1, got {n!r}")
    count = int(nbytes.size)
    if not count:
        return []
    prefix = np.concatenate([[0.0], np.cumsum(nbytes, dtype=np.float64)])
    targets = prefix[-1] * np.arange(1, int(n), dtype=np.float64) / int(n)
    hi = np.clip(np.searchsorted(prefix, targets), 1, count)
    lo = hi - 1
    nearer = np.where(np.abs(prefix[lo] - targets) <= np.abs(prefix[hi] - targets), lo, hi)
    bounds = np.unique(np.concatenate([[0], nearer, [count]]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a]
