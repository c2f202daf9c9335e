"""Extractor benchmark: Llama-3-70B KV shape, 128k tokens, vectorised extract/plan next to a
straightforward per-(layer, block) Python loop doing the identical job in the same run; then the
templated plans (``plan_templated``: one BlockPlan per segment shape) of every layout pair, 70B/128k and
Llama-3-8B/4k, with their planning time (warm: the layout pair's templates made by an earlier request;
cold: this request makes them) and their size (slot pairs + template runs) next to the runs their
expansion lists; with ``--workers``, the workers' path (``multirank.plan_between`` with a per-peer
``TemplateCache``) against the entry-per-run planner, Llama-3-8B shape, both plans checked equal.

Layouts are built with plan_layout + place_layout at fake, non-overlapping addresses: the extractor
only reads descriptors, so no 40 GiB pool is allocated.

    PYTHONPATH=$PWD python benchmarks/bench_extractor.py [--tokens 131072] [--layers 80] [--templated-only]
    PYTHONPATH=$PWD python benchmarks/bench_extractor.py --workers [--tokens 4096] [--layers 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.cache import BufferId, CacheConfig, CacheLayoutDesc
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.extractor import TemplateCache, extract, multirank, placements, plan_templated, plan_transfer
from kvxfer.extractor import blocks as extractor_blocks
from kvxfer.pagetable import PageTable, PhasedPlan, TransferPlan
from kvxfer.pagetable.affine import AffineGroups

SRC_BASE, DST_BASE = 0x7F00_0000_0000, 0x7A00_0000_0000


def layout(cfg: CacheConfig, base: int) -> CacheLayoutDesc:
    plan = plan_layout(cfg)
    bases, nxt = [], base
    for pg in plan.pool_groups:
        bases.append([])
        for pool in pg.pools:
            bases[-1].append(nxt)
            nxt += pool.nbytes + (1 << 20)
    return place_layout(plan, bases, "cuda", 0)


def config(layers: int, tpb: int, blocks: int, **kw: Any) -> CacheConfig:
    return CacheConfig.for_model(layers, 8, 128, tpb, "bfloat16", blocks, device="cpu", **kw)


def templated_rows(model: str, layers: int, tokens: int, repeat: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """plan_templated for every layout pair of one model shape (8 KV heads, head_dim 128, bf16, 32 tokens
    per block at the source), fragmented destination slots: warm and cold planning time, phases, slot
    pairs + template runs (the plan's size) and the runs its expansion would list."""
    tpb = 32
    blocks = math.ceil(tokens / tpb)
    spare = 2 * blocks + 64
    base = config(layers, tpb, spare)
    src = layout(base, SRC_BASE)
    src_ids = rng.permutation(spare)[:blocks].astype(np.int32)
    cases: dict[str, CacheConfig] = {
        "identical": base,
        "TP 1->2 (rank 0), HND": config(layers, tpb, spare, tp_size=2, tp_rank=0),
        "tokens/block 32->64": config(layers, 64, spare),
        "tokens/block 32->16": config(layers, 16, 2 * spare),
        "HND->NHD, all layers": dataclasses.replace(base, head_order="NHD"),
        "TP 1->2 + tokens/block 32->16": config(layers, 16, 2 * spare, tp_size=2, tp_rank=1),
        "TP 1->2 + 32->64, NHD": config(layers, 64, spare, tp_size=2, tp_rank=0, head_order="NHD"),
    }
    rows = []
    for name, cfg in cases.items():
        dst = layout(cfg, DST_BASE)
        need = math.ceil(tokens / cfg.tokens_per_block)
        slots = dst.pool_groups[dst.layer_groups[0].pool_group_index].num_slots
        dst_ids = rng.permutation(slots)[:need].astype(np.int32)

        def plan(dst: CacheLayoutDesc = dst, dst_ids: np.ndarray = dst_ids) -> Any:
            return plan_templated(src, {0: src_ids}, dst, {0: dst_ids})
        with extractor_blocks._templates_lock:
            extractor_blocks._templates.clear()
        t0 = time.perf_counter()
        phases = plan()
        cold = time.perf_counter() - t0
        warm, phases = best(plan, repeat)
        assert phases is not None, name
        # A later prompt ending one token short of the last block: its last segment is a shape of its own.
        t0 = time.perf_counter()
        assert plan_templated(src, {0: src_ids}, dst, {0: dst_ids}, token_range=(0, tokens - 1)) is not None
        new_end = time.perf_counter() - t0
        # What a device kernel takes instead of the template runs: its affine groups (made once per template).
        t0 = time.perf_counter()
        groups = sum(len(AffineGroups.of(p)) for p in phases)
        group_ms = (time.perf_counter() - t0) * 1e3
        rows.append({"model": model, "case": name, "warm_ms": warm * 1e3, "cold_ms": cold * 1e3,
                     "affine_groups": groups, "grouping_ms": group_ms,
                     "new_end_ms": new_end * 1e3,
                     "phases": len(phases), "slot_pairs": sum(p.num_blocks for p in phases),
                     "template_runs": sum(p.runs_per_block for p in phases),
                     "expanded_runs": sum(len(p) for p in phases),
                     "min_run_bytes": min(int(p.nbytes.min()) for p in phases if p.runs_per_block),
                     "bytes": sum(p.total_bytes for p in phases)})
    return rows


def print_templated(rows: list[dict[str, Any]]) -> None:
    print(f"{'templated plan (fragmented destination slots)':48} {'warm ms':>8} {'cold ms':>8} {'new end ms':>10} "
          f"{'phases':>6} {'slot pairs':>10} {'tmpl runs':>9} {'groups':>7} {'grouping ms':>11} {'expanded runs':>13} "
          f"{'min run B':>9}")
    for r in rows:
        print(f"{r['model'] + ', ' + r['case']:48} {r['warm_ms']:8.3f} {r['cold_ms']:8.1f} {r['new_end_ms']:10.2f} "
              f"{r['phases']:6d} {r['slot_pairs']:10d} {r['template_runs']:9d} {r['affine_groups']:7d} "
              f"{r['grouping_ms']:11.2f} {r['expanded_runs']:13d} {r['min_run_bytes']:9d}")


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time of ``repeat`` runs (seconds) and the last result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


# --- the straightforward loops (the baseline) -------------------------------------------------------
def loop_extract(lay: CacheLayoutDesc, ids: np.ndarray) -> list[tuple[int, int]]:
    """Per (block, layer, role): the buffer's address; buffers of one slot that touch are merged."""
    place = placements(lay)
    bufs = [(p.base, p.slot_bytes, p.fmt.nbytes) for p in sorted(place.values(), key=lambda p: (p.region, p.offset))]
    out: list[tuple[int, int]] = []
    for b in ids.tolist():
        if b < 0:
            continue
        last_end = -1
        for base, slot_bytes, size in bufs:
            addr = base + b * slot_bytes
            if addr == last_end:
                a, n = out[-1]
                out[-1] = (a, n + size)
            else:
                out.append((addr, size))
            last_end = addr + size
    return out


def loop_plan(src: CacheLayoutDesc, src_ids: np.ndarray, dst: CacheLayoutDesc, dst_ids: np.ndarray,
              layers: list[int]) -> tuple[list[tuple[int, int, int]], int]:
    """Per (layer, role, block segment): the runs contiguous on both sides, computed with scalar Python;
    then sorted by source address and coalesced. Returns (entries, raw entry count)."""
    sp, dp = placements(src), placements(dst)
    raw: list[tuple[int, int, int]] = []
    ts_, td_ = src.tokens_per_block, dst.tokens_per_block
    cover = min(len(src_ids) * ts_, len(dst_ids) * td_)
    sids, dids = src_ids.tolist(), dst_ids.tolist()
    for lid in layers:
        for role in ("key", "value"):
            a, b = sp[BufferId(lid, role)], dp[BufferId(lid, role)]
            fs, fd = a.fmt, b.fmt
            h0 = max(fs.head_start, fd.head_start)
            k = min(fs.head_start + fs.num_heads, fd.head_start + fd.num_heads) - h0
            if k <= 0:
                continue
            row = fs.head_dim * fs.itemsize
            shs, sts = (ts_ * row, row) if fs.order == "HND" else (row, fs.num_heads * row)
            shd, std = (td_ * row, row) if fd.order == "HND" else (row, fd.num_heads * row)
            t = 0
            while t < cover:
                n = min((t // ts_ + 1) * ts_, (t // td_ + 1) * td_, cover) - t
                s_slot, d_slot = sids[t // ts_], dids[t // td_]
                if s_slot >= 0 and d_slot >= 0:
                    s0 = a.base + s_slot * a.slot_bytes + (h0 - fs.head_start) * shs + (t % ts_) * sts
                    d0 = b.base + d_slot * b.slot_bytes + (h0 - fd.head_start) * shd + (t % td_) * std
                    if sts == row and std == row:
                        if k == 1 or (shs == n * row and shd == n * row):
                            raw.append((s0, d0, k * n * row))
                        else:
                            for h in range(k):
                                raw.append((s0 + h * shs, d0 + h * shd, n * row))
                    elif shs == row and shd == row:
                        if n == 1 or (sts == k * row and std == k * row):
                            raw.append((s0, d0, k * n * row))
                        else:
                            for j in range(n):
                                raw.append((s0 + j * sts, d0 + j * std, k * row))
                    else:
                        for h in range(k):
                            for j in range(n):
                                raw.append((s0 + h * shs + j * sts, d0 + h * shd + j * std, row))
                t += n
    raw_count = len(raw)
    raw.sort()
    out: list[tuple[int, int, int]] = []
    for s, d, n in raw:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            ps, pd, pn = out[-1]
            out[-1] = (ps, pd, pn + n)
        else:
            out.append((s, d, n))
    return out, raw_count


def same_plan(plan: TransferPlan, entries: list[tuple[int, int, int]]) -> bool:
    arr = np.array(entries, dtype=np.uint64).reshape(-1, 3)
    return (len(plan) == len(entries) and np.array_equal(plan.src.addr, arr[:, 0])
            and np.array_equal(plan.dst.addr, arr[:, 1]) and np.array_equal(plan.src.nbytes, arr[:, 2]))


def same_table(table: PageTable, entries: list[tuple[int, int]]) -> bool:
    arr = np.array(entries, dtype=np.uint64).reshape(-1, 2)
    return len(table) == len(entries) and np.array_equal(table.addr, arr[:, 0]) and np.array_equal(table.nbytes, arr[:, 1])


def worker_rows(layers: int, tokens: int, repeat: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The workers' planning of one request between differing layouts (16 tokens per block at the source,
    fragmented slots): ``multirank.plan_between`` without templates against it with the peer's templates
    warm, and ``multirank.plan_phased`` (the same templates, no expansion: what layer-wise pushes and pulls
    post); the plans must list the same runs (ValueError otherwise)."""
    tpb = 16
    blocks = math.ceil(tokens / tpb)
    spare = 2 * blocks + 64

    def ranks(tp: int, tpb_: int, nblocks: int, base: int, **kw: Any) -> list[CacheLayoutDesc]:
        out = []
        for r in range(tp):
            cfg = config(layers, tpb_, nblocks, **({"tp_size": tp, "tp_rank": r} if tp > 1 else {}))
            out.append(layout(dataclasses.replace(cfg, **kw) if kw else cfg, base + r * (1 << 40)))
        return out

    src = ranks(1, tpb, spare, SRC_BASE)
    src_ids = [{0: rng.permutation(spare)[:blocks].astype(np.int64)}]
    cases: dict[str, tuple[int, int, int, dict[str, Any]]] = {
        "TP 1->2": (2, tpb, spare, {}), "tokens/block 16->32": (1, 32, spare, {}),
        "tokens/block 16->8": (1, 8, 2 * spare, {}), "HND->NHD": (1, tpb, spare, {"head_order": "NHD"}),
        "TP 1->2 + 16->8 + NHD": (2, 8, 2 * spare, {"head_order": "NHD"})}
    rows = []
    for name, (tp, dst_tpb, nblocks, kw) in cases.items():
        dst = ranks(tp, dst_tpb, nblocks, DST_BASE, **kw)
        dst_ids = [{0: rng.permutation(nblocks)[:math.ceil(tokens / dst_tpb)].astype(np.int64)} for _ in dst]
        cache = TemplateCache()

        def plan(templates: TemplateCache | None, dst: list[CacheLayoutDesc] = dst,
                 dst_ids: list[dict[int, np.ndarray]] = dst_ids) -> TransferPlan:
            return multirank.plan_between(src, src_ids, dst, dst_ids, token_range=(0, tokens), templates=templates)

        def phases(dst: list[CacheLayoutDesc] = dst, dst_ids: list[dict[int, np.ndarray]] = dst_ids,
                   cache: TemplateCache = cache) -> PhasedPlan:
            return multirank.plan_phased(src, src_ids, dst, dst_ids, token_range=(0, tokens), templates=cache)

        t_plain, plain = best(functools.partial(plan, None), repeat)
        plan(cache)   # the first request of the layout pair makes the templates
        t_tmpl, templated = best(functools.partial(plan, cache), repeat)
        t_phased, phased = best(phases, repeat)
        if runs_of(plain) != runs_of(templated) or runs_of(phased.expand()) != runs_of(templated):
            raise ValueError(f"{name}: the templated or phased plan differs from the entry-per-run plan")
        size = sum(p.num_blocks + p.runs_per_block for p in phased.phases)
        rows.append({"case": name, "plain_ms": t_plain * 1e3, "templated_ms": t_tmpl * 1e3,
                     "speedup": t_plain / t_tmpl, "runs": len(templated), "phased_ms": t_phased * 1e3,
                     "phases": len(phased.phases), "phased_size": size})
    print(f"{'case':24} {'entry-per-run ms':>17} {'templated ms':>13} {'speed-up':>9} {'runs':>11} "
          f"{'phased ms':>10} {'phases':>7} {'slots+runs':>11}")
    for r in rows:
        print(f"{r['case']:24} {r['plain_ms']:17.2f} {r['templated_ms']:13.2f} {r['speedup']:8.1f}x {r['runs']:11,} "
              f"{r['phased_ms']:10.2f} {r['phases']:7} {r['phased_size']:11,}")
    return rows


def runs_of(plan: TransferPlan) -> list[tuple[int, ...]]:
    """A plan's runs in a canonical form (planners may cut runs that meet by chance differently)."""
    plan = plan.sort_by_source().coalesce()
    cols = (plan.src.addr, plan.src.region, plan.dst.addr, plan.dst.region, plan.src.nbytes)
    return sorted(zip(*(c.tolist() for c in cols), strict=True))


# --- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/extractor.json")
    ap.add_argument("--templated-only", action="store_true", help="only the templated plans (skips the loops)")
    ap.add_argument("--workers", action="store_true",
                    help="only the workers' planning path, 8B shape by default (--tokens 4096 --layers 32)")
    args = ap.parse_args(argv)
    if args.workers:
        worker_rows(args.layers if args.layers != 80 else 32, args.tokens if args.tokens != 131072 else 4096,
                    min(args.repeat, 3), np.random.default_rng(3))
        return 0
    templated = templated_rows(f"70B/{args.tokens // 1024}k", args.layers, args.tokens, args.repeat,
                               np.random.default_rng(1)) + \
        templated_rows("8B/4k", 32, 4096, args.repeat, np.random.default_rng(2))
    print_templated(templated)
    if args.templated_only:
        return 0
    tpb = 32
    blocks = math.ceil(args.tokens / tpb)
    rng = np.random.default_rng(0)
    spare = blocks + 64
    base_cfg = config(args.layers, tpb, spare)
    src = layout(base_cfg, SRC_BASE)
    src_ids = np.arange(blocks, dtype=np.int32)
    contiguous = {0: src_ids}
    fragmented = {0: rng.permutation(spare)[:blocks].astype(np.int32)}
    targets: dict[str, tuple[CacheLayoutDesc, np.ndarray, list[int]]] = {}
    every = list(range(args.layers))
    targets["identical, contiguous slots"] = (layout(base_cfg, DST_BASE), np.arange(7, 7 + blocks, dtype=np.int32), every)
    targets["identical, fragmented slots"] = (layout(base_cfg, DST_BASE),
                                               rng.permutation(spare)[:blocks].astype(np.int32), every)
    targets["TP 1->2 (rank 0), HND"] = (layout(config(args.layers, tpb, spare, tp_size=2, tp_rank=0), DST_BASE),
                                         np.arange(blocks, dtype=np.int32), every)
    targets["tokens/block 32->64"] = (layout(config(args.layers, 64, spare // 2 + 1), DST_BASE),
                                      np.arange(math.ceil(blocks / 2), dtype=np.int32), every)
    targets["HND->NHD, one layer"] = (layout(dataclasses.replace(base_cfg, head_order="NHD"), DST_BASE),
                                      np.arange(blocks, dtype=np.int32), [0])
    rows: list[dict[str, Any]] = []

    # extract: the whole request, every buffer (whole-slot entries)
    for name, ids in (("extract, contiguous slots", contiguous), ("extract, fragmented slots", fragmented)):
        t_vec, table = best(lambda ids=ids: extract(src, ids), args.repeat)
        t0 = time.perf_counter()
        looped = loop_extract(src, ids[0])
        t_loop = time.perf_counter() - t0
        assert same_table(table, looped), name
        rows.append({"case": name, "vectorised_ms": t_vec * 1e3, "loop_ms": t_loop * 1e3,
                     "speedup": t_loop / t_vec, "raw_entries": args.layers * 2 * blocks,
                     "entries": len(table), "coalesced_entries": len(table.coalesce())})

    for name, (dst, dst_ids, layers) in targets.items():
        s_ids = fragmented[0] if "fragmented" in name else src_ids
        one = layers if len(layers) < args.layers else None
        reps = args.repeat if "identical" in name else 3
        t_vec, plan = best(lambda dst=dst, dst_ids=dst_ids, s_ids=s_ids, one=one: plan_transfer(
            src, {0: s_ids}, dst, {0: dst_ids}, layers=one), reps)
        t0 = time.perf_counter()
        looped, raw = loop_plan(src, s_ids, dst, dst_ids, layers)
        t_loop = time.perf_counter() - t0
        assert same_plan(plan, looped), name
        rows.append({"case": f"plan, {name}", "vectorised_ms": t_vec * 1e3, "loop_ms": t_loop * 1e3,
                     "speedup": t_loop / t_vec, "raw_entries": raw, "entries": len(plan),
                     "coalesced_entries": len(plan), "bytes": plan.total_bytes})

    print(f"Llama-3-70B KV shape: {args.layers} layers x (key, value), 8 KV heads, head_dim 128, bf16, "
          f"32 tokens/block, {args.tokens} tokens ({blocks} blocks)")
    print(f"{'case':44} {'vectorised ms':>13} {'loop ms':>10} {'speed-up':>9} {'raw entries':>12} {'final':>8}")
    for r in rows:
        final = r["coalesced_entries"]
        print(f"{r['case']:44} {r['vectorised_ms']:13.3f} {r['loop_ms']:10.1f} {r['speedup']:8.0f}x "
              f"{r['raw_entries']:12d} {final:8d}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                               "machine": platform.platform(), "python": platform.python_version(),
                               "numpy": np.__version__, "tokens": args.tokens, "layers": args.layers,
                               "rows": rows, "templated": templated}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
