"""A request's KV as the model sees it: pages of one or more cache managers, read and written only
through ``KVCacheManager.buffer_view`` and the request's block ids.

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
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.errors import CacheStateError, KVCacheError, LayoutMismatch, OutOfSlotsError


@dataclass(frozen=True)
class _LayerShard:
    """One shard's typed views and head range for one layer."""

    key: torch.Tensor
    value: torch.Tensor
    head_start: int
    num_heads: int
    layer_group: int
    order: str


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
                parts.append(_LayerShard(manager.buffer_view(layer, "key"), manager.buffer_view(layer, "value"),
                                         fmt.head_start, fmt.num_heads,
                                         manager.layout.layer_group_of(layer).layer_group_id, fmt.order))
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
        """Store ``key``/``value`` ([tokens, kv_heads, head_dim]) of positions ``start..`` into the pages."""
        tpb = self.tokens_per_block
        pos = np.arange(start, start + key.shape[0], dtype=np.int64)
        for (_, cache), part in zip(self.shards, self._layers[layer], strict=True):
            blocks = cache.block_ids(part.layer_group)
            if pos.size and pos[-1] // tpb >= blocks.size:
                raise CacheStateError(f"PagedKV: cache {cache.id} holds {blocks.size} blocks, position "
                                      f"{int(pos[-1])} needs block {int(pos[-1] // tpb)}")
            slots = blocks[pos // tpb]
            if (slots < 0).any():
                raise CacheStateError(f"PagedKV: cache {cache.id} layer {layer}: no page for position "
                                      f"{int(pos[slots < 0][0])}")
            slot_t = torch.from_numpy(slots.astype(np.int64)).to(part.key.device)
            off_t = torch.from_numpy(pos % tpb).to(part.key.device)
            heads = slice(part.head_start, part.head_start + part.num_heads)
            k = key[:, heads].to(part.key.dtype)
            v = value[:, heads].to(part.value.dtype)
            if part.order == "HND":
                part.key[slot_t, :, off_t, :] = k
                part.value[slot_t, :, off_t, :] = v
            else:
                part.key[slot_t, off_t] = k
                part.value[slot_t, off_t] = v

    def gather(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, positions) of every stored token before ``end`` in ``layer``.

        keys/values are ``[kv_heads, tokens, head_dim]``; blocks a sliding window released (-1) are skipped,
        so ``positions`` (int64) need not be contiguous.
        """
        tpb = self.tokens_per_block
        reader = self._reader[layer]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        positions: torch.Tensor | None = None
        for i in np.unique(reader).tolist():
            part = self._layers[layer][i]
            cache = self.shards[i][1]
            blocks = cache.block_ids(part.layer_group)[:-(-end // tpb)]
            present = np.flatnonzero(blocks >= 0)
            pos = (present[:, None] * tpb + np.arange(tpb)).ravel()
            keep = torch.from_numpy(pos < end)
            slot_t = torch.from_numpy(blocks[present].astype(np.int64)).to(part.key.device)
            k, v = part.key[slot_t], part.value[slot_t]
            if part.order == "HND":     # [blocks, heads, tpb, dim] -> [heads, blocks * tpb, dim]
                k, v = k.transpose(0, 1), v.transpose(0, 1)
            else:                       # [blocks, tpb, heads, dim] -> [heads, blocks * tpb, dim]
                k, v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
            k = k.reshape(part.num_heads, -1, k.shape[-1])[:, keep.to(k.device)]
            v = v.reshape(part.num_heads, -1, v.shape[-1])[:, keep.to(v.device)]
            mine = np.flatnonzero(reader == i) - part.head_start
            idx = torch.from_numpy(mine).to(k.device)
            keys.append(k.index_select(0, idx))
            values.append(v.index_select(0, idx))
            shard_pos = torch.from_numpy(pos[pos < end])
            if positions is None:
                positions = shard_pos
            elif not torch.equal(positions, shard_pos):
                raise CacheStateError(f"PagedKV layer {layer}: shards hold different token positions")
        assert positions is not None
        # Shards were visited in shard order; put heads back in global order.
        order = np.argsort(np.concatenate([np.flatnonzero(reader == i) for i in np.unique(reader)]), kind="stable")
        perm = torch.from_numpy(order).to(keys[0].device)
        return (torch.cat(keys).index_select(0, perm), torch.cat(values).index_select(0, perm), positions)
