"""GPU transfer benchmark: two processes sharing one GPU, Llama-3-8B-shaped requests.

One run measures, with the same statistic (the median) in every column:
- D2D: the device-to-device copy limit (1 GiB ``copy_``, bytes copied / time, CUDA events),
  "D2D wall": one ``copy_`` of each case's bytes timed as kvxfer is (host clock, launch to synchronize),
  back to back, and "D2D in place": the same ``copy_`` timed inside the same loop as every post (after
  the same poisoning, before the same verification: the other process's GPU work and cold host caches
  cost it too, H200: 512 MiB back to back 266-282 us, in place 273-465 us);
- torch: an in-process torch copy of the same whole slots (``dst[idx_d] = src[idx_s]``);
- each kvxfer backend given (``--backends``), for identical layouts and TP 1->2, push and pull; with
  cuda_ipc also "cuda_ipc_blocks": the same transfers posted as BlockPlans (``plan_blocks``: one run
  template + slot pairs, whose addresses the kernel forms on the GPU);
- "cuda_ipc_prep" and "nixl_prep": the same plans prepared once per case (``Transport.prepare``: checked;
  cuda_ipc's kernel table packed and uploaded; nixl's requests made, as raw NIXL's lists are prepared once),
  one ``post`` per iteration (nixl reposts its requests, NIXL's prepared-request model);
- raw NIXL (``--raw-nixl``): NIXL's own agent in both processes, descriptor lists prepared once per
  case (``prep_xfer_dlist``), one ``make_prepped_xfer`` + ``transfer`` per iteration;
- the latency of one ``write(plan).wait()`` of 1, 4 and 16 blocks (p50) against the torch copy.

The columns of a case are interleaved (iteration i times each once, starting at column i), so that drift
of the machine reaches them alike; every iteration's time is kept in the JSON. Every timed iteration is
checked: the destination pages are poisoned before it and verified after it against a pattern that
encodes each element's logical position (layer, role, token, head, dim), computed independently in the
process that owns the destination.

  python benchmarks/bench_gpu.py --backends cuda_ipc nixl --raw-nixl --tokens 4096 32768 --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from kvxfer.cache import BufferId, CacheConfig, CacheLayoutDesc, KVCacheManager
from kvxfer.cache.memory import MemoryRegion
from kvxfer.extractor import plan_blocks, plan_templated, plan_transfer
from kvxfer.pagetable import BlockPlan, PageTable, PhasedPlan, TransferPlan
from kvxfer.pagetable.relayout import landing_plan
from kvxfer.transport import create
from kvxfer.transport import nixl as nixl_backend
from kvxfer.transport.relayout import read_relayout

LAYERS, KV_HEADS, HEAD_DIM, TPB = 32, 8, 128, 32
ROLES = ("key", "value")
PEER = "peer"
LOCAL = "local"


# --- the position pattern ----------------------------------------------------------------------------
def pattern(layer: int, role: int, ntokens: int, heads: tuple[int, int], order: str, device: str,
            tpb: int = TPB) -> torch.Tensor:
    """int16 words of (layer, role, token, head, dim) for tokens ``[0, ntokens)`` and global heads
    ``heads``, shaped like ``buffer_view`` rows (blocks, heads, tokens, dim) or (blocks, tokens, heads, dim)
    of ``tpb`` tokens per block."""
    tok = torch.arange(ntokens, device=device, dtype=torch.int64).view(-1, 1, tpb, 1)
    head = torch.arange(heads[0], heads[1], device=device, dtype=torch.int64).view(1, -1, 1, 1)
    dim = torch.arange(HEAD_DIM, device=device, dtype=torch.int64).view(1, 1, 1, -1)
    key = (((layer * 2 + role) << 20) + tok) * KV_HEADS + head
    words = (key * 40503 + (key >> 13) * 7 + dim * 9973) & 0xFFFF
    if order != "HND":
        words = words.transpose(1, 2)
    return words.to(torch.int16)


def _views(m: KVCacheManager) -> list[tuple[int, int, torch.Tensor, tuple[int, int], str]]:
    out = []
    for layer in range(LAYERS):
        for r, role in enumerate(ROLES):
            fmt = m.layout.format_of(BufferId(layer, role))
            out.append((layer, r, m.buffer_view(layer, role).view(torch.int16),
                        (fmt.head_start, fmt.head_start + fmt.num_heads), fmt.order))
    return out


def fill(m: KVCacheManager, blocks: np.ndarray, poison: bool = False) -> None:
    """Write the pattern (or its bitwise complement: every element differs) into ``blocks``."""
    idx = torch.as_tensor(blocks, device=m.device, dtype=torch.long)
    tpb = m.layout.tokens_per_block
    for layer, r, view, heads, order in _views(m):
        want = pattern(layer, r, len(blocks) * tpb, heads, order, str(m.device), tpb)
        view[idx] = torch.bitwise_not(want) if poison else want
    sync(m.device)


def mismatches(m: KVCacheManager, blocks: np.ndarray) -> int:
    """Elements of ``blocks`` that differ from the pattern (0: every byte arrived where it belongs)."""
    idx = torch.as_tensor(blocks, device=m.device, dtype=torch.long)
    bad = torch.zeros((), dtype=torch.int64, device=m.device)
    tpb = m.layout.tokens_per_block
    for layer, r, view, heads, order in _views(m):
        bad += (view[idx] != pattern(layer, r, len(blocks) * tpb, heads, order, str(m.device), tpb)).sum()
    return int(bad)


# --- set-up ------------------------------------------------------------------------------------------
#: The layout changes of ``--layouts``: (case, [(source manager, destination manager), ...]).
LAYOUT_CASES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("tpb32->16", (("prefill", "tpb16"),)),
    ("tpb32->64", (("prefill", "tpb64"),)),
    ("HND->NHD", (("prefill", "nhd"),)),
    ("tp1->2+32->16", (("prefill", "tp2r0_tpb16"), ("prefill", "tp2r1_tpb16"))),
    ("tp2->1+32->64", (("rank0", "tpb64"), ("rank1", "tpb64"))),
)
#: The extra managers of ``--layouts``: name -> (tokens per block, CacheConfig options).
LAYOUT_MANAGERS: dict[str, tuple[int, dict[str, Any]]] = {
    "tpb16": (16, {}), "tpb64": (64, {}), "nhd": (TPB, {"head_order": "NHD"}),
    "tp2r0_tpb16": (16, {"tp_size": 2, "tp_rank": 0}), "tp2r1_tpb16": (16, {"tp_size": 2, "tp_rank": 1}),
}


def managers(blocks: int, device: str, layouts: bool = False) -> dict[str, KVCacheManager]:
    """prefill (TP 1), decode (TP 1), and the two ranks of a TP-2 decode; with ``layouts`` also the
    destinations of ``LAYOUT_CASES`` (other tokens per block, NHD, both combined with TP 2), each with
    room for the same tokens."""
    tokens = blocks * TPB

    def make(tpb: int = TPB, **kw: Any) -> KVCacheManager:
        return KVCacheManager(CacheConfig.for_model(LAYERS, KV_HEADS, HEAD_DIM, tpb, "bfloat16",
                                                    -(-tokens // tpb) + 8, device=device, **kw))
    out = {"prefill": make(), "decode": make(), "rank0": make(tp_size=2, tp_rank=0),
           "rank1": make(tp_size=2, tp_rank=1)}
    if layouts:
        out.update({name: make(tpb, **kw) for name, (tpb, kw) in LAYOUT_MANAGERS.items()})
    return out


def region_offsets(mgrs: dict[str, KVCacheManager]) -> dict[str, int]:
    out, n = {}, 0
    for name, m in mgrs.items():
        out[name] = n
        n += len(m.memory_regions())
    return out


def transport_options(backend: str) -> dict[str, Any]:
    """Backend options from the environment (KVXFER_NIXL_THREADS: UCX worker threads of NIXL)."""
    threads = int(os.environ.get("KVXFER_NIXL_THREADS", "0"))
    return {"num_threads": threads} if backend == "nixl" and threads else {}


def raw_nixl_agent(name: str, mgrs: dict[str, KVCacheManager]) -> Any:
    """NIXL's own agent (its default UCX configuration, KVXFER_NIXL_THREADS threads) over every pool."""
    site = os.environ.get("KVXFER_SITE_NIXL")
    if site and site not in sys.path:
        sys.path.insert(0, site)
    from kvxfer.transport.ucx_env import load_nixl_api
    api = load_nixl_api()
    threads = int(os.environ.get("KVXFER_NIXL_THREADS", "0"))
    agent = api.nixl_agent(name, api.nixl_agent_config(num_threads=threads))
    regions = [r for m in mgrs.values() for r in m.memory_regions()]
    agent.register_memory([(r.base_address, r.nbytes, r.device_id, "") for r in regions], _mem(regions[0].memory_kind))
    return agent


