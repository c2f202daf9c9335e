"""Hostile input: every decoder of peer bytes, fuzzed one way, and hostile plans refused before a byte moves.

Part 1 runs one mutation engine over every decoder that reads bytes from a peer: arbitrary bytes,
byte-level mutations of valid encodings (flips, boundary values, inserted/deleted/duplicated runs,
64-bit boundary words over length fields) and, for the msgpack formats, structural mutations of
the decoded tree (a node replaced by a hostile value, a key dropped or added). Only the decoder's
documented error may escape; what decodes must re-encode to an equal value; decoding allocates in
proportion to the input. Part 2 posts hostile plans and forged peer metadata through every
available backend and checks that nothing is written, read or notified. RELIABILITY.md lists
which test covers which input, here and in the older per-module tests.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import msgspec.inspect
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cache.config import CacheConfig, LayerSpec, PrimaryTier, RoleSpec
from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.layout import plan_layout
from kvxfer.cache.memory import MemoryRegion
from kvxfer.disagg import messages
from kvxfer.disagg.messages import MESSAGE_TYPES, KvPosted
from kvxfer.disagg.worker_protocol import Notice, decode_notice, encode_notice
from kvxfer.errors import DecodeError, PageTableError, ProtocolError, TransferFailed, TransportError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import Transport, TransportMetadata, available_backends, create
from kvxfer.transport.integrity import ChecksumPolicy, DigestBuffer, KVDigest
from tests.support.transport_helpers.plans import PAGE, make_buffers, pair, random_pages, regions_of

pytestmark = pytest.mark.timeout(240)

# --- the decoders and their valid encodings ------------------------------------------------------


def _layouts() -> list[bytes]:
    scale = RoleSpec("key_scale", head_dim=1, dtype="float32")
    configs = [
        CacheConfig.for_model(4, 8, 64, 16, "bfloat16", 10, windows=[128, None], roles=("key", "value", scale)),
        CacheConfig.for_model(2, 4, 32, 8, "float16", 6, coalesce=False, head_order="NHD"),
        CacheConfig.for_model(3, 2, 16, 4, "float32", 3, windows=[32], sink_tokens=4, roles=("kv",)),
        # two slot variants of different buffer sizes (4 x 4 KiB, 2 x 8 KiB) sharing one pool group
        CacheConfig((LayerSpec(0, 2, 64, window=64), LayerSpec(1, 2, 64, window=64), LayerSpec(2, 2, 128)), 16,
                    "float16", (PrimaryTier(1 << 20),)),
    ]
    return [plan_layout(c).to_msgpack() for c in configs]


def _tables() -> list[bytes]:
    rng = np.random.default_rng(0)
    coords = {"layer": rng.integers(0, 8, 5), "block": rng.integers(0, 100, 5)}
    addr = rng.integers(0, 2**40, 5).astype(np.uint64)
    return [PageTable(addr, np.full(5, 4096, np.uint64), np.arange(5, dtype=np.uint32) % 2, coords).to_bytes(),
            PageTable.empty().to_bytes(), PageTable(addr[:1], np.array([7], np.uint64), np.zeros(1, np.uint32)).to_bytes()]


def _plans() -> list[bytes]:
    src = PageTable(np.array([4096, 8192, 65536], np.uint64), np.array([100, 4096, 1], np.uint64), np.zeros(3, np.uint32))
    dst = PageTable(np.array([1 << 33, 12288, 7], np.uint64), np.array([100, 4096, 1], np.uint64),
                    np.array([1, 0, 2], np.uint32))
    return [TransferPlan(src, dst).to_bytes(), TransferPlan.empty().to_bytes()]


def _metadata() -> list[bytes]:
    regions = (MemoryRegion(4096, 8192, "cpu", 0), MemoryRegion(1 << 40, 1 << 20, "cuda", 3),
               MemoryRegion(1 << 20, 64, "pinned", 0))
    return [TransportMetadata("nixl", "prefill-0", regions, b"\x00agent-blob" * 8).encode(),
            TransportMetadata("loopback", "d", (), b"").encode()]


def _sample(t: msgspec.inspect.Type) -> Any:
    """A value of the field type ``t`` within its bounds."""
    match t:
        case msgspec.inspect.LiteralType(values=values):
            return values[-1]
        case msgspec.inspect.StrType(min_length=least):
            return "x" * max(least or 0, 1)
        case msgspec.inspect.BytesType(min_length=least):
            return b"\x01" * max(least or 0, 1)
        case msgspec.inspect.BoolType():
            return True
        case msgspec.inspect.IntType(ge=ge, le=le):
            return max(ge or 0, min(7, 7 if le is None else le))
        case msgspec.inspect.FloatType(ge=ge):
            return max(ge or 0.0, 0.5)
        case msgspec.inspect.ListType():
            return [1, 2, 3]
    raise AssertionError(f"no sample for a field of type {t}")


def _messages() -> list[bytes]:
    """A valid frame of every control message type (workers' and the vLLM connector's included)."""
    out = []
    for cls in MESSAGE_TYPES:
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        out.append(messages.encode(cls(**{f.name: _sample(f.type) for f in info.fields})))
    return out


def _digests() -> list[bytes]:
    buffers = (DigestBuffer(0, "key", "bfloat16", 64, 8, ((0, 70),)),
               DigestBuffer(0, "value", "bfloat16", 64, 8, ((0, 70),)),
               DigestBuffer(1, "key", "float32", 32, 2, ((5, 20), (40, 70))))
    out = []
    for p in (ChecksumPolicy(), ChecksumPolicy.every(3, seed=2), ChecksumPolicy.sample(0.3, seed=5)):
        n = KVDigest("req-7", p, 16, (0, 70), buffers, bytes(32), b"").num_cells
        out.append(KVDigest("req-7", p, 16, (0, 70), buffers, bytes(range(32)),
                            bytes(range(p.tag_bytes)) * p.count(n)).to_bytes())
    return out


def _notices() -> list[bytes]:
    summary = KvPosted(request_id="req-7", first_token=7, parts=1, nbytes=4096, reused_tokens=16, prefill_s=0.25,
                       digest=b"", queued_s=0.001, post_s=0.0002, computed_at=1234.5, posted_at=1234.6)
    return [encode_notice("req-7", 1, summary, lambda b: bytes(range(16))),
            encode_notice("req-8", 3, None, lambda b: bytes(16))]


def _same_notice(v: Notice) -> bool:
    again = decode_notice(encode_notice(v.request_id, v.part, v.summary, lambda b: v.tag))
    return (again.request_id, again.part, again.summary, again.tag) == (v.request_id, v.part, v.summary, v.tag)


def _same_table(a: PageTable, b: PageTable) -> bool:
    return (np.array_equal(a.addr, b.addr) and np.array_equal(a.nbytes, b.nbytes) and np.array_equal(a.region, b.region)
            and a.coords.keys() == b.coords.keys() and all(np.array_equal(a.coords[k], b.coords[k]) for k in a.coords))


@dataclass(frozen=True)
class Decoder:
    """One decoder of peer bytes, the only error it documents, its valid encodings, and a check that
    a successful decode is a consistent value (it re-encodes to something that decodes equal)."""

    name: str
    decode: Callable[[bytes], Any]
    error: type[Exception]
    seeds: list[bytes]
    is_msgpack: bool
    consistent: Callable[[Any], bool]


DECODERS = [
    Decoder("CacheLayoutDesc.from_msgpack", CacheLayoutDesc.from_msgpack, DecodeError, _layouts(), True,
            lambda v: CacheLayoutDesc.from_msgpack(v.to_msgpack()) == v),
    Decoder("PageTable.from_bytes", PageTable.from_bytes, PageTableError, _tables(), False,
            lambda v: _same_table(PageTable.from_bytes(v.to_bytes()), v)
            and not (v.addr + v.nbytes < v.addr).any()),
    Decoder("TransferPlan.from_bytes", TransferPlan.from_bytes, PageTableError, _plans(), False,
            lambda v: _same_table(TransferPlan.from_bytes(v.to_bytes()).dst, v.dst)
            and np.array_equal(v.src.nbytes, v.dst.nbytes)),
    Decoder("TransportMetadata.decode", TransportMetadata.decode, DecodeError, _metadata(), True,
            lambda v: TransportMetadata.decode(v.encode()) == v),
    Decoder("disagg.messages.decode", messages.decode, ProtocolError, _messages(), True,
            lambda v: messages.decode(messages.encode_frame(v)) == v),
    Decoder("KVDigest.from_bytes", KVDigest.from_bytes, DecodeError, _digests(), True,
            lambda v: KVDigest.from_bytes(v.to_bytes()) == v),
    Decoder("worker_protocol.decode_notice", decode_notice, ProtocolError, _notices(), False, _same_notice),
]
IDS = [d.name for d in DECODERS]


def decodes_or_refuses(dec: Decoder, data: bytes) -> bool:
    """True if ``data`` decoded (into a consistent value), False if refused with the documented error;
    any other exception fails the test."""
    try:
        value = dec.decode(data)
    except dec.error:
        return False
    assert dec.consistent(value), f"{dec.name} decoded {data[:80]!r} into an inconsistent value {value!r:.200}"
    return True


def test_every_seed_decodes() -> None:
    for dec in DECODERS:
        assert dec.seeds and all(decodes_or_refuses(dec, s) for s in dec.seeds), dec.name
    assert len(_messages()) == len(MESSAGE_TYPES) >= 7


# --- mutation engine -----------------------------------------------------------------------------
BOUNDARY_U64 = [0, 1, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
MSGPACK_MARKERS = [0xC0, 0xC1, 0xC2, 0xC4, 0xC6, 0xCB, 0xCF, 0xD3, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0x90, 0x80, 0x9F]


@st.composite
def byte_mutations(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A valid encoding with 1-4 byte-level mutations."""
    buf = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "word", "insert", "delete", "truncate", "duplicate"]))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = draw(st.sampled_from(MSGPACK_MARKERS) | st.integers(0, 255))
        elif op == "word":
            word = draw(st.sampled_from(BOUNDARY_U64)).to_bytes(8, draw(st.sampled_from(["little", "big"])))
            size = draw(st.sampled_from([1, 2, 4, 8]))
            buf[pos:pos + size] = word[:size] if draw(st.booleans()) else word[-size:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del buf[pos:pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del buf[pos:]
        elif op == "duplicate":
            n = draw(st.integers(1, 64))
            buf[pos:pos] = buf[pos:pos + n] * draw(st.integers(1, 4))
    return bytes(buf)


def _nodes(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nodes(v, (*path, i))


hostile_values = st.recursive(
    st.sampled_from([None, True, False, 0, -1, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, -(2**63), float("nan"),
                     float("inf"), -0.0, 1e308, "", "x" * 5000, b"", b"\xff" * 5000, [], {}, "\u202e\x00"])
    | st.integers(-(2**64) + 1, 2**64 - 1) | st.text(max_size=12) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8)


@st.composite
def tree_mutations(draw: st.DrawFn, seeds: list[bytes]) -> bytes | None:
    """A valid msgpack encoding, decoded, with one node replaced, dropped or added, re-encoded."""
    tree = msgpack.unpackb(draw(st.sampled_from(seeds)), raw=False, strict_map_key=False)
    paths = list(_nodes(tree))
    path = draw(st.sampled_from(paths))
    op = draw(st.sampled_from(["replace", "drop", "add", "wrap"]))
    if not path:
        tree = draw(hostile_values) if op == "replace" else [tree] if op == "wrap" else tree
    else:
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if op == "replace":
            parent[key] = draw(hostile_values)
        elif op == "wrap":
            parent[key] = [parent[key]]
        elif op == "drop":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(hostile_values)
        else:
            parent.insert(key, draw(hostile_values))
    try:
        return bytes(msgpack.packb(tree, use_bin_type=True))
    except (OverflowError, ValueError, TypeError):
        return None


# --- part 1: decoders ----------------------------------------------------------------------------
@pytest.mark.parametrize("dec", DECODERS, ids=IDS)
@settings(max_examples=100)
@given(data=st.data())
def test_arbitrary_bytes_raise_only_the_documented_error(dec: Decoder, data: st.DataObject) -> None:
    raw = data.draw(st.binary(max_size=600) | st.builds(lambda b, s: s[:4] + b, st.binary(max_size=200),
                                                         st.sampled_from(dec.seeds)))
    decodes_or_refuses(dec, raw)


@pytest.mark.parametrize("dec", DECODERS, ids=IDS)
@settings(max_examples=150)
@given(data=st.data())
def test_mutated_valid_encodings_raise_only_the_documented_error(dec: Decoder, data: st.DataObject) -> None:
    decodes_or_refuses(dec, data.draw(byte_mutations(dec.seeds)))


@pytest.mark.parametrize("dec", [d for d in DECODERS if d.is_msgpack], ids=[d.name for d in DECODERS if d.is_msgpack])
@settings(max_examples=150)
@given(data=st.data())
def test_mutated_structures_raise_only_the_documented_error(dec: Decoder, data: st.DataObject) -> None:
    raw = data.draw(tree_mutations(dec.seeds))
    if raw is not None:
        decodes_or_refuses(dec, raw)


HOSTILE_HEADERS = [
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
    b"\x93\x01\xa5hello\xdf\x7f\xff\xff\xff", b"\x91" * 5000, b"\xdc\xff\xff" * 300,
    b"KVPT\x01\x00\x00\x00" + b"\xff" * 8, b"KVTP\x01\x00\x00\x00" + b"\xff" * 8,
    b"KVPT\x01\x00\x40\x00" + b"\x00" * 8 + b"\x20" + b"a" * 32, b"KVPT\x01\x00\x00\x00" + (2**61).to_bytes(8, "little"),
    # the page-table header: a count of 2**61, a names array claiming 2**32 items, a header length past the end
    b"KVPT\x02\x00\x0b\x00\x92\xcf" + (2**61).to_bytes(8, "big") + b"\x90",
    b"KVPT\x02\x00\x07\x00\x92\x00\xdd\xff\xff\xff\xff", b"KVTP\x02\x00\xff\xff\x92\x00\x90",
]


@pytest.mark.parametrize("dec", DECODERS, ids=IDS)
def test_hostile_lengths_are_refused_without_a_large_allocation(dec: Decoder) -> None:
    """Headers claiming 2**32 items, deep nesting, huge counts: refused, peak allocation < 4 MiB."""
    tracemalloc.start()
    try:
        for raw in HOSTILE_HEADERS + [s[:5] + b"\xdd\xff\xff\xff\xff" + s[5:] for s in dec.seeds]:
            tracemalloc.reset_peak()
            assert not decodes_or_refuses(dec, raw)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 4 << 20, f"{dec.name}: decoding {raw[:16]!r}... peaked at {peak} bytes"
    finally:
        tracemalloc.stop()


# --- part 2: hostile plans and forged metadata through the transports ----------------------------
AVAILABLE = available_backends()
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(AVAILABLE[b] is not None, reason=str(AVAILABLE[b])))
            for b in ("loopback", "nixl", "ucx")]
_names = itertools.count()


class Pair:
    """``a`` and ``b`` of one backend. ``b`` registers the first half of one buffer; the second half
    (``victim``) is memory of b's process that b never registered."""

    def __init__(self, backend: str) -> None:
        n = next(_names)
        self.a_bufs = make_buffers([16 * PAGE, 16 * PAGE], seed=21)
        whole = make_buffers([32 * PAGE], seed=22)[0]
        self.b_bufs, self.victim = [whole[:16 * PAGE]], whole[16 * PAGE:]
        self.a, self.b = create(backend, f"ha{n}"), create(backend, f"hb{n}")
        self.a.register(regions_of(self.a_bufs))
        self.b.register(regions_of(self.b_bufs))
        self.b.connect(self.a.name, self.a.metadata())
        self.a.connect(self.b.name, self.b.metadata())
        self.before = [x.copy() for x in [*self.a_bufs, *self.b_bufs, self.victim]]

    def unchanged(self) -> bool:
        return all(np.array_equal(x, y) for x, y in zip([*self.a_bufs, *self.b_bufs, self.victim], self.before,
                                                          strict=True))

    def notified(self) -> bool:
        return bool(self.a.notifications() or self.b.notifications())

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=BACKENDS)
def hostile_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()


