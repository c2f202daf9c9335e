"""transformers causal LMs (Llama, Mistral, Qwen2, Qwen3, ...) whose KV lives in kvxfer pages.

``HFSource`` names a model: a local checkpoint directory (``config.json`` + safetensors weights, and a
tokenizer when present), loaded with ``local_files_only=True``, or a shipped preset with seeded random
weights (``tiny``, ``tiny-swa``, ``llama-3.2-1b``, ``llama-3-8b``). Nothing is ever downloaded.

``HFModel`` runs the transformers model with ``PagedCache``, a transformers ``Cache`` whose layers
write each forward's new K/V straight into the request's pages (``PagedKV.write``) and hand attention
the layer's visible K/V read back from the pages (``PagedKV.read``): no dense copy of the whole cache
is kept between steps. Sliding-window layers (``layer_types`` / ``sliding_window`` of the config)
become kvxfer sliding-window layer groups with the same window, so their released blocks stay released.
Batch size is 1 (one request per forward), as in the workers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
import torch

from kvxfer.cache.dtypes import dtype_name, torch_dtype
from kvxfer.errors import ConfigError, KVCacheError
from kvxfer.model.base import KVSpec, Model, Tokenizer, token_ids
from kvxfer.model.paged import PagedKV
from kvxfer.model.tokenizer import ByteTokenizer

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:   # pragma: no cover - exercised only without the extra
    raise ImportError("kvxfer.model.hf needs transformers: pip install 'kvxfer[hf]'") from exc

_SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
          "pad_token_id": None, "initializer_range": 0.1}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # CPU tests and the demo: Llama, 4 layers, GQA (4 query / 2 KV heads), vocab 512 (byte tokenizer), fp32.
    "tiny": ("llama", {**_SMALL, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                       "dtype": "float32"}),
    # Qwen3 (q/k norms) with every other layer a 24-token sliding window.
    "tiny-swa": ("qwen3", {**_SMALL, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                           "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 0,
                           "layer_types": ["full_attention", "sliding_attention"] * 2, "dtype": "float32"}),
    # GPU benchmarks: the shapes of Llama-3.2-1B and Llama-3-8B (random weights), bf16.
    "llama-3.2-1b": ("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                               "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                               "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
                               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192},
                               "dtype": "bfloat16"}),
    "llama-3-8b": ("llama", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                             "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                             "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                             "dtype": "bfloat16"}),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class HFSource:
    """A transformers model by preset name or local directory (exactly one of them).

    ``seed`` seeds the random weights of a preset (the same seed gives the same weights in every
    process); ``dtype`` overrides the config's dtype; ``attn_implementation`` is transformers' own
    ("sdpa" or "eager").
    """

    preset: str | None = None
    path: str | None = None
    seed: int = 0
    dtype: str | None = None
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ConfigError(f"HFSource needs exactly one of preset and path, got preset={self.preset!r}, "
                              f"path={self.path!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"unknown transformers preset {self.preset!r}; expected one of {sorted(PRESETS)} or "
                              f"a checkpoint directory")
        if self.path is not None:
            if not (Path(self.path) / "config.json").is_file():
                raise ConfigError(f"{self.path!r} is not a transformers checkpoint directory (no config.json)")
            object.__setattr__(self, "path", str(Path(self.path).resolve()))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype, "HFSource.dtype"))
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"HFSource.attn_implementation must be 'sdpa' or 'eager', got "
                              f"{self.attn_implementation!r}")
        self._check_layer_types()

    @classmethod
    def from_name(cls, text: str) -> HFSource:
        """``PRESET`` or a directory path (what follows ``hf:`` in ``--model``)."""
        if text in PRESETS:
            return cls(preset=text)
        if Path(text).is_dir():
            return cls(path=text)
        raise ConfigError(f"hf:{text}: neither a transformers preset {sorted(PRESETS)} nor a checkpoint directory")

    @property
    def name(self) -> str:
        """``hf:PRESET`` or ``hf:PATH``."""
        return f"hf:{self.preset if self.preset is not None else self.path}"

    def hf_config(self) -> Any:
        """The transformers config (read from ``config.json``, or built from the preset)."""
        return _hf_config(self.preset, self.path)

    def _check_layer_types(self) -> None:
        for i, kind in enumerate(layer_types(self.hf_config())):
            if kind not in (FULL, SLIDING):
                raise ConfigError(f"{self.name}: layer {i} is {kind!r}; only {FULL} and {SLIDING} layers are "
                                  f"supported")

    @property
    def kv_spec(self) -> KVSpec:
        """The KV shape: layers, KV heads, head_dim, dtype and each layer's sliding window."""
        cfg = self.hf_config()
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        windows = tuple(int(cfg.sliding_window) if kind == SLIDING else None for kind in layer_types(cfg))
        return KVSpec(int(cfg.num_hidden_layers), int(kv_heads), int(head_dim), self.model_dtype(), windows)

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return int(self.hf_config().vocab_size)

    def model_dtype(self) -> str:
        """The weights' and KV's dtype: ``dtype``, else the config's, else float32."""
        if self.dtype is not None:
            return self.dtype
        raw = getattr(self.hf_config(), "dtype", None)
        return dtype_name(raw, "config.dtype") if raw is not None else "float32"

    def tokenizer(self) -> Tokenizer:
        """The directory's tokenizer when it has one, else UTF-8 bytes as ids."""
        if self.path is not None and any((Path(self.path) / f).is_file() for f in TOKENIZER_FILES):
            return HFTokenizer(transformers.AutoTokenizer.from_pretrained(self.path, local_files_only=True))
        return ByteTokenizer(self.vocab_size)

    def load(self, device: str | torch.device = "cpu") -> HFModel:
        """The model on ``device`` (weights from the directory, or seeded random ones)."""
        return HFModel(self, device)


