"""Engine-owned KV memory as a published layout: describe KV tensors kvxfer did not allocate (vLLM,
FlashInfer, SGLang, TensorRT-LLM shapes) as a ``CacheLayoutDesc`` plus the ``MemoryRegion``s to
register, so that ``extract``, ``plan_transfer`` and every transport work on them unchanged.

Each paged tensor is read through its strides: a block's bytes for one (layer, role) must be one
dense ``[heads][tokens][dim]`` (HND) or ``[tokens][heads][dim]`` (NHD) chunk, blocks equally spaced.
Where the K/V axis is outside the block axis (vLLM FlashAttention ``[2, blocks, ...]``) K and V are
two pools; where it is inside (FlashInfer ``[blocks, 2, ...]``) one pool holds a coalesced K,V pair.
Layers with the same attention window form one layer group, each with its own pool group (its own
block ids), so a request's block ids are ``{layer_group: engine block table}``. docs/engine-layouts.md
gives each engine's mapping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

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
from kvxfer.cache.dtypes import dtype_name
from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import ConfigError, LayoutError

__all__ = [
    "EngineKV",
    "block_ids_from_token_slots",
    "flashinfer",
    "paged_tensors",
    "sglang_mha",
    "trtllm_pools",
    "vllm_flash_attn",
]

#: Axis letters of ``paged_tensors``: K = the K/V axis (size 2), N = blocks, B = tokens per block,
#: H = KV heads, D = head dim. K and H may be absent (one role; one head).
AXES = "KNBHD"


@dataclass(frozen=True)
class EngineKV:
    """An engine's KV tensors described for kvxfer: plan with ``layout``, register ``regions`` (one per
    pool, in the layout's region order). ``tensors`` keeps the described memory alive."""

    layout: CacheLayoutDesc
    regions: tuple[MemoryRegion, ...]
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Pool:
    """One pool found in an engine tensor: ``num_slots`` slots of ``slot_bytes`` from ``base``."""

    base: int
    slot_bytes: int
    num_slots: int
    buffers: CoalescedBuffer


@dataclass(frozen=True)
class _Space:
    """Memory kind and device of every described tensor (they must agree)."""

    kind: str
    device_id: int


# --- public builders --------------------------------------------------------------------------------
def vllm_flash_attn(kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], *, head_start: int = 0,
                    total_heads: int | None = None, windows: Sequence[int | None] | None = None,
                    sink_tokens: int = 0) -> EngineKV:
    """vLLM's FlashAttention cache: per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``
    (NHD; with vLLM's HND stride order the same shape, heads outside tokens in memory). K and V are
    separate pools (one per layer and role). ``kv_caches`` is a list (layer ids 0..) or a mapping
    layer id -> tensor; ``head_start``/``total_heads`` give this rank's global head slice."""
    return paged_tensors(kv_caches, "KNBHD", head_start=head_start, total_heads=total_heads, windows=windows,
                         sink_tokens=sink_tokens, who="vllm_flash_attn")


def flashinfer(kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], *, order: str = "HND",
               head_start: int = 0, total_heads: int | None = None, windows: Sequence[int | None] | None = None,
               sink_tokens: int = 0) -> EngineKV:
    """FlashInfer's paged cache (vLLM's FlashInfer backend): per layer ``[num_blocks, 2, kv_heads,
    block_size, head_dim]`` (``order="HND"``) or ``[num_blocks, 2, block_size, kv_heads, head_dim]``
    (``order="NHD"``). One pool per layer, each slot holding the layer's K then V page."""
    if order not in ("HND", "NHD"):
        raise LayoutError(f"flashinfer: order must be 'HND' or 'NHD', got {order!r}")
    return paged_tensors(kv_caches, "NKHBD" if order == "HND" else "NKBHD", head_start=head_start,
                         total_heads=total_heads, windows=windows, sink_tokens=sink_tokens, who="flashinfer")