def _mem(kind: str) -> str:
    return "VRAM" if kind == "cuda" else "DRAM"


def peer_main(conn: Any, backends: list[str], raw: bool, blocks: int, device: str, layouts: bool = False) -> None:
    """The other process: the same managers and transports, answering commands."""
    mgrs = managers(blocks, device, layouts)
    ts = {b: create(b, f"{PEER}-{b}", **transport_options(b)) for b in backends}
    regions = [r for m in mgrs.values() for r in m.memory_regions()]
    for t in ts.values():
        t.register(regions)
    agent = raw_nixl_agent(f"{PEER}-raw", mgrs) if raw else None
    conn.send(({k: m.layout.to_msgpack() for k, m in mgrs.items()}, {b: t.metadata() for b, t in ts.items()},
               agent.get_agent_metadata() if agent is not None else None))
    while True:
        cmd, *args = conn.recv()
        if cmd == "connect":
            ts[args[0]].connect(args[1], args[2])
            conn.send(None)
        elif cmd == "raw_connect":
            assert agent is not None
            conn.send(agent.add_remote_agent(args[0]))
        elif cmd == "fill":
            fill(mgrs[args[0]], args[1], poison=args[2])
            conn.send(None)
        elif cmd == "mismatches":
            conn.send(mismatches(mgrs[args[0]], args[1]))
        elif cmd == "exit":
            for t in ts.values():
                t.close()
            conn.send(None)
            return


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def shift(table: PageTable, offset: int) -> PageTable:
    return PageTable(table.addr, table.nbytes, table.region + np.uint32(offset))


