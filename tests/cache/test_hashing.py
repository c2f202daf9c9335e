"""Block keys under every hash algorithm: the v2 chains (SHA-256, BLAKE3), TensorRT-LLM's v1 block
key, scopes, extra keys, event hashes and input checks.

The oracles here are written out independently of kvxfer.cache.hashing: the v2 chain with struct and
hashlib/blake3 block by block, the v1 hash as a scalar transcription of TensorRT-LLM's C++
``BlockKeyHasher::hash`` (one token at a time, Python ints masked to 64 bits), and pinned vectors.
"""

from __future__ import annotations

import hashlib
import struct

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache.hashing import (
    HASH_ALGOS,
    ReuseScope,
    block_hash_for_event,
    block_keys,
    cache_salt_id,
    external_hash,
    key_width,
    resolve_hash_algo,
    v1_block_hash,
)
from kvxfer.errors import CapacityError, ConfigError

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
V2 = ["v2_sha256", "v2_sha256_64", "v2_blake3", "v2_blake3_64"]


def h(algo: str, data: bytes) -> bytes:
    return blake3.blake3(data).digest() if "blake3" in algo else hashlib.sha256(data).digest()


def scope_bytes(lora: int | None, salt: int | None) -> bytes:
    mask = (lora is not None) | ((salt is not None) << 1)
    return bytes([mask]) + b"".join(struct.pack("<Q", v) for v in (lora, salt) if v is not None)


def v2_oracle(tokens: list[int], tpb: int, algo: str, lora: int | None = None, salt: int | None = None,
              extras: dict[int, bytes] | None = None) -> list[bytes]:
    """The reference's v2 chain: root = H(scope bytes), key = H(parent || uint64 LE tokens || extra)."""
    key = h(algo, scope_bytes(lora, salt))
    keys = []
    for b in range(len(tokens) // tpb):
        key = h(algo, key + struct.pack(f"<{tpb}Q", *tokens[b * tpb:(b + 1) * tpb]) + (extras or {}).get(b, b""))
        keys.append(key)
    return keys


def cxx_hash32(a: int, seed: int) -> int:
    a &= M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & M32
    a = (a >> 16) ^ a
    return (seed ^ (((a + 0x9E3779B9) & M32) + ((seed << 6) & M64) + (seed >> 2))) & M64


def cxx_hash64(c: int, seed: int) -> int:
    c = ((c ^ (c >> 30)) * 0xBF58476D1CE4E5B9) & M64
    c = ((c ^ (c >> 27)) * 0x94D049BB133111EB) & M64
    c = c ^ (c >> 31)
    return (seed ^ ((c + 0x9E3779B9 + ((seed << 6) & M64) + (seed >> 2)) & M64)) & M64


def v1_oracle(tokens: list[int], parent: int, lora: int | None, salt: int | None, mm: bytes = b"") -> int:
    """BlockKeyHasher::hash, token by token (mm: one 32-byte multimodal digest at block offset 0)."""
    seed = (len(tokens) ^ ((parent * 0xBF58476D1CE4E5B9) & M64)) & M64
    if parent == 0 and salt is not None:
        seed = cxx_hash64(salt, seed)
    for t in tokens:
        seed = cxx_hash32(t, seed)
    if lora is not None:
        seed = cxx_hash64(lora, seed)
    if mm:
        for i in range(0, 32, 4):
            seed = cxx_hash32(mm[i] | mm[i + 1] << 8 | mm[i + 2] << 16 | mm[i + 3] << 24, seed)
        seed = cxx_hash64(0, seed)
    return seed


# --- v2 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", V2)
def test_v2_keys_match_the_reference_chain(algo: str) -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 2**32, 37, dtype=np.int64).tolist()
    for lora, salt in ((None, None), (7, None), (None, 3), (2**64 - 1, 2**63)):
        scope = ReuseScope(lora, salt)
        keys = block_keys(tokens, 4, scope.root_key_for(algo), algo=algo, scope=scope)
        assert len(keys) == 9                       # the trailing 1-token block has no key
        assert keys == v2_oracle(tokens, 4, algo, lora, salt)
        assert all(len(k) == 32 for k in keys)


