"""``kvxfer bench transport``: move N random pages between two processes and report GB/s next to a
memcpy of the same bytes and the raw backend (no kvxfer) in the same run.

Every column is the median over ``--iters`` timed iterations, and every timed iteration is verified:
before it (untimed) the destination pages are poisoned with a byte pattern that changes per
iteration, after it (untimed) the destination pages, read in plan order, must hash (blake3) to the
source pages' stream. A transfer that reported DONE early, moved nothing, or put a page in the wrong
place fails ``verified`` (exit status 1) instead of showing a rate.

The peer is a spawned process holding a pool of 2N slots; this process holds another. ``scattered``
picks N random slots on each side (one descriptor per page); ``consecutive`` uses N consecutive
slots on each side, which coalesce into one descriptor. Loopback runs both sides in this process.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import blake3
import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.cli.output import ms, print_json
from kvxfer.errors import BackendUnavailable
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import available_backends, create
from kvxfer.transport.base import Transport
from kvxfer.transport.copy import merge_adjacent
from kvxfer.transport.registry import host_backends
from kvxfer.transport.ucp_iov import iov_array, ucp_iov
from kvxfer.transport.ucx_env import apply_ucx_defaults

_ALIGN = 4096


def _pool(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    pool = raw[off:off + nbytes]
    pool[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return pool


def _slots(rng: np.random.Generator, pages: int, layout: str) -> npt.NDArray[np.uint64]:
    if layout == "consecutive":
        return np.arange(pages, dtype=np.uint64) + np.uint64(pages // 2)
    return rng.choice(2 * pages, size=pages, replace=False).astype(np.uint64)


def _plan(local: MemoryRegion, local_slots: npt.NDArray[np.uint64], remote: MemoryRegion,
          remote_slots: npt.NDArray[np.uint64], page_bytes: int) -> tuple[PageTable, PageTable]:
    """Local and remote tables, one entry per page, then pages adjacent on both sides merged (what
    the extractor's coalesce gives: consecutive slots become one descriptor)."""
    la = np.uint64(local.base_address) + local_slots * np.uint64(page_bytes)
    ra = np.uint64(remote.base_address) + remote_slots * np.uint64(page_bytes)
    la, ra, n = merge_adjacent(la, ra, np.full(la.size, page_bytes, dtype=np.uint64))
    zeros = np.zeros(la.size, dtype=np.uint32)
    return PageTable(la, n, zeros), PageTable(ra, n, zeros)


def pages_digest(pool: npt.NDArray[np.uint8], base: int, table: PageTable) -> bytes:
    """blake3 of the pages of ``table`` in table order (what a transfer must make equal on both sides)."""
    h = blake3.blake3()
    for a, n in zip((table.addr - np.uint64(base)).tolist(), table.nbytes.tolist(), strict=True):
        h.update(pool[a:a + n].data)
    return h.digest()


def poison_pages(pool: npt.NDArray[np.uint8], base: int, table: PageTable, value: int) -> None:
    """Fill the pages of ``table`` with ``value``."""
    for a, n in zip((table.addr - np.uint64(base)).tolist(), table.nbytes.tolist(), strict=True):
        pool[a:a + n] = value


class _RawUcxx:
    """Plain ucxx without kvxfer: one worker polled by ``progress()``, one endpoint to the other
    process (error handling off, as kvxfer does), a tagged message per page, one multi-buffer message
    per transfer, or one UCP scatter-gather message per transfer (the call kvxfer's ucx backend makes,
    without its protocol). Both processes of the benchmark hold one."""

    def __init__(self, error_handling: bool = True) -> None:
        apply_ucx_defaults()
        self.error_handling = error_handling   # same endpoint mode as the kvxfer transport measured
        from ucxx._lib import libucxx as api
        from ucxx._lib.arr import Array

        self.api: Any = api
        self.array: Any = Array
        self.context = api.UCXContext(feature_flags=(api.Feature.TAG,))
        self.worker = api.UCXWorker(self.context)
        self.address = bytes(self.worker.address.tobytes())
        self.endpoint: Any = None
        self.iov = ucp_iov()

    def connect(self, address: bytes) -> None:
        self.endpoint = self.worker.create_endpoint_from_worker_address(
            self.api.UCXAddress.create_from_buffer(address), self.error_handling)

    def arrays(self, pool: npt.NDArray[np.uint8], base: int, table: PageTable) -> list[Any]:
        view = pool.data
        offsets = (table.addr - np.uint64(base)).tolist()
        return [self.array(view[o:o + n]) for o, n in zip(offsets, table.nbytes.tolist(), strict=True)]

    def post_iov(self, kind: str, table: PageTable, tag: int) -> list[Any]:
        """Post one scatter-gather send or receive over the pages of ``table``."""
        iov = iov_array(table.addr, table.nbytes)
        if kind == "recv":
            return [self.iov.recv(self.worker.handle, iov, tag)]
        return [self.iov.send(self.endpoint.handle, iov, tag)]

    def post(self, kind: str, arrays: list[Any], tag: int) -> list[Any]:
        """Post one tagged send or receive per page (tags ``tag | i``), or one multi-buffer send."""
        if kind == "recv":
            return [self.worker.tag_recv(a, self.api.UCXXTag(tag | i)) for i, a in enumerate(arrays)]
        if kind == "send":
            return [self.endpoint.tag_send(a, self.api.UCXXTag(tag | i)) for i, a in enumerate(arrays)]
        return [self.endpoint.tag_send_multi(tuple(arrays), self.api.UCXXTag(tag))]

    def wait(self, requests: list[Any]) -> None:
        for req in requests:
            while not req.completed:
                self.worker.progress()
            req.check_error()

    def recv_multi(self, pool: npt.NDArray[np.uint8], base: int, table: PageTable, tag: int) -> None:
        """Receive one multi-buffer message (ucxx allocates its buffers) and copy it into the pages."""
        req = self.endpoint.tag_recv_multi(self.api.UCXXTag(tag))
        self.wait([req])
        offsets = (table.addr - np.uint64(base)).tolist()
        for o, n, buf in zip(offsets, table.nbytes.tolist(), req.py_buffers, strict=True):
            pool[o:o + n] = np.frombuffer(buf, dtype=np.uint8, count=n)


def _raw_peer_command(raw: _RawUcxx, pool: npt.NDArray[np.uint8], base: int, conn: Connection,
                      cmd: str, args: list[Any]) -> None:
    """The peer's half of one raw ucxx transfer; replies when its side completed."""
    table = PageTable(np.frombuffer(args[0], np.uint64), np.frombuffer(args[1], np.uint64),
                      np.zeros(len(args[0]) // 8, np.uint32))
    tag = int(args[2])
    if cmd == "raw_recv":  # local writes: receive each page straight into the pool
        requests = raw.post("recv", raw.arrays(pool, base, table), tag)
        conn.send("posted")
        raw.wait(requests)
    elif cmd == "raw_recv_multi":
        conn.send("posted")
        raw.recv_multi(pool, base, table, tag)
    elif cmd == "raw_recv_iov":
        requests = raw.post_iov("recv", table, tag)
        conn.send("posted")
        raw.wait(requests)
    elif cmd == "raw_send_iov":
        raw.wait(raw.post_iov("send", table, tag))
    else:  # local reads: it already posted its receives
        raw.wait(raw.post("send" if cmd == "raw_send" else "multi", raw.arrays(pool, base, table), tag))
    conn.send("done")


def _peer(conn: Connection, backend: str, nbytes: int, seed: int, options: dict[str, Any]) -> None:
    """The remote side: a transport over one seeded pool, answering byte-dump requests."""
    pool = _pool(nbytes, seed)
    transport = create(backend, "bench-peer", **options)
    region = MemoryRegion(int(pool.ctypes.data), nbytes)
    transport.register([region])
    conn.send(transport.metadata())
    raw: _RawUcxx | None = None
    # NIXL over UCX with peer-failure handling uses TCP even on one host, whose one-sided writes need the
    # target's worker to progress: asked for notifications every millisecond while idle, as a worker does.
    progress = backend == "nixl" and bool(options.get("error_handling")) and not options.get("progress_thread")
    while True:
        while progress and not conn.poll(0.001):
            transport.notifications()
        cmd, *args = conn.recv()
        if cmd == "connect":
            transport.connect(args[0], args[1])
            conn.send(None)
        elif cmd in ("poison", "digest"):
            table = PageTable(np.frombuffer(args[0], np.uint64), np.frombuffer(args[1], np.uint64),
                              np.zeros(len(args[0]) // 8, np.uint32))
            if cmd == "poison":
                poison_pages(pool, region.base_address, table, int(args[2]))
                conn.send(None)
            else:
                conn.send(pages_digest(pool, region.base_address, table))
        elif cmd == "raw_connect":
            raw = _RawUcxx(bool(options.get("error_handling", True)))
            raw.connect(args[0])
            conn.send(raw.address)
        elif cmd.startswith("raw_"):
            assert raw is not None
            _raw_peer_command(raw, pool, region.base_address, conn, cmd, args)
        elif cmd == "exit":
            transport.close()
            conn.send(None)
            return


class Verifier:
    """Poisons a transfer's destination pages before each timed iteration and checks them after it
    (both untimed) against the source pages' digest; counts the iterations that failed."""

    def __init__(self, poison: Callable[[int], object], digest: Callable[[], bytes], expected: bytes) -> None:
        """``poison(value)`` fills the destination pages; ``digest()`` hashes them in plan order; ``expected``
        is the source pages' digest."""
        self._fill, self._hash, self.expected = poison, digest, expected
        self.checked = 0
        self.failed = 0
        self._round = 0

    def before(self) -> None:
        """Poison the destination (a pattern that changes per iteration: stale bytes never pass)."""
        self._round += 1
        self._fill(0x5A ^ (self._round * 37 & 0xFF))

    def after(self) -> None:
        """Check the destination against the source."""
        self.checked += 1
        self.failed += self._hash() != self.expected


def median_timed(fn: Any, iters: int, verify: Verifier | None = None) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after one warm-up; with ``verify``, every run (the
    warm-up too) is preceded by poisoning its destination and followed by checking it, outside the timing."""
    if verify is not None:
        verify.before()
    fn()
    if verify is not None:
        verify.after()
    times = []
    for _ in range(iters):
        if verify is not None:
            verify.before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if verify is not None:
            verify.after()
    return statistics.median(times)


def _raw_nixl(transport: Transport, peer: str, op: str, plan: TransferPlan) -> Any:
    """NIXL with the plan's own descriptors prepared once: the same READ/WRITE without kvxfer."""
    agent = transport._agent  # type: ignore[attr-defined]
    local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
    zeros = np.zeros(len(plan), dtype=np.uint64)
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack([local.addr, local.nbytes, zeros], 1), "DRAM")
    rh = agent.prep_xfer_dlist(peer, np.stack([remote.addr, remote.nbytes, zeros], 1), "DRAM")
    idx = np.arange(len(plan), dtype=np.int32)

    def run() -> None:
        req = agent.make_prepped_xfer(op.upper(), lh, idx, rh, idx, b"")
        state = agent.transfer(req)
        while state == "PROC":
            state = agent.check_xfer_state(req)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {op} failed: {state}")
        req.release()

    return run


RAW_UCX_WAYS = ("tag_per_page", "tag_multi", "ucp_iov")


def _raw_ucxx(conn: Connection, local_pool: npt.NDArray[np.uint8], local_base: int, mode: str,
              plan: TransferPlan, way: str, error_handling: bool = True) -> Any:
    """Plain ucxx moving the plan's pages between the two processes, the receiver posting first:
    a tagged message per page, one ``tag_send_multi`` whose receiver copies the buffers ucxx
    allocated into the pages, or one UCP scatter-gather message (``way``, one of RAW_UCX_WAYS).
    The pipe only orders the two sides."""
    raw = _RawUcxx(error_handling)
    conn.send(("raw_connect", raw.address))
    raw.connect(conn.recv())
    local, remote = (plan.src, plan.dst) if mode == "write" else (plan.dst, plan.src)
    remote_runs = (remote.addr.tobytes(), remote.nbytes.tobytes())
    tags = itertools.count(1)

    multi = way == "tag_multi"

    def run() -> None:
        tag = next(tags) << 32
        if way == "ucp_iov" and mode == "write":
            conn.send(("raw_recv_iov", *remote_runs, tag))
            assert conn.recv() == "posted"
            raw.wait(raw.post_iov("send", local, tag))
        elif way == "ucp_iov":
            requests = raw.post_iov("recv", local, tag)
            conn.send(("raw_send_iov", *remote_runs, tag))
            raw.wait(requests)
        elif mode == "write":
            conn.send(("raw_recv_multi" if multi else "raw_recv", *remote_runs, tag))
            assert conn.recv() == "posted"
            raw.wait(raw.post("multi" if multi else "send", raw.arrays(local_pool, local_base, local), tag))
        elif multi:
            conn.send(("raw_send_multi", *remote_runs, tag))
            raw.recv_multi(local_pool, local_base, local, tag)
        else:
            requests = raw.post("recv", raw.arrays(local_pool, local_base, local), tag)
            conn.send(("raw_send", *remote_runs, tag))
            raw.wait(requests)
        assert conn.recv() == "done"

    return run


class _Pair:
    """This process's transport over one pool and the peer it is connected to: a spawned process over a
    pool of its own (answering poison/digest requests over a pipe), or, for loopback, a second transport
    of this process."""

    def __init__(self, backend: str, nbytes: int, options: dict[str, Any]) -> None:
        reason = available_backends().get(backend, f"unknown backend {backend!r}")
        if reason is not None:
            raise BackendUnavailable(f"backend {backend!r}: {reason}")
        self.backend, self.options = backend, options
        self.local_pool = _pool(nbytes, 1)
        self.local = create(backend, "bench-local", **options)
        self.local_region = MemoryRegion(int(self.local_pool.ctypes.data), nbytes)
        self.local.register([self.local_region])
        self.proc: Any = None
        self.conn: Connection | None = None
        self.remote: Transport | None = None
        try:
            if backend == "loopback":
                self.peer_pool = _pool(nbytes, 2)
                self.remote = create(backend, "bench-peer", **options)
                self.remote.register([MemoryRegion(int(self.peer_pool.ctypes.data), nbytes)])
                self.local.connect("bench-peer", self.remote.metadata())
                self.remote.connect("bench-local", self.local.metadata())
            else:
                ctx = mp.get_context("spawn")
                self.conn, child = ctx.Pipe()
                proc = ctx.Process(target=_peer, args=(child, backend, nbytes, 2, options), daemon=True)
                proc.start()
                self.proc = proc
                self.local.connect("bench-peer", self.conn.recv())
                self.conn.send(("connect", "bench-local", self.local.metadata()))
                self.conn.recv()
        except BaseException:
            self.close()
            raise
        self.peer_region = self.local.peer_regions("bench-peer")[0]

    def remote_poison(self, table: PageTable, value: int) -> None:
        """Fill the peer's pages of ``table`` with ``value``."""
        if self.conn is None:
            poison_pages(self.peer_pool, self.peer_region.base_address, table, value)
        else:
            _ask(self.conn, "poison", table, value)

    def remote_digest(self, table: PageTable) -> bytes:
        """The digest of the peer's pages of ``table`` in table order."""
        if self.conn is None:
            return pages_digest(self.peer_pool, self.peer_region.base_address, table)
        return bytes(_ask(self.conn, "digest", table))

    def close(self) -> None:
        """Stop the peer process (or transport) and close this one."""
        if self.conn is not None and self.proc is not None:
            self.conn.send(("exit",))
            self.conn.poll(10)
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        self.local.close()
        if self.remote is not None:
            self.remote.close()


def run_bench(backend: str, pages: int, page_bytes: int, mode: str, layout: str = "scattered",
              iters: int = 5, options: dict[str, Any] | None = None, with_raw: bool = True) -> dict[str, Any]:
    """Measure one configuration; returns the JSON object ``--json`` prints. ``options`` go to
    ``create`` on both sides (e.g. ``scatter_gather=False`` for ucx); ``with_raw=False`` skips the raw
    backend's column."""
    options = dict(options or {})
    nbytes = 2 * pages * page_bytes
    rng = np.random.default_rng(1234)
    pair = _Pair(backend, nbytes, options)
    local, conn, local_pool, local_region = pair.local, pair.conn, pair.local_pool, pair.local_region
    try:
        peer_region = pair.peer_region
        local_t, remote_t = _plan(local_region, _slots(rng, pages, layout), peer_region,
                                  _slots(rng, pages, layout), page_bytes)
        plan = TransferPlan(local_t, remote_t) if mode == "write" else TransferPlan(remote_t, local_t)

        def kvxfer_op() -> None:
            getattr(local, mode)("bench-peer", plan).wait(60.0)

        lbase = local_region.base_address
        if mode == "write":   # local pages -> the peer's
            verifier = Verifier(lambda v: pair.remote_poison(remote_t, v), lambda: pair.remote_digest(remote_t),
                                pages_digest(local_pool, lbase, local_t))
        else:
            verifier = Verifier(lambda v: poison_pages(local_pool, lbase, local_t, v),
                                lambda: pages_digest(local_pool, lbase, local_t), pair.remote_digest(remote_t))

        t_kvxfer = median_timed(kvxfer_op, iters, verifier)

        src = np.random.default_rng(3).integers(0, 256, pages * page_bytes, dtype=np.uint8)
        dst = np.empty_like(src)
        src_digest = blake3.blake3(src.data).digest()
        memcpy_check = Verifier(lambda v: dst.fill(v), lambda: blake3.blake3(dst.data).digest(), src_digest)
        t_memcpy = median_timed(lambda: np.copyto(dst, src), iters, memcpy_check)

        total = pages * page_bytes
        t_raw: float | None = None
        raw_ways: dict[str, float] = {}
        checks = [verifier, memcpy_check]
        if backend == "nixl" and with_raw:
            t_raw = median_timed(_raw_nixl(local, "bench-peer", mode, plan), iters, verifier)
        elif backend == "ucx" and with_raw:
            assert conn is not None
            for way in RAW_UCX_WAYS:
                raw_ways[way] = total / median_timed(_raw_ucxx(conn, local_pool, lbase, mode, plan, way,
                                                         bool(options.get("error_handling", True))),
                                               iters, verifier) / 1e9
            t_raw = total / max(raw_ways.values()) / 1e9
        verified = all(c.failed == 0 for c in checks)
        return {
            "backend": backend, "options": options, "mode": mode, "layout": layout, "pages": pages, "page_bytes": page_bytes,
            "bytes": total, "descriptors": len(plan), "verified": bool(verified), "iters": iters,
            "verified_iterations": sum(c.checked for c in checks), "failed_iterations": sum(c.failed for c in checks),
            "verification": "destination poisoned before and blake3-checked against the source after every "
                            "timed iteration of every column (untimed); rates are medians over the iterations",
            "seconds": t_kvxfer, "gbps": total / t_kvxfer / 1e9,
            "memcpy_gbps": total / t_memcpy / 1e9,
            "raw_gbps": None if t_raw is None else total / t_raw / 1e9,
            "raw_ways_gbps": raw_ways,
            "raw": {"nixl": "NIXL make_prepped_xfer over the plan's own descriptors, prepared once",
                    "ucx": "best of plain ucxx (receiver posts first, busy progress): a tagged message per "
                           "page, one tag_send_multi (receiver copies ucxx's buffers into the pages), or one "
                           "UCP scatter-gather message on the ucxx worker",
                    "loopback": "none: loopback is itself an in-process copy"}[backend],
        }
    finally:
        pair.close()


class _RawNixlPages:
    """NIXL through its own agent, as a serving engine drives it: both pools cut into pages and their
    descriptor lists prepared once; a transfer is ``make_prepped_xfer`` over the pages' indices, posted
    and polled to completion back to back."""

    def __init__(self, transport: Transport, peer: str, local: MemoryRegion, remote: MemoryRegion,
                 page_bytes: int) -> None:
        self.agent: Any = transport._agent  # type: ignore[attr-defined]

        def dlist(region: MemoryRegion) -> npt.NDArray[np.uint64]:
            count = region.nbytes // page_bytes
            addr = np.uint64(region.base_address) + np.arange(count, dtype=np.uint64) * np.uint64(page_bytes)
            return np.stack([addr, np.full(count, page_bytes, np.uint64), np.zeros(count, np.uint64)], 1)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", dlist(local), "DRAM")
        self.remote = self.agent.prep_xfer_dlist(peer, dlist(remote), "DRAM")

    def post(self, op: str, local_pages: Any, remote_pages: Any) -> Any:
        """Make and post one request over the pages (index lists or int32 arrays)."""
        req = self.agent.make_prepped_xfer(op, self.local, local_pages, self.remote, remote_pages, b"")
        if self.agent.transfer(req) == "ERR":
            raise RuntimeError("raw NIXL refused the transfer")
        return req

    def wait(self, req: Any) -> None:
        """Poll ``req`` to completion back to back, then release it."""
        state = self.agent.check_xfer_state(req)
        while state == "PROC":
            state = self.agent.check_xfer_state(req)
        req.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer failed: {state}")

    def close(self) -> None:
        self.local.release()
        self.remote.release()


def run_post_latency(backend: str, page_bytes: int = 16384, iters: int = 200, post_pages: int = 4096,
                     post_iters: int = 9, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-request plans, as a serving engine builds them: every iteration builds a new TransferPlan over
    random pages (outside the timing) and times ``write(plan).wait()`` of one ``page_bytes`` page, and
    ``write(plan)`` alone (the post) of ``post_pages`` scattered pages. With nixl, raw NIXL (its agent,
    the pools' descriptor lists prepared once, ``make_prepped_xfer`` + ``transfer`` + polling) runs the
    same pages interleaved with kvxfer's iterations, the order alternating (kvxfer then raw, raw then
    kvxfer: the second finds the pages in cache), so both see the same machine. Every timed iteration's destination is poisoned before and checked after (untimed).
    Returns medians in seconds and the ratios kvxfer / raw."""
    options = dict(options or {})
    slots = 2 * max(post_pages, 64)
    pair = _Pair(backend, slots * page_bytes, options)
    local, lbase, pbase = pair.local, pair.local_region.base_address, pair.peer_region.base_address
    rng = np.random.default_rng(99)
    raw = _RawNixlPages(local, "bench-peer", pair.local_region, pair.peer_region, page_bytes) \
        if backend == "nixl" else None
    checked = failed = 0

    def tables(count: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], PageTable, PageTable]:
        ls = rng.choice(slots, size=count, replace=False).astype(np.int64)
        rs = rng.choice(slots, size=count, replace=False).astype(np.int64)
        nb, zeros = np.full(count, page_bytes, np.uint64), np.zeros(count, np.uint32)
        lt = PageTable(np.uint64(lbase) + ls.astype(np.uint64) * np.uint64(page_bytes), nb, zeros)
        rt = PageTable(np.uint64(pbase) + rs.astype(np.uint64) * np.uint64(page_bytes), nb.copy(), zeros.copy())
        return ls, rs, lt, rt

    def verified(lt: PageTable, rt: PageTable, value: int, timed: Callable[[], float]) -> float:
        nonlocal checked, failed
        pair.remote_poison(rt, value)
        seconds = timed()
        checked += 1
        failed += pair.remote_digest(rt) != pages_digest(pair.local_pool, lbase, lt)
        return seconds

    def kvxfer_page(lt: PageTable, rt: PageTable) -> float:
        plan = TransferPlan(lt, rt)
        t0 = time.perf_counter()
        local.write("bench-peer", plan).wait(10.0)
        return time.perf_counter() - t0

    def kvxfer_post(lt: PageTable, rt: PageTable) -> float:
        plan = TransferPlan(lt, rt)
        t0 = time.perf_counter()
        handle = local.write("bench-peer", plan)
        seconds = time.perf_counter() - t0
        handle.wait(60.0)
        return seconds

    def raw_page(ls: list[int], rs: list[int]) -> float:
        assert raw is not None
        t0 = time.perf_counter()
        raw.wait(raw.post("WRITE", ls, rs))
        return time.perf_counter() - t0

    def raw_post(ls: npt.NDArray[np.int32], rs: npt.NDArray[np.int32]) -> float:
        assert raw is not None
        t0 = time.perf_counter()
        req = raw.post("WRITE", ls, rs)
        seconds = time.perf_counter() - t0
        raw.wait(req)
        return seconds

    page: dict[str, list[float]] = {"kvxfer": [], "raw": []}
    post: dict[str, list[float]] = {"kvxfer": [], "raw": []}
    try:
        # Both run the same pages; which goes first alternates, so neither always finds them in cache.
        for i in range(iters + 5):   # the first 5 warm both paths up (their figures are dropped)
            ls, rs, lt, rt = tables(1)
            runs = [("kvxfer", lambda: kvxfer_page(lt, rt))]   # noqa: B023
            if raw is not None:
                runs.append(("raw", lambda: raw_page(ls.tolist(), rs.tolist())))   # noqa: B023
            for k, (who, fn) in enumerate(runs[::-1] if i % 2 else runs):
                t = verified(lt, rt, 0x11 + k + i % 200, fn)
                if i >= 5:
                    page[who].append(t)
        for i in range(post_iters + 1):
            ls, rs, lt, rt = tables(post_pages)
            runs = [("kvxfer", lambda: kvxfer_post(lt, rt))]   # noqa: B023
            if raw is not None:
                runs.append(("raw", lambda: raw_post(ls.astype(np.int32), rs.astype(np.int32))))   # noqa: B023
            for k, (who, fn) in enumerate(runs[::-1] if i % 2 else runs):
                t = verified(lt, rt, 0x21 + k + i % 200, fn)
                if i:
                    post[who].append(t)
    finally:
        if raw is not None:
            raw.close()
        pair.close()
    med = {f"{what}_{who}_s": (statistics.median(times[who]) if times[who] else None)
           for what, times in (("page", page), ("post", post)) for who in ("kvxfer", "raw")}

    def ratio(what: str) -> float | None:
        k, r = med[f"{what}_kvxfer_s"], med[f"{what}_raw_s"]
        return None if k is None or r is None else k / r
    return {"backend": backend, "options": options, "page_bytes": page_bytes, "iters": iters,
            "post_pages": post_pages, "post_iters": post_iters, **med,
            "page_ratio": ratio("page"), "post_ratio": ratio("post"),
            "verified": checked > 0 and failed == 0, "verified_iterations": checked, "failed_iterations": failed}


#: The rows of ``--table``: (pages, page bytes, mode), scattered pages, one descriptor per page.
TABLE_ROWS = ((4096, 16384, "write"), (256, 1 << 20, "read"), (64, 4 << 20, "write"))


def run_table(iters: int = 5, latency_iters: int = 200, backends: tuple[str, ...] = ("nixl", "ucx"),
              options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every row of the transport table for each backend, raw NIXL (its own agent, descriptor lists
    prepared once) measured in the nixl runs themselves: bandwidth of scattered pages (``TABLE_ROWS``),
    the one-page ``write(plan).wait()`` p50 and the 4096-descriptor post (``run_post_latency``: a new plan
    every iteration), every timed iteration verified. No ``prepare``: every kvxfer post does its plan's
    whole work again (the bandwidth rows post one plan object, which kvxfer keeps nothing of). Each
    backend keeps its defaults unless ``options`` names some for it (``create`` options; for nixl they
    apply to raw NIXL too, which runs on the same agent)."""
    usable = [b for b in backends if available_backends().get(b, "unknown") is None]
    opts = options or {}
    rows: list[dict[str, Any]] = []
    for pages, page_bytes, mode in TABLE_ROWS:
        row: dict[str, Any] = {"what": f"{pages} x {_size(page_bytes)} {mode}, GB/s", "unit": "GB/s"}
        for backend in usable:
            res = run_bench(backend, pages, page_bytes, mode, "scattered", iters, opts.get(backend),
                            with_raw=backend == "nixl")
            row[backend] = res["gbps"]
            row[f"{backend}_verified"] = res["verified"]
            if backend == "nixl":
                row["raw_nixl"] = res["raw_gbps"]
        rows.append(row)
    lat = {b: run_post_latency(b, iters=latency_iters, options=opts.get(b)) for b in usable}
    for key, label in (("page", "one 16 KiB page write+wait, p50, us"), ("post", "4096-descriptor post, p50, us")):
        row = {"what": label, "unit": "us"}
        for backend, res in lat.items():
            row[backend] = res[f"{key}_kvxfer_s"] * 1e6
            row[f"{backend}_verified"] = res["verified"]
            if backend == "nixl":
                row["raw_nixl"] = res[f"{key}_raw_s"] * 1e6
        rows.append(row)
    return {"backends": usable, "iters": iters, "latency_iters": latency_iters, "options": opts, "rows": rows,
            "verified": all(v for r in rows for k, v in r.items() if k.endswith("_verified"))}


def run_chunks(entries: list[int], iters: int = 300) -> list[dict[str, Any]]:
    """The layer-wise path's posts: per count in ``entries``, ``write(plan)`` alone of that many scattered
    16 KiB pages over one pool a side (a layer chunk's shape), a new plan each iteration, against raw NIXL
    posting the same pages (``run_post_latency``, interleaved, every iteration verified)."""
    rows = []
    for n in entries:
        res = run_post_latency("nixl", iters=0, post_pages=n, post_iters=iters)
        rows.append({"entries": n, "kvxfer_us": res["post_kvxfer_s"] * 1e6, "raw_nixl_us": res["post_raw_s"] * 1e6,
                     "ratio": res["post_ratio"], "verified": res["verified"]})
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def print_table(table: dict[str, Any]) -> None:
    """The table ``run_table`` measured: raw NIXL, then each backend with its ratio to raw NIXL (for
    GB/s a ratio above 1 is faster, for microseconds below 1 is)."""
    cols = table["backends"]
    print(f"{'':40} {'raw NIXL':>10} " + " ".join(f"{'kvxfer ' + b:>22}" for b in cols))
    for row in table["rows"]:
        raw = row.get("raw_nixl")
        cells = []
        for b in cols:
            value = row.get(b)
            ratio = "" if raw is None or value is None else f" ({value / raw:.2f}x)"
            cells.append(f"{'-' if value is None else f'{value:.2f}'}{ratio}".rjust(22))
        print(f"{row['what']:40} {'-' if raw is None else f'{raw:.2f}':>10} " + " ".join(cells))
    print(f"every timed iteration verified: {table['verified']} (medians; raw NIXL measured in the nixl runs)")
    if table.get("options"):
        print(f"options: {table['options']}")


def _ask(conn: Connection | None, cmd: str, table: PageTable, *extra: int) -> Any:
    """Ask the peer process to ``poison`` or ``digest`` the pages of ``table`` in its pool."""
    assert conn is not None
    conn.send((cmd, table.addr.tobytes(), table.nbytes.tobytes(), *extra))
    return conn.recv()


def json_view(res: dict[str, Any]) -> dict[str, Any]:
    """``run_bench``'s figures with explicit units: ``..._gb_per_s`` (GB/s, 1e9 bytes) and ``median_ms``."""
    out = {k: v for k, v in res.items() if k not in ("gbps", "memcpy_gbps", "raw_gbps", "raw_ways_gbps", "seconds")}
    return out | {"median_ms": ms(res["seconds"]), "gb_per_s": res["gbps"], "memcpy_gb_per_s": res["memcpy_gbps"],
                  "raw_gb_per_s": res["raw_gbps"], "raw_ways_gb_per_s": res["raw_ways_gbps"]}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvxfer bench transport``; returns the process exit status."""
    ap = argparse.ArgumentParser(prog="kvxfer bench transport", description=__doc__)
    ap.add_argument("--backend", choices=host_backends(), default="loopback",
                    help="host-memory transports (GPU pools: benchmarks/bench_gpu.py)")
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--page-bytes", type=int, default=16384)
    ap.add_argument("--mode", choices=("read", "write"), default="write")
    ap.add_argument("--layout", choices=("scattered", "consecutive"), default="scattered")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--no-scatter-gather", action="store_true",
                    help="ucx: one UCX message per run instead of one scatter-gather message per transfer")
    ap.add_argument("--no-error-handling", action="store_true",
                    help="ucx: endpoints without peer-failure handling (faster on one host; a dead peer may "
                         "abort the process)")
    ap.add_argument("--no-rma", action="store_true",
                    help="ucx: the two-sided tag protocol only (no one-sided puts/gets)")
    ap.add_argument("--error-handling", action="store_true",
                    help="nixl: UCX endpoints with peer-failure handling (ucx_error_handling_mode=peer)")
    ap.add_argument("--progress-thread", action="store_true", help="nixl: run NIXL's own progress thread")
    ap.add_argument("--table", action="store_true",
                    help="the transport table: nixl and ucx against raw NIXL over scattered pages (4096 x 16 KiB "
                         "write, 256 x 1 MiB read, 64 x 4 MiB write), the one-page write+wait p50 and the "
                         "4096-descriptor post, per-request plans; --iters per bandwidth row; with it "
                         "--no-error-handling / --no-rma apply to ucx, --error-handling / --progress-thread to "
                         "nixl and raw NIXL")
    ap.add_argument("--latency-iters", type=int, default=200, help="--table: one-page iterations; --chunks: "
                                                                      "iterations per count")
    ap.add_argument("--chunks", metavar="N,N,...",
                    help="nixl: the post (write() alone) of layer chunks of N scattered 16 KiB pages against raw "
                         "NIXL's, per N (e.g. 2,16,64,256)")
    args = ap.parse_args(argv)
    if args.chunks:
        try:
            counts = [int(x) for x in args.chunks.split(",")]
        except ValueError:
            ap.error(f"--chunks: comma-separated counts, got {args.chunks!r}")
        if not counts or min(counts) < 1 or args.latency_iters < 1:
            ap.error("--chunks counts and --latency-iters must be >= 1")
        try:
            rows = run_chunks(counts, args.latency_iters)
        except BackendUnavailable as exc:
            print(f"kvxfer bench transport: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print_json("bench.transport_chunks", {"iters": args.latency_iters, "rows": rows})
        else:
            print(f"layer chunks, write() alone, p50 of {args.latency_iters} (new plan each, verified)")
            print(f"{'entries':>8} {'raw NIXL us':>12} {'kvxfer us':>10} {'ratio':>6} verified")
            for r in rows:
                print(f"{r['entries']:>8} {r['raw_nixl_us']:>12.1f} {r['kvxfer_us']:>10.1f} {r['ratio']:>6.2f} "
                      f"{r['verified']}")
        return 0 if all(r["verified"] for r in rows) else 1
    if args.table:
        if args.no_scatter_gather:
            ap.error("--no-scatter-gather does not apply to --table")
        per_backend: dict[str, dict[str, Any]] = {}
        if args.no_error_handling:
            per_backend["ucx"] = {"error_handling": False}
        if args.no_rma:
            per_backend.setdefault("ucx", {})["rma"] = False
        if args.error_handling or args.progress_thread:
            per_backend["nixl"] = {k: True for k, on in (("error_handling", args.error_handling),
                                                         ("progress_thread", args.progress_thread)) if on}
        table = run_table(args.iters, args.latency_iters, options=per_backend)
        if args.json:
            print_json("bench.transport_table", table)
        else:
            print_table(table)
        return 0 if table["verified"] else 1
    if args.pages <= 0 or args.page_bytes <= 0 or args.iters <= 0:
        ap.error("--pages, --page-bytes and --iters must be > 0")
    try:
        options: dict[str, Any] = {}
        if args.no_scatter_gather:
            options["scatter_gather"] = False
        if args.no_error_handling:
            options["error_handling"] = False
        if args.no_rma:
            options["rma"] = False
        if options and args.backend != "ucx":
            ap.error("--no-scatter-gather / --no-error-handling / --no-rma apply to --backend ucx only")
        if (args.error_handling or args.progress_thread) and args.backend != "nixl":
            ap.error("--error-handling / --progress-thread apply to --backend nixl only")
        if args.error_handling:
            options["error_handling"] = True
        if args.progress_thread:
            options["progress_thread"] = True
        res = run_bench(args.backend, args.pages, args.page_bytes, args.mode, args.layout, args.iters, options)
    except BackendUnavailable as exc:
        print(f"kvxfer bench transport: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json("bench.transport", json_view(res))
    else:
        raw = "-" if res["raw_gbps"] is None else f"{res['raw_gbps']:.2f}"
        print(f"median of {res['iters']} iterations each; every timed iteration verified "
              f"({res['verified_iterations']} checks, {res['failed_iterations']} failed)")
        print(f"{'backend':9} {'mode':5} {'layout':11} {'pages':>6} {'page_B':>7} {'descs':>6} "
              f"{'GB/s':>7} {'memcpy':>7} {'raw':>7} verified")
        print(f"{res['backend']:9} {res['mode']:5} {res['layout']:11} {res['pages']:>6} {res['page_bytes']:>7} "
              f"{res['descriptors']:>6} {res['gbps']:>7.2f} {res['memcpy_gbps']:>7.2f} {raw:>7} {res['verified']}")
    return 0 if res["verified"] else 1
