"""Sliding-window scratch slots: which blocks of a prefill step get no page of their own, and how many
shared slots stand in for them.

During a prefill step a sliding-window layer needs the KV of a block that falls out of the window by
the step's end only while that layer runs; layers run one after another, so every layer of a layer
group can write such blocks into the same memory. A coalesced slot holds one block of every buffer of
the layer group; given to one layer it holds ``1 / share`` blocks, where ``share`` is the largest part
of a slot (over its pools) one layer's buffers take. ``n`` scratch blocks thus need
``ceil(n * share)`` slots, and block ``i`` of the scratch range lives at sub-page
``i * pages_per_block`` of those slots, shifted by the buffer's own sub-page (see
``PageIndexConverter``).
"""

from __future__ import annotations

import math
from fractions import Fraction

from kvxfer.cache.common import HalfOpenRange, div_up
from kvxfer.cache.descriptors import BufferId, SlotDescVariant

__all__ = ["layer_pages_per_block", "scratch_range", "scratch_share", "scratch_slots_needed"]


def scratch_range(window: int | None, sink_tokens: int, history: int, capacity: int, tokens_per_block: int,
                  max_rewind_len: int) -> HalfOpenRange[int]:
    """Blocks of the step ``[history, capacity)`` that use scratch slots: the step's blocks
    (``[ceil(history / tpb), ceil(capacity / tpb))``, earlier ones hold KV of earlier steps) that are
    out of the window once the step's tokens, less the last ``max_rewind_len`` (which may be rolled
    back and so keep pages), are history. Empty for a full-attention layer group."""
    if window is None:
        return HalfOpenRange(0, 0)
    kept = max(0, capacity - max_rewind_len)
    sink_blocks = div_up(sink_tokens, tokens_per_block)
    stale_beg = min(div_up(kept, tokens_per_block), sink_blocks)
    stale_end = max(stale_beg, (kept + 1 - window) // tokens_per_block)
    beg = max(stale_beg, div_up(history, tokens_per_block))
    end = min(stale_end, div_up(capacity, tokens_per_block))
    return HalfOpenRange(beg, end) if end > beg else HalfOpenRange(0, 0)


def layer_pages_per_block(variant: SlotDescVariant, buffer_id: BufferId) -> int:
    """Sub-pages one scratch block of ``buffer_id``'s layer takes in the pool holding ``buffer_id``:
    the number of that layer's buffers coalesced there (key and value of one size: 2)."""
    for cb in variant.coalesced_buffers:
        if buffer_id in cb.buffer_ids:
            return sum(1 for b in cb.buffer_ids if b.layer_id == buffer_id.layer_id)
    raise KeyError(buffer_id)


def scratch_share(variant: SlotDescVariant) -> Fraction:
    """The largest part of one of the layer group's slots that one layer's buffers take (over its
    pools): ``1 / layers`` when every layer has the same buffers."""
    share = Fraction(0)
    for cb in variant.coalesced_buffers:
        per_layer: dict[int, int] = {}
        for b in cb.buffer_ids:
            per_layer[b.layer_id] = per_layer.get(b.layer_id, 0) + 1
        for count in per_layer.values():
            share = max(share, Fraction(count, cb.num_buffers))
    return share


def scratch_slots_needed(num_blocks: int, share: Fraction) -> int:
    """Slots that hold ``num_blocks`` scratch blocks of a layer group whose layers each take ``share``
    of a slot."""
    return math.ceil(num_blocks * share)
