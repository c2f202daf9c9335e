"""Element types by name: the published layout speaks dtype names, torch code needs torch dtypes."""

from __future__ import annotations

import torch

from kvxfer.errors import ConfigError

_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def dtype_name(dtype: str | torch.dtype, field: str = "dtype") -> str:
    """Canonical name of a dtype given as a torch.dtype or a name ("bfloat16", "bf16", ...)."""
    if isinstance(dtype, torch.dtype):
        for name, value in _BY_NAME.items():
            if value == dtype:
                return name
        raise ConfigError(f"{field}: unsupported torch dtype {dtype!r}")
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
        if name.startswith("torch."):
            name = name[len("torch."):]
        if name in _BY_NAME:
            return name
    raise ConfigError(f"{field}: unknown dtype {dtype!r}; expected one of {sorted(_BY_NAME)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name."""
    return _BY_NAME[dtype_name(name)]


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return int(torch.empty((), dtype=torch_dtype(name)).element_size())
