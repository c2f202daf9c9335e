"""TensorRT-LLM's key helpers and kv_cache_hash functions in kvxfer.cache.hashing: the 4-byte key chain
(``sequence_to_blockchain_keys``), reuse-scope bytes, multimodal key tokens, ``MmItemContext``, the
64-bit truncation, the v1 block-key hash, the tenant salt id and the ``auto`` algorithm name.

Oracles are written out here with struct/hashlib/blake3 byte by byte, and the v1 hash is checked against
the scalar transcription of the C++ hasher in test_hashing.py.
"""

from __future__ import annotations

import hashlib
import struct

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache import MmItemContext, gen_multimodal_cache_key_tokens, sequence_to_blockchain_keys
from kvxfer.cache.hashing import (
    HASH_ALGOS,
    KV_CACHE_HASH_ALGO_AUTO,
    KV_CACHE_HASH_ALGO_DEFAULT,
    KV_CACHE_HASH_ALGO_V1,
    KV_CACHE_HASH_ALGO_V2,
    KV_CACHE_HASH_ALGO_V2_SHA256_64,
    NonTextTokenHashError,
    ReuseScope,
    block_hash_for_event,
    block_keys,
    cache_salt_id,
    get_cache_salt_id,
    get_effective_kv_cache_event_hash_algo,
    hash_v1_block_key,
    pack_key_tokens,
    resolve_hash_algo,
    reuse_scope_to_bytes,
    truncate_sha256_hash_to_int64,
    v1_block_hash,
)
from kvxfer.errors import ConfigError
from tests.cache.test_hashing import v1_oracle

DIGEST = bytes(range(100, 132))


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_token_ids_pack_as_4_little_endian_bytes_and_digests_as_themselves() -> None:
    assert pack_key_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert pack_key_tokens([7, DIGEST, 8]) == b"\x07\x00\x00\x00" + DIGEST + b"\x08\x00\x00\x00"
    assert pack_key_tokens([MmItemContext(DIGEST, "img-1")]) == DIGEST
    assert pack_key_tokens([]) == b""


@pytest.mark.parametrize("bad", [-1, 1 << 31, True, 2.0, "7"])
def test_tokens_outside_the_4_byte_id_space_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="2\\*\\*31"):
        pack_key_tokens([1, bad])  # type: ignore[list-item]


@pytest.mark.parametrize(("scope", "expected"), [
    (ReuseScope(), b"\x00"),
    (ReuseScope(lora_id=5), b"\x01" + struct.pack("<Q", 5)),
    (ReuseScope(salt=9), b"\x02" + struct.pack("<Q", 9)),
    (ReuseScope(lora_id=5, salt=9), b"\x03" + struct.pack("<QQ", 5, 9)),
    ((None, 2**64 - 1), b"\x02" + b"\xff" * 8),
    ((0, None), b"\x01" + bytes(8)),
])
def test_reuse_scope_bytes(scope: ReuseScope | tuple[int | None, int | None], expected: bytes) -> None:
    assert reuse_scope_to_bytes(scope) == expected


def test_reuse_scope_bytes_refuse_bad_fields() -> None:
    with pytest.raises(ConfigError, match="field 1"):
        reuse_scope_to_bytes((None, -3))


def test_blockchain_keys_are_sha256_of_previous_key_and_packed_tokens() -> None:
    tokens = [11, 12, 13, 14, 15]
    pairs = list(sequence_to_blockchain_keys(2, ReuseScope(lora_id=3), tokens))
    root = sha(b"\x01" + struct.pack("<Q", 3))
    k1 = sha(root + struct.pack("<2I", 11, 12))
    k2 = sha(k1 + struct.pack("<2I", 13, 14))
    k3 = sha(k2 + struct.pack("<I", 15))                 # the trailing partial chunk gets a key too
    assert pairs == [([], root), ([11, 12], k1), ([13, 14], k2), ([15], k3)]


