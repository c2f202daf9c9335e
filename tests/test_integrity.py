"""Per-transfer blake3 checksums over the loopback transport and its corruption hook."""

from __future__ import annotations

import itertools

import blake3
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transport_helpers.plans import PAGE, make_buffers, pair, random_pages, regions_of

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import ConfigError, DecodeError, IntegrityError, PageTableError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import LoopbackFaults, LoopbackTransport, create
from kvxfer.transport.integrity import (
    MAX_DIGEST_ENTRIES,
    ChecksumPolicy,
    TransferDigest,
    _splitmix64,
    digest_source,
    digest_table,
    verify_destination,
)

_names = itertools.count()


class Pair:
    """Two loopback transports over seeded host buffers; ``a`` pushes to ``b`` with ``a.faults``."""

    def __init__(self, seed: int, corrupt: tuple[int, int] | None = None) -> None:
        n = next(_names)
        self.a_bufs = make_buffers([32 * PAGE, 16 * PAGE], seed)
        self.b_bufs = make_buffers([24 * PAGE, 24 * PAGE], seed + 1)
        self.a = LoopbackTransport(f"ia{n}", LoopbackFaults(corrupt=corrupt))
        self.b = create("loopback", f"ib{n}")
        self.a.register(regions_of(self.a_bufs))
        self.b.register(regions_of(self.b_bufs))
        self.a.connect(self.b.name, self.b.metadata())
        self.b.connect(self.a.name, self.a.metadata())

    def plan(self, seed: int, pages: int = 12, page: int = PAGE, coalesced: bool = False) -> TransferPlan:
        rng = np.random.default_rng(seed)
        return pair(random_pages(rng, list(self.a.regions), pages, page, coalesced),
                    random_pages(rng, list(self.b.regions), pages, page, coalesced))

    def push(self, plan: TransferPlan, policy: ChecksumPolicy, name: str = "req-1") -> TransferDigest:
        """Digest on a's side, write, and return the digest as the wire carries it."""
        digest = digest_source(plan, self.a.regions, policy, name)
        self.a.write(self.b.name, plan).wait(5.0)
        return TransferDigest.from_bytes(digest.to_bytes())

    def close(self) -> None:
        self.a.close()
        self.b.close()


def entry_of(plan: TransferPlan, offset: int) -> int:
    """The plan entry holding byte ``offset`` of the transfer's byte stream."""
    return int(np.searchsorted(np.cumsum(plan.dst.nbytes.astype(np.int64)), offset, side="right"))


POLICIES = [ChecksumPolicy(), ChecksumPolicy.every(3, seed=1), ChecksumPolicy.sample(0.4, seed=7),
            ChecksumPolicy(tag_bytes=32)]


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "every3", "random40", "tag32"])
@pytest.mark.parametrize("coalesced", [False, True])
def test_intact_transfer_verifies(policy: ChecksumPolicy, coalesced: bool) -> None:
    p = Pair(seed=1)
    try:
        plan = p.plan(seed=2, coalesced=coalesced)
        digest = p.push(plan, policy)
        assert digest.entry_count == len(plan)
        assert digest.checked_entries == policy.select(len(plan)).size > 0
        verify_destination(plan, p.b.regions, digest)
    finally:
        p.close()


def test_full_mode_names_the_corrupted_entry_and_its_address() -> None:
    offset = 5 * PAGE + 17
    p = Pair(seed=3, corrupt=(offset, 1))
    try:
        plan = p.plan(seed=4)
        digest = p.push(plan, ChecksumPolicy(), name="req-42")
        i = entry_of(plan, offset)
        addr = int(plan.dst.addr[i])
        with pytest.raises(IntegrityError, match=rf"transfer 'req-42': entry {i} \(destination {addr:#x}, "
                                                 rf"{PAGE} bytes, region {int(plan.dst.region[i])}\)"):
            verify_destination(plan, p.b.regions, digest)
    finally:
        p.close()


def test_sampled_mode_detects_corruption_only_where_the_sample_covers_it() -> None:
    policy = ChecksumPolicy.every(2, seed=0)          # entries 0, 2, 4, ...
    for entry, detected in ((4, True), (5, False)):
        p = Pair(seed=5, corrupt=(entry * PAGE + 100, 8))
        try:
            plan = p.plan(seed=6)
            digest = p.push(plan, policy)
            if detected:
                with pytest.raises(IntegrityError, match=f"entry {entry} "):
                    verify_destination(plan, p.b.regions, digest)
            else:
                verify_destination(plan, p.b.regions, digest)   # unsampled entry: not seen, by design
        finally:
            p.close()


