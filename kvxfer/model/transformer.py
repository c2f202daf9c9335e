"""The reference transformer: Llama-style blocks whose KV lives only in cache-manager pages.

Weights are random but seeded, so two processes building the same ModelConfig hold the same model:
prefill on one, decode on the other, and the tokens must match a single process doing both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy.typing as npt
import torch

from kvxfer.cache.dtypes import torch_dtype
from kvxfer.errors import KVCacheError
from kvxfer.model.base import KVSpec, Model, token_ids
from kvxfer.model.config import ModelConfig
from kvxfer.model.paged import PagedKV
from kvxfer.model.tokenizer import ByteTokenizer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in ``x``'s dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of ``x`` = [tokens, heads, head_dim]."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
    angles = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None, :]
    xf = x.float()
    half = dim // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: int | None, sink_tokens: int) -> torch.Tensor:
    """Causal grouped-query attention with an optional sliding window and sink tokens.

    q: [tokens, heads, dim]; k, v: [keys, kv_heads, dim]; positions are absolute token indices.
    Returns [tokens, heads * dim]. Computed in float32.
    """
    t, heads, dim = q.shape
    group = heads // k.shape[1]
    kf = k.float().transpose(0, 1).repeat_interleave(group, 0)      # [heads, keys, dim]
    vf = v.float().transpose(0, 1).repeat_interleave(group, 0)
    # In place on the fresh product: a 32k-token chunk's scores are 4 GiB at the 8B shape, and the
    # out-of-place forms held two or three of them at once.
    scores = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2))                     # [heads, t, keys]
    scores.div_(math.sqrt(dim))
    qp, kp = q_pos.to(q.device)[:, None], k_pos.to(q.device)[None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= (qp - kp < window) | (kp < sink_tokens)
    scores.masked_fill_(~allowed[None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, -1), vf)                                       # [heads, t, dim]
    return out.transpose(0, 1).reshape(t, heads * dim).to(q.dtype)


def _draw_weights(specs: Sequence[tuple[str, tuple[int, ...], float | None]], seed: int, device: torch.device,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight of ``specs`` drawn on the CPU from a generator of its own (seeded from ``seed`` and its
    index), so any process on any device gets the same weights, and the draws run in parallel threads
    (an 8B-parameter model took ~90 s on one thread with one generator)."""
    def draw(index: int, shape: tuple[int, ...], std: float | None) -> torch.Tensor:
        gen = torch.Generator().manual_seed((seed * _SEED_MIX + index) % (1 << 63))
        noise = torch.randn(*shape, generator=gen)
        return (1.0 + 0.1 * noise if std is None else noise * std).to(device, dtype)

    workers = max(1, min(len(specs), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="kvxfer-weights") as pool:
        futures = {name: pool.submit(draw, i, shape, std) for i, (name, shape, std) in enumerate(specs)}
        return {name: f.result() for name, f in futures.items()}


_SEED_MIX = 0x9E3779B97F4A7C15


class ReferenceModel(Model):
    """A small Llama-style transformer with seeded random weights and paged KV."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype)
        c = config
        h, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # (name, shape, std) of every weight in a fixed order; std None: a norm's 1 + 0.1 * noise.
        layer = [("attn_norm", (h,), None), ("wq", (h, q_out), h ** -0.5), ("wk", (h, kv_out), h ** -0.5),
                 ("wv", (h, kv_out), h ** -0.5), ("wo", (q_out, h), q_out ** -0.5), ("mlp_norm", (h,), None),
                 ("w_gate", (h, c.intermediate_size), h ** -0.5), ("w_up", (h, c.intermediate_size), h ** -0.5),
                 ("w_down", (c.intermediate_size, h), c.intermediate_size ** -0.5)]
        specs = [("embed", (c.vocab_size, h), 1.0), *[(f"{i}.{n}", shape, std) for i in range(c.num_layers)
                                                     for n, shape, std in layer],
                 ("final_norm", (h,), None), ("lm_head", (h, c.vocab_size), h ** -0.5)]
        drawn = _draw_weights(specs, c.seed, self.device, self.dtype)
        self.embed = drawn["embed"]
        self.layers: list[dict[str, torch.Tensor]] = [{n: drawn[f"{i}.{n}"] for n, _, _ in layer}
                                                      for i in range(c.num_layers)]
        self.final_norm = drawn["final_norm"]
        self.lm_head = drawn["lm_head"]

    # --- forward ----------------------------------------------------------------------------------
    @property
    def kv_spec(self) -> KVSpec:
        """The KV shape (from the ModelConfig)."""
        return self.config.kv_spec

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return self.config.vocab_size

    def tokenizer(self) -> ByteTokenizer:
        """UTF-8 bytes as token ids."""
        return self.config.tokenizer()

    @torch.inference_mode()
    def forward(self, kv: PagedKV, tokens: Sequence[int] | npt.ArrayLike, *, last_only: bool = False) -> torch.Tensor:
        """Run ``tokens`` after the ``kv.length`` tokens already cached; writes and commits their KV.

        Returns float32 logits ``[len(tokens), vocab]`` (the last token's only with ``last_only``).
        """
        c = self.config
        ids = token_ids(tokens, c.vocab_size, "ReferenceModel.forward")
        start = kv.length
        if not ids.size:
            return torch.empty(0, c.vocab_size)
        kv.reserve(start + ids.size)
        positions = torch.arange(start, start + ids.size, dtype=torch.int64)
        x = self.embed[torch.from_numpy(ids).to(self.device)]
        for i, w in enumerate(self.layers):
            hs = rms_norm(x, w["attn_norm"], c.norm_eps)
            q = (hs @ w["wq"]).view(-1, c.num_heads, c.head_dim)
            k = (hs @ w["wk"]).view(-1, c.num_kv_heads, c.head_dim)
            v = (hs @ w["wv"]).view(-1, c.num_kv_heads, c.head_dim)
            q, k = apply_rope(q, positions, c.rope_theta), apply_rope(k, positions, c.rope_theta)
            kv.write(i, k, v, start)
            keys, values, k_pos = kv.read(i, 0, start + ids.size)
            window = c.window_of(i)
            self._check_visible(i, k_pos, start, start + ids.size, window)
            x = x + attention(q, keys, values, positions, k_pos, window, c.sink_tokens) @ w["wo"]
            hs = rms_norm(x, w["mlp_norm"], c.norm_eps)
            x = x + (torch.nn.functional.silu(hs @ w["w_gate"]) * (hs @ w["w_up"])) @ w["w_down"]
        if last_only:
            x = x[-1:]
        logits = (rms_norm(x, self.final_norm, c.norm_eps) @ self.lm_head).float()
        kv.commit(ids)
        return logits

    def _check_visible(self, layer: int, k_pos: torch.Tensor, q_start: int, q_end: int, window: int | None) -> None:
        """Every key some query may attend to must have a page (a released sliding-window block must not)."""
        lo = 0 if window is None else max(0, q_start - window + 1)
        need = q_end - lo + (min(self.config.sink_tokens, lo) if window is not None else 0)
        have = int(((k_pos >= lo) | (k_pos < self.config.sink_tokens if window is not None else False)).sum())
        if have != need:
            raise KVCacheError(f"layer {layer}: {need} visible key positions for queries [{q_start}, {q_end}) but "
                               f"only {have} have pages")