def median_event_ms(fn: Any, iters: int, device: str) -> float:
    """Median of ``iters`` timings of ``fn`` (CUDA events on a GPU, perf_counter on a CPU)."""
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def d2d_gbps(device: str) -> float:
    """The device copy limit: bytes copied per second by one 1 GiB ``copy_`` (median of 20)."""
    a = torch.empty(1 << (30 if device.startswith("cuda") else 26), dtype=torch.uint8, device=device)
    a.random_(0, 256)
    b = torch.empty_like(a)
    b.copy_(a)
    ms = median_event_ms(lambda: b.copy_(a), 20, device)
    return a.numel() / ms / 1e6


class WallCopy:
    """The device copy limit timed as kvxfer is (host clock, launch to completion): one ``copy_`` of a
    case's byte count between two buffers plus a synchronize, median of ``iters``."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._a: torch.Tensor | None = None
        self._b: torch.Tensor | None = None

    def post(self, nbytes: int) -> Any:
        """One ``copy_`` of ``nbytes`` plus a synchronize, shaped like a timed post (returns when launched)."""
        if self._a is None or self._a.numel() < nbytes:
            self._a = self._b = None
            self._a = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._b = torch.empty_like(self._a)
        a, b = self._a[:nbytes], self._b[:nbytes]   # type: ignore[index]

        def copy() -> float:
            b.copy_(a)
            launched = time.perf_counter()
            sync(self.device)
            return launched
        return copy

    def ms(self, nbytes: int, iters: int = 20) -> float:
        """Back to back (the copy's best surroundings)."""
        copy = self.post(nbytes)
        copy()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            copy()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def index_copy(pool_s: torch.Tensor, pool_d: torch.Tensor, si: torch.Tensor, di: torch.Tensor, device: str,
               wait: bool) -> Any:
    """The in-process torch copy of whole slots ``si`` -> ``di`` (optionally waiting for the GPU)."""
    def copy() -> None:
        pool_d[di] = pool_s[si]
        if wait:
            sync(device)
    return copy


# --- the run -----------------------------------------------------------------------------------------
class Bench:
    """The local side: managers, transports, the peer process and its pipe."""

    def __init__(self, backends: list[str], raw: bool, nblocks: int, device: str,
                 own_context_first: bool = True, layouts: bool = False) -> None:
        self.device, self.nblocks, self.backends = device, nblocks, backends
        self.mgrs = managers(nblocks, device, layouts)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, backends, raw, nblocks, device, layouts), daemon=True)
        self.proc.start()
        layouts_b, mds, raw_md = self.conn.recv()
        self.peer_layouts = {k: CacheLayoutDesc.from_msgpack(v) for k, v in layouts_b.items()}
        regions = [r for m in self.mgrs.values() for r in m.memory_regions()]
        # --layouts: a landing region for the pulls that move large source-layout pieces, then re-lay them
        # out on this GPU (as big as the prefill pools: the most a request's source slots hold).
        self.landing: torch.Tensor | None = None
        self.landing_index = len(regions)
        if layouts:
            self.landing = torch.empty(sum(r.nbytes for r in self.mgrs["prefill"].memory_regions()),
                                       dtype=torch.uint8, device=device)
            regions.append(MemoryRegion.of_tensor(self.landing))
        self.ts = {}
        for b in backends:
            t = create(b, f"{LOCAL}-{b}", **transport_options(b))
            t.register(regions)
            t.connect(f"{PEER}-{b}", mds[b])
            self.call("connect", b, t.name, t.metadata())
            self.ts[b] = t
        self.agent = None
        if raw:
            self.agent = raw_nixl_agent(f"{LOCAL}-raw", self.mgrs)
            self.agent.add_remote_agent(raw_md)
            self.call("raw_connect", self.agent.get_agent_metadata())
        self.offsets = region_offsets(self.mgrs)
        self.own_context_first = own_context_first
        self._tick = torch.zeros(1, device=device) if device.startswith("cuda") else None

    def call(self, *cmd: Any) -> Any:
        """Send a command to the peer and spin until it answers: a thread asleep in ``recv`` wakes on
        a slow core, and the post timed right after a poisoning call ran ~4x slower (on an H200, a
        128-run post 0.57 ms after ``recv``, 0.12 ms back to back), which the back-to-back baselines
        never pay. Spinning keeps the timing thread as warm as theirs (a sleep before timing instead
        idles the GPU, which then starts every column's copy late)."""
        self.conn.send(cmd)
        while not self.conn.poll(0):
            pass
        return self.conn.recv()

    def close(self) -> None:
        self.call("exit")
        self.proc.join(30)
        for t in self.ts.values():
            t.close()

    def plans(self, mode: str, dst_names: list[str], blk: dict[str, np.ndarray]) -> tuple[list[TransferPlan], float]:
        """Plans (region ids shifted into the registered list) and the planning time in ms."""
        out, ms = [], 0.0
        for dn in dst_names:
            if mode == "push":   # local prefill -> peer decode rank(s)
                sl, dl = self.mgrs["prefill"].layout, self.peer_layouts[dn]
            else:                # local decode rank(s) pull from the peer's prefill
                sl, dl = self.peer_layouts["prefill"], self.mgrs[dn].layout
            t0 = time.perf_counter()
            plan = plan_transfer(sl, {0: blk["prefill"]}, dl, {0: blk[dn]})
            ms += (time.perf_counter() - t0) * 1e3
            out.append(TransferPlan(shift(plan.src, self.offsets["prefill"]), shift(plan.dst, self.offsets[dn])))
        return out, ms

    def block_plans(self, mode: str, dst_names: list[str], blk: dict[str, np.ndarray]) -> tuple[list[BlockPlan], float]:
        """The same transfers as ``plans``, as BlockPlans, and the planning time in ms."""
        out, ms = [], 0.0
        for dn in dst_names:
            sl, dl = (self.mgrs["prefill"].layout, self.peer_layouts[dn]) if mode == "push" else \
                (self.peer_layouts["prefill"], self.mgrs[dn].layout)
            t0 = time.perf_counter()
            plan = plan_blocks(sl, {0: blk["prefill"]}, dl, {0: blk[dn]})
            ms += (time.perf_counter() - t0) * 1e3
            if plan is None:
                raise RuntimeError(f"plan_blocks gave no block plan for {mode} to {dn}")
            out.append(plan.shift_regions(self.offsets["prefill"], self.offsets[dn]))
        return out, ms

    def set_source(self, mode: str, blocks: np.ndarray) -> None:
        if mode == "push":
            fill(self.mgrs["prefill"], blocks)
        else:
            self.call("fill", "prefill", blocks, False)

    def poison(self, mode: str, dst_names: list[str], blk: dict[str, np.ndarray]) -> None:
        for dn in dst_names:
            if mode == "push":
                self.call("fill", dn, blk[dn], True)
            else:
                fill(self.mgrs[dn], blk[dn], poison=True)

    def bad(self, mode: str, dst_names: list[str], blk: dict[str, np.ndarray]) -> int:
        return sum(int(self.call("mismatches", dn, blk[dn])) if mode == "push" else mismatches(self.mgrs[dn], blk[dn])
                   for dn in dst_names)

    def interleaved(self, columns: list[tuple[str, Any, bool]], mode: str, dst_names: list[str],
                    blk: dict[str, np.ndarray], iters: int) -> dict[str, tuple[list[float], list[float], int]]:
        """Per column (name, post, moves its pages): (seconds per iteration, seconds spent posting, elements
        wrong summed over iterations). Iteration i times every column once, starting at column i (mod
        their count), so drift of the machine (clocks, the other process, NIXL's progress) reaches every
        column alike. Each timed post is poisoned before and verified after; a post that does not move
        the case's pages (the D2D limit in place) goes through the same and counts 0 wrong."""
        for _, post, _ in columns:
            post()   # warm-up (connection set-up, registration caches, kernel compile)
        out: dict[str, tuple[list[float], list[float], int]] = {name: ([], [], 0) for name, _, _ in columns}
        for i in range(iters):
            for k in range(len(columns)):
                name, post, moves_pages = columns[(i + k) % len(columns)]
                self.poison(mode, dst_names, blk)
                sync(self.device)
                if self.own_context_first:
                    self.touch_own_context()
                t0 = time.perf_counter()
                t_posted = post()
                elapsed = time.perf_counter() - t0
                wrong = self.bad(mode, dst_names, blk)
                times, posts, bad = out[name]
                times.append(elapsed)
                posts.append(t_posted - t0)
                out[name] = (times, posts, bad + (wrong if moves_pages else 0))
        return out

    def touch_own_context(self) -> None:
        """One tiny kernel of this process, waited for: after the peer process poisoned the pages, the GPU
        switches from its context to ours on our next kernel, which cost 130-190 us of the timed copy on an
        H200 ("D2D in place" 0.54x D2D for push against 0.92x for pull). A serving process posts
        right after its own model's kernels (the push's prefill, the pull's decode), and two workers
        sharing one GPU is this harness's set-up, not a deployment's: the switch is kept out of every
        column alike (``--peer-context-last`` times it in again)."""
        if self._tick is not None:
            self._tick.add_(1)
            sync(self.device)

    def backend_post(self, backend: str, mode: str, plans: list[TransferPlan] | list[BlockPlan] | list[PhasedPlan]) -> Any:
        t = self.ts[backend]
        op, peer = (t.write if mode == "push" else t.read), f"{PEER}-{backend}"

        def post() -> float:
            hs = [op(peer, p) for p in plans]
            posted = time.perf_counter()
            for h in hs:
                h.wait(120)
            return posted
        return post

    def prepared_post(self, backend: str, mode: str, plans: list[TransferPlan]) -> tuple[Any, list[Any]]:
        """The plans prepared once here (``Transport.prepare``), one ``post`` of each per iteration; and the
        prepared transfers, to release after the case."""
        t = self.ts[backend]
        prepared = [t.prepare("write" if mode == "push" else "read", f"{PEER}-{backend}", p) for p in plans]

        def post() -> float:
            hs = [x.post() for x in prepared]
            posted = time.perf_counter()
            for h in hs:
                h.wait(120)
            return posted
        return post, prepared

    def raw_nixl_post(self, mode: str, plans: list[TransferPlan]) -> Any:
        """Raw NIXL: both sides' descriptor lists prepared once here, one prepared transfer per plan."""
        agent = self.agent
        assert agent is not None
        local_regions = [r for m in self.mgrs.values() for r in m.memory_regions()]
        dev = np.uint64(local_regions[0].device_id)
        mem = _mem(local_regions[0].memory_kind)
        prepped = []
        for p in plans:
            local, remote = (p.src, p.dst) if mode == "push" else (p.dst, p.src)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack([local.addr, local.nbytes,
                                                                    np.full(len(p), dev)], axis=1), mem)
            rh = agent.prep_xfer_dlist(f"{PEER}-raw", np.stack([remote.addr, remote.nbytes,
                                                                np.full(len(p), dev)], axis=1), mem)
            prepped.append((lh, rh, np.arange(len(p), dtype=np.int32)))
        op = "WRITE" if mode == "push" else "READ"

        def post() -> float:
            reqs = [agent.make_prepped_xfer(op, lh, idx, rh, idx) for lh, rh, idx in prepped]
            for r in reqs:
                if agent.transfer(r) == "ERR":
                    raise RuntimeError("raw NIXL refused the transfer")
            posted = time.perf_counter()
            for r in reqs:
                while (state := agent.check_xfer_state(r)) != "DONE":
                    if state == "ERR":
                        raise RuntimeError("raw NIXL transfer failed")
                r.release()
            return posted
        return post, prepped


