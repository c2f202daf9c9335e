"""nixl backend: prepared transfers repost their NIXL requests (NIXL's prepared-request model), each post
with its own notification, on real NIXL agents over UCX in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import PageTableError
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import TransferStatus, Transport, available_backends, create
from tests.support.transport_helpers.plans import (
    PAGE,
    expected_after,
    make_buffers,
    pair,
    random_pages,
    regions_of,
)

REASON = available_backends()["nixl"]
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
_names = iter(range(1_000_000))


class Agents:
    """Two connected nixl transports over seeded host buffers, with a count of the NIXL requests made."""

    def __init__(self) -> None:
        n = next(_names)
        self.a_bufs, self.b_bufs = make_buffers([256 << 10, 192 << 10], 5), make_buffers([128 << 10, 320 << 10], 6)
        self.a, self.b = create("nixl", f"na{n}"), create("nixl", f"nb{n}")
        self.a.register(regions_of(self.a_bufs))
        self.b.register(regions_of(self.b_bufs))
        self.a.connect(self.b.name, self.b.metadata())
        self.b.connect(self.a.name, self.a.metadata())
        self.made = 0
        agent: Any = self.a._agent  # type: ignore[attr-defined]
        for verb in ("make_prepped_xfer", "initialize_xfer"):
            real = getattr(agent, verb)

            def counted(*args: Any, _real: Any = real, **kw: Any) -> Any:
                self.made += 1
                return _real(*args, **kw)
            setattr(agent, verb, counted)
        core: Any = self.a._core  # type: ignore[attr-defined]
        if core is not None:   # the one-entry path makes its request through NIXL's binding
            real_make = core.make

            def counted_make(*args: Any) -> Any:
                self.made += 1
                return real_make(*args)
            core.make = counted_make

    def plan(self, seed: int, pages: int = 24) -> TransferPlan:
        rng = np.random.default_rng(seed)
        return pair(random_pages(rng, list(self.a.regions), pages, PAGE, False),
                    random_pages(rng, list(self.b.regions), pages, PAGE, False))

    def expected(self, plan: TransferPlan) -> list[np.ndarray]:
        return expected_after(plan, list(self.a.regions), self.a_bufs, list(self.b.regions), self.b_bufs)

    def rewrite_source(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for buf in self.a_bufs:
            buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def agents() -> Iterator[Agents]:
    x = Agents()
    yield x
    x.close()


def notifications(t: Transport, want: int, timeout: float = 5.0, settle: float = 0.1) -> list[bytes]:
    """Every notification ``t`` receives until ``want`` arrived (or timeout), then during ``settle``."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += [m for msgs in t.notifications().values() for m in msgs]
        time.sleep(0.002)
    time.sleep(settle)
    return got + [m for msgs in t.notifications().values() for m in msgs]


def test_posts_repost_the_prepared_requests_each_with_its_notification(agents: Agents) -> None:
    """After ``prepare`` no post makes a NIXL request: each reposts the prepared ones, lands the source's
    current bytes where the plan says, and its own notification reaches the peer once, after the data.
    Mutation: a prepared post that makes requests of its own (the unprepared path) fails the count."""
    plan = agents.plan(1)
    prepared = agents.a.prepare("write", agents.b.name, plan)
    made_at_prepare = agents.made
    assert made_at_prepare == 1
    for round_no in range(4):
        agents.rewrite_source(100 + round_no)
        want = agents.expected(plan)
        handle = prepared.post(notify=b"post%d" % round_no)
        handle.wait(10.0)
        assert handle.status is TransferStatus.DONE and handle.nbytes == plan.total_bytes
        assert all(np.array_equal(got, w) for got, w in zip(agents.b_bufs, want, strict=True))
        assert notifications(agents.b, 1) == [b"post%d" % round_no]
    assert agents.made == made_at_prepare


def test_a_post_without_notification_after_one_with_sends_none(agents: Agents) -> None:
    """NIXL keeps the notification a post gave a request: a later post without one must not repeat it
    (it makes requests of its own), and one with a notification again sends that one.
    Mutation: ``take`` lending the notified requests to a post without notification fails this."""
    plan = agents.plan(2)
    prepared = agents.a.prepare("write", agents.b.name, plan)
    prepared.post(notify=b"first").wait(10.0)
    assert notifications(agents.b, 1) == [b"first"]
    agents.rewrite_source(7)
    want = agents.expected(plan)
    quiet = prepared.post()
    quiet.wait(10.0)
    assert quiet.status is TransferStatus.DONE
    assert all(np.array_equal(got, w) for got, w in zip(agents.b_bufs, want, strict=True))
    assert notifications(agents.b, 1, timeout=0.3) == []
    prepared.post(notify=b"second").wait(10.0)
    assert notifications(agents.b, 1) == [b"second"]