@given(seed=st.integers(0, 2**32 - 1), pages=st.integers(1, 20), coalesced=st.booleans(),
       offset=st.integers(0, 20 * 1024 - 1), length=st.integers(1, 3000),
       policy=st.sampled_from(POLICIES[:3]), corrupt=st.booleans())
def test_random_plans_detect_exactly_the_covered_corruptions(seed: int, pages: int, coalesced: bool, offset: int,
                                                             length: int, policy: ChecksumPolicy,
                                                             corrupt: bool) -> None:
    page = 1024
    p = Pair(seed=seed % 1000, corrupt=(offset, length) if corrupt else None)
    try:
        plan = p.plan(seed=seed, pages=pages, page=page, coalesced=coalesced)
        digest = p.push(plan, policy)
        hit = np.zeros(len(plan), dtype=bool)
        if corrupt and offset < plan.total_bytes:
            ends = np.cumsum(plan.dst.nbytes.astype(np.int64))
            hit = (ends - plan.dst.nbytes.astype(np.int64) < offset + length) & (ends > offset)
        covered = np.flatnonzero(hit[policy.select(len(plan))] if hit.any() else [])
        if covered.size:
            first = int(policy.select(len(plan))[covered[0]])
            with pytest.raises(IntegrityError, match=f"entry {first} "):
                verify_destination(plan, p.b.regions, digest)
        else:
            verify_destination(plan, p.b.regions, digest)
    finally:
        p.close()


def test_digest_is_small_and_round_trips() -> None:
    bufs = make_buffers([8192 * 256], seed=11)
    regions = regions_of(bufs)
    base = regions[0].base_address
    table = PageTable(base + np.arange(8192, dtype=np.uint64) * np.uint64(256), np.full(8192, 256, np.uint64),
                      np.zeros(8192, np.uint32))
    full = digest_table(table, regions, ChecksumPolicy(), "big")
    assert TransferDigest.from_bytes(full.to_bytes()) == full
    assert len(full.to_bytes()) < 8192 * 8 + 128                   # 8-byte tags + a 32-byte root
    assert full.checked_bytes == 8192 * 256 and full.checked_entries == 8192
    every = digest_table(table, regions, ChecksumPolicy.every(64), "big")
    assert every.checked_entries == 128 and len(every.to_bytes()) < 128 * 8 + 128
    # The tags are the leading bytes of each entry's blake3 digest.
    assert full.tags[:8] == blake3.blake3(bufs[0][:256]).digest()[:8]


