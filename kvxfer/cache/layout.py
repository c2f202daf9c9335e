"""Layout construction: layers -> layer groups -> coalesced slots -> pool groups -> CacheLayoutDesc.

Rules (DESIGN.md "Vocabulary"):
- layers with the same (window, sink_tokens) form a layer group, ordered by their first layer id;
- inside a layer group, buffers of equal size are coalesced into one slot (one pool per size), or
  each buffer gets its own pool when ``coalesce=False``;
- layer groups whose pools have the same (buffer size, buffers per slot) list share one pool group,
  so one slot allocator serves them all (a stricter key than "same slot sizes": it guarantees that
  every group's buffers tile the shared slots the same way);
- the primary quota is split so that every layer group gets the same number of slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvxfer.cache.config import CacheConfig
from kvxfer.cache.descriptors import (
    LAYOUT_VERSION,
    BufferFormat,
    BufferId,
    CacheLayoutDesc,
    CoalescedBuffer,
    LayerGroupDesc,
    PoolDesc,
    PoolGroupDesc,
    SlotDesc,
)
from kvxfer.errors import ConfigError, LayoutError

__all__ = [
    "LAYOUT_VERSION",
    "BufferFormat",
    "BufferId",
    "CacheLayoutDesc",
    "CoalescedBuffer",
    "LayerGroupDesc",
    "PoolDesc",
    "PoolGroupDesc",
    "SlotDesc",
    "buffer_formats",
    "place_layout",
    "plan_layout",
]


def buffer_formats(config: CacheConfig) -> dict[BufferId, BufferFormat]:
    """The format of every (layer, role) buffer this rank holds."""
    out: dict[BufferId, BufferFormat] = {}
    for layer in config.layers:
        start, heads = config.local_heads(layer)
        for role in layer.role_specs:
            out[BufferId(layer.layer_id, role.name)] = BufferFormat(
                dtype=role.dtype or config.dtype, head_dim=role.head_dim or layer.head_dim,
                tokens_per_block=config.tokens_per_block, head_start=start, num_heads=heads,
                total_heads=layer.num_kv_heads, order=config.head_order)
    return out


def _group_slots(config: CacheConfig, layer_ids: Sequence[int],
                 formats: dict[BufferId, BufferFormat]) -> list[CoalescedBuffer]:
    """The coalesced buffers (one per pool) of one layer group, in a canonical order."""
    ids = [bid for bid in sorted(formats, key=lambda b: (b.layer_id, _role_rank(config, b)))
           if bid.layer_id in set(layer_ids)]
    if not config.coalesce:
        return [CoalescedBuffer(formats[b].nbytes, (b,)) for b in ids]
    by_size: dict[int, list[BufferId]] = {}
    for bid in ids:
        by_size.setdefault(formats[bid].nbytes, []).append(bid)
    # Largest buffers first: the big key/value pool comes first, small scale pools after.
    return [CoalescedBuffer(size, tuple(by_size[size])) for size in sorted(by_size, reverse=True)]


def _role_rank(config: CacheConfig, bid: BufferId) -> int:
    for layer in config.layers:
        if layer.layer_id == bid.layer_id:
            return [r.name for r in layer.role_specs].index(bid.role)
    raise LayoutError(f"buffer {bid} has no layer")


def plan_layout(config: CacheConfig, quota_bytes: int | None = None) -> CacheLayoutDesc:
    """The layout of ``config`` with unplaced pools (base address 0) sized to ``quota_bytes``
    (default: the primary tier's quota)."""
    formats = buffer_formats(config)
    # 1. layer groups by (window, sink tokens), ordered by first layer id
    groups: dict[tuple[int | None, int], list[int]] = {}
    for layer in config.layers:
        groups.setdefault((layer.window, layer.sink_tokens), []).append(layer.layer_id)
    ordered = sorted(groups.items(), key=lambda kv: kv[1][0])
    # 2. coalesced slots per layer group, 3. pool groups keyed by slot structure
    per_group = [_group_slots(config, ids, formats) for _, ids in ordered]
    pool_group_of_key: dict[tuple[tuple[int, int], ...], int] = {}
    pg_members: list[list[int]] = []
    lg_pool_group: list[int] = []
    for gi, slots in enumerate(per_group):
        key = tuple((c.single_buffer_size, len(c.buffer_ids)) for c in slots)
        if key not in pool_group_of_key:
            pool_group_of_key[key] = len(pg_members)
            pg_members.append([])
        pg_members[pool_group_of_key[key]].append(gi)
        lg_pool_group.append(pool_group_of_key[key])
    # 4. slots per pool group: every layer group gets the same number of slots
    quota = config.primary.quota_bytes if quota_bytes is None else quota_bytes
    bytes_per_group_slot = sum(sum(c.single_buffer_size * len(c.buffer_ids) for c in per_group[g])
                               for members in pg_members for g in members)
    per_layer_group_slots = quota // bytes_per_group_slot
    if per_layer_group_slots < 1:
        raise ConfigError(f"quota_bytes={quota} holds no block: one block of every layer group needs "
                          f"{bytes_per_group_slot} bytes")
    pool_groups = []
    for pgi, members in enumerate(pg_members):
        num_slots = per_layer_group_slots * len(members)
        slot_descs, pools = [], []
        for pi in range(len(per_group[members[0]])):
            parts = [per_group[g][pi] for g in members]
            single = parts[0].single_buffer_size
            slot_bytes = single * len(parts[0].buffer_ids)
            ids = tuple(b for part in parts for b in part.buffer_ids)
            slot_descs.append(SlotDesc(slot_bytes, CoalescedBuffer(single, ids)))
            pools.append(PoolDesc(pi, 0, slot_bytes, num_slots, "cpu", 0))
        pool_groups.append(PoolGroupDesc(pgi, num_slots, tuple(members), tuple(pools), tuple(slot_descs)))
    layer_groups = tuple(
        LayerGroupDesc(gi, tuple(ids), window, sink, lg_pool_group[gi])
        for gi, ((window, sink), ids) in enumerate(ordered))
    return CacheLayoutDesc(LAYOUT_VERSION, config.tokens_per_block, layer_groups, tuple(pool_groups),
                           tuple(formats.items()))


def place_layout(layout: CacheLayoutDesc, base_addresses: Sequence[Sequence[int]], memory_kind: str,
                 device_id: int = 0) -> CacheLayoutDesc:
    """The same layout with pools placed at ``base_addresses[pool_group][pool]``."""
    if len(base_addresses) != len(layout.pool_groups):
        raise LayoutError(f"place_layout: {len(base_addresses)} address lists for {len(layout.pool_groups)} pool groups")
    groups = []
    for pg, bases in zip(layout.pool_groups, base_addresses, strict=True):
        if len(bases) != len(pg.pools):
            raise LayoutError(f"place_layout: pool group {pg.pool_group_index} has {len(pg.pools)} pools, "
                              f"got {len(bases)} addresses")
        pools = tuple(dataclasses.replace(p, base_address=int(b), memory_kind=memory_kind, device_id=device_id)
                      for p, b in zip(pg.pools, bases, strict=True))
        groups.append(dataclasses.replace(pg, pools=pools))
    return dataclasses.replace(layout, pool_groups=tuple(groups), fingerprint=b"")


def block_bytes(config: CacheConfig) -> int:
    """Bytes one block of every layer and role takes on this rank."""
    return sum(f.nbytes for f in buffer_formats(config).values())
