"""vLLM's paged KV tensors (``register_kv_caches``' ``{layer_name: tensor}``) as a kvxfer layout.

vLLM's attention backends shape a layer's cache differently. Since vLLM 0.32 a layer's cache is the
logical ``[num_blocks, kv_heads, block_size, content]`` (``KVCacheLayout``, physical order by strides),
``content`` holding a token's K then V (``2 * head_dim``): kvxfer describes it with one role ``"kv"`` of
``2 * head_dim`` per head, so K and V travel together (both sides must be such caches). Older vLLM
(and FlashAttention / FlashInfer views) have 5 axes: ``[2, num_blocks, ...]`` (K/V outside the
blocks) or ``[num_blocks, 2, ...]``, tokens and heads in either order: roles ``"key"``/``"value"``. Rather than keep a table per backend
and version, the axes are read off the tensor: the known sizes (2, num_blocks, block_size, kv_heads,
head_dim) name them, vLLM's usual orders first when sizes coincide, and ``engine_layouts.paged_tensors``
then reads the memory order from the strides (refusing anything not paged as kvxfer can describe).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

import torch

from kvxfer.cache.engine_layouts import EngineKV, paged_tensors
from kvxfer.errors import LayoutError

#: Logical orders vLLM's backends use, tried first (``engine_layouts.AXES`` letters).
PREFERRED_AXES = ("NHBD", "NBHD", "KNBHD", "KNHBD", "NKBHD", "NKHBD")
#: The role of a 4-axis cache's content (a token's K then V).
KV_ROLE = "kv"
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_ids(names: list[str]) -> dict[str, int]:
    """Each layer name's layer id: its first dotted integer (``model.layers.7.self_attn.attn`` -> 7), or
    the names' order when some name has none or two names share one."""
    found = [_LAYER_INDEX.search(n) for n in names]
    ids = [int(m.group(1)) if m else None for m in found]
    if None in ids or len(set(ids)) != len(ids):
        return {n: i for i, n in enumerate(names)}
    return {n: int(i) for n, i in zip(names, ids, strict=True) if i is not None}


def infer_axes(shape: tuple[int, ...], num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> str:
    """The logical axes (letters of ``KNBHD``) of a cache tensor of ``shape``: LayoutError when no order of
    the known sizes fits."""
    if len(shape) not in (4, 5):
        raise LayoutError(f"vLLM KV cache of shape {shape}: expected [blocks, heads, tokens, K+V content] or 5 "
                          f"axes (K/V, blocks, tokens, heads, dim)")
    sizes = {"K": 2, "N": num_blocks, "B": block_size, "H": kv_heads, "D": head_dim * (2 if len(shape) == 4 else 1)}
    letters = "NBHD" if len(shape) == 4 else "KNBHD"
    candidates = [a for a in PREFERRED_AXES if len(a) == len(shape)]
    candidates += ["".join(p) for p in itertools.permutations(letters) if "".join(p) not in candidates]
    for axes in candidates:
        if all(sizes[a] == s for a, s in zip(axes, shape, strict=True)):
            return axes
    raise LayoutError(f"vLLM KV cache of shape {shape}: no order of K=2, blocks={num_blocks}, "
                      f"block_size={block_size}, kv_heads={kv_heads}, head_dim={head_dim} fits it")


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], *, block_size: int, kv_heads: int, head_dim: int,
                       tp_rank: int = 0, tp_size: int = 1, axes: str | None = None) -> tuple[EngineKV, dict[str, int]]:
    """``kv_caches`` (this rank's: ``kv_heads`` heads each) as one kvxfer layout, and each layer name's
    layer id. ``axes`` overrides the inferred order. The rank holds global heads
    ``[tp_rank * kv_heads, (tp_rank + 1) * kv_heads)`` of ``tp_size * kv_heads``."""
    if not kv_caches:
        raise LayoutError("vLLM KV caches: no layer registered")
    names = list(kv_caches)
    ids = layer_ids(names)
    first = kv_caches[names[0]]
    shapes = {tuple(t.shape) for t in kv_caches.values()}
    if len(shapes) != 1:
        raise LayoutError(f"vLLM KV caches: layers of different shapes {sorted(shapes)} (one KV cache group "
                          f"of one attention type is supported)")
    num_blocks = _num_blocks(tuple(first.shape), block_size, kv_heads, head_dim)
    order = axes or infer_axes(tuple(first.shape), num_blocks, block_size, kv_heads, head_dim)
    tensors = {ids[n]: kv_caches[n] for n in names}
    roles = (KV_ROLE,) if "K" not in order else ("key", "value")
    kv = paged_tensors(tensors, order, roles=roles, head_start=tp_rank * kv_heads, total_heads=tp_size * kv_heads,
                       who="vllm")
    return kv, ids


def _num_blocks(shape: tuple[int, ...], block_size: int, kv_heads: int, head_dim: int) -> int:
    """The block count of a cache tensor: what is left of its size once K/V, block, heads, dim are out."""
    total = 1
    for s in shape:
        total *= s
    per_block = 2 * block_size * kv_heads * head_dim
    if per_block <= 0 or total % per_block:
        raise LayoutError(f"vLLM KV cache of shape {shape} is not whole blocks of block_size={block_size}, "
                          f"kv_heads={kv_heads}, head_dim={head_dim}")
    return total // per_block