def test_a_post_while_the_requests_are_lent_makes_its_own(agents: Agents) -> None:
    """NIXL refuses to repost a request in flight: a post made before the previous one was seen finished
    gets requests of its own; both land their bytes and notify, and the prepared requests serve the next
    post again. Mutation: lending the same requests to both posts makes NIXL refuse the second."""
    plan = agents.plan(3)
    prepared = agents.a.prepare("write", agents.b.name, plan)
    want = agents.expected(plan)
    first = prepared.post(notify=b"one")      # not waited for: its requests stay held until it is seen done
    second = prepared.post(notify=b"two")
    assert agents.made == 2
    for h in (first, second):
        h.wait(10.0)
        assert h.status is TransferStatus.DONE
    assert all(np.array_equal(got, w) for got, w in zip(agents.b_bufs, want, strict=True))
    assert sorted(notifications(agents.b, 2)) == [b"one", b"two"]
    prepared.post(notify=b"three").wait(10.0)
    assert agents.made == 2
    assert notifications(agents.b, 1) == [b"three"]


def test_a_read_is_prepared_the_same_way(agents: Agents) -> None:
    """A prepared read pulls the peer's current bytes at each post, reposting its requests."""
    plan = agents.plan(4)
    read_plan = TransferPlan(plan.dst, plan.src)    # peer (b) -> local (a)
    prepared = agents.a.prepare("read", agents.b.name, read_plan)
    for round_no in range(3):
        rng = np.random.default_rng(200 + round_no)
        for buf in agents.b_bufs:
            buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
        want = expected_after(read_plan, list(agents.b.regions), agents.b_bufs, list(agents.a.regions), agents.a_bufs)
        prepared.post(notify=b"r%d" % round_no).wait(10.0)
        assert all(np.array_equal(got, w) for got, w in zip(agents.a_bufs, want, strict=True))
        assert notifications(agents.b, 1) == [b"r%d" % round_no]
    assert agents.made == 1


def test_a_failed_post_releases_the_requests_and_later_posts_make_their_own(agents: Agents) -> None:
    """NIXL refusing a post fails that post's handle naming NIXL, releases the prepared requests (they are
    not handed out again), and the next post makes requests of its own and lands its bytes and notification.
    Mutation: giving the requests back on failure makes the next post repost released requests (NIXL then
    crashes the process: seen)."""
    plan = agents.plan(5)
    prepared = agents.a.prepare("write", agents.b.name, plan)
    agent: Any = agents.a._agent  # type: ignore[attr-defined]
    real_transfer = agent.transfer
    agent.transfer = lambda *args, **kw: "ERR"
    refused = prepared.post(notify=b"lost")
    assert refused.status is TransferStatus.FAILED and "NIXL refused" in refused.reason
    agent.transfer = real_transfer
    assert notifications(agents.b, 1, timeout=0.2) == []
    agents.rewrite_source(9)
    want = agents.expected(plan)
    handle = prepared.post(notify=b"after")
    handle.wait(10.0)
    assert handle.status is TransferStatus.DONE and agents.made == 2
    assert all(np.array_equal(got, w) for got, w in zip(agents.b_bufs, want, strict=True))
    assert notifications(agents.b, 1) == [b"after"]


def test_notifications_from_an_agent_this_transport_did_not_connect_are_dropped(agents: Agents) -> None:
    """c loads b's metadata but b never connected c: NIXL's one-sided write lands (that is NIXL's model: the
    metadata is the capability), but b's inbox, keyed by peer input, takes no notification from c; a's
    notifications still arrive."""
    c_bufs = make_buffers([64 << 10], 7)
    c = create("nixl", f"nc{next(_names)}")
    try:
        c.register(regions_of(c_bufs))
        c.connect(agents.b.name, agents.b.metadata())
        rng = np.random.default_rng(12)
        plan = pair(random_pages(rng, list(c.regions), 8, PAGE, False),
                    random_pages(rng, list(agents.b.regions), 8, PAGE, False))
        c.write(agents.b.name, plan, notify=b"from-c").wait(10.0)
        agents.a.write(agents.b.name, agents.plan(13), notify=b"from-a").wait(10.0)
        assert notifications(agents.b, 1, settle=0.3) == [b"from-a"]
    finally:
        c.close()


