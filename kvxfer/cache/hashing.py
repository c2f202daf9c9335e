"""Block keys for prefix reuse: a chain of blake3 digests rooted in the reuse scope.

``key(block i) = blake3(key(block i-1) || token ids of block i as little-endian uint32 || extra key)``
where ``key(block -1)`` is the scope's root key. A key therefore names the whole prefix up to and
including its block, so two requests share a block only when everything before it matches too.

Hash names (as used in KV events):
- ``v2_blake3``: the 32-byte digest itself;
- ``v2_blake3_64``: the first 8 digest bytes read as a big-endian unsigned integer (so the integer's
  16 hex digits are the digest's first 16 hex digits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import blake3
import numpy as np
import numpy.typing as npt

from kvxfer.errors import CapacityError, ConfigError

HASH_V2_BLAKE3 = "v2_blake3"
HASH_V2_BLAKE3_64 = "v2_blake3_64"
HashName = Literal["v2_blake3", "v2_blake3_64"]
HASH_NAMES: tuple[str, ...] = (HASH_V2_BLAKE3, HASH_V2_BLAKE3_64)
KEY_BYTES = 32

_ROOT_DOMAIN = b"kvxfer.reuse.root.v2"
_MAX_SALT_BYTES = 1 << 16
_MAX_EXTRA_KEY_BYTES = 1 << 16

ExtraKeys = Mapping[int, bytes]
TokenArray = npt.NDArray[np.int64]


def as_token_ids(tokens: Sequence[int] | npt.ArrayLike, what: str) -> TokenArray:
    """``tokens`` as a 1-D int64 array after checking every id fits uint32 (CapacityError otherwise)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise CapacityError(f"{what}: token ids must be a 1-D integer sequence, got shape {arr.shape} "
                            f"dtype {arr.dtype}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > 0xFFFFFFFF:
        raise CapacityError(f"{what}: token ids must fit uint32, got max {int(arr.max())}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise CapacityError(f"{what}: token ids must fit uint32, got range [{int(arr.min())}, {int(arr.max())}]")
    return arr


@dataclass(frozen=True)
class ReuseScope:
    """Who may share blocks: requests share only when their LoRA id and salt (tenant) are equal."""

    lora_id: int | None = None
    salt: bytes | str | None = None

    def __post_init__(self) -> None:
        lora = self.lora_id
        if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int) or not 0 <= lora < 1 << 63):
            raise ConfigError(f"ReuseScope.lora_id must be None or an int in [0, 2**63), got {lora!r}")
        salt = self.salt
        if salt is not None:
            if not isinstance(salt, bytes | str):
                raise ConfigError(f"ReuseScope.salt must be None, bytes or str, got {type(salt).__name__}")
            if len(self.salt_bytes) > _MAX_SALT_BYTES:
                raise ConfigError(f"ReuseScope.salt is {len(self.salt_bytes)} bytes, at most {_MAX_SALT_BYTES}")

    @property
    def salt_bytes(self) -> bytes:
        """The salt as bytes (str salts are UTF-8 encoded; None is empty)."""
        if self.salt is None:
            return b""
        return self.salt.encode() if isinstance(self.salt, str) else self.salt

    @property
    def root_key(self) -> bytes:
        """The chain's root: blake3 over a domain tag, the LoRA id and the salt, each length-framed
        so that no two scopes encode alike (``lora_id=None`` differs from every integer id)."""
        lora = b"\x00" if self.lora_id is None else b"\x01" + self.lora_id.to_bytes(8, "little")
        salt = self.salt_bytes
        tag = b"\x00" if self.salt is None else b"\x01" + len(salt).to_bytes(4, "little") + salt
        return blake3.blake3(_ROOT_DOMAIN + lora + tag).digest()


DEFAULT_SCOPE = ReuseScope()


def check_extra_keys(extra_keys: ExtraKeys | None, what: str) -> dict[int, bytes]:
    """``extra_keys`` (block index -> bytes such as a multimodal digest) validated into a dict."""
    if extra_keys is None:
        return {}
    if not isinstance(extra_keys, Mapping):
        raise ConfigError(f"{what}: extra_keys must map block index -> bytes, got {type(extra_keys).__name__}")
    out: dict[int, bytes] = {}
    for index, value in extra_keys.items():
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise ConfigError(f"{what}: extra_keys block index must be an int >= 0, got {index!r}")
        if not isinstance(value, bytes | bytearray | memoryview):
            raise ConfigError(f"{what}: extra_keys[{index}] must be bytes, got {type(value).__name__}")
        data = bytes(value)
        if len(data) > _MAX_EXTRA_KEY_BYTES:
            raise ConfigError(f"{what}: extra_keys[{index}] is {len(data)} bytes, at most {_MAX_EXTRA_KEY_BYTES}")
        if data:
            out[int(index)] = data
    return out


def block_keys(tokens: Sequence[int] | npt.ArrayLike, tokens_per_block: int, parent: bytes,
               *, first_block: int = 0, extra_keys: ExtraKeys | None = None) -> list[bytes]:
    """Keys of every full block of ``tokens``, chained from ``parent``.

    ``tokens`` starts at block ``first_block`` of the request (only used to look up ``extra_keys``,
    which map a request-wide block index to bytes appended to that block's hash input). A trailing
    partial block gets no key. The token ids are converted to little-endian uint32 in one numpy
    step; the loop runs once per block because each key needs the previous one.
    """
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
        raise ConfigError(f"block_keys: tokens_per_block must be an int > 0, got {tokens_per_block!r}")
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ConfigError(f"block_keys: parent key must be {KEY_BYTES} bytes, got {parent!r:.80}")
    arr = as_token_ids(tokens, "block_keys")
    extras = check_extra_keys(extra_keys, "block_keys")
    n_blocks = arr.size // tokens_per_block
    data = memoryview(arr[:n_blocks * tokens_per_block].astype("<u4").tobytes())
    stride = 4 * tokens_per_block
    keys: list[bytes] = []
    key = parent
    if not extras:
        for off in range(0, n_blocks * stride, stride):
            key = blake3.blake3(key + data[off:off + stride]).digest()
            keys.append(key)
        return keys
    for b in range(n_blocks):
        extra = extras.get(first_block + b, b"")
        key = blake3.blake3(key + data[b * stride:(b + 1) * stride] + extra).digest()
        keys.append(key)
    return keys


def external_hash(key: bytes, hash_name: str = HASH_V2_BLAKE3_64) -> bytes | int:
    """A block key as published under ``hash_name``: the digest (v2_blake3) or its 64-bit prefix."""
    if hash_name == HASH_V2_BLAKE3:
        return key
    if hash_name == HASH_V2_BLAKE3_64:
        return int.from_bytes(key[:8], "big")
    raise ConfigError(f"unknown hash name {hash_name!r} (have {', '.join(HASH_NAMES)})")
