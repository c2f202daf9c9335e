"""Block keys: the blake3 chain, scopes, extra keys, hash names and input checks."""

from __future__ import annotations

import struct

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache.hashing import (
    HASH_V2_BLAKE3,
    HASH_V2_BLAKE3_64,
    ReuseScope,
    block_keys,
    external_hash,
)
from kvxfer.errors import CapacityError, ConfigError


def reference_keys(tokens: list[int], tpb: int, root: bytes, extras: dict[int, bytes] | None = None) -> list[bytes]:
    """The chain written out block by block with struct, as the issue defines it."""
    keys, key = [], root
    for b in range(len(tokens) // tpb):
        block = tokens[b * tpb:(b + 1) * tpb]
        key = blake3.blake3(key + struct.pack(f"<{tpb}I", *block) + (extras or {}).get(b, b"")).digest()
        keys.append(key)
    return keys


def test_keys_match_the_defined_chain() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 2**32, 37, dtype=np.int64).tolist()
    root = ReuseScope().root_key
    keys = block_keys(tokens, 4, root)
    assert len(keys) == 9                       # the trailing 1-token block has no key
    assert keys == reference_keys(tokens, 4, root)
    assert all(len(k) == 32 for k in keys)


def test_extra_keys_change_their_block_and_everything_after() -> None:
    tokens = list(range(40))
    root = ReuseScope().root_key
    plain = block_keys(tokens, 8, root)
    extras = {2: b"image-digest-1"}
    with_mm = block_keys(tokens, 8, root, extra_keys=extras)
    assert with_mm == reference_keys(tokens, 8, root, extras)
    assert with_mm[:2] == plain[:2]
    assert all(a != b for a, b in zip(with_mm[2:], plain[2:], strict=True))
    assert block_keys(tokens, 8, root, extra_keys={2: b""}) == plain   # an empty extra key is no key


def test_scopes_have_distinct_roots() -> None:
    scopes = [ReuseScope(), ReuseScope(lora_id=0), ReuseScope(lora_id=1), ReuseScope(salt=b""),
              ReuseScope(salt="tenant-a"), ReuseScope(salt="tenant-b"), ReuseScope(lora_id=1, salt="tenant-a")]
    roots = {s.root_key for s in scopes}
    assert len(roots) == len(scopes)
    assert ReuseScope(salt="tenant-a").root_key == ReuseScope(salt=b"tenant-a").root_key   # str is UTF-8
    tokens = list(range(16))
    firsts = {block_keys(tokens, 4, s.root_key)[0] for s in scopes}
    assert len(firsts) == len(scopes)


def test_hash_names() -> None:
    key = block_keys(list(range(4)), 4, ReuseScope().root_key)[0]
    assert external_hash(key, HASH_V2_BLAKE3) == key
    h64 = external_hash(key, HASH_V2_BLAKE3_64)
    assert isinstance(h64, int) and 0 <= h64 < 2**64
    assert h64 == int.from_bytes(key[:8], "big")
    assert f"{h64:016x}" == key[:8].hex()
    with pytest.raises(ConfigError, match="unknown hash name 'sha256'"):
        external_hash(key, "sha256")


@pytest.mark.parametrize("bad", [[-1, 2], [0, 2**32], np.array([2**63], dtype=np.uint64), [[1, 2]], [1.5, 2.0]])
def test_token_ids_outside_uint32_are_refused(bad: object) -> None:
    with pytest.raises(CapacityError, match="token ids"):
        block_keys(bad, 1, ReuseScope().root_key)   # type: ignore[arg-type]


def test_bad_arguments_are_refused() -> None:
    root = ReuseScope().root_key
    with pytest.raises(ConfigError, match="tokens_per_block"):
        block_keys([1, 2], 0, root)
    with pytest.raises(ConfigError, match="parent key must be 32 bytes"):
        block_keys([1, 2], 1, b"short")
    with pytest.raises(ConfigError, match=r"extra_keys\[0\] must be bytes"):
        block_keys([1, 2], 1, root, extra_keys={0: "text"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="block index must be an int >= 0"):
        block_keys([1, 2], 1, root, extra_keys={-1: b"x"})
    with pytest.raises(ConfigError, match="lora_id"):
        ReuseScope(lora_id=-3)
    with pytest.raises(ConfigError, match="salt"):
        ReuseScope(salt=42)  # type: ignore[arg-type]


def test_long_prompt_is_hashed_in_one_call() -> None:
    tokens = np.random.default_rng(2).integers(0, 128_000, 131_072)
    keys = block_keys(tokens, 16, ReuseScope().root_key)
    assert len(keys) == 8192 and len(set(keys)) == 8192
    assert keys[:3] == reference_keys(tokens[:48].tolist(), 16, ReuseScope().root_key)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64), tpb=st.integers(1, 8), cut=st.integers(0, 16))
def test_chain_is_prefix_stable_and_resumable(tokens: list[int], tpb: int, cut: int) -> None:
    root = ReuseScope(lora_id=3).root_key
    keys = block_keys(tokens, tpb, root)
    assert keys == reference_keys(tokens, tpb, root)
    cut = min(cut, len(keys))
    assert block_keys(tokens[:cut * tpb], tpb, root) == keys[:cut]
    parent = keys[cut - 1] if cut else root
    assert block_keys(tokens[cut * tpb:], tpb, parent, first_block=cut) == keys[cut:]
