"""Offload/onboard bandwidth of the copy engine per tier pair, next to plain torch copies of the same bytes.

For every pair (primary->host, host->primary, host->disk, disk->host, primary->disk, disk->primary; on
CUDA the primary is the device, so the first two are device<->pinned) it copies ``--copy`` whole slots
of an attention-shaped cache, scattered (random slot ids: nothing coalesces) and consecutive (one run
per pool), and reports the median GB/s over ``--repeat`` runs. Then, at manager level, one suspended
request of ``--copy`` blocks is offloaded (another request takes the whole primary tier) and onboarded
by its ``resume``, once with a host tier and once with a disk tier below the primary; the engine's
scattered figures of the same pair are its baseline. Baselines measured in the same run:
- torch: one ``copy_`` per slot of the same slots between the same two memory tiers (for disk pairs,
  between their memory side and the host tier), and one contiguous ``copy_`` of the same byte count;
- file: one sequential aligned write/read of the same number of bytes to/from the same pool file.

    PYTHONPATH=. python benchmarks/bench_tiers.py [--device cuda:0] [--blocks 192 --copy 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvxfer.cache.config import CacheConfig
from kvxfer.cache.copy_engine import CopyEngine
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.tiers import (
    DiskTierStorage,
    MemoryTierStorage,
    TierStorage,
    open_host_tier,
    primary_tier_of,
)

RESULTS = Path(__file__).resolve().parent / "results"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], repeat: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rows(tier: MemoryTierStorage, pg: int, pool: int) -> torch.Tensor:
    desc = tier.layout.pool_groups[pg].pools[pool]
    return tier.pool_tensor(pg, pool).view(desc.num_slots, desc.slot_bytes)


def _torch_slot_copy(src: MemoryTierStorage, dst: MemoryTierStorage, s: np.ndarray,
                     d: np.ndarray) -> Callable[[], None]:
    """Plain torch: one ``copy_`` per slot and pool (``index_select``/``index_copy_`` on uint8 rows is
    slower still on CPU, so the loop is the fair baseline)."""
    pools = src.layout.pool_groups[0].pools
    pairs = [(_rows(src, 0, p.pool_index), _rows(dst, 0, p.pool_index)) for p in pools]
    idx = list(zip(s.tolist(), d.tolist(), strict=True))

    def run() -> None:
        for a, b in pairs:
            for i, j in idx:
                b[j].copy_(a[i], non_blocking=True)

    return run


def _torch_contiguous(src: MemoryTierStorage, dst: MemoryTierStorage, nbytes: int) -> Callable[[], None]:
    """Plain torch: one contiguous ``copy_`` of the same byte count between the two tiers (the ceiling)."""
    a = src.pool_tensor(0, 0)[:nbytes]
    b = dst.pool_tensor(0, 0)[:nbytes]

    def run() -> None:
        b.copy_(a, non_blocking=True)

    return run


def _engine_copy(engine: CopyEngine, src: TierStorage, dst: TierStorage, s: np.ndarray, d: np.ndarray) -> None:
    engine.copy_slots(src, dst, 0, s, d).wait(600)


def _file_copy(disk: DiskTierStorage, nbytes: int, write: bool) -> Callable[[], None]:
    size = min(nbytes, disk.layout.pool_groups[0].pools[0].nbytes) // 4096 * 4096
    raw = torch.empty(size + 4096, dtype=torch.uint8)
    skew = (-raw.data_ptr()) % 4096
    buf = raw[skew:skew + size].numpy()
    buf[:] = 7

    def run() -> None:
        (disk.write_from if write else disk.read_into)(0, 0, buf.data)

    return run


def _manager_round_trip(cfg: CacheConfig, copy: int, repeat: int, device: torch.device) -> dict[str, float]:
    """Manager level: a suspended request of ``copy`` blocks is offloaded when another request takes
    the whole primary tier (timed: that ``resize``), then onboarded by its ``resume`` (timed).
    Median seconds over ``repeat`` rounds after one warm-up round."""
    manager = KVCacheManager(cfg)
    try:
        tpb = cfg.tokens_per_block
        primary = manager.layout.pool_groups[0].num_slots
        req = manager.create_kv_cache_for_prompt(None, "request")
        assert req.resume() and req.resize(copy * tpb)
        for pg in manager.layout.pool_groups:
            for p in pg.pools:
                t = manager.pool_tensor(pg.pool_group_index, p.pool_index)
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8).to(t.device))
        offload, onboard = [], []
        for _ in range(repeat + 1):
            req.suspend()
            other = manager.create_kv_cache_for_prompt(None, "pressure")
            assert other.resume()
            _sync(device)
            t0 = time.perf_counter()
            assert other.resize(primary * tpb)
            _sync(device)
            offload.append(time.perf_counter() - t0)
            assert int((req.page_tiers(0) > 0).sum()) == copy
            other.close()
            t0 = time.perf_counter()
            assert req.resume()
            _sync(device)
            onboard.append(time.perf_counter() - t0)
        req.close()
        slot_bytes = sum(p.slot_bytes for p in manager.layout.pool_groups[0].pools)
        return {"bytes": copy * slot_bytes, "offload_s": statistics.median(offload[1:]),
                "onboard_s": statistics.median(onboard[1:])}
    finally:
        manager.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=192, help="slots per tier")
    ap.add_argument("--copy", type=int, default=64, help="slots moved per transfer")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--staging-mib", type=int, default=32)
    ap.add_argument("--disk-path", default=None, help="directory for the disk tier (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "bench_tiers.json"))
    args = ap.parse_args(argv)

    disk_dir = args.disk_path or tempfile.mkdtemp(prefix="kvxfer-bench-tiers-")
    # Llama-3-8B-shaped layers (8 KV heads x 128, bf16, 32 tokens/block): 64 KiB buffers, 1 MiB slots at 8 layers
    cfg = CacheConfig.for_model(args.layers, 8, 128, 32, "bfloat16", args.blocks, args.device,
                                host_blocks=args.blocks, disk_blocks=args.blocks, disk_path=disk_dir)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the engine copies on one thread: compare like with like
    # The raw rows use standalone tiers: the manager contributes only its primary pools.
    manager = KVCacheManager(dataclasses.replace(cfg, tiers=cfg.tiers[:1]))
    tiers: dict[str, TierStorage] = {"primary": primary_tier_of(manager), "host": open_host_tier(cfg),
                                     "disk": DiskTierStorage(cfg)}
    rng = np.random.default_rng(0)
    for tier in tiers.values():
        if isinstance(tier, MemoryTierStorage):
            for pg in tier.layout.pool_groups:
                for p in pg.pools:
                    tier.pool_tensor(pg.pool_group_index, p.pool_index).copy_(
                        torch.from_numpy(rng.integers(0, 256, p.nbytes, dtype=np.uint8)))
    slot_bytes = sum(p.slot_bytes for p in tiers["host"].layout.pool_groups[0].pools)
    nbytes = args.copy * slot_bytes
    rows = []
    engine = CopyEngine(staging_bytes=args.staging_mib << 20)
    try:
        for a, b in [("primary", "host"), ("host", "primary"), ("host", "disk"), ("disk", "host"),
                     ("primary", "disk"), ("disk", "primary")]:
            src, dst = tiers[a], tiers[b]
            for pattern in ("scattered", "consecutive"):
                if pattern == "scattered":
                    s = rng.choice(args.blocks, args.copy, replace=False).astype(np.int64)
                    d = rng.choice(args.blocks, args.copy, replace=False).astype(np.int64)
                else:
                    s = np.arange(args.copy, dtype=np.int64)
                    d = np.arange(args.blocks - args.copy, args.blocks, dtype=np.int64)
                runs = engine.copy_slots(src, dst, 0, s, d)
                runs.wait(600)
                t_engine = _timed(functools.partial(_engine_copy, engine, src, dst, s, d), args.repeat, device)
                mem_src = src if isinstance(src, MemoryTierStorage) else tiers["host"]
                mem_dst = dst if isinstance(dst, MemoryTierStorage) else tiers["host"]
                t_torch = t_contig = None
                if mem_src is not mem_dst:
                    assert isinstance(mem_src, MemoryTierStorage) and isinstance(mem_dst, MemoryTierStorage)
                    t_torch = _timed(_torch_slot_copy(mem_src, mem_dst, s, d), args.repeat, device)
                    t_contig = _timed(_torch_contiguous(mem_src, mem_dst, nbytes), args.repeat, device)
                t_file = None
                if "disk" in (a, b):
                    disk = tiers["disk"]
                    assert isinstance(disk, DiskTierStorage)
                    t_file = _timed(_file_copy(disk, nbytes, write=b == "disk"), args.repeat, device)
                rows.append({
                    "pair": f"{a}({src.memory_kind})->{b}({dst.memory_kind})", "pattern": pattern,
                    "bytes": nbytes, "runs": runs.num_runs,
                    "engine_gbps": nbytes / t_engine / 1e9,
                    "torch_gbps": nbytes / t_torch / 1e9 if t_torch else None,
                    "torch_contiguous_gbps": nbytes / t_contig / 1e9 if t_contig else None,
                    "file_seq_gbps": nbytes / t_file / 1e9 if t_file else None,
                })
        stats = engine.stats
        for tier in tiers.values():
            tier.close()
        # Manager level: suspend -> pressure -> resume of one request, per colder tier.
        manager_rows = []
        for below, kw in (("host", {"host_blocks": args.blocks}),
                          ("disk", {"disk_blocks": args.blocks, "disk_path": disk_dir})):
            mcfg = CacheConfig.for_model(args.layers, 8, 128, 32, "bfloat16", args.blocks, args.device, **kw)
            got = _manager_round_trip(mcfg, args.copy, args.repeat, device)
            engine_row = {r["pair"].split("(")[0] + "->" + r["pair"].split("->")[1].split("(")[0]: r
                          for r in rows if r["pattern"] == "scattered"}
            manager_rows.append({
                "tiers": f"primary({tiers['primary'].memory_kind})<->{below}", "bytes": got["bytes"],
                "offload_gbps": got["bytes"] / got["offload_s"] / 1e9,
                "onboard_gbps": got["bytes"] / got["onboard_s"] / 1e9,
                "engine_offload_gbps": engine_row[f"primary->{below}"]["engine_gbps"],
                "engine_onboard_gbps": engine_row[f"{below}->primary"]["engine_gbps"],
            })
    finally:
        engine.close()
        for tier in tiers.values():
            tier.close()
        if args.disk_path is None:
            shutil.rmtree(disk_dir, ignore_errors=True)

    header = f"{'pair':<28} {'pattern':<12} {'MiB':>6} {'runs':>5} {'engine GB/s':>12} {'torch GB/s':>11} " \
             f"{'ratio':>6} {'torch contig':>13} {'file seq GB/s':>14}"
    print(header)
    print("-" * len(header))
    for r in rows:
        torch_s = f"{r['torch_gbps']:.2f}" if r["torch_gbps"] else "-"
        ratio = f"{r['engine_gbps'] / r['torch_gbps']:.2f}" if r["torch_gbps"] else "-"
        file_s = f"{r['file_seq_gbps']:.2f}" if r["file_seq_gbps"] else "-"
        contig = f"{r['torch_contiguous_gbps']:.2f}" if r["torch_contiguous_gbps"] else "-"
        print(f"{r['pair']:<28} {r['pattern']:<12} {r['bytes'] / 2**20:>6.0f} {r['runs']:>5} "
              f"{r['engine_gbps']:>12.2f} {torch_s:>11} {ratio:>6} {contig:>13} {file_s:>14}")
    print(f"cuda batched calls: {stats.cuda_batch_calls}, single calls: {stats.cuda_single_calls}, "
          f"fallback: {stats.cuda_fallback_reason}, ring wraps: {stats.ring_wraps}")
    print()
    mheader = f"{'manager round trip':<28} {'MiB':>6} {'offload GB/s':>13} {'engine GB/s':>12} " \
              f"{'onboard GB/s':>13} {'engine GB/s':>12}"
    print(mheader)
    print("-" * len(mheader))
    for m in manager_rows:
        print(f"{m['tiers']:<28} {m['bytes'] / 2**20:>6.0f} {m['offload_gbps']:>13.2f} "
              f"{m['engine_offload_gbps']:>12.2f} {m['onboard_gbps']:>13.2f} {m['engine_onboard_gbps']:>12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "bench_tiers", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": args.device,
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "args": vars(args), "slot_bytes": slot_bytes, "rows": rows, "manager_rows": manager_rows,
        "cuda": {"batch_calls": stats.cuda_batch_calls, "single_calls": stats.cuda_single_calls,
                 "fallback_reason": stats.cuda_fallback_reason, "batch_supported": stats.cuda_batch_supported},
    }, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