@functools.lru_cache(maxsize=8)
def _hf_config(preset: str | None, path: str | None) -> Any:
    if path is not None:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    assert preset is not None
    model_type, kwargs = PRESETS[preset]
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def layer_types(config: Any) -> list[str]:
    """Each layer's attention kind, as transformers' own caches derive it from the config."""
    from transformers.cache_utils import get_layer_types_and_kwargs
    kinds, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return list(kinds)


class HFTokenizer:
    """A transformers tokenizer as a kvxfer ``Tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, e.g. BOS)."""
        return [int(i) for i in self.hf.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return str(self.hf.decode([int(i) for i in ids], skip_special_tokens=True))


class PagedLayer(CacheLayerMixin):  # type: ignore[misc,no-untyped-call]
    """One layer of ``PagedCache``: K/V go to and come from the request's pages."""

    is_compileable = False
    is_croppable = False

    def __init__(self, kv: PagedKV, layer: int, window: int | None, start: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kv, self.layer, self.window = kv, layer, window
        self.is_sliding = window is not None
        self.length = start   # tokens whose K/V this layer holds
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pages exist."""

    def _visible_from(self) -> int:
        """First key position the next queries may see."""
        return 0 if self.window is None else max(self.length - self.window + 1, 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V (``[1, kv_heads, tokens, head_dim]``) into the pages; return the K/V
        every new query may see, read back from the pages, as ``[1, kv_heads, keys, head_dim]``."""
        if key_states.shape[0] != 1:
            raise KVCacheError(f"PagedCache layer {self.layer}: batch size must be 1, got {key_states.shape[0]}")
        lo, start = self._visible_from(), self.length
        end = start + int(key_states.shape[-2])
        self.kv.write(self.layer, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), start)
        got = self.kv.read(self.layer, lo, end)
        if got.positions.numel() != end - lo:
            raise KVCacheError(f"PagedCache layer {self.layer}: keys [{lo}, {end}) must all have pages, only "
                               f"{got.positions.numel()} do")
        self.length = end
        keys = got.key.to(key_states.dtype).transpose(0, 1).unsqueeze(0).contiguous()
        values = got.value.to(value_states.dtype).transpose(0, 1).unsqueeze(0).contiguous()
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys ``update`` returns for ``query_length`` new queries."""
        lo = self._visible_from()
        return self.length - lo + query_length, lo

    def get_seq_length(self) -> int:
        """Tokens this layer holds."""
        return self.length

    def get_max_length(self) -> int:
        """No maximum (the pages grow with the request)."""
        return -1


class PagedCache(Cache):  # type: ignore[misc]
    """A transformers ``Cache`` over one request's pages, for one forward starting at token ``start``."""

    def __init__(self, kv: PagedKV, spec: KVSpec, start: int) -> None:
        super().__init__(layers=[PagedLayer(kv, i, spec.window_of(i), start) for i in range(spec.num_layers)])


class HFModel(Model):
    """A transformers causal LM run over kvxfer pages (see the module docstring)."""

    def __init__(self, source: HFSource, device: str | torch.device = "cpu") -> None:
        self.source = source
        self.device = torch.device(device)
        self._kv_spec = source.kv_spec
        dtype = torch_dtype(source.model_dtype())
        kw: dict[str, Any] = {"dtype": dtype, "attn_implementation": source.attn_implementation}
        self.hf: Any   # a transformers PreTrainedModel (typed loosely: its methods are wrapped)
        if source.path is not None:
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(source.path, local_files_only=True, **kw)
        else:
            # Seeded init on the CPU, whatever the device: every process gets the same weights.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(source.seed)
                self.hf = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    source.hf_config(), **kw)
        self.hf.to(self.device).eval()
        self._vocab = int(self.hf.config.vocab_size)

    @property
    def kv_spec(self) -> KVSpec:
        """The KV shape (from the transformers config)."""
        return self._kv_spec

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return self._vocab

    def tokenizer(self) -> Tokenizer:
        """The source's tokenizer."""
        return self.source.tokenizer()

    @torch.inference_mode()
    def forward(self, kv: PagedKV, tokens: Sequence[int] | npt.ArrayLike, *, last_only: bool = False) -> torch.Tensor:
        """Run ``tokens`` after the ``kv.length`` tokens in the pages; their K/V go into the pages and are
        committed. Returns float32 logits ``[len(tokens), vocab]`` (the last token's only with
        ``last_only``, as transformers' ``generate`` computes them: ``logits_to_keep=1``)."""
        ids = token_ids(tokens, self._vocab, "HFModel.forward")
        start = kv.length
        if not ids.size:
            return torch.empty(0, self._vocab)
        kv.reserve(start + ids.size)
        input_ids = torch.from_numpy(ids).to(self.device)[None]
        positions = torch.arange(start, start + ids.size, device=self.device)[None]
        out = self.hf(input_ids=input_ids, position_ids=positions, past_key_values=PagedCache(kv, self._kv_spec, start),
                      use_cache=True, logits_to_keep=1 if last_only else 0)
        kv.commit(ids)
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def dense_generate(self, tokens: Sequence[int] | npt.ArrayLike,
                       max_new_tokens: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The same model generating alone with transformers' own ``DynamicCache`` and no kvxfer code
        (greedy as transformers' ``generate`` runs it: one-shot prefill, then one token per step, LM head
        on the last position): the tokens, and each layer's K/V of the
        prompt as ``[tokens, kv_heads, head_dim]`` (every position, sliding-window layers too). What
        kvxfer's paged generation is checked against."""
        ids = token_ids(tokens, self._vocab, "HFModel.dense_generate")
        cache: Any = transformers.DynamicCache()   # full layers keep every position; the masks still apply windows
        out_tokens: list[int] = []
        prompt_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.inference_mode():
            x = torch.from_numpy(ids).to(self.device)[None]
            for step in range(max_new_tokens):
                logits = self.hf(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
                if step == 0:
                    prompt_kv = [(layer.keys[0].transpose(0, 1).clone(), layer.values[0].transpose(0, 1).clone())
                                 for layer in cache.layers]
                token = int(torch.argmax(logits.float()).item())
                out_tokens.append(token)
                x = torch.tensor([[token]], device=self.device)
        return out_tokens, prompt_kv