def _table(addr: list[int], nbytes: list[int], region: list[int]) -> PageTable:
    return PageTable(np.array(addr, np.uint64), np.array(nbytes, np.uint64), np.array(region, np.uint32))


def post(t: Transport, op: str, peer: str, local: PageTable, remote: PageTable) -> None:
    plan = TransferPlan(local, remote) if op == "write" else TransferPlan(remote, local)
    getattr(t, op)(peer, plan, notify=b"must-not-arrive").wait(10.0)


@pytest.mark.parametrize("op", ["write", "read"])
def test_hostile_plans_are_refused_before_any_byte_moves(hostile_pair: Pair, op: str) -> None:
    p = hostile_pair
    a0, b0 = p.a.regions[0], p.b.regions[0]
    local2 = _table([a0.base_address, a0.base_address + 2 * PAGE], [PAGE, PAGE], [0, 0])
    cases: dict[str, tuple[PageTable, PageTable, str]] = {
        # Two remote (write) / local (read) destinations sharing bytes.
        "overlapping destinations": (
            local2, _table([b0.base_address, b0.base_address + PAGE // 2], [PAGE, PAGE], [0, 0]), "overlap")
        if op == "write" else
        (_table([a0.base_address + PAGE, a0.base_address + PAGE + 8], [PAGE, PAGE], [0, 0]),
         _table([b0.base_address, b0.base_address + 4 * PAGE], [PAGE, PAGE], [0, 0]), "overlap"),
        "size wrapping 2**64": (
            _table([a0.base_address], [2**64 - a0.base_address + 1], [0]),
            _table([b0.base_address], [2**64 - a0.base_address + 1], [0]), "outside region"),
        "address near 2**64": (
            _table([a0.base_address], [PAGE], [0]), _table([2**64 - PAGE // 2], [PAGE], [0]), "outside region"),
        "region index 2**32-1": (
            _table([a0.base_address], [PAGE], [0]), _table([b0.base_address], [PAGE], [2**32 - 1]), "not registered"),
        "remote entry past the registration into unregistered memory": (
            _table([a0.base_address], [2 * PAGE], [0]), _table([b0.end_address - PAGE], [2 * PAGE], [0]),
            "outside region"),
        "a million entries, one of them outside": (
            _table([a0.base_address] * 10**6, [0] * (10**6 - 1) + [PAGE], [0] * 10**6),
            _table([b0.base_address] * (10**6 - 1) + [b0.end_address], [0] * (10**6 - 1) + [PAGE], [0] * 10**6),
            "entry 999999"),
    }
    for what, (local, remote, words) in cases.items():
        with pytest.raises(PageTableError, match=words):
            post(p.a, op, p.b.name, local, remote)
        assert p.unchanged(), what
    assert not p.notified()


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("forge", ["grown region", "extra region"])
def test_forged_metadata_cannot_reach_unregistered_memory(hostile_pair: Pair, op: str, forge: str) -> None:
    """b advertises more than it registered (its own unregistered memory right after its region): a
    write there and a read from there fail, and no byte of the victim moves in either direction."""
    p = hostile_pair
    real = TransportMetadata.decode(p.b.metadata())
    b0 = real.regions[0]
    if forge == "grown region":
        regions = (MemoryRegion(b0.base_address, 2 * b0.nbytes, b0.memory_kind, b0.device_id),)
    else:
        regions = (b0, MemoryRegion(b0.end_address, b0.nbytes, b0.memory_kind, b0.device_id))
    p.a.connect(p.b.name, TransportMetadata(real.backend, real.name, regions, real.backend_blob).encode())
    local = _table([p.a.regions[1].base_address], [2 * PAGE], [1])
    remote = _table([int(p.victim.ctypes.data) + PAGE], [2 * PAGE], [0 if forge == "grown region" else 1])
    with pytest.raises(TransportError) as info:
        post(p.a, op, p.b.name, local, remote)
    assert isinstance(info.value, TransferFailed | PageTableError), info.value
    assert p.unchanged()
    assert not p.b.notifications()


def test_the_transports_own_checks_refuse_a_decoded_hostile_plan() -> None:
    """A plan decoded from a peer's bytes and aimed at memory nobody registered stops at post time."""
    p = Pair("loopback")
    try:
        rng = np.random.default_rng(5)
        good = pair(random_pages(rng, list(p.a.regions), 4, PAGE, False),
                    random_pages(rng, list(p.b.regions), 4, PAGE, False))
        wire = bytearray(good.to_bytes())
        # Point destination entry 2 one page past b's region (dst_addr column, little-endian u64).
        pos = 16 + 4 * 8 + 2 * 8
        wire[pos:pos + 8] = (p.b.regions[0].end_address - PAGE // 2).to_bytes(8, "little")
        hostile = TransferPlan.from_bytes(bytes(wire))
        with pytest.raises(PageTableError, match="remote destination: entry 2"):
            p.a.write(p.b.name, hostile, notify=b"x")
        assert p.unchanged() and not p.notified()
    finally:
        p.close()