def test_policy_selection_is_specified_and_deterministic() -> None:
    # splitmix64's first output for seed 0 (a published test vector).
    assert int(_splitmix64(np.array([0], np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert ChecksumPolicy().select(5).tolist() == [0, 1, 2, 3, 4]
    assert ChecksumPolicy.every(3, seed=4).select(10).tolist() == [1, 4, 7]
    a = ChecksumPolicy.sample(0.25, seed=99).select(4000)
    assert np.array_equal(a, ChecksumPolicy.sample(0.25, seed=99).select(4000))
    assert 850 < a.size < 1150 and np.all(np.diff(a) > 0)
    assert not np.array_equal(a[:50], ChecksumPolicy.sample(0.25, seed=100).select(4000)[:50])
    assert ChecksumPolicy.sample(1e-9, seed=1).select(3).size == 1      # never an empty sample
    assert ChecksumPolicy.sample(0.5, seed=1).select(0).size == 0


@pytest.mark.parametrize("kwargs", [{"mode": "some"}, {"stride": 0}, {"fraction": 0.0}, {"fraction": float("nan")},
                                    {"seed": -1}, {"tag_bytes": 3}, {"tag_bytes": 33}, {"stride": True}])
def test_bad_policies_are_config_errors(kwargs: dict[str, object]) -> None:
    field = next(iter(kwargs))
    with pytest.raises(ConfigError, match=f"ChecksumPolicy.{field}"):
        ChecksumPolicy(**kwargs)  # type: ignore[arg-type]


def test_verifier_refuses_a_digest_of_another_plan_or_a_tampered_digest() -> None:
    p = Pair(seed=12)
    try:
        plan = p.plan(seed=13)
        digest = p.push(plan, ChecksumPolicy())
        with pytest.raises(IntegrityError, match="digest covers a plan of 12 entries, the destination table has 11"):
            verify_destination(plan.take(slice(0, 11)), p.b.regions, digest)
        bigger = TransferPlan(plan.src.split(PAGE // 2), plan.dst.split(PAGE // 2)).take(slice(0, 12))
        with pytest.raises(IntegrityError, match="plans differ"):
            verify_destination(bigger, p.b.regions, digest)
        flipped = bytes([digest.root[0] ^ 1]) + digest.root[1:]
        bad_root = TransferDigest(digest.transfer, digest.policy, digest.entry_count, digest.checked_bytes,
                                  flipped, digest.tags)
        with pytest.raises(IntegrityError, match="root differs although every entry tag matches"):
            verify_destination(plan, p.b.regions, bad_root)
        outside = TransferPlan(plan.src, PageTable(plan.dst.addr, plan.dst.nbytes, np.full(12, 7, np.uint32)))
        with pytest.raises(IntegrityError, match="cannot be checked: entry 0: region 7 not registered"):
            verify_destination(outside, p.b.regions, digest)
    finally:
        p.close()


def test_source_side_refuses_bad_tables_and_oversized_digests() -> None:
    bufs = make_buffers([4 * PAGE], seed=14)
    regions = regions_of(bufs)
    past = PageTable(np.array([regions[0].end_address - 8], np.uint64), np.array([16], np.uint64),
                     np.zeros(1, np.uint32))
    with pytest.raises(PageTableError, match="entry 0"):
        digest_table(past, regions, ChecksumPolicy(), "t")
    n = MAX_DIGEST_ENTRIES + 1
    many = PageTable(np.full(n, regions[0].base_address, np.uint64), np.ones(n, np.uint64), np.zeros(n, np.uint32))
    with pytest.raises(ConfigError, match="coalesce the plan or sample"):
        digest_table(many, regions, ChecksumPolicy(), "t")
    assert digest_table(many, regions, ChecksumPolicy.every(1024), "t").checked_entries == 1025
    with pytest.raises(ConfigError, match="transfer name"):
        digest_table(past, regions, ChecksumPolicy(), "x" * 300)


def test_digest_decoder_names_the_bad_field() -> None:
    good = digest_table(PageTable.empty(), [], ChecksumPolicy.every(2), "t").to_bytes()
    obj = msgpack.unpackb(good)
    cases = {
        "version": [2, *obj[1:]],
        "transfer": [obj[0], 5, *obj[2:]],
        "policy": [*obj[:2], ["full", 1, 1.0, 0], *obj[3:]],
        "policy: ChecksumPolicy.stride": [*obj[:2], ["stride", 0, 1.0, 0, 8], *obj[3:]],
        "entry_count": [*obj[:3], -1, *obj[4:]],
        "root": [*obj[:5], b"short", obj[6]],
        "tags: 1 tags, the policy selects 0": [*obj[:6], b"12345678"],
    }
    for field, value in cases.items():
        with pytest.raises(DecodeError, match=f"transfer digest.{field}"):
            TransferDigest.from_bytes(msgpack.packb(value))
    with pytest.raises(DecodeError, match="invalid msgpack"):
        TransferDigest.from_bytes(b"\xc1")


@pytest.mark.gpu
def test_cuda_source_and_destination_verify_and_detect_corruption() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: checksums of device memory read it through torch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (64 * PAGE,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.zeros(64 * PAGE, dtype=torch.uint8, device="cuda")
    sreg, dreg = MemoryRegion.of_tensor(src), MemoryRegion.of_tensor(dst)
    rng = np.random.default_rng(1)
    plan = pair(random_pages(rng, [sreg], 40, PAGE, False), random_pages(rng, [dreg], 40, PAGE, False))
    digest = digest_source(plan, [sreg], ChecksumPolicy(), "gpu")
    for s, d, n in zip(plan.src.addr.tolist(), plan.dst.addr.tolist(), plan.src.nbytes.tolist(), strict=True):
        dst[d - dreg.base_address:d - dreg.base_address + n] = src[s - sreg.base_address:s - sreg.base_address + n]
    torch.cuda.synchronize()
    verify_destination(plan, [dreg], digest)
    bad = int(plan.dst.addr[7]) - dreg.base_address + 5
    dst[bad] ^= 0xFF
    torch.cuda.synchronize()
    with pytest.raises(IntegrityError, match="entry 7 "):
        verify_destination(plan, [dreg], digest)
