"""Block keys for prefix reuse: a chain of digests rooted in the reuse scope, under the hash
algorithms of the reference design (``CacheConfig.hash_algo``).

A key names the whole prefix up to and including its block, so two requests share a block only
when everything before it matches too. The v2 chain (the reference's construction):

- root key: ``H(scope bytes)``, scope bytes = one mask byte (bit 0: LoRA id present, bit 1: salt
  present) then each present field as a little-endian uint64;
- ``key(block i) = H(key(block i-1) || token ids as little-endian uint64 || extra key bytes)``;

with ``H`` = SHA-256 (``v2_sha256``, ``v2_sha256_64``) or BLAKE3 (``v2_blake3``, ``v2_blake3_64``).
The ``_64`` names differ only in what events publish (the first 8 digest bytes as a big-endian
integer); the full-width names publish the digest as a hex string.

``v2_sha256_packed`` is the chain of the reference's v2 manager (``sequence_to_blockchain_keys``): the
same root, then ``key(block i) = SHA-256(key(block i-1) || each token as 4 little-endian bytes, or a
multimodal item's 32-byte digest as itself)``; token ids must be below 2**31. Its tokens may be such
digests (``TokenIdExt``): a manager keeps them in its int64 token arrays as negative codes of a
``DigestTable`` and packs the digest itself into the key. Events publish the digest as a hex string.

``v1_block_key`` (and ``auto``, which resolves to it as in the reference) is TensorRT-LLM's
``BlockKeyHasher``: a 64-bit chain where ``seed = num_tokens ^ (parent * 0xbf58476d1ce4e5b9)``, the
cache-salt id is mixed into a first block (parent 0), each token id with the 32-bit mix, the LoRA
id with the 64-bit mix, and an extra key as TensorRT-LLM mixes a multimodal item digest (4-byte
little-endian words with the 32-bit mix, zero-padded, then its start offset 0 with the 64-bit mix).
A 64-bit hash is not collision resistant, and the prefix tree decides reuse by key equality, so a
v1 key is *composite*: the 8-byte v1 hash (big-endian) followed by the 32-byte SHA-256 v2 digest of
the same chain. The tree matches all 40 bytes; events publish the v1 hash (the first 8 bytes).

The last section holds TensorRT-LLM's names for the same ideas (its ``kv_cache_hash`` module and the key
helpers of ``kv_cache_manager_v2``), with their byte layout: ``sequence_to_blockchain_keys`` packs each
token id as 4 little-endian bytes (ids below 2**31, the C++ backend's ``TokenIdExt``), where
``block_keys`` above packs 8. Both chains start from the same root bytes; their block keys differ.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import blake3
import numpy as np
import numpy.typing as npt

from kvxfer.errors import CapacityError, ConfigError

HASH_AUTO = "auto"
HASH_V1_BLOCK_KEY = "v1_block_key"
HASH_V2_SHA256 = "v2_sha256"
HASH_V2_SHA256_64 = "v2_sha256_64"
HASH_V2_BLAKE3 = "v2_blake3"
HASH_V2_BLAKE3_64 = "v2_blake3_64"
HASH_V2_SHA256_PACKED = "v2_sha256_packed"
HashAlgo = Literal["auto", "v1_block_key", "v2_sha256", "v2_sha256_64", "v2_blake3", "v2_blake3_64",
                   "v2_sha256_packed"]
#: Every algorithm name ``CacheConfig.hash_algo`` accepts (the reference design's list, then
#: ``v2_sha256_packed``: the key chain of the reference's v2 manager, which ``KVCacheManagerConfig`` selects).
HASH_ALGOS: tuple[str, ...] = (HASH_AUTO, HASH_V1_BLOCK_KEY, HASH_V2_SHA256, HASH_V2_SHA256_64, HASH_V2_BLAKE3,
                               HASH_V2_BLAKE3_64, HASH_V2_SHA256_PACKED)
#: kvxfer's default: BLAKE3 keys (cryptographic, one hash per block), 64-bit prefixes in events.
DEFAULT_HASH_ALGO: HashAlgo = "v2_blake3_64"
#: Hash names the event publisher of this module's first version accepted (kept for kvxfer.cache.events).
HASH_NAMES: tuple[str, ...] = (HASH_V2_BLAKE3, HASH_V2_BLAKE3_64)
#: Width of a v2 key (a SHA-256 or BLAKE3 digest) and of a v1 composite key (8-byte hash + digest).
KEY_BYTES = 32
V1_KEY_BYTES = 40

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_MIX32 = 0x45D9F3B
_MIX64_1 = 0xBF58476D1CE4E5B9
_MIX64_2 = 0x94D049BB133111EB
_COMBINE = 0x9E3779B9
_PARENT = 0xBF58476D1CE4E5B9
_MAX_EXTRA_KEY_BYTES = 1 << 16

ExtraKeys = Mapping[int, bytes]
TokenArray = npt.NDArray[np.int64]


def resolve_hash_algo(algo: str) -> str:
    """The concrete algorithm ``algo`` names (``auto`` -> ``v1_block_key``); ConfigError when unknown."""
    if algo not in HASH_ALGOS:
        raise ConfigError(f"unknown hash algorithm {algo!r} (have {', '.join(HASH_ALGOS)})")
    return HASH_V1_BLOCK_KEY if algo == HASH_AUTO else algo


def key_width(algo: str) -> int:
    """Bytes of a block key under ``algo`` (40 for the v1 composite key, 32 otherwise)."""
    return V1_KEY_BYTES if resolve_hash_algo(algo) == HASH_V1_BLOCK_KEY else KEY_BYTES


def _hasher(algo: str) -> Callable[[bytes], Any]:
    """The constructor of the 32-byte hash of the v2 chain under ``algo`` (v1 keys carry a SHA-256 chain):
    called with the first bytes, it returns an object with ``update`` and ``digest``."""
    return blake3.blake3 if resolve_hash_algo(algo) in (HASH_V2_BLAKE3, HASH_V2_BLAKE3_64) else hashlib.sha256


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    """The 32-byte digest function of the v2 chain under ``algo``."""
    new = _hasher(algo)
    return lambda data: bytes(new(data).digest())


def cache_salt_id(cache_salt: str) -> int:
    """The integer salt of a tenant string: an 8-byte BLAKE3 digest of its UTF-8 bytes read little-endian
    (TensorRT-LLM's ``get_cache_salt_id``, so routers compute the same root keys)."""
    if not isinstance(cache_salt, str):
        raise ConfigError(f"cache_salt_id: the cache salt must be a str, got {type(cache_salt).__name__}")
    return int.from_bytes(blake3.blake3(cache_salt.encode("utf-8")).digest(length=8), "little")


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


def _u64_field(value: int | None, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MASK64):
        raise ConfigError(f"ReuseScope.{name} must be None or an int in [0, 2**64), got {value!r}")
    return value


@dataclass(frozen=True)
class ReuseScope:
    """Who may share blocks: requests share only when their LoRA id and salt (tenant) are equal.

    Both are unsigned 64-bit integers or None, as in the reference; derive a salt from a tenant
    string with ``cache_salt_id`` (or ``ReuseScope.for_tenant``).
    """

    lora_id: int | None = None
    salt: int | None = None

    def __post_init__(self) -> None:
        _u64_field(self.lora_id, "lora_id")
        _u64_field(self.salt, "salt")

    @classmethod
    def for_tenant(cls, cache_salt: str, lora_id: int | None = None) -> ReuseScope:
        """The scope of a tenant named by a string salt (``salt = cache_salt_id(cache_salt)``)."""
        return cls(lora_id, cache_salt_id(cache_salt))

    def scope_bytes(self) -> bytes:
        """The scope's encoding: a presence mask byte, then each present field as little-endian uint64."""
        mask = (self.lora_id is not None) | (self.salt is not None) << 1
        out = bytes([mask])
        for value in (self.lora_id, self.salt):
            if value is not None:
                out += value.to_bytes(8, "little")
        return out

    def root_key_for(self, algo: str) -> bytes:
        """The chain's root under ``algo``: ``H(scope bytes)``; a v1 root is 8 zero bytes (parent hash
        0, so the salt is mixed into the first block) followed by the SHA-256 root."""
        digest = _digest_fn(algo)(self.scope_bytes())
        return bytes(8) + digest if resolve_hash_algo(algo) == HASH_V1_BLOCK_KEY else digest

    @property
    def root_key(self) -> bytes:
        """The root under DEFAULT_HASH_ALGO (see ``root_key_for`` for the others)."""
        return self.root_key_for(DEFAULT_HASH_ALGO)


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


# --- v1: TensorRT-LLM's BlockKeyHasher ----------------------------------------------------------
def _premix32(values: npt.NDArray[np.uint64]) -> list[int]:
    """The seed-independent part of the 32-bit mix of each value, plus the combine constant (vectorised)."""
    a = values & np.uint64(_MASK32)
    a = (((a >> np.uint64(16)) ^ a) * np.uint64(_MIX32)) & np.uint64(_MASK32)
    a = (((a >> np.uint64(16)) ^ a) * np.uint64(_MIX32)) & np.uint64(_MASK32)
    a = (a >> np.uint64(16)) ^ a
    a = (a + np.uint64(_COMBINE)) & np.uint64(_MASK32)
    return [int(v) for v in a.tolist()]


def _mix64(value: int, seed: int) -> int:
    c = value & _MASK64
    c = ((c ^ (c >> 30)) * _MIX64_1) & _MASK64
    c = ((c ^ (c >> 27)) * _MIX64_2) & _MASK64
    c ^= c >> 31
    return seed ^ ((c + _COMBINE + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)


def _combine32(premixed: list[int], seed: int) -> int:
    for v in premixed:
        seed ^= (v + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64
    return seed


def v1_block_hash(tokens: Sequence[int] | npt.ArrayLike, parent_hash: int = 0, *, lora_id: int | None = None,
                  salt: int | None = None, extra_key: bytes = b"") -> int:
    """TensorRT-LLM's v1 hash of one block of ``tokens`` after ``parent_hash`` (0: first block)."""
    arr = as_token_ids(tokens, "v1_block_hash").astype(np.uint64)
    return _v1_hash(_premix32(arr), arr.size, parent_hash, lora_id, salt, extra_key)


def _v1_hash(premixed: list[int], num_tokens: int, parent: int, lora_id: int | None, salt: int | None,
             extra: bytes) -> int:
    seed = (num_tokens ^ ((parent * _PARENT) & _MASK64)) & _MASK64
    if parent == 0 and salt is not None:
        seed = _mix64(salt, seed)
    seed = _combine32(premixed, seed)
    if lora_id is not None:
        seed = _mix64(lora_id, seed)
    if extra:
        padded = extra + bytes(-len(extra) % 4)
        seed = _combine32(_premix32(np.frombuffer(padded, dtype="<u4").astype(np.uint64)), seed)
        seed = _mix64(0, seed)
    return seed


# --- the chain ------------------------------------------------------------------------------------
def block_keys(tokens: Sequence[int] | npt.ArrayLike, tokens_per_block: int, parent: bytes,
               *, first_block: int = 0, extra_keys: ExtraKeys | None = None, algo: str = DEFAULT_HASH_ALGO,
               scope: ReuseScope | None = None, digests: DigestTable | None = None) -> list[bytes]:
    """Keys of every full block of ``tokens`` under ``algo``, chained from ``parent``.

    ``tokens`` starts at block ``first_block`` of the request (only used to look up ``extra_keys``,
    which map a request-wide block index to bytes entering that block's key). A trailing partial
    block gets no key. ``scope`` matters only to ``v1_block_key`` (its LoRA id is mixed into every
    block, its salt into the first): pass the scope whose root ``parent`` descends from. Token ids
    are converted in one numpy step; the loop runs once per block because each key needs the last.
    ``digests`` resolves the negative digest codes a ``v2_sha256_packed`` manager keeps for multimodal
    tokens (see ``DigestTable``); the other algorithms take token ids only.
    """
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
        raise ConfigError(f"block_keys: tokens_per_block must be an int > 0, got {tokens_per_block!r}")
    concrete = resolve_hash_algo(algo)
    width = key_width(concrete)
    if not isinstance(parent, bytes) or len(parent) != width:
        raise ConfigError(f"block_keys: parent key must be {width} bytes under {concrete}, got {parent!r:.80}")
    if concrete == HASH_V2_SHA256_PACKED:
        return _packed_block_keys(tokens, tokens_per_block, parent, first_block,
                                  check_extra_keys(extra_keys, "block_keys"), digests)
    arr = as_token_ids(tokens, "block_keys")
    extras = check_extra_keys(extra_keys, "block_keys")
    n_blocks = arr.size // tokens_per_block
    full = arr[:n_blocks * tokens_per_block].astype(np.uint64)
    data = memoryview(full.astype("<u8").tobytes())
    stride = 8 * tokens_per_block
    digest = _digest_fn(concrete)
    keys: list[bytes] = []
    if concrete != HASH_V1_BLOCK_KEY:
        # H(parent key || block's tokens || extra key), fed piece by piece (no joined copy per block).
        new = _hasher(concrete)
        key = parent
        for b in range(n_blocks):
            h = new(key)
            h.update(data[b * stride:(b + 1) * stride])
            extra = extras.get(first_block + b)
            if extra is not None:
                h.update(extra)
            key = h.digest()
            keys.append(key)
        return keys
    scope = DEFAULT_SCOPE if scope is None else scope
    premixed = _premix32(full)
    v1 = int.from_bytes(parent[:8], "big")
    chain = parent[8:]
    for b in range(n_blocks):
        extra = extras.get(first_block + b, b"")
        v1 = _v1_hash(premixed[b * tokens_per_block:(b + 1) * tokens_per_block], tokens_per_block, v1,
                      scope.lora_id, scope.salt, extra)
        chain = digest(b"".join((chain, data[b * stride:(b + 1) * stride], extra)))
        keys.append(v1.to_bytes(8, "big") + chain)
    return keys


def _packed_block_keys(tokens: Sequence[int] | npt.ArrayLike, tokens_per_block: int, parent: bytes, first_block: int,
                       extras: dict[int, bytes], digests: DigestTable | None) -> list[bytes]:
    """``block_keys`` under ``v2_sha256_packed``: ids as 4 little-endian bytes, digest codes as their digests."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise CapacityError(f"block_keys: token ids must be a 1-D integer sequence, got shape {arr.shape} "
                            f"dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.max()) >= _TOKEN_ID_LIMIT:
        raise CapacityError(f"block_keys: v2_sha256_packed token ids must be below 2**31, got {int(arr.max())}")
    coded = arr < 0
    if coded.any() and digests is None:
        raise CapacityError(f"block_keys: token id {int(arr[coded][0])} is negative (a digest code needs the "
                            f"DigestTable that issued it)")
    n_blocks = arr.size // tokens_per_block
    full = arr[:n_blocks * tokens_per_block]
    data = memoryview(np.where(coded[:full.size], 0, full).astype("<u4").tobytes())
    stride = 4 * tokens_per_block
    keys: list[bytes] = []
    key = parent
    for b in range(n_blocks):
        lo, hi = b * tokens_per_block, (b + 1) * tokens_per_block
        h = hashlib.sha256(key)
        if digests is not None and coded[lo:hi].any():
            h.update(b"".join(digests.digest(t) if t < 0 else t.to_bytes(4, "little")
                              for t in full[lo:hi].tolist()))
        else:
            h.update(data[b * stride:(b + 1) * stride])
        extra = extras.get(first_block + b)
        if extra is not None:
            h.update(extra)
        key = h.digest()
        keys.append(key)
    return keys


class DigestTable:
    """Codes for multimodal digest tokens: a manager keeps token ids in int64 arrays and each 32-byte digest
    as a negative code (stable while the table lives, never equal to a token id), so prefix matching
    compares codes while block keys and ``committed_tokens`` give back the digest itself."""

    __slots__ = ("_codes", "_digests", "_uuids")

    def __init__(self) -> None:
        self._codes: dict[bytes, int] = {}
        self._digests: dict[int, bytes] = {}
        self._uuids: dict[int, str] = {}       # code -> routing uuid last seen with its digest

    def __len__(self) -> int:
        return len(self._codes)

    def code(self, digest: bytes) -> int:
        """The negative code of ``digest`` (32 bytes), issued on first sight."""
        code = self._codes.get(digest)
        if code is not None:
            return code
        if not isinstance(digest, bytes) or len(digest) != _DIGEST_BYTES:
            raise CapacityError(f"a multimodal digest token must be {_DIGEST_BYTES} bytes, got {digest!r:.80}")
        code = -1 - (int.from_bytes(digest[:8], "little") & ((1 << 62) - 1))
        while code in self._digests:      # two digests share their 62 low bits: take the next free code
            code -= 1
        self._codes[digest] = code
        self._digests[code] = digest
        return code

    def digest(self, code: int) -> bytes:
        """The digest of ``code`` (CapacityError for a code this table did not issue)."""
        try:
            return self._digests[code]
        except KeyError:
            raise CapacityError(f"token {code} is not a digest code of this manager") from None

    def encode(self, tokens: Sequence[Any] | npt.ArrayLike, what: str) -> TokenArray:
        """``tokens`` (ids, 32-byte digests or ``MmItemContext``) as an int64 array of ids and digest codes."""
        if isinstance(tokens, np.ndarray) or not isinstance(tokens, Sequence) or not any(
                isinstance(t, bytes | bytearray | MmItemContext) for t in tokens):
            return as_token_ids(tokens, what)
        out = np.empty(len(tokens), dtype=np.int64)
        for i, t in enumerate(tokens):
            if isinstance(t, MmItemContext):
                out[i] = self.code(t.digest)
                if t.uuid is not None:
                    self._uuids[int(out[i])] = t.uuid
            elif isinstance(t, bytes | bytearray):
                out[i] = self.code(bytes(t))
            elif isinstance(t, int | np.integer) and not isinstance(t, bool) and 0 <= t <= _MASK32:
                out[i] = int(t)
            else:
                raise CapacityError(f"{what}: token {i} must be an id in [0, 2**32) or a 32-byte digest, "
                                    f"got {t!r:.80}")
        return out

    def decode(self, tokens: npt.ArrayLike) -> list[int | bytes]:
        """Token ids and digests of an int64 array of ids and codes (a new list)."""
        return [self.digest(t) if t < 0 else t for t in np.asarray(tokens, dtype=np.int64).tolist()]

    def key_tokens(self, tokens: npt.ArrayLike) -> list[TokenIdExt]:
        """Like ``decode``, but a digest that came with a routing uuid comes back as its ``MmItemContext``
        (what events put in a block's ``mm_keys``)."""
        out: list[TokenIdExt] = []
        for t in np.asarray(tokens, dtype=np.int64).tolist():
            if t >= 0:
                out.append(t)
                continue
            uuid = self._uuids.get(t)
            out.append(self.digest(t) if uuid is None else MmItemContext(self.digest(t), uuid))
        return out


def block_hash_for_event(key: bytes, algo: str) -> int | str:
    """A block key as KV events publish it under ``algo``: the 64-bit hash as an unsigned int for
    ``v1_block_key``/``auto`` and the ``_64`` names, the full digest as a lowercase hex string for
    ``v2_sha256`` and ``v2_blake3``. ``algo`` must be the one the keys were made with."""
    concrete = resolve_hash_algo(algo)
    width = key_width(concrete)
    if not isinstance(key, bytes) or len(key) != width:
        raise ConfigError(f"block_hash_for_event: a {concrete} key is {width} bytes, got {key!r:.80}")
    if concrete in (HASH_V2_SHA256, HASH_V2_BLAKE3, HASH_V2_SHA256_PACKED):
        return key.hex()
    return int.from_bytes(key[:8], "big")


def external_hash(key: bytes, hash_name: str = HASH_V2_BLAKE3_64) -> bytes | int:
    """A block key as the first event publisher sent it: the raw key (``v2_blake3``) or its first 8
    bytes as a big-endian int (``v2_blake3_64``). New code uses ``block_hash_for_event``."""
    if hash_name == HASH_V2_BLAKE3:
        return key
    if hash_name == HASH_V2_BLAKE3_64:
        return int.from_bytes(key[:8], "big")
    raise ConfigError(f"unknown hash name {hash_name!r} (have {', '.join(HASH_NAMES)})")


# --- TensorRT-LLM's names: the kv_cache_hash helpers and the v2 manager's key helpers ---------------
#: Event hash algorithm names of TensorRT-LLM's ``kv_cache_hash`` (the same strings as ``HASH_*`` above).
KV_CACHE_HASH_ALGO_AUTO = HASH_AUTO
KV_CACHE_HASH_ALGO_V1 = HASH_V1_BLOCK_KEY
KV_CACHE_HASH_ALGO_V2 = HASH_V2_SHA256
KV_CACHE_HASH_ALGO_V2_SHA256_64 = HASH_V2_SHA256_64
#: What ``auto`` means for events: the v1 block-key hash, which routers of the v1 manager already know.
KV_CACHE_HASH_ALGO_DEFAULT = KV_CACHE_HASH_ALGO_V1

_TOKEN_ID_LIMIT = 1 << 31        # 4-byte token ids keep the top bit clear (the C++ TokenIdExt tag bit)
_DIGEST_BYTES = 32


class NonTextTokenHashError(ConfigError):
    """The v1 block-key hash was asked to hash a token that is not an integer id (a multimodal digest)."""


def get_effective_kv_cache_event_hash_algo(hash_algo: str, use_kv_cache_manager_v2: bool = True) -> str:
    """The event hash algorithm ``hash_algo`` stands for: ``auto`` is KV_CACHE_HASH_ALGO_DEFAULT, any
    other name is itself (both managers resolve ``auto`` alike, so the flag only keeps the signature)."""
    return KV_CACHE_HASH_ALGO_DEFAULT if hash_algo == KV_CACHE_HASH_ALGO_AUTO else hash_algo


def truncate_sha256_hash_to_int64(block_hash: bytes) -> int:
    """A 32-byte block key as a 64-bit event hash: its first 8 bytes read as an unsigned big-endian int."""
    if not isinstance(block_hash, bytes | bytearray | memoryview):
        raise ConfigError(f"truncate_sha256_hash_to_int64: block_hash must be bytes, got "
                          f"{type(block_hash).__name__}")
    data = bytes(block_hash)
    if len(data) < 8:
        raise ConfigError(f"truncate_sha256_hash_to_int64: block_hash needs at least 8 bytes, got {data!r}")
    return int.from_bytes(data[:8], "big", signed=False)


#: TensorRT-LLM's name of ``cache_salt_id`` (the same function).
get_cache_salt_id = cache_salt_id


def hash_v1_block_key(tokens: Sequence[int], parent_hash: int = 0, lora_task_id: int | None = None,
                      cache_salt_id: int | None = None) -> int:
    """TensorRT-LLM's v1 ``BlockKeyHasher`` hash of one block (token ids taken modulo 2**32, as the C++
    hasher's 32-bit mix does); NonTextTokenHashError when a token is not an int (a multimodal digest)."""
    ids: list[int] = []
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise NonTextTokenHashError(f"hash_v1_block_key: v1 hashing takes integer token ids only, got "
                                        f"{type(token).__name__} {token!r:.80}")
        ids.append(int(token) & _MASK32)
    for name, value in (("parent_hash", parent_hash), ("lora_task_id", lora_task_id),
                        ("cache_salt_id", cache_salt_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                  or value > _MASK64):
            raise ConfigError(f"hash_v1_block_key: {name} must be an int in [0, 2**64), got {value!r}")
    return _v1_hash(_premix32(np.asarray(ids, dtype=np.uint64)), len(ids), parent_hash, lora_task_id,
                    cache_salt_id, b"")


@dataclass(frozen=True, slots=True)
class MmItemContext:
    """The first key token of a multimodal item: its 32-byte content digest, and the ``uuid`` a frontend
    routes the item by (None: the digest alone names it). Only the digest enters block keys; events carry
    the uuid in the item's ``mm_keys`` entries."""

    digest: bytes
    uuid: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != _DIGEST_BYTES:
            raise ConfigError(f"MmItemContext.digest must be {_DIGEST_BYTES} bytes, got {self.digest!r:.80}")
        if self.uuid is not None and not isinstance(self.uuid, str):
            raise ConfigError(f"MmItemContext.uuid must be a str or None, got {type(self.uuid).__name__}")


#: A key token: a token id, a multimodal item's 32-byte digest, or a digest with its routing uuid.
TokenIdExt: TypeAlias = int | bytes | MmItemContext


def _token_bytes(token: object) -> bytes:
    if isinstance(token, bytes):
        return token
    if isinstance(token, MmItemContext):
        return token.digest
    if isinstance(token, int | np.integer) and not isinstance(token, bool) and 0 <= token < _TOKEN_ID_LIMIT:
        return int(token).to_bytes(4, "little")
    raise ConfigError(f"key token must be an int in [0, 2**31), bytes or MmItemContext, got {token!r:.80}")


def pack_key_tokens(tokens: Sequence[TokenIdExt]) -> bytes:
    """The bytes a block of key tokens contributes to its key: each id as 4 little-endian bytes, each
    multimodal digest as itself (ConfigError for anything else or an id outside [0, 2**31))."""
    ids = [t for t in tokens if type(t) is int]
    if len(ids) == len(tokens):
        if ids and (min(ids) < 0 or max(ids) >= _TOKEN_ID_LIMIT):
            bad = next(t for t in ids if not 0 <= t < _TOKEN_ID_LIMIT)
            raise ConfigError(f"key token ids must be in [0, 2**31), got {bad!r}")
        return struct.pack(f"<{len(ids)}I", *ids)
    return b"".join(_token_bytes(t) for t in tokens)


def reuse_scope_to_bytes(reuse_scope: ReuseScope | Iterable[int | None]) -> bytes:
    """A reuse scope's namespace bytes: a mask byte (bit i: field i present) then each present field as a
    little-endian uint64; takes kvxfer's ``ReuseScope`` or any iterable of optional ints ``(lora_id, salt)``."""
    values: list[int | None] = ([reuse_scope.lora_id, reuse_scope.salt] if isinstance(reuse_scope, ReuseScope)
                                else list(reuse_scope))
    mask = 0
    out = b""
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MASK64:
            raise ConfigError(f"reuse scope field {i} must be None or an int in [0, 2**64), got {value!r}")
        mask |= 1 << i
        out += value.to_bytes(8, "little")
    return mask.to_bytes((len(values) + 7) // 8, "little") + out


def gen_multimodal_cache_key_tokens(id_offset: int, multi_modal_data_digest: bytes, num_tokens: int,
                                    token_offset: int = 0) -> list[TokenIdExt]:
    """Key tokens of ``num_tokens`` positions of a multimodal item from item-local ``token_offset`` on:
    offset 0 is the item's 32-byte digest, offset k > 0 the synthetic id ``id_offset + k`` (``id_offset``
    is usually the vocabulary size, so synthetic ids never equal text ids)."""
    if not isinstance(multi_modal_data_digest, bytes) or len(multi_modal_data_digest) != _DIGEST_BYTES:
        raise ConfigError(f"gen_multimodal_cache_key_tokens: the digest must be {_DIGEST_BYTES} bytes, got "
                          f"{multi_modal_data_digest!r:.80}")
    for name, value, low in (("id_offset", id_offset, 0), ("num_tokens", num_tokens, 1),
                             ("token_offset", token_offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"gen_multimodal_cache_key_tokens: {name} must be an int >= {low}, got {value!r}")
    return [multi_modal_data_digest if token_offset + i == 0 else id_offset + token_offset + i
            for i in range(num_tokens)]


def sequence_to_blockchain_keys(tokens_per_block: int, reuse_scope: ReuseScope | Iterable[int | None],
                                tokens: Iterable[TokenIdExt]) -> Iterator[tuple[list[TokenIdExt], bytes]]:
    """TensorRT-LLM's key chain: first ``([], root)`` with ``root = SHA-256(reuse_scope_to_bytes(scope))``,
    then for each chunk of ``tokens_per_block`` tokens (the last may be shorter) ``(chunk, key)`` with
    ``key = SHA-256(previous key || pack_key_tokens(chunk))``."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
        raise ConfigError(f"sequence_to_blockchain_keys: tokens_per_block must be an int > 0, got "
                          f"{tokens_per_block!r}")
    key = hashlib.sha256(reuse_scope_to_bytes(reuse_scope)).digest()
    yield [], key
    it = iter(tokens)
    while chunk := list(itertools.islice(it, tokens_per_block)):
        key = hashlib.sha256(key + pack_key_tokens(chunk)).digest()
        yield chunk, key