@pytest.mark.parametrize("entries", [1, 3, 16, 40])
@pytest.mark.parametrize("op", ["write", "read"])
def test_per_request_plans_of_every_size_move_exact_bytes(agents: Agents, op: str, entries: int) -> None:
    """The post path a per-request plan takes (one entry, a few checked over ints, many over arrays), with
    entries of one page and of several (a coalesced run spans several grid units), lands exactly the plan's
    bytes and makes one NIXL request per post."""
    rng = np.random.default_rng(entries)
    a1, b1 = agents.a.regions[1], agents.b.regions[1]
    three = PageTable(np.array([a1.base_address + PAGE], np.uint64), np.array([3 * PAGE], np.uint64),
                      np.array([1], np.uint32))
    three_remote = PageTable(np.array([b1.base_address + 2 * PAGE], np.uint64), np.array([3 * PAGE], np.uint64),
                             np.array([1], np.uint32))
    tables = [(random_pages(rng, list(agents.a.regions), entries, PAGE, coalesced),
               random_pages(rng, list(agents.b.regions), entries, PAGE, coalesced)) for coalesced in (False, True)]
    for local, remote in [*tables, (three, three_remote)]:
        plan = pair(local, remote) if op == "write" else pair(remote, local)
        src_regions, src_bufs, dst_regions, dst_bufs = (
            (agents.a.regions, agents.a_bufs, agents.b.regions, agents.b_bufs) if op == "write"
            else (agents.b.regions, agents.b_bufs, agents.a.regions, agents.a_bufs))
        want = expected_after(plan, list(src_regions), src_bufs, list(dst_regions), dst_bufs)
        made = agents.made
        getattr(agents.a, op)(agents.b.name, plan).wait(10.0)
        assert agents.made == made + 1
        assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))


def _one(addr: int, nbytes: int, region: int) -> PageTable:
    return PageTable(np.array([addr], np.uint64), np.array([nbytes], np.uint64), np.array([region], np.uint32))


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("fault", ["local below the base", "remote below the base", "local past the end",
                                   "remote past the end", "remote region", "local region"])
def test_a_one_entry_plan_outside_the_regions_is_refused_once_the_grids_exist(agents: Agents, op: str,
                                                                               fault: str) -> None:
    """The one-entry post path checks bounds and regions itself (its grids prepared by an earlier post of the
    same unit): a page one unit below a region's base, one just past a region's end, or in a region that
    is not registered, is refused with the side named, no request made, no byte moved and no notification.
    Mutation: dropping a bound lets the page land in the neighbouring region's grid cells (or NIXL fail it
    as a transfer error instead of a refusal)."""
    a0, a1 = agents.a.regions
    b0, b1 = agents.b.regions
    good = (_one(a1.base_address + PAGE, PAGE, 1), _one(b0.base_address + 2 * PAGE, PAGE, 0))
    local, remote = {
        "local below the base": (_one(a1.base_address - PAGE, PAGE, 1), good[1]),
        "remote below the base": (good[0], _one(b1.base_address - PAGE, PAGE, 1)),
        "local past the end": (_one(a0.end_address, PAGE, 0), good[1]),
        "remote past the end": (good[0], _one(b0.end_address, PAGE, 0)),
        "remote region": (good[0], _one(b1.base_address, PAGE, 2)),
        "local region": (_one(a0.base_address, PAGE, 7), good[1]),
    }[fault]

    def plan_of(lt: PageTable, rt: PageTable) -> TransferPlan:
        return TransferPlan(lt, rt) if op == "write" else TransferPlan(rt, lt)
    getattr(agents.a, op)(agents.b.name, plan_of(*good)).wait(10.0)   # prepares the grids of this unit
    before = [x.copy() for x in agents.a_bufs + agents.b_bufs]
    made = agents.made
    words = "not registered" if "region" in fault else fault.split()[0]
    with pytest.raises(PageTableError, match=words):
        getattr(agents.a, op)(agents.b.name, plan_of(local, remote), notify=b"never")
    assert agents.made == made
    assert notifications(agents.b, 1, timeout=0.1, settle=0.05) == []
    assert all(np.array_equal(got, w) for got, w in zip(agents.a_bufs + agents.b_bufs, before, strict=True))


