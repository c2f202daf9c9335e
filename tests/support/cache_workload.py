"""A deterministic mixed workload over the cache manager, recording everything a consumer or the
allocator could observe: the drained event stream (ids included), statistics, reference counts, free
stacks, tree-page marks, tree contents (keys, pages, tiers, priorities, LRU stamps) and each open
request's pages. ``tests/cache/test_golden.py`` compares it with ``tests/data/cache_golden.json`` (made by the per-block
code this round replaced: events whole, each state section as a digest).

``run_random_workloads`` adds seeded random workloads, compared by digest with
``tests/data/cache_golden_random.txt``. Regenerate both only for an intended behaviour change:
``PYTHONPATH=. python tests/support/cache_workload.py tests/data/cache_golden.json tests/data/cache_golden_random.txt``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.cache import CacheConfig, KVCache, KVCacheManager
from kvxfer.cache.hashing import ReuseScope
from tests.support.tier_helpers import multi_pool_config

TPB = 4
Record = list[dict[str, Any]]


def _tokens(seed: int, n: int, start: int = 0) -> np.ndarray:
    """Token ids by formula (no RNG whose stream could change between numpy versions)."""
    i = np.arange(start, start + n, dtype=np.int64)
    return (i * 7919 + seed * 104729 + (i * i) % 97) % 32000


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    return value


def _event(event: Any) -> dict[str, Any]:
    out = {f.name: _jsonable(getattr(event, f.name)) for f in dataclasses.fields(event)}
    out["type"] = type(event).__name__
    return out


def snapshot(mgr: KVCacheManager, caches: dict[str, KVCache]) -> dict[str, Any]:
    """Allocator, tree, request and statistics state of ``mgr`` (after draining its events)."""
    allocs = []
    for tier in range(len(mgr._state.tiers)):
        for pg in range(len(mgr._state.allocators)):
            a = mgr._state.alloc_of(tier, pg)
            owners = sorted((slot, node.key.hex(), lg) for slot, (node, lg) in mgr._state.tree_owner[tier][pg].items())
            allocs.append({"tier": tier, "pg": pg, "refcount": a.refcount.tolist(),
                           "free": a._free[:a._top].tolist(), "usable": a.usable,
                           "in_tree": np.flatnonzero(mgr._state.in_tree_t[tier][pg]).tolist(), "owners": owners})
    nodes = sorted(([n.key.hex(), None if n.parent is None or n.parent.is_root else n.parent.key.hex(), n.depth,
                     n.tokens.tolist(), n.pages.tolist(), n.tiers.tolist(), n.priority, n.last_used,
                     n.has_extra_key, sorted(k.hex() for k in n.children)] for n in mgr._state.tree.nodes()),
                   key=lambda r: r[0])
    reqs = {cid: {"blocks": [b.tolist() for b in c.record.blocks], "tiers": [t.tolist() for t in c.record.tiers],
                  "keys": [k.hex() for k in c.record.keys],
                  "nodes": [None if n is None else n.key.hex() for n in c.record.tree_nodes],
                  "committed": c.num_committed_tokens, "reused": c.num_reused_tokens,
                  "state": c.state.value, "scratch": [s.tolist() for s in c.record.scratch]}
            for cid, c in sorted(caches.items()) if c.state.value != "closed"}
    return {
        "allocators": allocs, "tree": nodes, "requests": reqs,
        "committed_stats": _jsonable(dataclasses.asdict(mgr.get_committed_stats())),
        "iteration_stats": {str(k): _jsonable(dataclasses.asdict(v))
                            for k, v in sorted(mgr.get_and_reset_iteration_stats().items())},
        "peaks": [[_jsonable(dataclasses.asdict(p)) for p in level]
                  for level in mgr.get_and_reset_iteration_peak_block_stats_by_level()],
        "traffic": _jsonable(dataclasses.asdict(mgr.tier_traffic())),
        "events_dropped": mgr.events_dropped,
        "dirty": sorted(mgr.get_dirty_stats_kv_cache_ids()),
    }


class _Run:
    """Steps on one manager; ``check`` records the events drained and the state after a step."""

    def __init__(self, name: str, mgr: KVCacheManager, record: Record) -> None:
        self.name, self.mgr, self.record = name, mgr, record
        self.caches: dict[str, KVCache] = {}

    def check(self, step: str) -> None:
        events = [_event(e) for e in self.mgr.drain_events()]
        self.record.append({"run": self.name, "step": step, "events": events,
                            "state": snapshot(self.mgr, self.caches)})

    def open(self, cid: str, tokens: np.ndarray | None, **kw: Any) -> KVCache:
        cache = self.mgr.create_kv_cache_for_prompt(tokens, cid, **kw)
        self.caches[cid] = cache
        return cache

    def prefill(self, cache: KVCache, tokens: np.ndarray, chunk: int, priority: int | None = None) -> bool:
        """Resize and commit ``tokens`` after what ``cache`` has committed, ``chunk`` tokens at a time;
        False when a resize found no room."""
        done = cache.num_committed_tokens
        while done < tokens.size:
            stop = min(done + chunk, tokens.size)
            if cache.capacity < stop and not cache.resize(stop):
                return False
            cache.commit(tokens[done:stop], priority=priority)
            done = stop
        return True


def _full_attention_tiers(record: Record, disk_dir: str) -> None:
    """Full attention with host and disk tiers: chunked commits, prefix hits (partial too), duplicate
    commits adopting tree blocks with priorities, offload / onboard under pressure, salt and LoRA
    scopes, extra keys, pins, set_priority, a small event queue that drops, a tree reset."""
    cfg = CacheConfig.for_model(2, 2, 8, TPB, "float16", 24, host_blocks=10, disk_blocks=12, disk_path=disk_dir,
                                event_queue_capacity=12)
    run = _Run("tiers", KVCacheManager(cfg), record)
    run.check("created")
    p1 = _tokens(1, 30)
    a = run.open("a", p1)
    a.resume()
    run.prefill(a, p1, 7, priority=50)
    run.check("a committed in chunks")
    p2 = np.concatenate([p1[:18], _tokens(2, 9)])
    b = run.open("b", p2)
    b.resume()
    run.prefill(b, p2, 5)
    run.check("b prefix hit with partial block")
    # Two requests of one prompt created before either commits: the second adopts the first's blocks.
    p3 = _tokens(3, 26)
    c, d = run.open("c", p3), run.open("d", p3)
    c.resume()
    d.resume()
    run.prefill(c, p3, 26)
    run.prefill(d, p3, 9, priority=70)
    run.check("d adopts c's blocks with a new priority")
    a.suspend()
    b.suspend()
    d.set_priority(20)
    run.check("suspended, priority set")
    a.close()
    c.close()
    run.check("a and c closed")
    # Pressure: a new long request pushes held and tree pages down to the host and disk tiers.
    p4 = _tokens(4, 60)
    e = run.open("e", p4, extra_keys={1: b"img-1", 3: b"img-2"})
    e.resume()
    run.prefill(e, p4[:40], 8)
    run.check("e under pressure (offload)")
    pin = run.mgr.pin_pages(e.block_id_map())
    e.suspend()
    run.check("e pinned and suspended")
    assert b.resume()
    run.check("b onboarded")
    pin.release()
    b.close()
    d.close()
    run.check("b, d closed")
    assert e.resume()
    run.prefill(e, p4, 6, priority=10)
    run.check("e onboarded and grown (drops)")
    salted = ReuseScope(lora_id=7, salt=12345)
    f = run.open("f", p4, reuse_scope=salted)
    f.resume()
    run.prefill(f, p4[:33], 11)
    run.check("f in a salted LoRA scope")
    g = run.open("g", p4[:33], reuse_scope=salted)
    g.resume()
    run.prefill(g, p4[:33], 33)
    run.check("g hits f's scope")
    e.close()
    f.close()
    g.close()
    run.check("all closed")
    h = run.open("h", _tokens(5, 90))
    h.resume()
    run.prefill(h, _tokens(5, 90), 13)
    run.check("h evicts the tree")
    h.close()
    run.check("h closed")
    assert run.mgr.reset_prefix_tree()
    run.check("tree reset")


def _sliding_window(record: Record) -> None:
    """Two layer groups (full attention and a 12-token window with 4 sink tokens): window pages the
    tree lets go of, adoption of a page the tree lacks, scratch slots, eviction under pressure."""
    cfg = CacheConfig.for_model(4, 2, 8, TPB, "float16", 24, windows=[None, 12], sink_tokens=4,
                                event_queue_capacity=4096, swa_scratch_reuse=True)
    run = _Run("swa", KVCacheManager(cfg), record)
    run.check("created")
    p1 = _tokens(11, 41)
    a = run.open("a", p1)
    a.enable_swa_scratch_reuse = False      # scratch slots for request e only
    a.resume()
    run.prefill(a, p1, 6)
    run.check("a committed (window pages dropped)")
    b = run.open("b", p1)
    b.enable_swa_scratch_reuse = False
    b.resume()
    run.prefill(b, p1, 41, priority=60)
    run.check("b prefix hit")
    c, d = run.open("c", _tokens(12, 30)), run.open("d", _tokens(12, 30))
    c.enable_swa_scratch_reuse = d.enable_swa_scratch_reuse = False
    c.resume()
    d.resume()
    run.prefill(c, _tokens(12, 30), 4)
    run.prefill(d, _tokens(12, 30), 30)
    run.check("d adopts c's blocks")
    a.close()
    b.close()
    c.close()
    run.check("closed")
    e = run.open("e", _tokens(13, 90))
    e.enable_swa_scratch_reuse = True
    e.resume()
    run.prefill(e, _tokens(13, 90), 20)
    run.check("e with scratch slots evicts")
    d.close()
    e.close()
    run.check("all closed")


def _two_pool_groups(record: Record, disk_dir: str) -> None:
    """Two pool groups (full attention, and sliding-window layers of another head size) over host and
    disk tiers, 16 tokens per block: offload, onboard and drops per pool group."""
    run = _Run("pool-groups", KVCacheManager(multi_pool_config(disk_dir)), record)
    run.check("created")
    p1 = _tokens(31, 200)
    a = run.open("a", p1)
    a.resume()
    run.prefill(a, p1, 64)
    a.suspend()
    run.check("a committed and suspended")
    b = run.open("b", np.concatenate([p1[:100], _tokens(32, 150)]))
    b.resume()
    run.prefill(b, np.concatenate([p1[:100], _tokens(32, 150)]), 48, priority=40)
    run.check("b hit and grown (offload)")
    b.close()
    assert a.resume()
    run.check("a onboarded")
    a.close()
    c = run.open("c", _tokens(33, 300))
    c.resume()
    run.prefill(c, _tokens(33, 300), 100)
    c.close()
    run.check("c evicts")


def _no_reuse(record: Record) -> None:
    """Prefix reuse off: only allocation, statistics and the Created event."""
    cfg = CacheConfig.for_model(2, 2, 8, TPB, "float16", 16, enable_prefix_reuse=False)
    run = _Run("no-reuse", KVCacheManager(cfg), record)
    a = run.open("a", _tokens(21, 30))
    a.resume()
    run.prefill(a, _tokens(21, 30), 8)
    run.check("a committed")
    a.close()
    run.check("a closed")


def _random_workload(seed: int, record: Record, disk_dir: str) -> None:
    """A seeded random mix of create (prompts sharing prefixes, salts, extra keys), resume, commit in
    random chunks with random priorities, suspend, close, set_priority, pins, shrinking and history
    moves, on one of three configurations (tiers and a tiny event queue; sliding windows; two pool
    groups over tiers); recorded every 5 operations."""
    rnd = random.Random(seed)
    if seed % 3 == 0:
        cfg = CacheConfig.for_model(2, 2, 8, TPB, "float16", 20, host_blocks=8, disk_blocks=10, disk_path=disk_dir,
                                    event_queue_capacity=rnd.choice([2, 50]))
    elif seed % 3 == 1:
        cfg = CacheConfig.for_model(4, 2, 8, TPB, "float16", 22, windows=[None, 12], sink_tokens=4)
    else:
        cfg = multi_pool_config(disk_dir, primary_slots=20, host_slots=12, disk_slots=14)
    tpb = cfg.tokens_per_block
    run = _Run(f"random-{seed}", KVCacheManager(cfg), record)
    prompts: dict[str, np.ndarray] = {}
    bases = [_tokens(s, 40 * tpb) for s in range(3)]
    for step in range(60):
        op = rnd.random()
        live = [c for c in run.caches.values() if c.state.value != "closed"]
        if op < 0.25 and len(live) < 4:
            n = rnd.randint(1, 12 * tpb)
            tokens = np.concatenate([rnd.choice(bases)[:rnd.randint(0, n)], _tokens(100 + step, n)])[:n]
            kw: dict[str, Any] = {}
            if rnd.random() < 0.2:
                kw["reuse_scope"] = ReuseScope(salt=5)
            if rnd.random() < 0.2:
                kw["extra_keys"] = {1: b"x"}
            prompts[f"c{step}"] = tokens
            run.open(f"c{step}", tokens, **kw)
        elif live:
            c = rnd.choice(live)
            active = c.state.value == "active"
            if op < 0.55 and not active:
                c.resume()
            elif op < 0.55:
                tokens, done = prompts[c.id], c.num_committed_tokens
                stop = min(tokens.size, done + rnd.randint(1, 5 * tpb))
                if stop > done and (c.capacity >= stop or c.resize(stop)):
                    c.commit(tokens[done:stop], priority=rnd.choice([None, None, 10, 60]))
            elif op < 0.65:
                c.suspend()
            elif op < 0.75:
                c.close()
            elif op < 0.8:
                c.set_priority(rnd.choice([5, 35, 90]))
            elif op < 0.85 and active:
                pin = run.mgr.pin_pages(c.block_id_map())
                if rnd.random() < 0.5:
                    pin.release()
            elif op < 0.9 and active:
                c.resize(max(c.history_length, c.capacity - tpb))
            elif active:
                c.history_length = c.capacity
        if step % 5 == 4:
            run.check(f"op {step}")


def run_random_workloads(seeds: range) -> Record:
    """Every recorded step of ``_random_workload`` for each seed, in order."""
    record: Record = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as disk_dir:
            _random_workload(seed, record, disk_dir)
    return record


def digests(record: Record) -> list[str]:
    """One line per step: its name, then digests of its events and of its state."""
    return [f"{step['run']} {step['step']} {_digest(step['events'])} {_digest(step['state'])}" for step in record]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


WORKLOADS: tuple[Callable[[Record], None], ...] = (_sliding_window, _no_reuse)


def run_workload() -> Record:
    """Every step's record of the three managers, in order."""
    record: Record = []
    with tempfile.TemporaryDirectory() as disk_dir:
        _full_attention_tiers(record, disk_dir)
        _two_pool_groups(record, disk_dir)
    for workload in WORKLOADS:
        workload(record)
    return record


def compact(record: Record) -> Record:
    """``record`` with each state section replaced by a digest of its canonical JSON (events kept whole)."""
    out = []
    for step in record:
        state = {k: _digest(v) for k, v in step["state"].items()}
        out.append({"run": step["run"], "step": step["step"], "events": step["events"], "state": state})
    return out


RANDOM_SEEDS = range(24)


def main(argv: list[str]) -> None:
    record = compact(run_workload())
    with open(argv[1], "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(step, separators=(",", ":")) for step in record) + "\n]\n")
    print(f"{len(record)} steps, {sum(len(s['events']) for s in record)} events -> {argv[1]}")
    if len(argv) > 2:
        lines = digests(run_random_workloads(RANDOM_SEEDS))
        with open(argv[2], "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"{len(lines)} random-workload steps -> {argv[2]}")


if __name__ == "__main__":
    main(sys.argv)