def sglang_mha(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], *, page_size: int = 1,
               layer_ids: Sequence[int] | None = None, head_start: int = 0, total_heads: int | None = None,
               windows: Sequence[int | None] | None = None, sink_tokens: int = 0) -> EngineKV:
    """SGLang's MHA token pool: per layer separate K and V ``[num_tokens, kv_heads, head_dim]``. A block
    is ``page_size`` consecutive token slots (block ``b`` = slots ``b*page_size ..``); turn a request's
    token slots (``req_to_token``) into block ids with ``block_ids_from_token_slots``. ``layer_ids``
    (default 0..) names the buffers' layers, e.g. a pipeline stage's."""
    who = "sglang_mha"
    _check_count(page_size, f"{who}: page_size")
    if len(k_buffers) != len(v_buffers):
        raise LayoutError(f"{who}: {len(k_buffers)} K buffers but {len(v_buffers)} V buffers")
    ids = list(range(len(k_buffers))) if layer_ids is None else [int(x) for x in layer_ids]
    if len(ids) != len(k_buffers) or len(set(ids)) != len(ids):
        raise LayoutError(f"{who}: layer_ids must name each of the {len(k_buffers)} layers once, got {list(ids)}")
    per_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for layer, k, v in zip(ids, k_buffers, v_buffers, strict=True):
        for role, t in (("key", k), ("value", v)):
            _check_tensor(t, 3, f"{who}: layer {layer} {role}")
            if not t.is_contiguous():
                raise LayoutError(f"{who}: layer {layer} {role} must be contiguous [num_tokens, kv_heads, head_dim], "
                                  f"got strides {tuple(t.stride())} for shape {tuple(t.shape)}")
            if t.shape[0] % page_size:
                raise LayoutError(f"{who}: layer {layer} {role} holds {t.shape[0]} token slots, not a multiple of "
                                  f"page_size={page_size}")
        if k.shape != v.shape:
            raise LayoutError(f"{who}: layer {layer} K has shape {tuple(k.shape)}, V has {tuple(v.shape)}")
        # [num_tokens, H, D] read as [N = num_tokens / page_size, B = page_size, H, D]
        per_layer[layer] = [(role, t.view(t.shape[0] // page_size, page_size, t.shape[1], t.shape[2]))
                            for role, t in (("key", k), ("value", v))]
    return _build(per_layer, "NBHD", head_start, total_heads, windows, sink_tokens, who,
                  tuple(t for pair in zip(k_buffers, v_buffers, strict=True) for t in pair))


def trtllm_pools(plan: CacheLayoutDesc, pools: Sequence[Sequence[torch.Tensor]]) -> EngineKV:
    """TensorRT-LLM KVCacheManagerV2-style coalesced pools (what kvxfer's own manager publishes): the
    slot structure of ``plan`` (e.g. ``plan_layout(config)``) placed on the engine's pool tensors,
    ``pools[pool_group][pool]``, each a contiguous tensor of whole slots; slot counts come from them."""
    who = "trtllm_pools"
    if len(pools) != len(plan.pool_groups):
        raise LayoutError(f"{who}: {len(pools)} pool-group tensor lists for {len(plan.pool_groups)} pool groups")
    groups: list[PoolGroupDesc] = []
    flat: list[torch.Tensor] = []
    space: _Space | None = None
    for pg, tensors in zip(plan.pool_groups, pools, strict=True):
        if len(tensors) != len(pg.pools):
            raise LayoutError(f"{who}: pool group {pg.pool_group_index} has {len(pg.pools)} pools, got "
                              f"{len(tensors)} tensors")
        counts = []
        for desc, t in zip(pg.pools, tensors, strict=True):
            where = f"{who}: pool {pg.pool_group_index}.{desc.pool_index}"
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise LayoutError(f"{where}: expected a contiguous torch.Tensor, got "
                                  f"{type(t).__name__ if not isinstance(t, torch.Tensor) else 'strides ' + str(t.stride())}")
            nbytes = t.numel() * t.element_size()
            if nbytes == 0 or nbytes % desc.slot_bytes:
                raise LayoutError(f"{where}: {nbytes} bytes is not a whole number of {desc.slot_bytes}-byte slots")
            counts.append(nbytes // desc.slot_bytes)
            space = _same_space(space, t, where)
            flat.append(t)
        if len(set(counts)) != 1:
            raise LayoutError(f"{who}: pool group {pg.pool_group_index}'s tensors hold different slot counts {counts}")
        assert space is not None
        placed = tuple(PoolDesc(d.pool_index, int(t.data_ptr()), d.slot_bytes, counts[0], space.kind, space.device_id)
                       for d, t in zip(pg.pools, tensors, strict=True))
        groups.append(PoolGroupDesc(pg.pool_group_index, counts[0], pg.slot_desc, placed))
    layout = CacheLayoutDesc(LAYOUT_VERSION, plan.tokens_per_block, plan.layer_groups, tuple(groups), plan.formats)
    return EngineKV(layout, _regions(layout), tuple(flat))


def paged_tensors(kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], axes: str, *,
                  roles: Sequence[str] = ("key", "value"), head_start: int = 0, total_heads: int | None = None,
                  windows: Sequence[int | None] | None = None, sink_tokens: int = 0,
                  who: str = "paged_tensors") -> EngineKV:
    """Any per-layer paged KV tensor whose logical axes are ``axes`` (letters of ``AXES``, e.g.
    ``"KNBHD"`` for vLLM FlashAttention, ``"NBD"`` for a one-role, one-head MLA cache); ``roles``
    names the K/V axis entries (or the single role when there is no K axis)."""
    if sorted(axes) != sorted(set(axes)) or not set(axes) <= set(AXES) or not {"N", "B", "D"} <= set(axes):
        raise LayoutError(f"{who}: axes {axes!r} must use each of {AXES} at most once and include N, B and D")
    n_roles = 2 if "K" in axes else 1
    if len(roles) != n_roles or len(set(roles)) != n_roles:
        raise LayoutError(f"{who}: {n_roles} distinct role name(s) needed for axes {axes!r}, got {list(roles)}")
    items = sorted(kv_caches.items()) if isinstance(kv_caches, Mapping) else list(enumerate(kv_caches))
    per_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for layer, t in items:
        _check_tensor(t, len(axes), f"{who}: layer {layer}")
        per_layer[layer] = [(roles[0], t)] if n_roles == 1 else [(roles[0], t), (roles[1], t)]
    return _build(per_layer, axes, head_start, total_heads, windows, sink_tokens, who, tuple(t for _, t in items))


def block_ids_from_token_slots(token_slots: npt.ArrayLike, page_size: int) -> npt.NDArray[np.int64]:
    """SGLang: a request's token slots (one row of ``req_to_token``) -> its block ids, one per
    ``page_size`` tokens. Each page's slots must be the consecutive slots of one page."""
    slots = np.asarray(token_slots, dtype=np.int64).ravel()
    _check_count(page_size, "block_ids_from_token_slots: page_size")
    if slots.size == 0:
        return np.empty(0, np.int64)
    blocks = slots[::page_size] // page_size
    pos = np.arange(slots.size)
    want = blocks[pos // page_size] * page_size + pos % page_size
    bad = np.flatnonzero((want != slots) | (slots < 0))
    if bad.size:
        i = int(bad[0])
        raise LayoutError(f"block_ids_from_token_slots: token {i} is in slot {int(slots[i])}, expected "
                          f"{int(want[i])} (page {i // page_size} is not one aligned run of {page_size} slots)")
    return blocks


# --- analysis ---------------------------------------------------------------------------------------
def _check_count(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{where} must be an int > 0, got {value!r}")


def _check_tensor(t: object, ndim: int, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise LayoutError(f"{where}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.device.type not in ("cpu", "cuda"):
        raise LayoutError(f"{where}: tensors must live on the CPU or a CUDA device, got {t.device}")
    try:
        dtype_name(t.dtype)
    except ConfigError as exc:
        raise LayoutError(f"{where}: {exc}") from exc
    if t.numel() == 0:
        raise LayoutError(f"{where}: empty tensor of shape {tuple(t.shape)}")


def _same_space(space: _Space | None, t: torch.Tensor, where: str) -> _Space:
    kind = "cuda" if t.is_cuda else ("pinned" if t.is_pinned() else "cpu")
    mine = _Space(kind, int(t.device.index or 0))
    if space is not None and space != mine:
        raise LayoutError(f"{where}: on {mine.kind}:{mine.device_id}, other tensors on {space.kind}:{space.device_id}")
    return mine


def _memory_order(t: torch.Tensor, axes: str, where: str) -> str:
    """The axes longer than 1, outermost to innermost in memory; raises unless the tensor densely packs
    its elements (a permutation of a contiguous tensor), head_dim innermost and, inside a block, the
    heads x tokens of one role contiguous."""
    size = dict(zip(axes, t.shape, strict=True))
    stride = dict(zip(axes, t.stride(), strict=True))
    real = "".join(sorted((a for a in axes if size[a] > 1), key=lambda a: -stride[a]))
    expect = 1
    for a in reversed(real):
        if stride[a] != expect:
            raise LayoutError(f"{where}: not densely packed (axes {axes}, shape {tuple(t.shape)}, strides "
                              f"{tuple(t.stride())}); pass a contiguous tensor or a permutation of one")
        expect *= size[a]
    if size["D"] > 1 and not real.endswith("D"):
        raise LayoutError(f"{where}: head_dim must be innermost (stride 1), strides {tuple(t.stride())}")
    inner = [real.index(a) for a in "HB" if a in real]
    outer = [real.index(a) for a in "KN" if a in real]
    if inner and outer and max(outer) > min(inner):
        raise LayoutError(f"{where}: one block's heads x tokens must be contiguous, but axes {axes} lie in memory "
                          f"as {real} (strides {tuple(t.stride())})")
    return real


def _build(per_layer: Mapping[int, list[tuple[str, torch.Tensor]]], axes: str, head_start: int,
           total_heads: int | None, windows: Sequence[int | None] | None, sink_tokens: int, who: str,
           keep: tuple[torch.Tensor, ...]) -> EngineKV:
    """The layout of per-layer tensors of logical ``axes``; ``per_layer[layer]`` pairs each role with its
    tensor (the same tensor twice when a K axis holds both)."""
    if not per_layer:
        raise LayoutError(f"{who}: no layers given")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise LayoutError(f"{who}: sink_tokens must be an int >= 0, got {sink_tokens!r}")
    layer_ids = sorted(per_layer)
    if windows is not None and len(windows) != len(layer_ids):
        raise LayoutError(f"{who}: {len(windows)} windows for {len(layer_ids)} layers")
    first = per_layer[layer_ids[0]][0][1]
    space: _Space | None = None
    for lid in layer_ids:
        for role, t in per_layer[lid]:
            where = f"{who}: layer {lid} {role}"
            if t.shape != first.shape or t.dtype != first.dtype:
                raise LayoutError(f"{where} has shape {tuple(t.shape)} {t.dtype}, layer {layer_ids[0]} has "
                                  f"{tuple(first.shape)} {first.dtype} (every layer's tensors must match)")
            space = _same_space(space, t, where)
    assert space is not None
    size = dict(zip(axes, first.shape, strict=True))
    if "K" in axes and size["K"] != 2:
        raise LayoutError(f"{who}: the K/V axis must have size 2, got shape {tuple(first.shape)}")
    heads, num_blocks, tpb, isz = size.get("H", 1), size["N"], size["B"], first.element_size()
    chunk = heads * tpb * size["D"] * isz     # one block of one (layer, role)
    pools_of: list[list[_Pool]] = []
    formats: dict[BufferId, BufferFormat] = {}
    for lid in layer_ids:
        roles = per_layer[lid]
        orders = {_memory_order(t, axes, f"{who}: layer {lid} {role}") for role, t in roles}
        if len(orders) > 1:
            raise LayoutError(f"{who}: layer {lid}: its roles' tensors are laid out differently ({sorted(orders)})")
        order = orders.pop()
        # HND when heads lie outside tokens in memory (with one head or one token both read the same)
        hnd = "H" not in order or "B" not in order or order.index("H") < order.index("B")
        try:
            fmt = BufferFormat(dtype_name(first.dtype), size["D"], tpb, head_start, heads,
                               heads if total_heads is None else total_heads, "HND" if hnd else "NHD")
        except LayoutError as exc:
            raise LayoutError(f"{who}: {exc}") from exc
        t = roles[0][1]
        if len(roles) == 2 and roles[1][1] is t:     # one tensor with a K/V axis
            stride = dict(zip(axes, t.stride(), strict=True))
            if num_blocks == 1 or stride["K"] > stride["N"]:     # [2, blocks, ...]: K and V are two pools
                pools = [_Pool(int(t.data_ptr()) + r * stride["K"] * isz, chunk, num_blocks,
                               CoalescedBuffer(chunk, (BufferId(lid, role),))) for r, (role, _) in enumerate(roles)]
            else:                                                # [blocks, 2, ...]: a K,V pair per slot
                pools = [_Pool(int(t.data_ptr()), 2 * chunk, num_blocks,
                               CoalescedBuffer(chunk, tuple(BufferId(lid, role) for role, _ in roles)))]
        else:                                        # a tensor per role, or a single role
            pools = [_Pool(int(x.data_ptr()), chunk, num_blocks, CoalescedBuffer(chunk, (BufferId(lid, role),)))
                     for role, x in roles]
        formats.update((BufferId(lid, role), fmt) for role, _ in roles)
        pools_of.append(pools)
    return _assemble(who, tpb, layer_ids, pools_of, formats, windows, sink_tokens, space, keep)


def _assemble(who: str, tpb: int, layer_ids: list[int], pools_of: list[list[_Pool]],
              formats: Mapping[BufferId, BufferFormat], windows: Sequence[int | None] | None, sink_tokens: int,
              space: _Space, keep: tuple[torch.Tensor, ...]) -> EngineKV:
    """Layer groups by (window, sink tokens), each with its own pool group of its layers' pools."""
    by_window: dict[int | None, list[int]] = {}
    for i in range(len(layer_ids)):
        by_window.setdefault(None if windows is None else windows[i], []).append(i)
    layer_groups, pool_groups = [], []
    for g, (window, members) in enumerate(by_window.items()):
        pools = sorted((p for i in members for p in pools_of[i]), key=lambda p: p.slot_bytes, reverse=True)
        num_slots = pools[0].num_slots
        descs = tuple(PoolDesc(k, p.base, p.slot_bytes, num_slots, space.kind, space.device_id)
                      for k, p in enumerate(pools))
        variant = SlotDescVariant(g, tuple(p.buffers for p in pools))
        pool_groups.append(PoolGroupDesc(g, num_slots, SlotDesc((variant,)), descs))
        layer_groups.append(LayerGroupDesc(g, tuple(layer_ids[i] for i in members), window,
                                           sink_tokens if window is not None else 0, g))
    try:
        layout = CacheLayoutDesc(LAYOUT_VERSION, tpb, tuple(layer_groups), tuple(pool_groups), tuple(formats.items()))
    except LayoutError as exc:
        raise LayoutError(f"{who}: {exc}") from exc
    return EngineKV(layout, _regions(layout), keep)


def _regions(layout: CacheLayoutDesc) -> tuple[MemoryRegion, ...]:
    """One region per pool, in flat (pool group, pool) order: the extractor's region indices."""
    return tuple(MemoryRegion(p.base_address, p.nbytes, p.memory_kind, p.device_id)
                 for pg in layout.pool_groups for p in pg.pools)