def test_blockchain_root_matches_kvxfer_v2_sha256_root_but_block_keys_differ() -> None:
    scope = ReuseScope(lora_id=4, salt=77)
    pairs = list(sequence_to_blockchain_keys(4, scope, range(8)))
    assert pairs[0][1] == scope.root_key_for("v2_sha256")
    kvxfer_keys = block_keys(list(range(8)), 4, scope.root_key_for("v2_sha256"), algo="v2_sha256")
    assert [k for _, k in pairs[1:]] != kvxfer_keys      # 4-byte vs 8-byte token packing


def test_blockchain_keys_accept_iterators_and_tuple_scopes() -> None:
    assert list(sequence_to_blockchain_keys(3, (6, None), iter(range(6)))) == list(
        sequence_to_blockchain_keys(3, ReuseScope(lora_id=6), list(range(6))))
    assert list(sequence_to_blockchain_keys(3, ReuseScope(), [])) == [([], sha(b"\x00"))]


def test_blockchain_keys_refuse_bad_block_size() -> None:
    with pytest.raises(ConfigError, match="tokens_per_block"):
        next(sequence_to_blockchain_keys(0, ReuseScope(), [1]))


def test_mm_item_uuid_does_not_enter_the_key() -> None:
    def key(item: object) -> bytes:
        return list(sequence_to_blockchain_keys(4, ReuseScope(), [1, item, 1001, 1002]))[1][1]  # type: ignore[list-item]

    assert key(MmItemContext(DIGEST, "a")) == key(MmItemContext(DIGEST, "b")) == key(DIGEST)
    assert key(MmItemContext(DIGEST, "a")) != key(MmItemContext(bytes(32), "a"))


def test_mm_item_context_checks_its_fields() -> None:
    with pytest.raises(ConfigError, match="32 bytes"):
        MmItemContext(b"short")
    with pytest.raises(ConfigError, match="uuid"):
        MmItemContext(DIGEST, 5)  # type: ignore[arg-type]


def test_multimodal_key_tokens() -> None:
    assert gen_multimodal_cache_key_tokens(1000, DIGEST, 3) == [DIGEST, 1001, 1002]
    assert gen_multimodal_cache_key_tokens(1000, DIGEST, 2, token_offset=5) == [1005, 1006]
    with pytest.raises(ConfigError, match="32 bytes"):
        gen_multimodal_cache_key_tokens(1000, DIGEST[:8], 2)
    with pytest.raises(ConfigError, match="num_tokens"):
        gen_multimodal_cache_key_tokens(1000, DIGEST, 0)
    with pytest.raises(ConfigError, match="token_offset"):
        gen_multimodal_cache_key_tokens(1000, DIGEST, 1, token_offset=-1)


def test_truncation_reads_the_first_8_bytes_unsigned_big_endian() -> None:
    assert truncate_sha256_hash_to_int64(bytes.fromhex("0102030405060708") + bytes(24)) == 0x0102030405060708
    assert truncate_sha256_hash_to_int64(b"\xfe" + bytes(31)) == 0xFE << 56
    with pytest.raises(ConfigError, match="8 bytes"):
        truncate_sha256_hash_to_int64(b"\x01\x02")
    with pytest.raises(ConfigError, match="bytes"):
        truncate_sha256_hash_to_int64("0102")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=12), st.integers(0, 2**64 - 1),
       st.none() | st.integers(0, 2**64 - 1), st.none() | st.integers(0, 2**64 - 1))
def test_v1_block_key_hash_is_the_cxx_hasher(tokens: list[int], parent: int, lora: int | None,
                                              salt: int | None) -> None:
    assert hash_v1_block_key(tokens, parent, lora, salt) == v1_oracle(tokens, parent, lora, salt)