def test_pinned_v2_vectors() -> None:
    """Known vectors (tokens 1..8, 4 per block), pinned so any change of the chain shows."""
    tokens = list(range(1, 9))
    sha = block_keys(tokens, 4, ReuseScope().root_key_for("v2_sha256"), algo="v2_sha256")
    assert [k.hex() for k in sha] == ["d640331a8566b89199962bb4552f386a57361738fef5a92ac3d8a5c7bfbb4231",
                                      "ba0e9248b87b075c3f3d3643fe81cbe1ba0facfa92df428554ea3c69a23047ee"]
    b3 = block_keys(tokens, 4, ReuseScope().root_key_for("v2_blake3"), algo="v2_blake3")
    assert [k.hex() for k in b3] == ["79db3988772433d98b33fc58dff54d2bb9d5c334e85eda915eb5381fdb50d714",
                                     "d119d2987306f0f547b612f16fb843d9e460720b75936ba13d1dd9338e2e0b02"]
    scope = ReuseScope(7, cache_salt_id("tenant-a"))
    salted = block_keys(tokens, 4, scope.root_key_for("v2_sha256"), algo="v2_sha256", scope=scope)
    assert salted[0].hex() == "5ce4b9bf1d2c26291d27972cc5e477f15a3fdedf891342624f873ef1080b6772"
    assert salted == v2_oracle(tokens, 4, "v2_sha256", 7, 15947361407820284973)


def test_extra_keys_change_their_block_and_everything_after() -> None:
    tokens = list(range(40))
    root = ReuseScope().root_key
    plain = block_keys(tokens, 8, root)
    extras = {2: b"image-digest-1"}
    with_mm = block_keys(tokens, 8, root, extra_keys=extras)
    assert with_mm == v2_oracle(tokens, 8, "v2_blake3", extras=extras)
    assert with_mm[:2] == plain[:2]
    assert all(a != b for a, b in zip(with_mm[2:], plain[2:], strict=True))
    assert block_keys(tokens, 8, root, extra_keys={2: b""}) == plain   # an empty extra key is no key


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_scopes_have_distinct_roots_and_first_keys(algo: str) -> None:
    scopes = [ReuseScope(), ReuseScope(lora_id=0), ReuseScope(lora_id=1), ReuseScope(salt=0),
              ReuseScope.for_tenant("tenant-a"), ReuseScope.for_tenant("tenant-b"),
              ReuseScope.for_tenant("tenant-a", lora_id=1)]
    firsts = {block_keys(list(range(16)), 4, s.root_key_for(algo), algo=algo, scope=s)[0] for s in scopes}
    assert len(firsts) == len(scopes)
    assert ReuseScope.for_tenant("tenant-a").salt == cache_salt_id("tenant-a")
    assert cache_salt_id("tenant-a") == int.from_bytes(blake3.blake3(b"tenant-a").digest()[:8], "little")
    assert cache_salt_id("tenant-a") == 15947361407820284973


# --- v1 -----------------------------------------------------------------------------------------------
def test_pinned_v1_vectors() -> None:
    assert v1_block_hash([1, 2, 3, 4]) == 924206229973855 == v1_oracle([1, 2, 3, 4], 0, None, None)
    first = v1_block_hash([1, 2, 3, 4])
    assert v1_block_hash([5, 6, 7, 8], first, lora_id=3) == 13491129222444925150
    assert v1_block_hash([1, 2, 3, 4], salt=cache_salt_id("tenant-a")) == 2786633490472482812
    assert v1_block_hash([1, 2, 3, 4], extra_key=bytes(range(32))) == 757211070935802747
    assert v1_oracle([1, 2, 3, 4], 0, None, None, bytes(range(32))) == 757211070935802747


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40), parent=st.integers(0, M64),
       lora=st.none() | st.integers(0, M64), salt=st.none() | st.integers(0, M64),
       mm=st.none() | st.binary(min_size=32, max_size=32))
def test_v1_hash_is_tensorrt_llms_block_key_hasher(tokens: list[int], parent: int, lora: int | None,
                                                   salt: int | None, mm: bytes | None) -> None:
    assert v1_block_hash(tokens, parent, lora_id=lora, salt=salt, extra_key=mm or b"") == \
        v1_oracle(tokens, parent, lora, salt, mm or b"")


