"""Read and write one layer's K/V of a request by token position, in one axis order both ways.

Keys and values go in and come out as ``[tokens, heads, head_dim]`` whatever the pages' order (HND or
NHD): ``heads`` are the heads this manager holds (its ``BufferFormat`` head range), token ``i`` of the
tensor is position ``start + i``. Pages are found through ``KVCache.block_ids`` (slot of block
``pos // tokens_per_block``, offset ``pos % tokens_per_block``) and ``KVCacheManager.buffer_view``, so
nothing outside the request's own pages is read or written. This is the public way for a model (or an
integrator's engine) to put its KV into kvxfer pages and read it back.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.descriptors import BufferFormat, BufferId
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.errors import CacheStateError, CapacityError, KVCacheError, LayoutError


class LayerKV(NamedTuple):
    """One layer's K/V over some token positions: ``key``/``value`` are ``[tokens, heads, head_dim]``,
    ``positions`` (int64, ascending) the token position of each row."""

    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor


class _LayerPages(NamedTuple):
    """What locating one layer's pages costs once: its format, layer group and typed key/value views."""

    fmt: BufferFormat
    group: int
    key: torch.Tensor
    value: torch.Tensor


# Per request cache (weakly: the entry goes with the KVCache object, so a manager shut down after its
# requests keeps no pool memory alive through these views), per layer: located once, not per call.
_pages: weakref.WeakKeyDictionary[KVCache, dict[int, _LayerPages]] = weakref.WeakKeyDictionary()


def _layer_pages(manager: KVCacheManager, cache: KVCache, layer: int) -> _LayerPages:
    if cache.manager is not manager:
        raise KVCacheError(f"KVCache {cache.id} belongs to another manager")
    per_layer = _pages.setdefault(cache, {})
    found = per_layer.get(layer)
    if found is None:
        fmt = layer_format(manager, layer)
        with torch.inference_mode(False):   # views made under inference mode could not be written outside it
            key, value = manager.buffer_view(layer, "key"), manager.buffer_view(layer, "value")
        found = _LayerPages(fmt, manager.layout.layer_group_of(layer).layer_group_id, key, value)
        per_layer[layer] = found
    return found


def layer_format(manager: KVCacheManager, layer: int) -> BufferFormat:
    """The key buffer format of ``layer`` (head range, head_dim, dtype, order); LayoutError if absent."""
    try:
        return manager.layout.format_of(BufferId(layer, "key"))
    except (KeyError, LayoutError) as exc:
        raise LayoutError(f"layer {layer} has no key buffer in this cache (layers {manager.layout.layer_ids})") from exc


def _check(cache: KVCache, pages: _LayerPages, layer: int, start: int, end: int) -> npt.NDArray[np.int32]:
    """The block ids covering [start, end) of the layer's group, after checking the arguments."""
    if isinstance(start, bool) or not isinstance(start, int) or isinstance(end, bool) or not isinstance(end, int) \
            or not 0 <= start <= end:
        raise CapacityError(f"KVCache {cache.id} layer {layer}: token range must be ints 0 <= start <= end, "
                            f"got [{start!r}, {end!r})")
    if end > cache.capacity:
        raise CapacityError(f"KVCache {cache.id} layer {layer}: token range [{start}, {end}) exceeds the capacity "
                            f"of {cache.capacity} tokens (resize first)")
    return cache.block_ids(pages.group)


def write_kv(manager: KVCacheManager, cache: KVCache, layer: int, start: int,
             key: torch.Tensor, value: torch.Tensor) -> None:
    """Store ``key``/``value`` (``[tokens, heads, head_dim]``, this manager's heads) of positions
    ``start, start + 1, ...`` of ``layer`` into the request's pages (converted to the pages' dtype and
    device). CacheStateError when a position has no page (a released sliding-window block)."""
    pages = _layer_pages(manager, cache, layer)
    fmt = pages.fmt
    want = (fmt.num_heads, fmt.head_dim)
    if key.dim() != 3 or tuple(key.shape[1:]) != want or key.shape != value.shape:
        raise KVCacheError(f"write_kv layer {layer}: key and value must both be [tokens, {want[0]}, {want[1]}], "
                           f"got {tuple(key.shape)} and {tuple(value.shape)}")
    n = int(key.shape[0])
    blocks = _check(cache, pages, layer, start, start + n)
    if not n:
        return
    tpb = fmt.tokens_per_block
    pos = np.arange(start, start + n, dtype=np.int64)
    slots = blocks[pos // tpb]
    if (slots < 0).any():
        raise CacheStateError(f"KVCache {cache.id} layer {layer}: no page for position {int(pos[slots < 0][0])} "
                              f"(its block was released)")
    kview, vview = pages.key, pages.value
    slot_t = torch.from_numpy(slots.astype(np.int64)).to(kview.device)
    off_t = torch.from_numpy(pos % tpb).to(kview.device)
    k = key.to(kview.device, kview.dtype)
    v = value.to(vview.device, vview.dtype)
    if fmt.order == "HND":   # [slot, head, token, dim]: the two index tensors broadcast to [tokens, heads, dim]
        kview[slot_t, :, off_t, :] = k
        vview[slot_t, :, off_t, :] = v
    else:                    # [slot, token, head, dim]
        kview[slot_t, off_t] = k
        vview[slot_t, off_t] = v


def read_kv(manager: KVCacheManager, cache: KVCache, layer: int, start: int, end: int, *,
            skip_released: bool = False) -> LayerKV:
    """The K/V of positions ``[start, end)`` of ``layer`` as ``[tokens, heads, head_dim]`` tensors on the
    pages' device and dtype (a copy). A position whose block was released (sliding window) raises
    CacheStateError, or with ``skip_released`` is left out (``positions`` says which rows are present)."""
    pages = _layer_pages(manager, cache, layer)
    fmt = pages.fmt
    blocks = _check(cache, pages, layer, start, end)
    tpb = fmt.tokens_per_block
    first, last = start // tpb, -(-end // tpb)
    span = blocks[first:last]
    present = np.flatnonzero(span >= 0)
    if present.size != span.size and not skip_released:
        gone = int((first + np.flatnonzero(span < 0)[0]) * tpb)
        raise CacheStateError(f"KVCache {cache.id} layer {layer}: no page for position {max(gone, start)} "
                              f"(its block was released)")
    pos = ((first + present)[:, None] * tpb + np.arange(tpb)).ravel()
    keep = np.flatnonzero((pos >= start) & (pos < end))
    kview, vview = pages.key, pages.value
    slot_t = torch.from_numpy(span[present].astype(np.int64)).to(kview.device)
    keep_t = torch.from_numpy(keep).to(kview.device)

    def rows(view: torch.Tensor) -> torch.Tensor:
        pages = view.index_select(0, slot_t)
        if fmt.order == "HND":   # [blocks, heads, tpb, dim] -> [blocks, tpb, heads, dim]
            pages = pages.transpose(1, 2)
        return pages.reshape(-1, fmt.num_heads, fmt.head_dim).index_select(0, keep_t)

    return LayerKV(rows(kview), rows(vview), torch.from_numpy(pos[keep]))
