"""Layout construction: layers -> layer groups -> coalesced slots -> pool groups -> CacheLayoutDesc.

Rules (docs/architecture.md, "Vocabulary"):
- layers with the same window and sink blocks (sink tokens rounded up to whole blocks) form a layer
  group, ordered by their first layer id (its sink_tokens: the largest of its layers');
- inside a layer group, buffers of equal size are coalesced into one slot (one pool per size), or
  each buffer gets its own pool when ``coalesce=False``: the group's ``SlotDescVariant``, pools
  sorted by slot size, largest first;
- layer groups whose variants have the same ``slot_size_list`` share one pool group (one slot
  allocator), even when their buffer sizes and counts differ (4 x 4096 B and 2 x 8192 B slots);
- the primary quota is split so that every layer group gets the same number of slots, unless the
  caller gives each pool group's slot count (``num_slots``: the ratio planning of ``pool_ratio``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

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
    SlotDescVariant,
)
from kvxfer.cache.manager_config import EXTRA_SLOT_FLOORS
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
    "SlotDescVariant",
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
            own_tpb = role.tokens_per_block or config.tokens_per_block
            if role.block_bytes:    # opaque: one nominal uint8 head, a page of block_bytes
                fmt = BufferFormat(dtype="uint8", head_dim=1, tokens_per_block=own_tpb, head_start=0, num_heads=1,
                                   total_heads=1, order=config.head_order, block_bytes=role.block_bytes)
            else:
                fmt = BufferFormat(dtype=role.dtype or config.dtype, head_dim=role.head_dim or layer.head_dim,
                                   tokens_per_block=own_tpb, head_start=start, num_heads=heads,
                                   total_heads=layer.num_kv_heads, order=config.head_order)
            out[BufferId(layer.layer_id, role.name)] = fmt
    return out


def slot_bytes_of(config: CacheConfig, fmt: BufferFormat) -> int:
    """Bytes one block of a buffer takes in its slot: its pages of the block (several for a buffer
    paged by fewer tokens than the cache)."""
    return fmt.nbytes * (config.tokens_per_block // fmt.tokens_per_block)


def _group_buffers(config: CacheConfig, layer_group_id: int, layer_ids: Sequence[int],
                   formats: dict[BufferId, BufferFormat]) -> SlotDescVariant:
    """One layer group's slot variant: its buffers of equal size coalesced (one pool per size), or one
    pool per buffer when ``coalesce=False``; largest first, as the reference design sorts them."""
    chosen = set(layer_ids)
    ids = [bid for bid in sorted(formats, key=lambda b: (b.layer_id, _role_rank(config, b)))
           if bid.layer_id in chosen]
    if not config.coalesce:
        buffers = [CoalescedBuffer(slot_bytes_of(config, formats[b]), (b,)) for b in ids]
    else:
        by_size: dict[int, list[BufferId]] = {}
        for bid in ids:
            by_size.setdefault(slot_bytes_of(config, formats[bid]), []).append(bid)
        buffers = [CoalescedBuffer(size, tuple(members)) for size, members in by_size.items()]
    # Largest slot first (the big key/value pool, then small scale pools); ties by buffer size.
    buffers.sort(key=lambda c: (c.size, c.single_buffer_size), reverse=True)
    return SlotDescVariant(layer_group_id, tuple(buffers))


def _role_rank(config: CacheConfig, bid: BufferId) -> int:
    for layer in config.layers:
        if layer.layer_id == bid.layer_id:
            return [r.name for r in layer.role_specs].index(bid.role)
    raise LayoutError(f"buffer {bid} has no layer")


def slot_floors(config: CacheConfig, group_keys: Sequence[tuple[int | None, int, bool]]) -> list[int]:
    """Slots one request may hold at once in each layer group (keyed ``(window, sink blocks, recurrent)``),
    at worst: a sliding window its sink blocks, the blocks of ``window - 1`` tokens and the block being
    written; full attention the largest of the windows' (1 without any); a recurrent group its one state
    slot."""
    tpb = config.tokens_per_block
    swa = [sink + -(-(window - 1) // tpb) + 1 for window, sink, _ in group_keys if window is not None]
    full = max(swa, default=1)
    return [1 if recurrent else full if window is None else sink + -(-(window - 1) // tpb) + 1
            for window, sink, recurrent in group_keys]


def plan_layout(config: CacheConfig, quota_bytes: int | None = None,
                num_slots: Sequence[int] | None = None) -> CacheLayoutDesc:
    """The layout of ``config`` with unplaced pools (base address 0) sized to ``quota_bytes``
    (default: the primary tier's quota), or holding ``num_slots[pg]`` slots per pool group."""
    formats = buffer_formats(config)
    # 1. layer groups by (window, sink blocks: sink tokens rounded up to whole blocks), ordered by first
    #    layer id; a group's sink_tokens is its layers' largest (the model's value, what peers compare)
    #    (recurrent layers form their own group)
    groups: dict[tuple[int | None, int, bool], list[int]] = {}
    group_sink: dict[tuple[int | None, int, bool], int] = {}
    tpb = config.tokens_per_block
    for layer in config.layers:
        group_key = (layer.window, -(-layer.sink_tokens // tpb), layer.recurrent)
        groups.setdefault(group_key, []).append(layer.layer_id)
        group_sink[group_key] = max(group_sink.get(group_key, 0), layer.sink_tokens)
    ordered = sorted(groups.items(), key=lambda kv: kv[1][0])
    # 2. one slot variant per layer group, 3. pool groups keyed by slot_size_list (a recurrent group's
    #    state slots never share a pool group with attention pages)
    variants = [_group_buffers(config, gi, ids, formats) for gi, (_, ids) in enumerate(ordered)]
    members_of: dict[tuple[tuple[int, ...], bool], list[SlotDescVariant]] = {}
    for v, (gk, _) in zip(variants, ordered, strict=True):
        members_of.setdefault((v.slot_size_list, gk[2]), []).append(v)
    pool_group_of = {v.layer_group_id: pgi for pgi, members in enumerate(members_of.values()) for v in members}
    # 4. slots per pool group: every layer group gets the same number of slots
    quota = config.primary.quota_bytes if quota_bytes is None else quota_bytes
    bytes_per_group_slot = sum(sum(v.slot_size_list) for v in variants)
    per_layer_group_slots = quota // bytes_per_group_slot
    if dict(config.extra).get(EXTRA_SLOT_FLOORS):
        per_layer_group_slots = max(per_layer_group_slots, max(slot_floors(config, [gk for gk, _ in ordered])))
    if per_layer_group_slots < 1 and num_slots is None:
        raise ConfigError(f"quota_bytes={quota} holds no block: one block of every layer group needs "
                          f"{bytes_per_group_slot} bytes")
    if num_slots is not None and (len(num_slots) != len(members_of) or any(int(n) < 1 for n in num_slots)):
        raise ConfigError(f"plan_layout: num_slots must give every one of the {len(members_of)} pool groups "
                          f"at least one slot, got {list(num_slots)}")
    pool_groups = []
    for pgi, ((sizes, _), members) in enumerate(members_of.items()):
        count = per_layer_group_slots * len(members) if num_slots is None else int(num_slots[pgi])
        pools = tuple(PoolDesc(pi, 0, size, count, "cpu", 0) for pi, size in enumerate(sizes))
        pool_groups.append(PoolGroupDesc(pgi, count, SlotDesc(tuple(members)), pools))
    layer_groups = tuple(
        LayerGroupDesc(gi, tuple(ids), gk[0], group_sink[gk], pool_group_of[gi], recurrent=gk[2])
        for gi, (gk, ids) in enumerate(ordered))
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


def check_placed(layout: CacheLayoutDesc, pools: Sequence[Sequence[Any]]) -> None:
    """LayoutError unless every pool descriptor describes its live tensor (``pools[pool_group][pool]``):
    the same base address, and no more bytes than the tensor holds. Descriptors are published to
    transports, which register and read the memory they name."""
    if len(pools) != len(layout.pool_groups):
        raise LayoutError(f"check_placed: {len(pools)} tensor lists for {len(layout.pool_groups)} pool groups")
    for pg, tensors in zip(layout.pool_groups, pools, strict=True):
        if len(tensors) != len(pg.pools):
            raise LayoutError(f"check_placed: pool group {pg.pool_group_index} has {len(pg.pools)} pools, "
                              f"got {len(tensors)} tensors")
        for desc, t in zip(pg.pools, tensors, strict=True):
            ptr, held = int(t.data_ptr()), int(t.numel()) * int(t.element_size())
            if desc.base_address != ptr or desc.nbytes > held:
                raise LayoutError(f"pool {pg.pool_group_index}.{desc.pool_index}: the descriptor names "
                                  f"[{desc.base_address:#x}, {desc.end_address:#x}), the live pool is "
                                  f"[{ptr:#x}, {ptr + held:#x})")


def block_bytes(config: CacheConfig) -> int:
    """Bytes one block of every layer and role takes on this rank."""
    return sum(slot_bytes_of(config, f) for f in buffer_formats(config).values())