def test_v1_keys_are_the_v1_chain_plus_a_sha256_chain() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 150_000, 50).tolist()
    scope = ReuseScope(lora_id=5, salt=cache_salt_id("t"))
    for algo in ("auto", "v1_block_key"):
        keys = block_keys(tokens, 8, scope.root_key_for(algo), algo=algo, scope=scope)
        assert all(len(k) == 40 for k in keys)
        parent = 0
        for b, key in enumerate(keys):
            parent = v1_oracle(tokens[b * 8:(b + 1) * 8], parent, 5, scope.salt)
            assert int.from_bytes(key[:8], "big") == parent == block_hash_for_event(key, algo)
        assert [k[8:] for k in keys] == v2_oracle(tokens, 8, "v2_sha256", 5, scope.salt)
    assert resolve_hash_algo("auto") == "v1_block_key" and key_width("auto") == 40


# --- events and checks -------------------------------------------------------------------------------------
def test_block_hash_for_event() -> None:
    key32 = block_keys(list(range(4)), 4, ReuseScope().root_key_for("v2_sha256"), algo="v2_sha256")[0]
    assert block_hash_for_event(key32, "v2_sha256") == key32.hex()
    assert block_hash_for_event(key32, "v2_blake3") == key32.hex()
    h64 = block_hash_for_event(key32, "v2_sha256_64")
    assert isinstance(h64, int) and 0 <= h64 < 2**64 and f"{h64:016x}" == key32[:8].hex()
    assert block_hash_for_event(key32, "v2_blake3_64") == h64
    with pytest.raises(ConfigError, match="a v1_block_key key is 40 bytes"):
        block_hash_for_event(key32, "auto")
    with pytest.raises(ConfigError, match="unknown hash algorithm 'md5'"):
        block_hash_for_event(key32, "md5")
    assert external_hash(key32, "v2_blake3") == key32
    assert external_hash(key32, "v2_blake3_64") == h64
    with pytest.raises(ConfigError, match="unknown hash name 'sha256'"):
        external_hash(key32, "sha256")


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
    with pytest.raises(ConfigError, match="parent key must be 40 bytes under v1_block_key"):
        block_keys([1, 2], 1, root, algo="auto")
    with pytest.raises(ConfigError, match=r"extra_keys\[0\] must be bytes"):
        block_keys([1, 2], 1, root, extra_keys={0: "text"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="block index must be an int >= 0"):
        block_keys([1, 2], 1, root, extra_keys={-1: b"x"})
    with pytest.raises(ConfigError, match="lora_id"):
        ReuseScope(lora_id=-3)
    with pytest.raises(ConfigError, match="salt"):
        ReuseScope(salt="tenant")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="salt"):
        ReuseScope(salt=2**64)


def test_long_prompt_is_hashed_in_one_call() -> None:
    tokens = np.random.default_rng(2).integers(0, 128_000, 131_072)
    keys = block_keys(tokens, 16, ReuseScope().root_key)
    assert len(keys) == 8192 and len(set(keys)) == 8192
    assert keys[:3] == v2_oracle(tokens[:48].tolist(), 16, "v2_blake3")


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64), tpb=st.integers(1, 8), cut=st.integers(0, 16),
       algo=st.sampled_from(["v2_blake3", "v2_sha256", "v1_block_key"]))
def test_chain_is_prefix_stable_and_resumable(tokens: list[int], tpb: int, cut: int, algo: str) -> None:
    scope = ReuseScope(lora_id=3)
    root = scope.root_key_for(algo)
    keys = block_keys(tokens, tpb, root, algo=algo, scope=scope)
    if algo != "v1_block_key":
        assert keys == v2_oracle(tokens, tpb, algo, lora=3)
    cut = min(cut, len(keys))
    assert block_keys(tokens[:cut * tpb], tpb, root, algo=algo, scope=scope) == keys[:cut]
    parent = keys[cut - 1] if cut else root
    assert block_keys(tokens[cut * tpb:], tpb, parent, first_block=cut, algo=algo, scope=scope) == keys[cut:]
