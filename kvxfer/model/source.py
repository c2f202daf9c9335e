"""Pick a model by name, as ``--model`` of ``kvxfer serve | demo | generate`` does.

- ``tiny``, ``tiny-swa``, ``small``, ``medium`` (or ``ref:NAME``): the reference model's presets;
- ``hf:PRESET`` (``hf:tiny``, ``hf:tiny-swa``, ``hf:llama-3.2-1b``, ``hf:llama-3-8b``): a transformers
  model with seeded random weights of that shape; ``hf:PATH``: a local transformers checkpoint
  directory (``config.json``, safetensors weights, optionally a tokenizer). Needs the ``hf`` extra.
"""

from __future__ import annotations

from kvxfer.errors import ConfigError
from kvxfer.model.base import ModelSource
from kvxfer.model.config import PRESETS, preset

HF_PREFIX = "hf:"
REF_PREFIX = "ref:"


def model_source(name: str) -> ModelSource:
    """The model ``name`` designates (see the module docstring); ConfigError names what was wrong."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"model name must be a non-empty string, got {name!r}")
    if name.startswith(HF_PREFIX):
        try:   # transformers is an optional extra: import it only when asked
            from kvxfer.model.hf import HFSource
        except ImportError as exc:
            raise ConfigError(f"model {name!r} needs transformers: pip install 'kvxfer[hf]' ({exc})") from exc
        return HFSource.from_name(name[len(HF_PREFIX):])
    ref = name[len(REF_PREFIX):] if name.startswith(REF_PREFIX) else name
    if ref not in PRESETS:
        raise ConfigError(f"unknown model {name!r}: expected a reference preset {sorted(PRESETS)} or "
                          f"hf:PRESET_OR_DIRECTORY")
    return preset(ref)