@pytest.mark.parametrize("op", ["write", "read"])
def test_one_entry_posts_finish_within_the_post_or_when_polled_alike(agents: Agents, op: str) -> None:
    """A one-page post that NIXL finishes within the post returns a handle already done (callbacks run at
    once, cancel is too late); one it reports in progress is polled to completion. Both land the bytes."""
    rng = np.random.default_rng(11)
    for i in range(20):
        plan = pair(random_pages(rng, list(agents.a.regions), 1, PAGE, False),
                    random_pages(rng, list(agents.b.regions), 1, PAGE, False))
        if op == "read":
            plan = TransferPlan(plan.dst, plan.src)
        src_regions, src_bufs, dst_regions, dst_bufs = (
            (agents.a.regions, agents.a_bufs, agents.b.regions, agents.b_bufs) if op == "write"
            else (agents.b.regions, agents.b_bufs, agents.a.regions, agents.a_bufs))
        want = expected_after(plan, list(src_regions), src_bufs, list(dst_regions), dst_bufs)
        handle = getattr(agents.a, op)(agents.b.name, plan, notify=f"n{i}".encode())
        handle.wait(10.0)
        seen: list[int] = []
        handle.add_done_callback(lambda h, seen=seen: seen.append(h.id))  # type: ignore[misc]
        assert seen == [handle.id] and handle.status is TransferStatus.DONE and not handle.cancel()
        assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
    assert sorted(notifications(agents.b, 20)) == sorted(f"n{i}".encode() for i in range(20))


