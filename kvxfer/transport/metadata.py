"""Transport metadata: what one transport tells a peer (backend, name, advertised regions, backend blob).

Metadata arrives from another process, so decoding is bounded and checks every field: a hostile or
truncated blob is a DecodeError naming the field, never a huge allocation or a bad region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import DecodeError, LayoutError

METADATA_VERSION = 1
MAX_METADATA_BYTES = 64 << 20
MAX_REGIONS = 1 << 16
MAX_NAME_CHARS = 256
MEMORY_KINDS = ("cpu", "pinned", "cuda")
_MAX_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class TransportMetadata:
    """Decoded metadata of one transport endpoint."""

    backend: str
    name: str
    regions: tuple[MemoryRegion, ...]
    backend_blob: bytes = b""

    def encode(self) -> bytes:
        """Versioned msgpack form (see ``decode``)."""
        return msgpack.packb({
            "v": METADATA_VERSION,
            "backend": self.backend,
            "name": self.name,
            "regions": [[r.base_address, r.nbytes, r.memory_kind, r.device_id] for r in self.regions],
            "blob": self.backend_blob,
        }, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> TransportMetadata:
        """Parse and check metadata from a peer; DecodeError names the first bad field."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError(f"transport metadata: expected bytes, got {type(data).__name__}")
        if len(data) > MAX_METADATA_BYTES:
            raise DecodeError(f"transport metadata: {len(data)} bytes exceeds the {MAX_METADATA_BYTES} limit")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True,
                                  max_bin_len=MAX_METADATA_BYTES, max_str_len=MAX_NAME_CHARS,
                                  max_array_len=min(MAX_REGIONS, len(data)), max_map_len=16, max_ext_len=0)
        except Exception as exc:
            raise DecodeError(f"transport metadata: not valid msgpack ({exc})") from exc
        if not isinstance(obj, dict):
            raise DecodeError(f"transport metadata: expected a map, got {type(obj).__name__}")
        version = obj.get("v")
        if version != METADATA_VERSION:
            raise DecodeError(f"transport metadata: unsupported version {version!r} (expected {METADATA_VERSION})")
        backend = _text(obj, "backend")
        name = _text(obj, "name")
        raw_regions = obj.get("regions")
        if not isinstance(raw_regions, list):
            raise DecodeError(f"transport metadata.regions: expected a list, got {type(raw_regions).__name__}")
        regions = tuple(_region(r, i) for i, r in enumerate(raw_regions))
        blob = obj.get("blob")
        if not isinstance(blob, bytes):
            raise DecodeError(f"transport metadata.blob: expected bytes, got {type(blob).__name__}")
        return cls(backend, name, regions, blob)


def _text(obj: dict[str, Any], key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not v or len(v) > MAX_NAME_CHARS:
        raise DecodeError(f"transport metadata.{key}: expected a non-empty string of <= {MAX_NAME_CHARS} "
                          f"chars, got {v!r:.80}")
    return v


def _region(v: Any, i: int) -> MemoryRegion:
    where = f"transport metadata.regions[{i}]"
    if not isinstance(v, list) or len(v) != 4:
        raise DecodeError(f"{where}: expected [base, nbytes, kind, device], got {v!r:.80}")
    base, nbytes, kind, dev = v
    for fname, x in (("base", base), ("nbytes", nbytes), ("device", dev)):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= _MAX_U64:
            raise DecodeError(f"{where}.{fname}: expected an unsigned 64-bit int, got {x!r:.80}")
    if kind not in MEMORY_KINDS:
        raise DecodeError(f"{where}.kind: expected one of {MEMORY_KINDS}, got {kind!r:.80}")
    try:
        return MemoryRegion(base, nbytes, kind, dev)
    except LayoutError as exc:
        raise DecodeError(f"{where}: {exc}") from exc


def check_regions(regions: Sequence[MemoryRegion], where: str) -> tuple[MemoryRegion, ...]:
    """Regions a transport can register: MemoryRegion instances of a known kind, non-empty, at most
    MAX_REGIONS. (Overlap is allowed: two pools may alias the same memory on purpose.)"""
    out = tuple(regions)
    if len(out) > MAX_REGIONS:
        raise LayoutError(f"{where}: {len(out)} regions exceeds the {MAX_REGIONS} limit")
    for i, r in enumerate(out):
        if not isinstance(r, MemoryRegion):
            raise LayoutError(f"{where}: regions[{i}] is a {type(r).__name__}, expected MemoryRegion")
        if r.memory_kind not in MEMORY_KINDS:
            raise LayoutError(f"{where}: regions[{i}] has memory kind {r.memory_kind!r}, "
                              f"transports move {MEMORY_KINDS}")
        if r.nbytes == 0:
            raise LayoutError(f"{where}: regions[{i}] is empty (0 bytes at {r.base_address:#x})")
    return out