def prepared_backends(backends: list[str]) -> list[str]:
    """The backends also timed with their plans prepared once per case (a ``<backend>_prep`` column)."""
    return [b for b in backends if b in ("cuda_ipc", "nixl")]


def profile(bench: Bench, blk: dict[str, np.ndarray], tokens: int, posts: int) -> list[dict[str, Any]]:
    """Where a per-request post's host time goes: ``posts`` identical-layout pushes of each backend under
    cProfile, each a ``write`` of a plan that was not prepared (a TransferPlan, and for cuda_ipc a BlockPlan;
    built once, outside the profile, as the timed columns' plans are) and waited for; the functions that took
    the most cumulative time (not poisoned or verified: the timed columns are)."""
    out = []
    for backend in bench.ts:
        kinds: list[tuple[str, Any]] = [("plan", bench.plans)]
        if backend == "cuda_ipc":
            kinds.append(("blocks", bench.block_plans))
        for kind, make in kinds:
            bench.set_source("push", blk["prefill"])
            plans, _ = make("push", ["decode"], blk)
            post = bench.backend_post(backend, "push", plans)
            post()                      # warm: compile, connection caches
            sync(bench.device)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(posts):
                post()
            prof.disable()
            wall_ms = (time.perf_counter() - t0) * 1e3 / posts
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
            out.append({"tokens": tokens, "backend": backend, "plan": kind, "posts": posts,
                        "ms_per_post_profiled": wall_ms, "top": text.getvalue()})
            print(f"--- profile: {backend} {kind} push, {tokens} tokens, {posts} posts, {wall_ms:.3f} ms each "
                  f"under the profiler\n{text.getvalue()}", flush=True)
    return out