@pytest.mark.parametrize("entries", [2, 16])
def test_a_few_entries_writing_one_byte_twice_are_refused_before_nixl_sees_them(agents: Agents,
                                                                                entries: int) -> None:
    """The few-entry path checks the destination for overlap itself: two entries onto one remote page are
    refused with the overlap named and no request made. Mutation: dropping that check lets the post through
    (one request made, no error)."""
    rng = np.random.default_rng(3)
    local = random_pages(rng, list(agents.a.regions), entries, PAGE, False)
    remote = random_pages(rng, list(agents.b.regions), entries, PAGE, False)
    addr = remote.addr.copy()
    addr[-1] = addr[0] + np.uint64(PAGE // 2)   # half a page into the first entry's page
    region = remote.region.copy()
    region[-1] = region[0]
    bad = TransferPlan(local, PageTable(addr, remote.nbytes, region))
    made = agents.made
    with pytest.raises(PageTableError, match="overlap"):
        agents.a.write(agents.b.name, bad)
    assert agents.made == made


@pytest.fixture
def one_region_each() -> Iterator[tuple[Transport, Transport, list[np.ndarray], list[np.ndarray]]]:
    """Two nixl transports over one region each (the KV pool's shape: the uniform post path)."""
    n = next(_names)
    a_bufs, b_bufs = make_buffers([1 << 20], 21), make_buffers([1 << 20], 22)
    a, b = create("nixl", f"u{n}a"), create("nixl", f"u{n}b")
    a.register(regions_of(a_bufs))
    b.register(regions_of(b_bufs))
    a.connect(b.name, b.metadata())
    b.connect(a.name, a.metadata())
    yield a, b, a_bufs, b_bufs
    a.close()
    b.close()


@pytest.mark.parametrize("entries", [17, 64, 200])
@pytest.mark.parametrize("op", ["write", "read"])
def test_uniform_plans_over_one_region_move_exact_bytes(one_region_each: Any, op: str, entries: int) -> None:
    """Many one-page entries over one region a side (the layer-wise chunk's shape) land exactly, in both
    directions, the few-entries-in-a-large-grid case (sorted check) and the many (marked grid) alike."""
    a, b, a_bufs, b_bufs = one_region_each
    rng = np.random.default_rng(entries)
    local = random_pages(rng, list(a.regions), entries, PAGE, False)
    remote = random_pages(rng, list(b.regions), entries, PAGE, False)
    plan = pair(local, remote) if op == "write" else pair(remote, local)
    src_regions, src_bufs, dst_regions, dst_bufs = ((a.regions, a_bufs, b.regions, b_bufs) if op == "write"
                                                    else (b.regions, b_bufs, a.regions, a_bufs))
    want = expected_after(plan, list(src_regions), src_bufs, list(dst_regions), dst_bufs)
    getattr(a, op)(b.name, plan, notify=b"u").wait(10.0)
    assert all(np.array_equal(got, w) for got, w in zip(dst_bufs, want, strict=True))
    assert notifications(b, 1) == [b"u"]


@pytest.mark.parametrize("entries", [20, 100])
@pytest.mark.parametrize("fault", ["overlap", "past the end", "below the base", "region"])
def test_uniform_plans_are_refused_as_every_plan_is(one_region_each: Any, fault: str, entries: int) -> None:
    """The uniform path's own checks refuse what ``TransferPlan.validate`` refuses, with its messages, before
    NIXL sees the plan; the destination stays as it was. Mutation: dropping the grid-marking check lets two
    entries onto one page through."""
    a, b, _a_bufs, b_bufs = one_region_each
    rng = np.random.default_rng(1)
    local = random_pages(rng, list(a.regions), entries, PAGE, False)
    remote = random_pages(rng, list(b.regions), entries, PAGE, False)
    addr, region = remote.addr.copy(), remote.region.copy()
    r0 = b.regions[0]
    if fault == "overlap":
        addr[-1] = addr[0]
    elif fault == "past the end":
        addr[-1] = np.uint64(r0.end_address - PAGE // 2)
    elif fault == "below the base":
        addr[-1] = np.uint64(r0.base_address - PAGE)
    else:
        region[-1] = 1
    before = [x.copy() for x in b_bufs]
    bad = TransferPlan(local, PageTable(addr, remote.nbytes, region))
    words = {"overlap": "overlap", "region": "not registered"}.get(fault, "remote")
    with pytest.raises(PageTableError, match=words):
        a.write(b.name, bad, notify=b"never")
    assert notifications(b, 1, timeout=0.1, settle=0.05) == []
    assert all(np.array_equal(got, w) for got, w in zip(b_bufs, before, strict=True))


_THREADS_SCRIPT = r"""
import sys, threading
import numpy as np
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import create
from tests.support.transport_helpers.plans import PAGE, make_buffers, regions_of

threads, rounds, slots = int(sys.argv[1]), int(sys.argv[2]), 4
src, dst = make_buffers([threads * slots * PAGE], 3), make_buffers([threads * slots * PAGE], None)
a, b = create("nixl", "threads-a"), create("nixl", "threads-b")
a.register(regions_of(dst))
b.register(regions_of(src))
a.connect(b.name, b.metadata())
base_a, base_b = a.regions[0].base_address, b.regions[0].base_address
errors = []

def reads(t):
    # thread t reads source page (t*slots + (i+k) % slots) into its own slot k: every thread its own pages
    try:
        for i in range(rounds):
            pages = [t * slots + (i + k) % slots for k in range(slots)]
            here = [t * slots + k for k in range(slots)]
            n = np.full(slots, PAGE, np.uint64)
            plan = TransferPlan(PageTable(np.array([base_b + p * PAGE for p in pages], np.uint64), n,
                                          np.zeros(slots, np.uint32)),
                                PageTable(np.array([base_a + p * PAGE for p in here], np.uint64), n,
                                          np.zeros(slots, np.uint32)))
            a.read(b.name, plan).wait(20)
            for p, h in zip(pages, here):
                if not np.array_equal(dst[0][h * PAGE:(h + 1) * PAGE], src[0][p * PAGE:(p + 1) * PAGE]):
                    raise AssertionError(f"thread {t} round {i}: page {p} did not land in slot {h}")
    except Exception as exc:
        errors.append(repr(exc))

workers = [threading.Thread(target=reads, args=(t,)) for t in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
a.close()
b.close()
print("ERRORS", errors)
sys.exit(1 if errors else 0)
"""


def test_threads_sharing_one_agent_post_and_poll_at_once() -> None:
    """Several threads reading through one transport at once (a vLLM rank's concurrent receives, a worker's
    pushes) all land, bit for bit, and the process exits cleanly: NIXL's agent serializes its calls. (An
    agent left unsynchronized crashes this process or stalls its transfers.) Run in a child process, whose
    crash is this test's failure rather than the suite's end."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, "3", "1500"], cwd=root, capture_output=True,
                         text=True, timeout=240, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "ERRORS []" in out.stdout
