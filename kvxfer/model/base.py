"""The model seam: what a prefill or decode worker needs from a model, and nothing more.

- ``KVSpec``: the shape of the model's KV (layers, KV heads, head_dim, dtype, window per layer), from
  which the worker builds its cache managers;
- ``ModelSource``: what ``WorkerConfig.model`` holds: the KV shape and tokenizer without loading any
  weights, and ``load(device)`` for the model itself (``ModelConfig`` of the reference model,
  ``kvxfer.model.hf.HFSource``, or a loaded ``Model``);
- ``Model``: one ``forward`` over a request's pages (``PagedKV``: write the new tokens' K/V, read the
  pages for attention, commit); prefill in chunks, decode steps and greedy continuation follow from it.

A model reads and writes KV only through the ``PagedKV`` it is given, so a worker may hand it a
``PagedKV`` subclass that observes the writes (layer-wise sending does).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.config import CacheConfig
from kvxfer.cache.dtypes import dtype_name
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.errors import CapacityError, ConfigError
from kvxfer.model.paged import PagedKV


def _positive(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be an int > 0, got {value!r}")


@dataclass(frozen=True)
class KVSpec:
    """The shape of a model's KV cache.

    ``windows`` gives each layer's sliding window in tokens (None = full attention; a query at
    position p sees keys k with p - k < window), cycled over the layers like ``CacheConfig.for_model``;
    ``sink_tokens`` leading tokens stay visible to sliding-window layers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    windows: tuple[int | None, ...] = (None,)
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _positive(getattr(self, name), f"KVSpec.{name}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "KVSpec.dtype"))
        windows = tuple(self.windows)
        if not windows:
            raise ConfigError("KVSpec.windows must not be empty (use (None,) for full attention)")
        for w in windows:
            if w is not None:
                _positive(w, "KVSpec.windows[]")
        object.__setattr__(self, "windows", windows)
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ConfigError(f"KVSpec.sink_tokens must be an int >= 0, got {self.sink_tokens!r}")

    def window_of(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (None = full attention)."""
        return self.windows[layer % len(self.windows)]

    def cache_config(self, tokens_per_block: int, num_blocks: int, device: str = "cpu", **kw: Any) -> CacheConfig:
        """A CacheConfig holding this KV: ``num_blocks`` blocks per layer group on ``device``.

        Extra keywords go to ``CacheConfig`` (``head_order``, ``tp_rank``, ``tp_size``, ...).
        """
        return CacheConfig.for_model(
            self.num_layers, self.num_kv_heads, self.head_dim, tokens_per_block, self.dtype, num_blocks, device,
            windows=self.windows, sink_tokens=self.sink_tokens, **kw)


class Tokenizer(Protocol):
    """Text <-> token ids."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""


@runtime_checkable
class ModelSource(Protocol):
    """A model not (necessarily) loaded yet: its KV shape and tokenizer, and how to load it."""

    @property
    def kv_spec(self) -> KVSpec:
        """The KV shape (known without loading weights)."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""

    def tokenizer(self) -> Tokenizer:
        """The tokenizer that goes with the model."""

    def load(self, device: str | torch.device = "cpu") -> Model:
        """The model on ``device``; every process loading the same source gets the same weights."""


def token_ids(tokens: Sequence[int] | npt.ArrayLike, vocab_size: int, where: str) -> npt.NDArray[np.int64]:
    """``tokens`` as a flat int64 array; CapacityError when an id is outside ``[0, vocab_size)``."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise CapacityError(f"{where}: token ids must be in [0, {vocab_size}), got [{int(ids.min())}, "
                            f"{int(ids.max())}]")
    return ids


class Model(ABC):
    """A causal LM whose KV lives in kvxfer pages. Implementations write ``forward``; the rest is shared.

    A Model is also a ``ModelSource`` (``load`` returns itself), so a loaded model can go straight into
    ``WorkerConfig.model``.
    """

    device: torch.device

    @property
    @abstractmethod
    def kv_spec(self) -> KVSpec:
        """The KV shape the model writes."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""

    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The tokenizer that goes with the model."""

    @abstractmethod
    def forward(self, kv: PagedKV, tokens: Sequence[int] | npt.ArrayLike, *, last_only: bool = False) -> torch.Tensor:
        """Run ``tokens`` after the ``kv.length`` tokens already in the pages: write their K/V through
        ``kv.write``, attend over ``kv.read``, commit them. Returns float32 logits ``[len(tokens), vocab]``
        (``[1, vocab]``, the last token's, with ``last_only``: what sampling needs, without the LM head's
        cost over the whole prompt)."""

    # --- shared behaviour ---------------------------------------------------------------------
    def load(self, device: str | torch.device = "cpu") -> Model:
        """This model (ConfigError if it lives on another device)."""
        if torch.device(device) != self.device:
            raise ConfigError(f"{type(self).__name__} lives on {self.device}, not {device}")
        return self

    def bind(self, shards: Sequence[tuple[KVCacheManager, KVCache]] | PagedKV) -> PagedKV:
        """A PagedKV over (manager, cache) shards, checked against this model's KV shape."""
        if isinstance(shards, PagedKV):
            return shards
        s = self.kv_spec
        return PagedKV(shards, s.num_layers, s.num_kv_heads, s.head_dim)

    def prefill(self, kv: PagedKV, tokens: Sequence[int] | npt.ArrayLike, chunk_size: int | None = None, *,
                last_only: bool = False) -> torch.Tensor:
        """Forward ``tokens`` in chunks of ``chunk_size`` (None: one chunk); logits of every token, or of
        the last one only (``[1, vocab]``) with ``last_only``."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size <= 0):
            raise CapacityError(f"{type(self).__name__}.prefill: chunk_size must be an int > 0, got {chunk_size!r}")
        step = ids.size if chunk_size is None else chunk_size
        parts = [self.forward(kv, ids[i:i + step], last_only=last_only) for i in range(0, ids.size, max(step, 1))]
        if last_only:
            return parts[-1] if parts else torch.empty(0, self.vocab_size)
        return torch.cat(parts) if parts else torch.empty(0, self.vocab_size)

    def decode_step(self, kv: PagedKV, token: int) -> torch.Tensor:
        """Logits ``[vocab]`` after feeding one token."""
        return self.forward(kv, [token])[0]

    def continue_greedy(self, kv: PagedKV, first_token: int, max_new_tokens: int) -> list[int]:
        """Greedy tokens after a prefill: ``first_token`` (sampled from the prefill's last logits)
        followed by ``max_new_tokens - 1`` decode steps."""
        out: list[int] = []
        token = int(first_token)
        while len(out) < max_new_tokens:
            out.append(token)
            if len(out) < max_new_tokens:
                token = greedy(self.decode_step(kv, token))
        return out

    def generate(self, managers: KVCacheManager | Sequence[KVCacheManager], tokens: Sequence[int] | npt.ArrayLike,
                 max_new_tokens: int, chunk_size: int | None = None) -> list[int]:
        """Greedy generation of ``max_new_tokens`` tokens after ``tokens``, with KV in ``managers``
        (one manager, or one per tensor-parallel rank); the request's blocks are freed at the end."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise CapacityError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not ids.size:
            raise CapacityError("generate: the prompt must hold at least one token")
        group = [managers] if isinstance(managers, KVCacheManager) else list(managers)
        caches = [m.create_kv_cache() for m in group]
        try:
            for cache in caches:
                cache.resume()
            kv = self.bind(list(zip(group, caches, strict=True)))
            with torch.inference_mode():
                logits = self.prefill(kv, ids, chunk_size, last_only=True)
                if max_new_tokens == 0:
                    return []
                return self.continue_greedy(kv, greedy(logits[-1]), max_new_tokens)
        finally:
            for cache in caches:
                cache.close()


def greedy(logits: torch.Tensor) -> int:
    """The arg-max token of one row of logits (lowest id on ties)."""
    return int(torch.argmax(logits.float()).item())
