"""ModelConfig of the reference transformer, its presets, and the CacheConfig that holds its KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvxfer.cache.config import CacheConfig
from kvxfer.cache.dtypes import dtype_name
from kvxfer.errors import ConfigError
from kvxfer.model.base import KVSpec
from kvxfer.model.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from kvxfer.model.transformer import ReferenceModel


def _check_positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"ModelConfig.{name} must be an int > 0, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a small Llama-style model (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    ``windows`` gives each layer's sliding-window length in tokens (None = full attention), cycled
    over the layers like ``CacheConfig.for_model``; ``sink_tokens`` leading tokens stay visible to
    sliding-window layers. ``dtype`` is the weights' and KV cache's element type.
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    windows: tuple[int | None, ...] = (None,)
    sink_tokens: int = 0
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            _check_positive(getattr(self, name), name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        windows = tuple(self.windows)
        if not windows:
            raise ConfigError("ModelConfig.windows must not be empty (use (None,) for full attention)")
        for w in windows:
            if w is not None:
                _check_positive(w, "windows[]")
        object.__setattr__(self, "windows", windows)
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ConfigError(f"ModelConfig.sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if self.sink_tokens and all(w is None for w in windows):
            raise ConfigError(f"ModelConfig.sink_tokens={self.sink_tokens} needs a sliding-window layer")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError(f"ModelConfig.rope_theta and norm_eps must be > 0, got {self.rope_theta}, "
                              f"{self.norm_eps}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "ModelConfig.dtype"))
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"ModelConfig.dtype must be a float type, got {self.dtype!r}")

    def window_of(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (None = full attention)."""
        return self.windows[layer % len(self.windows)]

    @property
    def kv_spec(self) -> KVSpec:
        """The KV shape of this model (``ModelSource``)."""
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.windows, self.sink_tokens)

    def cache_config(self, tokens_per_block: int, num_blocks: int, device: str = "cpu", **kw: Any) -> CacheConfig:
        """A CacheConfig holding this model's KV: ``num_blocks`` blocks per layer group on ``device``.

        Extra keywords go to ``CacheConfig`` (``head_order``, ``tp_rank``, ``tp_size``, ...).
        """
        return self.kv_spec.cache_config(tokens_per_block, num_blocks, device, **kw)

    def tokenizer(self) -> ByteTokenizer:
        """UTF-8 bytes as token ids (``ModelSource``)."""
        return ByteTokenizer(self.vocab_size)

    def load(self, device: str | torch.device = "cpu") -> ReferenceModel:
        """The reference model with this config's seeded weights on ``device`` (``ModelSource``)."""
        from kvxfer.model.transformer import ReferenceModel
        return ReferenceModel(self, device)


PRESETS: dict[str, ModelConfig] = {
    # Runs in seconds on 2 CPU cores: tests, the demo and examples.
    "tiny": ModelConfig(),
    # Every other layer has a 48-token sliding window with 4 sink tokens.
    "tiny-swa": ModelConfig(windows=(None, 48), sink_tokens=4),
    # GPU presets (bf16): KV sizes in the range of real 1-8B models, random weights.
    "small": ModelConfig(num_layers=16, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=64,
                         intermediate_size=2816, vocab_size=32000, dtype="bfloat16"),
    "medium": ModelConfig(num_layers=32, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=128,
                          intermediate_size=5632, vocab_size=32000, rope_theta=500000.0, dtype="bfloat16"),
    # The shapes of Llama-3.2-1B and Llama-3-8B (random weights): GPU TTFT benchmarks.
    "llama-3.2-1b": ModelConfig(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                                intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, dtype="bfloat16"),
    "llama-3-8b": ModelConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, dtype="bfloat16"),
}


def preset(name: str) -> ModelConfig:
    """The named preset (``tiny``, ``tiny-swa``, ``small``, ``medium``, ``llama-3.2-1b``, ``llama-3-8b``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}") from None
