"""Token segments: the pieces of a token range that lie in one block on each side.

A segment never crosses a block boundary of either side, so inside it both sides address tokens
with one affine rule; segments where either side has no page (-1) are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError, ReadOnlyPageError

I64 = npt.NDArray[np.int64]
MAX_TOKEN = 1 << 62
"""An open token range's stop."""


@dataclass(frozen=True)
class Segments:
    """Parallel arrays, one item per segment, in token order."""

    start: I64      # first token (global position)
    length: I64     # tokens
    src_slot: I64   # source slot id
    src_tok: I64    # token offset inside the source block
    dst_slot: I64
    dst_tok: I64

    def take(self, mask: npt.NDArray[np.bool_]) -> Segments:
        """The segments where ``mask`` is true."""
        return Segments(self.start[mask], self.length[mask], self.src_slot[mask], self.src_tok[mask],
                        self.dst_slot[mask], self.dst_tok[mask])

    def __len__(self) -> int:
        return int(self.start.size)


def check_token_range(token_range: tuple[int, int] | None) -> tuple[int, int] | None:
    """``token_range`` as (start, stop) ints with 0 <= start <= stop, or PageTableError."""
    if token_range is None:
        return None
    try:
        lo, hi = token_range
    except (TypeError, ValueError) as exc:
        raise PageTableError(f"token_range must be (start, stop), got {token_range!r}") from exc
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise PageTableError(f"token_range must hold ints, got {token_range!r}")
    if not 0 <= lo <= hi:
        raise PageTableError(f"token_range must satisfy 0 <= start <= stop, got {token_range!r}")
    return int(lo), int(hi)


def token_segments(src_ids: I64, src_tpb: int, dst_ids: I64, dst_tpb: int,
                   token_range: tuple[int, int] | None) -> Segments:
    """Segments of the tokens both block lists cover (inside ``token_range``) where both have a page."""
    lo, hi = 0, min(src_ids.size * src_tpb, dst_ids.size * dst_tpb)
    if token_range is not None:
        lo, hi = max(lo, token_range[0]), min(hi, token_range[1])
    if hi <= lo:
        empty = np.empty(0, np.int64)
        return Segments(empty, empty, empty, empty, empty, empty)
    src_cuts = np.arange(-(-lo // src_tpb) * src_tpb, hi, src_tpb, dtype=np.int64)
    if src_tpb == dst_tpb:
        inner = src_cuts[src_cuts > lo]
    else:
        dst_cuts = np.arange(-(-lo // dst_tpb) * dst_tpb, hi, dst_tpb, dtype=np.int64)
        inner = np.union1d(src_cuts, dst_cuts)
        inner = inner[inner > lo]
    bounds = np.concatenate([np.array([lo], np.int64), inner, np.array([hi], np.int64)])
    start, length = bounds[:-1], np.diff(bounds)
    src_block, src_tok = np.divmod(start, src_tpb)
    dst_block, dst_tok = np.divmod(start, dst_tpb)
    src_slot, dst_slot = src_ids[src_block], dst_ids[dst_block]
    keep = (src_slot >= 0) & (dst_slot >= 0)
    segs = Segments(start, length, src_slot, src_tok, dst_slot, dst_tok)
    return segs if keep.all() else segs.take(keep)


def refuse_read_only(segs: Segments, layer_group: int, read_only: int, dst_tpb: int) -> None:
    """Raise ReadOnlyPageError when a segment lands in a destination block before token ``read_only``
    (blocks the destination committed and may share with its prefix tree)."""
    bad = segs.start < read_only
    if bad.any():
        i = int(np.argmax(bad))
        start = int(segs.start[i])
        raise ReadOnlyPageError(
            f"destination layer group {layer_group} block {start // dst_tpb} (slot {int(segs.dst_slot[i])}) is "
            f"committed and may be shared with its prefix tree, yet the plan writes tokens [{start}, "
            f"{start + int(segs.length[i])}) there ({int(bad.sum())} segments do; the destination holds tokens "
            f"before {read_only} read-only: plan from there)")
