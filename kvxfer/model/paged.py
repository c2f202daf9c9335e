"""A request's KV as the model sees it: pages of one or more cache managers, read and written only
through ``kvxfer.cache.kv_access`` (the request's block ids and ``KVCacheManager.buffer_view``), always
as ``[tokens, kv_heads, head_dim]``.

Several managers hold tensor-parallel shards of the KV heads (each its ``BufferFormat`` head range);
the model writes every shard the heads it holds and reads each head from the first shard holding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.descriptors import BufferId
from kvxfer.cache.kv_access import LayerKV, read_kv, write_kv
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.errors import CacheStateError, KVCacheError, LayoutMismatch, OutOfSlotsError


@dataclass(frozen=True)
class _LayerShard:
    """The KV heads one shard holds of one layer."""

    head_start: int
    num_heads: int


class PagedKV:
    """One request's KV over ``shards`` (manager, cache) pairs that together cover every KV head."""

    def __init__(self, shards: Sequence[tuple[KVCacheManager, KVCache]], num_layers: int,
                 num_kv_heads: int, head_dim: int) -> None:
        if not shards:
            raise KVCacheError("PagedKV needs at least one (manager, cache) shard")
        self.shards = tuple(shards)
        layouts = [m.layout for m, _ in self.shards]
        self.tokens_per_block = layouts[0].tokens_per_block
        for i, lay in enumerate(layouts):
            if lay.tokens_per_block != self.tokens_per_block:
                raise LayoutMismatch(f"PagedKV shard {i}: tokens_per_block {lay.tokens_per_block} != "
                                     f"{self.tokens_per_block} of shard 0")
            if lay.layer_ids != tuple(range(num_layers)):
                raise LayoutMismatch(f"PagedKV shard {i}: layers {lay.layer_ids} != model layers 0..{num_layers - 1}")
        self._layers: list[list[_LayerShard]] = []
        # reader[layer][head] = index of the shard the head is read from
        self._reader: list[npt.NDArray[np.int64]] = []
        for layer in range(num_layers):
            parts: list[_LayerShard] = []
            reader = np.full(num_kv_heads, -1, dtype=np.int64)
            for i, (manager, _) in enumerate(self.shards):
                fmt = manager.layout.format_of(BufferId(layer, "key"))
                if fmt.head_dim != head_dim or fmt.total_heads != num_kv_heads:
                    raise LayoutMismatch(
                        f"PagedKV shard {i} layer {layer}: head_dim {fmt.head_dim}, total_heads {fmt.total_heads} "
                        f"!= model head_dim {head_dim}, num_kv_heads {num_kv_heads}")
                parts.append(_LayerShard(fmt.head_start, fmt.num_heads))
                span = reader[fmt.head_start:fmt.head_start + fmt.num_heads]
                span[span < 0] = i
            if (reader < 0).any():
                raise LayoutMismatch(f"PagedKV layer {layer}: KV heads {np.flatnonzero(reader < 0).tolist()} "
                                     f"are held by no shard")
            self._layers.append(parts)
            self._reader.append(reader)

    # --- token accounting -----------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens whose KV is written (and committed) in every shard."""
        lengths = {c.history_length for _, c in self.shards}
        committed = {c.num_committed_tokens for _, c in self.shards}
        if len(lengths) != 1 or lengths != committed:
            raise CacheStateError(f"PagedKV: shards disagree or hold uncommitted KV: history {sorted(lengths)}, "
                                  f"committed {sorted(committed)}")
        return lengths.pop()

    def reserve(self, num_tokens: int) -> None:
        """Grow every shard to hold ``num_tokens`` tokens; OutOfSlotsError (nothing kept) if one cannot."""
        grown: list[tuple[KVCache, int]] = []
        for manager, cache in self.shards:
            if cache.capacity >= num_tokens:
                continue
            old = cache.capacity
            if not cache.resize(num_tokens):
                for c, cap in grown:
                    c.resize(cap)
                raise OutOfSlotsError(f"PagedKV: cache {cache.id} cannot grow to {num_tokens} tokens "
                                      f"({manager.num_free_slots()} slots free)")
            grown.append((cache, old))

    def commit(self, tokens: npt.NDArray[np.int64]) -> None:
        """Declare the KV of ``tokens`` written in every shard."""
        for _, cache in self.shards:
            cache.commit(tokens)

    # --- KV pages -------------------------------------------------------------------------------
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        """Store ``key``/``value`` (``[tokens, kv_heads, head_dim]``, every KV head) of positions ``start..``
        into the pages: each shard gets the heads it holds (``kvxfer.cache.kv_access.write_kv``)."""
        for (manager, cache), part in zip(self.shards, self._layers[layer], strict=True):
            heads = slice(part.head_start, part.head_start + part.num_heads)
            write_kv(manager, cache, layer, start, key[:, heads], value[:, heads])

    def read(self, layer: int, start: int, end: int) -> LayerKV:
        """Every stored token of ``[start, end)`` in ``layer``: keys/values ``[tokens, kv_heads, head_dim]``
        (the same axis order as ``write``). Blocks a sliding window released are skipped, so ``positions``
        (int64) need not be contiguous; each head comes from the first shard holding it."""
        reader = self._reader[layer]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        positions: torch.Tensor | None = None
        shard_ids = np.unique(reader)
        for i in shard_ids.tolist():
            part = self._layers[layer][i]
            manager, cache = self.shards[i]
            got = read_kv(manager, cache, layer, start, end, skip_released=True)
            mine = torch.from_numpy(np.flatnonzero(reader == i) - part.head_start).to(got.key.device)
            keys.append(got.key.index_select(1, mine))
            values.append(got.value.index_select(1, mine))
            if positions is None:
                positions = got.positions
            elif not torch.equal(positions, got.positions):
                raise CacheStateError(f"PagedKV layer {layer}: shards hold different token positions")
        assert positions is not None
        if shard_ids.size == 1:
            return LayerKV(keys[0], values[0], positions)
        # Shards were visited in shard order; put heads back in global order.
        order = np.argsort(np.concatenate([np.flatnonzero(reader == i) for i in shard_ids]), kind="stable")
        perm = torch.from_numpy(order).to(keys[0].device)
        return LayerKV(torch.cat(keys, 1).index_select(1, perm), torch.cat(values, 1).index_select(1, perm),
                       positions)
