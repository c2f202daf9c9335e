"""Block-id inputs: a mapping layer group -> slot ids (or a KVCache), checked against a layout."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.errors import BlockIdError

I64 = npt.NDArray[np.int64]


@runtime_checkable
class HasBlockIdMap(Protocol):
    """Anything that can list its block ids per layer group, such as a KVCache."""

    def block_id_map(self) -> Mapping[int, npt.ArrayLike]: ...


BlockIds = Mapping[int, npt.ArrayLike] | HasBlockIdMap


def block_id_map(layout: CacheLayoutDesc, block_ids: BlockIds | Any, layer_groups: Iterable[int],
                 side: str) -> dict[int, I64]:
    """The block ids of ``layer_groups`` as int64 arrays, each id checked to be -1 (no page) or a slot
    of the layer group's pool group; raises BlockIdError naming the side, group, position and id."""
    if isinstance(block_ids, HasBlockIdMap):
        block_ids = block_ids.block_id_map()
    if not isinstance(block_ids, Mapping):
        raise BlockIdError(f"{side} block ids: expected a mapping layer group -> ids or a KVCache, got "
                           f"{type(block_ids).__name__}")
    out: dict[int, I64] = {}
    for g in layer_groups:
        if g not in block_ids:
            raise BlockIdError(f"{side} block ids: no entry for layer group {g} (have {sorted(block_ids)})")
        raw = np.asarray(block_ids[g])
        if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
            raise BlockIdError(f"{side} block ids of layer group {g}: expected a 1-D integer array, got shape "
                               f"{raw.shape} dtype {raw.dtype}")
        ids = raw.astype(np.int64)
        num_slots = layout.pool_groups[layout.layer_groups[g].pool_group_index].num_slots
        bad = raw >= num_slots if raw.dtype.kind == "u" else (ids < -1) | (ids >= num_slots)
        if bad.any():
            i = int(np.argmax(bad))
            raise BlockIdError(f"{side} block ids of layer group {g}: position {i} holds {raw[i]}, outside "
                               f"[-1, {num_slots}) (the pool group's slots)")
        out[g] = ids
    return out


def check_distinct(layout: CacheLayoutDesc, ids: Mapping[int, I64], side: str) -> None:
    """Raise BlockIdError when one slot is listed twice among the layer groups of one pool group: a plan
    writing there would write some bytes twice."""
    by_pool_group: dict[int, list[I64]] = {}
    for g, arr in ids.items():
        by_pool_group.setdefault(layout.layer_groups[g].pool_group_index, []).append(arr[arr >= 0])
    for pg, parts in by_pool_group.items():
        every = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if every.size < 2:
            continue
        ordered = np.sort(every)
        dup = ordered[1:] == ordered[:-1]
        if dup.any():
            raise BlockIdError(f"{side} block ids: slot {int(ordered[1:][dup][0])} of pool group {pg} is listed "
                               f"twice")