def run(backends: list[str], raw: bool, tokens_list: list[int], iters: int, latency_iters: int,
        device: str, own_context_first: bool = True, layouts: bool = False, profile_posts: int = 0) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    columns = backends + (["cuda_ipc_blocks"] if "cuda_ipc" in backends else []) + \
        [f"{b}_prep" for b in prepared_backends(backends)] + (["raw_nixl"] if raw else [])
    results: dict[str, Any] = {"backends": backends, "raw_nixl": raw, "gpu": gpu, "device": device, "cases": [],
                               "columns": columns,
                               "latency": [], "nixl_threads": int(os.environ.get("KVXFER_NIXL_THREADS", "0")),
                               "own_context_first": own_context_first,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results["d2d_gbps"] = d2d_gbps(device)
    print(f"D2D {results['d2d_gbps']:.0f} GB/s", flush=True)
    wall = WallCopy(device)
    for tokens in tokens_list:
        nblocks = tokens // TPB
        bench = Bench(backends, raw, nblocks, device, own_context_first, layouts)
        rng = np.random.default_rng(tokens)
        blk = {name: rng.choice(-(-tokens // m.layout.tokens_per_block) + 8, tokens // m.layout.tokens_per_block,
                                replace=False).astype(np.int32) for name, m in bench.mgrs.items()}
        # in-process torch copy of the same whole slots (int64 rows: torch's index kernels move 8-byte elements)
        src_idx = torch.as_tensor(blk["prefill"], device=device, dtype=torch.long)
        dst_idx = torch.as_tensor(blk["decode"], device=device, dtype=torch.long)
        pool_s = bench.mgrs["prefill"].pool_tensor(0, 0).view(torch.int64).view(nblocks + 8, -1)
        pool_d = bench.mgrs["decode"].pool_tensor(0, 0).view(torch.int64).view(nblocks + 8, -1)
        copy_bytes = nblocks * pool_s.shape[1] * 8
        torch_ms = median_event_ms(index_copy(pool_s, pool_d, src_idx, dst_idx, device, False), iters + 2, device)
        for case, dst_names in (("identical", ["decode"]), ("tp1->2", ["rank0", "rank1"])):
            for mode in ("push", "pull"):
                bench.set_source(mode, blk["prefill"])
                plans, plan_ms = bench.plans(mode, dst_names, blk)
                nbytes = sum(p.total_bytes for p in plans)
                row: dict[str, Any] = {"tokens": tokens, "case": case, "mode": mode,
                                       "descriptors": sum(len(p) for p in plans), "bytes": nbytes, "plan_ms": plan_ms,
                                       "torch_gbps": copy_bytes / torch_ms / 1e6, "d2d_gbps": results["d2d_gbps"]}
                row["d2d_wall_gbps"] = nbytes / wall.ms(nbytes) / 1e6
                posts: list[tuple[str, Any]] = [(b, bench.backend_post(b, mode, plans)) for b in backends]
                if "cuda_ipc" in backends:
                    block_plans, row["block_plan_ms"] = bench.block_plans(mode, dst_names, blk)
                    assert sum(p.total_bytes for p in block_plans) == nbytes
                    posts.append(("cuda_ipc_blocks", bench.backend_post("cuda_ipc", mode, block_plans)))
                prepared: list[Any] = []
                for b in prepared_backends(backends):
                    prepared_post, made = bench.prepared_post(b, mode, plans)
                    posts.append((f"{b}_prep", prepared_post))
                    prepared += made
                prepped = None
                if raw:
                    raw_post, prepped = bench.raw_nixl_post(mode, plans)
                    posts.append(("raw_nixl", raw_post))
                # The same copy_ timed inside the loop every post is timed in (after the peer or this
                # process poisoned the pages, before the verification), interleaved with the posts: the
                # limit in those surroundings.
                timed = bench.interleaved([("d2d_inplace", wall.post(nbytes), False)] +
                                          [(name, post, True) for name, post in posts], mode, dst_names, blk, iters)
                row["d2d_inplace_gbps"] = nbytes / statistics.median(timed["d2d_inplace"][0]) / 1e9
                row["d2d_inplace_times_ms"] = [t * 1e3 for t in timed["d2d_inplace"][0]]
                for name, _ in posts:
                    times, post_s, bad = timed[name]
                    row[f"{name}_times_ms"] = [t * 1e3 for t in times]
                    med = statistics.median(times)
                    row[f"{name}_gbps"] = nbytes / med / 1e9
                    row[f"{name}_ms"] = med * 1e3
                    row[f"{name}_post_ms"] = statistics.median(post_s) * 1e3
                    row[f"{name}_x_d2d"] = row[f"{name}_gbps"] / results["d2d_gbps"]
                    row[f"{name}_x_d2d_wall"] = row[f"{name}_gbps"] / row["d2d_wall_gbps"]
                    row[f"{name}_x_d2d_inplace"] = row[f"{name}_gbps"] / row["d2d_inplace_gbps"]
                    row[f"{name}_wrong_elements"] = bad
                for lh, rh, _ in prepped or []:
                    lh.release()
                    rh.release()
                for x in prepared:
                    x.release()
                if raw:
                    for b in backends + [f"{b}_prep" for b in prepared_backends(backends)]:
                        row[f"{b}_x_raw_nixl"] = row[f"{b}_gbps"] / row["raw_nixl_gbps"]
                results["cases"].append(row)
                print(json.dumps(row), flush=True)
        if layouts:
            results.setdefault("layouts", []).extend(run_layouts(bench, blk, tokens, iters, results["d2d_gbps"], wall))
        if tokens == tokens_list[0]:
            results["latency"] = latency(bench, blk, latency_iters, raw, pool_s, pool_d)
        if profile_posts:
            results.setdefault("profiles", []).extend(profile(bench, blk, tokens, profile_posts))
        bench.close()
        del bench
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


def templated_plans(bench: Bench, mode: str, pairs: tuple[tuple[str, str], ...],
                    blk: dict[str, np.ndarray]) -> tuple[list[PhasedPlan], float]:
    """``plan_templated`` of each (source, destination) pair as one PhasedPlan (what the workers post) (push: local sources to the peer's managers;
    pull: the peer's sources to local managers), region ids shifted into the registered list; and the
    planning time in ms (the layout pairs' templates made by a first, untimed call)."""
    out, ms = [], 0.0
    for sn, dn in pairs:
        sl, dl = (bench.mgrs[sn].layout, bench.peer_layouts[dn]) if mode == "push" else \
            (bench.peer_layouts[sn], bench.mgrs[dn].layout)
        plan_templated(sl, {0: blk[sn]}, dl, {0: blk[dn]})
        t0 = time.perf_counter()
        phases = plan_templated(sl, {0: blk[sn]}, dl, {0: blk[dn]})
        ms += (time.perf_counter() - t0) * 1e3
        if phases is None:
            raise RuntimeError(f"plan_templated gave no plan for {mode} {sn} -> {dn}")
        out.append(PhasedPlan(tuple(p.shift_regions(bench.offsets[sn], bench.offsets[dn]) for p in phases)))
    return out, ms


def landing_post(bench: Bench, pairs: tuple[tuple[str, str], ...], blk: dict[str, np.ndarray]) -> Any:
    """Pull over nixl through the landing region: per (source, destination) pair, the templated plan's
    large source-layout pieces read into this process's landing region, then re-laid out here on the
    device (``read_relayout``: the handle is done once the re-layout is)."""
    assert bench.landing is not None
    t, peer = bench.ts["nixl"], f"{PEER}-nixl"
    base, plans = int(bench.landing.data_ptr()), []
    for sn, dn in pairs:
        phases = plan_templated(bench.peer_layouts[sn], {0: blk[sn]}, bench.mgrs[dn].layout, {0: blk[dn]})
        assert phases is not None
        lp = landing_plan([p.shift_regions(bench.offsets[sn], bench.offsets[dn]) for p in phases], base,
                          bench.landing_index)
        base += lp.landing_bytes
        plans.append(lp)
    if base - int(bench.landing.data_ptr()) > bench.landing.numel():
        raise RuntimeError("the landing region is too small for this case")

    def post() -> float:
        hs = [read_relayout(t, peer, lp) for lp in plans]
        posted = time.perf_counter()
        for h in hs:
            h.wait(120)
        return posted
    return post


def run_layouts(bench: Bench, blk: dict[str, np.ndarray], tokens: int, iters: int, d2d: float,
                wall: WallCopy) -> list[dict[str, Any]]:
    """The layout changes (``LAYOUT_CASES``), push and pull: each backend posts the request's templated plan
    (one BlockPlan per segment shape, built per request, no ``prepare``: cuda_ipc's kernel reads the
    source layout and writes the destination's in one pass), interleaved with the D2D copy of the same
    bytes in place; every timed iteration poisoned before and checked after by logical position."""
    rows = []
    for case, pairs in LAYOUT_CASES:
        sources = sorted({sn for sn, _ in pairs})
        dst_names = sorted({dn for _, dn in pairs})
        for mode in ("push", "pull"):
            for sn in sources:
                if mode == "push":
                    fill(bench.mgrs[sn], blk[sn])
                else:
                    bench.call("fill", sn, blk[sn], False)
            plans, plan_ms = templated_plans(bench, mode, pairs, blk)
            nbytes = sum(p.total_bytes for p in plans)
            row: dict[str, Any] = {"tokens": tokens, "case": case, "mode": mode, "phases": len(plans),
                                   "runs": sum(len(p) for p in plans), "bytes": nbytes, "plan_ms": plan_ms,
                                   "d2d_gbps": d2d, "d2d_wall_gbps": nbytes / wall.ms(nbytes) / 1e6}
            posts = [(f"{b}_templated", bench.backend_post(b, mode, plans)) for b in bench.backends]
            if mode == "pull" and "nixl" in bench.backends:
                posts.append(("nixl_landing", landing_post(bench, pairs, blk)))
            timed = bench.interleaved([("d2d_inplace", wall.post(nbytes), False)] +
                                      [(name, post, True) for name, post in posts], mode, dst_names, blk, iters)
            row["d2d_inplace_gbps"] = nbytes / statistics.median(timed["d2d_inplace"][0]) / 1e9
            for name, _ in posts:
                times, post_s, bad = timed[name]
                med = statistics.median(times)
                row[f"{name}_gbps"] = nbytes / med / 1e9
                row[f"{name}_ms"] = med * 1e3
                row[f"{name}_post_ms"] = statistics.median(post_s) * 1e3
                row[f"{name}_x_d2d"] = row[f"{name}_gbps"] / d2d
                row[f"{name}_x_d2d_inplace"] = row[f"{name}_gbps"] / row["d2d_inplace_gbps"]
                row[f"{name}_wrong_elements"] = bad
                row[f"{name}_times_ms"] = [t * 1e3 for t in times]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def latency(bench: Bench, blk: dict[str, np.ndarray], iters: int, raw: bool, pool_s: torch.Tensor,
            pool_d: torch.Tensor) -> list[dict[str, Any]]:
    """p50 of one push of k blocks (identical layout), each backend and torch's in-process copy. The
    destination is poisoned before the ``iters`` iterations and verified after them."""
    rows = []
    for k in (1, 4, 16):
        sub = {n: b[:k] for n, b in blk.items()}
        bench.set_source("push", sub["prefill"])
        plans, _ = bench.plans("push", ["decode"], sub)
        si = torch.as_tensor(sub["prefill"], device=bench.device, dtype=torch.long)
        di = torch.as_tensor(sub["decode"], device=bench.device, dtype=torch.long)
        row: dict[str, Any] = {"blocks": k, "bytes": plans[0].total_bytes, "descriptors": len(plans[0])}
        posts: list[tuple[str, Any]] = [("torch", index_copy(pool_s, pool_d, si, di, bench.device, True))]
        posts += [(b, bench.backend_post(b, "push", plans)) for b in bench.backends]
        if "cuda_ipc" in bench.backends:
            posts.append(("cuda_ipc_blocks", bench.backend_post("cuda_ipc", "push", bench.block_plans("push", ["decode"], sub)[0])))
        prepared: list[Any] = []
        for b in prepared_backends(bench.backends):
            prepared_post, made = bench.prepared_post(b, "push", plans)
            posts.append((f"{b}_prep", prepared_post))
            prepared += made
        prepped = None
        if raw:
            raw_post, prepped = bench.raw_nixl_post("push", plans)
            posts.append(("raw_nixl", raw_post))
        for name, post in posts:
            if name != "torch":
                bench.poison("push", ["decode"], sub)
            for _ in range(10):
                post()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                post()
                times.append(time.perf_counter() - t0)
            row[f"{name}_p50_us"] = statistics.median(times) * 1e6
            if name != "torch":
                row[f"{name}_wrong_elements"] = bench.bad("push", ["decode"], sub)
        for lh, rh, _ in prepped or []:
            lh.release()
            rh.release()
        for x in prepared:
            x.release()
        for b in bench.backends + (["cuda_ipc_blocks"] if "cuda_ipc" in bench.backends else []) + \
                [f"{b}_prep" for b in prepared_backends(bench.backends)]:
            row[f"{b}_x_torch"] = row[f"{b}_p50_us"] / row["torch_p50_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_tables(res: dict[str, Any]) -> None:
    names = res["columns"]
    print(f"\n{res['gpu']}; D2D {res['d2d_gbps']:.0f} GB/s; medians; NIXL threads {res['nixl_threads']}; "
          f"own context first {res['own_context_first']}")
    head = f"{'tokens':>6} {'case':>9} {'mode':>4} {'desc':>7} {'MiB':>6} {'torch':>6} {'D2Dwall':>7} {'inplace':>7}"
    for n in names:
        head += f" {n[-9:]:>9} {'xD2D':>5} {'xwall':>5} {'xinpl':>5} {'post ms':>7}"
    print(head + " wrong")
    for r in res["cases"]:
        line = (f"{r['tokens']:>6} {r['case']:>9} {r['mode']:>4} {r['descriptors']:>7} {r['bytes'] / 2**20:>6.0f} "
                f"{r['torch_gbps']:>6.0f} {r['d2d_wall_gbps']:>7.0f} {r['d2d_inplace_gbps']:>7.0f}")
        for n in names:
            line += (f" {r[f'{n}_gbps']:>9.1f} {r[f'{n}_x_d2d']:>5.2f} {r[f'{n}_x_d2d_wall']:>5.2f}"
                     f" {r[f'{n}_x_d2d_inplace']:>5.2f} {r[f'{n}_post_ms']:>7.2f}")
        print(line + " " + str(sum(r[f"{n}_wrong_elements"] for n in names)))
    if res.get("layouts"):
        cols = [f"{b}_templated" for b in res["backends"]] + (["nixl_landing"] if "nixl" in res["backends"] else [])
        print(f"\n{'tokens':>6} {'layout case':>14} {'mode':>4} {'phases':>6} {'runs':>8} {'MiB':>6} {'plan ms':>7} "
              f"{'inplace':>7}" + "".join(f" {c[-18:]:>18} {'xD2D':>5} {'xinpl':>5}" for c in cols) + " wrong")
        for r in res["layouts"]:
            print(f"{r['tokens']:>6} {r['case']:>14} {r['mode']:>4} {r['phases']:>6} {r['runs']:>8} "
                  f"{r['bytes'] / 2**20:>6.0f} {r['plan_ms']:>7.2f} {r['d2d_inplace_gbps']:>7.0f}"
                  + "".join(f" {r[f'{c}_gbps']:>18.1f} {r[f'{c}_x_d2d']:>5.2f} {r[f'{c}_x_d2d_inplace']:>5.2f}"
                            if f"{c}_gbps" in r else f" {'-':>18} {'-':>5} {'-':>5}" for c in cols)
                  + " " + str(sum(r.get(f"{c}_wrong_elements", 0) for c in cols)))
    print(f"\n{'blocks':>6} {'MiB':>5} {'torch us':>9}" + "".join(f" {n[-9:]:>9} us" for n in names))
    for r in res["latency"]:
        print(f"{r['blocks']:>6} {r['bytes'] / 2**20:>5.0f} {r['torch_p50_us']:>9.1f}"
              + "".join(f" {r[f'{n}_p50_us']:>12.1f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["cuda_ipc"], choices=("cuda_ipc", "nixl", "ucx"))
    p.add_argument("--raw-nixl", action="store_true", help="also time NIXL's own agent with prepared lists")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--iters", type=int, default=7, help="timed (poisoned, verified) iterations per case")
    p.add_argument("--latency-iters", type=int, default=300)
    p.add_argument("--device", default="cuda:0", help="cuda:0 (both processes share it) or cpu (logic check)")
    p.add_argument("--peer-context-last", action="store_true",
                   help="time each iteration right after the peer's poisoning, GPU context switch included")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--layouts", action="store_true",
                   help="also the layout changes (tokens per block 32->16 and 32->64, HND->NHD, TP 1->2 and 2->1 "
                        "with a block-size change), push and pull, per-request templated plans")
    p.add_argument("--nixl-sleep-every-us", type=float, default=None,
                   help="the nixl handle's wait: sleep once per this many us of asking (kvxfer's default 500; "
                        "0: between every two asks), for an A/B in one run")
    p.add_argument("--packed-tiled", action="store_true",
                   help="cuda_ipc: short-run block plans through copy_block_runs_tiled (cuda_copy.PACKED_TILED)")
    p.add_argument("--packed-groups", action="store_true",
                   help="cuda_ipc: short-run block plans whose templates cut into affine groups through "
                        "copy_block_groups (cuda_copy.PACKED_GROUPS)")
    p.add_argument("--profile-posts", type=int, default=0, metavar="N",
                   help="also profile N per-request identical-layout pushes of each backend per prompt length "
                        "(cProfile, cumulative; printed and kept in the JSON)")
    a = p.parse_args(argv)
    if a.packed_tiled or a.packed_groups:
        from kvxfer.transport import cuda_copy
        cuda_copy.PACKED_TILED = a.packed_tiled
        cuda_copy.PACKED_GROUPS = a.packed_groups
    if a.nixl_sleep_every_us is not None:
        nixl_backend.WAIT_SLEEP_EVERY_S = a.nixl_sleep_every_us / 1e6
    res = run(a.backends, a.raw_nixl, a.tokens, a.iters, a.latency_iters, a.device, not a.peer_context_last,
              a.layouts, a.profile_posts)
    res["packed_order"] = "groups" if a.packed_groups else "tiled" if a.packed_tiled else "flat"
    print_tables(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    names = res["columns"]
    wrong = sum(r[f"{n}_wrong_elements"] for r in res["cases"] + res["latency"] for n in names
                if f"{n}_wrong_elements" in r)
    wrong += sum(v for r in res.get("layouts", []) for k, v in r.items() if k.endswith("_wrong_elements"))
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