def test_v1_block_key_hash_chain_and_token_width() -> None:
    first = hash_v1_block_key([1, 2, 3, 4])
    assert first == v1_oracle([1, 2, 3, 4], 0, None, None)
    assert hash_v1_block_key([5, 6], first) == v1_oracle([5, 6], first, None, None)
    assert hash_v1_block_key([(1 << 32) + 9]) == hash_v1_block_key([9])   # ids taken modulo 2**32
    assert hash_v1_block_key([1], 0, None, 5) != hash_v1_block_key([1])   # salt mixed into a first block
    assert hash_v1_block_key([1], 7, None, 5) == hash_v1_block_key([1], 7)  # ... only there


def test_v1_block_key_hash_refuses_digests_and_bad_fields() -> None:
    with pytest.raises(NonTextTokenHashError):
        hash_v1_block_key([1, DIGEST])  # type: ignore[list-item]
    assert issubclass(NonTextTokenHashError, ValueError)
    with pytest.raises(ConfigError, match="lora_task_id"):
        hash_v1_block_key([1], 0, -1)


def test_cache_salt_id_is_8_blake3_bytes_little_endian() -> None:
    assert get_cache_salt_id("tenant-a") == int.from_bytes(blake3.blake3(b"tenant-a").digest()[:8], "little")
    assert get_cache_salt_id is cache_salt_id
    assert ReuseScope.for_tenant("tenant-a", lora_id=2) == ReuseScope(2, get_cache_salt_id("tenant-a"))
    assert get_cache_salt_id("tenant-a") != get_cache_salt_id("tenant-b")
    with pytest.raises(ConfigError, match="str"):
        get_cache_salt_id(b"tenant-a")  # type: ignore[arg-type]


def test_auto_event_hash_algo_is_v1() -> None:
    assert KV_CACHE_HASH_ALGO_DEFAULT == KV_CACHE_HASH_ALGO_V1 == "v1_block_key"
    assert get_effective_kv_cache_event_hash_algo(KV_CACHE_HASH_ALGO_AUTO, True) == "v1_block_key"
    assert get_effective_kv_cache_event_hash_algo(KV_CACHE_HASH_ALGO_AUTO, False) == "v1_block_key"
    for name in (KV_CACHE_HASH_ALGO_V2, KV_CACHE_HASH_ALGO_V2_SHA256_64):
        assert get_effective_kv_cache_event_hash_algo(name, True) == name


# --- parity of kvxfer's algorithm options with the kv_cache_hash names ----------------------------------
def test_reference_algorithm_names_are_kvxfer_options_with_the_same_auto() -> None:
    names = (KV_CACHE_HASH_ALGO_AUTO, KV_CACHE_HASH_ALGO_V1, KV_CACHE_HASH_ALGO_V2, KV_CACHE_HASH_ALGO_V2_SHA256_64)
    assert set(names) <= set(HASH_ALGOS)
    assert resolve_hash_algo("auto") == get_effective_kv_cache_event_hash_algo("auto") == KV_CACHE_HASH_ALGO_DEFAULT


@pytest.mark.parametrize("algo", ["v2_sha256_64", "v2_blake3_64"])
def test_64_bit_event_hashes_are_the_truncation(algo: str) -> None:
    for key in (bytes(range(32)), b"\xff" * 32, sha(b"k")):
        assert block_hash_for_event(key, algo) == truncate_sha256_hash_to_int64(key)
    assert block_hash_for_event(sha(b"k"), "v2_sha256") == sha(b"k").hex()


def test_v1_event_hashes_of_kvxfer_keys_are_the_reference_v1_chain() -> None:
    scope = ReuseScope(lora_id=3, salt=cache_salt_id("t"))
    tokens = list(range(40, 52))
    keys = block_keys(tokens, 4, scope.root_key_for("v1_block_key"), algo="v1_block_key", scope=scope)
    chain, parent = [], 0
    for b in range(3):
        parent = hash_v1_block_key(tokens[4 * b:4 * b + 4], parent, 3, scope.salt)
        chain.append(parent)
    assert [block_hash_for_event(k, "v1_block_key") for k in keys] == chain
    assert chain[0] == v1_block_hash(tokens[:4], lora_id=3, salt=scope.salt)
