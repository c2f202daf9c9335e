"""``kvxfer bench e2e``: time to first token and decode-side KV arrival, disaggregated (a prefill process
started with ``kvxfer serve prefill``, a decode worker in this process, over a UCX transport on
127.0.0.1) next to one process doing prefill itself, for each prompt length.

Every request uses a fresh random prompt (no prefix hit anywhere) and one output token, so TTFT is
prompt -> KV computed -> KV moved -> first token on decode. Figures are medians over ``--iters``.
"after prefill" is the time from the end of prefill's compute to the KV in place (and verified) on decode,
read from prefill's clock (``kv_posted``, push) and decode's: both run on this host. It splits into
"post" (prefill: compute end to the last write posted: hand-off, planning), "landing" (the last post to
decode seeing the data in place: the copy, the transport's notification, decode's wake-up; also the
"transfer" column, and its GB/s) and "verify" (with ``--checksum``: decode's check). Where prefill's clock
is not reported (pull), "after prefill" falls back to "overhead". "overhead" is TTFT minus prefill's
compute: everything that is not the model, before its compute as well as after, split into "request"
(decode: submit to ``kv_request`` sent; the prompt goes before decode allocates its destination blocks,
so that allocation, column "alloc", overlaps prefill's compute), "queued" (prefill: request arrival to
its compute starting: source blocks allocated, hand-off to the compute thread), "post", the transfer as
decode measured it (push: from prefill's ``kv_posted`` to the data in place), "verify" and "messages"
(what is left: control messages, the completion notification, engine wake-ups). TTFT ends at
arrival (the first token, prefill's, is known and its KV in place and verified: a streaming server sends
it then); "commit" (decode entering the prompt's blocks into its prefix tree) follows it, as the
one-process baseline's commit would follow its first token (the baseline does not commit).

The one-process baseline uses prefill's cache configuration (prefix reuse on, the same block count)
and looks the prompt up in its prefix tree as a serving engine would, so both sides pay the same
cache bookkeeping; the two alternate which runs first on each iteration. ``--device cuda:N`` runs both workers and the one-process
baseline on that GPU (``--backend cuda_ipc`` moves KV through CUDA IPC); the goal there is
"after prefill" <= 1 ms + KV bytes / (0.8 x D2D), with D2D (device copy, bytes/s) measured in the run.

``--tokens-per-block`` and ``--head-order`` set prefill's (and the baseline's) cache layout;
``--decode-tokens-per-block`` and ``--decode-head-order`` give decode another one (default: prefill's), so
every transfer changes layout on the way (the workers plan the pairing themselves) and TTFT includes it.

Every timed request is verified (untimed): the single-process baseline runs on the same prompt, and
decode's committed prompt KV (``--kv-positions`` stratified positions, read from its pages after the
first token) must equal the baseline's by (layer, role, token, head) within the KV oracle's tolerance,
and the first tokens must agree (``verified``; exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.cache.config import HeadOrder
from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.output import print_json
from kvxfer.cli.serve import parse_checksum
from kvxfer.disagg.auth import SECRET_ENV
from kvxfer.disagg.oracle import (
    DEFAULT_POSITIONS,
    TOLERANCE,
    PromptKV,
    compare_kv,
    positions_within,
    read_prompt_kv,
)
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker, one_host_landing_s
from kvxfer.errors import ConfigError
from kvxfer.model import PRESETS, ReferenceModel, greedy, preset
from kvxfer.transport import best_backend
from kvxfer.transport.integrity import ChecksumPolicy
from kvxfer.transport.registry import AUTO_PREFERENCE

TOKENS_PER_BLOCK = 16
HEAD_ORDERS: tuple[HeadOrder, ...] = ("HND", "NHD")


def layout_of(layout: CacheLayoutDesc) -> dict[str, Any]:
    """The block size and page order a worker's published layout has (one order: its pages share it)."""
    orders = sorted({fmt.order for _, fmt in layout.formats})
    return {"tokens_per_block": layout.tokens_per_block, "head_order": "/".join(orders)}


def layout_name(layout: dict[str, Any]) -> str:
    """``16 tokens/block HND``: one side's layout as the table's title names it."""
    return f"{layout['tokens_per_block']} tokens/block {layout['head_order']}"


def d2d_bytes_per_s(device: str) -> float:
    """The device copy limit on ``device``: bytes per second of one 256 MiB ``copy_`` (median of 9)."""
    if not device.startswith("cuda"):
        return 0.0
    a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(9):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        b.copy_(a)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(a.numel() / statistics.median(times))


def single_process_ttft(model: ReferenceModel, manager: KVCacheManager, tokens: np.ndarray, chunk: int,
                        positions: np.ndarray | None = None) -> tuple[float, int, PromptKV | None]:
    """Seconds from prompt to first token when one process prefills (the baseline), the first token, and
    (read after the timing, when ``positions`` are given) the prompt KV at ``positions``. Only the last
    token's logits are computed, as in the prefill worker and in a server (all of them cost an extra
    vocab-wide matmul and, at 16k tokens of a 128k vocabulary, 8 GB of float32 logits)."""
    t0 = time.perf_counter()
    cache = manager.create_kv_cache_for_prompt(tokens)
    try:
        cache.resume()
        kv = model.bind([(manager, cache)])
        with torch.inference_mode():
            first = greedy(model.prefill(kv, tokens, chunk, last_only=True)[-1])   # as prefill workers do
        took = time.perf_counter() - t0
        c = model.config
        prompt = None if positions is None else read_prompt_kv([(manager, cache)], positions, c.num_layers,
                                                                c.num_kv_heads, c.head_dim)
        return took, first, prompt
    finally:
        cache.close()


def run(lengths: list[int], backend: str, mode: str, layerwise: bool, iters: int, chunk: int,
        model_name: str = "tiny", on_row: Callable[[dict[str, Any]], None] | None = None,
        checksum: ChecksumPolicy | None = None, kv_positions: int = DEFAULT_POSITIONS,
        device: str = "cpu", switch_interval_ms: float = 0.5, prepare_writes: bool = True,
        tokens_per_block: int = TOKENS_PER_BLOCK, head_order: HeadOrder = "HND",
        decode_tokens_per_block: int | None = None, decode_head_order: HeadOrder | None = None) -> dict[str, Any]:
    """Measure every length; returns the rows and the set-up (``on_row`` sees each row as it is done;
    ``checksum``: decode verifies every request's pages, so TTFT and arrival include digest and check;
    ``switch_interval_ms``: the GIL switch interval of both processes, as ``kvxfer serve`` takes it;
    ``tokens_per_block``/``head_order``: prefill's and the baseline's cache layout, ``decode_*``: decode's,
    None: prefill's)."""
    d_tpb = tokens_per_block if decode_tokens_per_block is None else decode_tokens_per_block
    d_order = head_order if decode_head_order is None else decode_head_order
    for name, tpb, order in (("", tokens_per_block, head_order), ("decode_", d_tpb, d_order)):
        if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb <= 0:
            raise ConfigError(f"bench e2e: {name}tokens_per_block must be an int > 0, got {tpb!r}")
        if order not in HEAD_ORDERS:
            raise ConfigError(f"bench e2e: {name}head_order must be one of {HEAD_ORDERS}, got {order!r}")
    torch.set_num_threads(1)
    sys.setswitchinterval(switch_interval_ms / 1e3)
    logging.getLogger("kvxfer").setLevel(logging.ERROR)
    backend = best_backend() if backend == "auto" else backend
    cfg = preset(model_name)
    blocks = -(-max(lengths) // tokens_per_block) + 64
    d_blocks = -(-max(lengths) // d_tpb) + 64   # decode holds the same tokens in its own block size
    secret = secrets.token_hex(32)
    env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    d2d = d2d_bytes_per_s(device)
    # One copy of the weights serves the baseline and decode's generation, drawn while the prefill process
    # draws its own (seeded CPU generators, one per tensor, keep them equal; at 8B a copy is ~8e9 draws).
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(ReferenceModel, cfg, device)
        try:
            prefill = WorkerProcess(["prefill", "--backend", backend, "--model", model_name, "--device", device,
                                     "--blocks", str(blocks), "--tokens-per-block", str(tokens_per_block),
                                     "--head-order", head_order,
                                     "--chunk-size", str(chunk), "--name", f"bench-prefill-{os.getpid()}",
                                     "--switch-interval-ms", str(switch_interval_ms),
                                     *([] if prepare_writes else ["--no-prepare-writes"])],
                                    env, 600.0)
        finally:
            ref_model = loading.result()
    rows: list[dict[str, Any]] = []
    layouts: dict[str, dict[str, Any]] = {}
    rng = np.random.default_rng(0)
    try:
        dcfg = WorkerConfig(f"bench-decode-{os.getpid()}", cfg, d_tpb, d_blocks, head_order=d_order, backend=backend,
                            deadline_s=600.0, lease_s=600.0, checksum=checksum, device=device)
        ref_manager = KVCacheManager(cfg.cache_config(tokens_per_block, blocks, device,   # as the prefill worker
                                                      head_order=head_order))
        with DecodeWorker(dcfg, secret, prefill=prefill.address, mode=mode, layerwise=layerwise,
                          model=ref_model) as decode:
            decode.generate(rng.integers(0, cfg.vocab_size, min(lengths)), 1)           # warm-up (connections)
            # The layouts the two sides run with, as decode's handshake with prefill saw them.
            layouts = {"prefill_layout": layout_of(next(iter(decode.peers)).layouts[0]),
                       "decode_layout": layout_of(decode.layouts[0])}
            asked = {"prefill_layout": {"tokens_per_block": tokens_per_block, "head_order": head_order},
                     "decode_layout": {"tokens_per_block": d_tpb, "head_order": d_order}}
            if layouts != asked:
                raise ConfigError(f"bench e2e: the workers run with layouts {layouts}, not the {asked} asked for")
            single_process_ttft(ref_model, ref_manager, rng.integers(0, cfg.vocab_size, min(lengths)), chunk)
            tolerance = TOLERANCE.get(cfg.dtype, 3e-2)
            for n in lengths:
                d_ttft, d_arrival, d_xfer, d_prefill, d_tail, d_verify, s_ttft, nbytes = [], [], [], [], [], [], [], 0
                d_after, d_landing = [], []   # from the two processes' clocks (push, protocol 2)
                stages: dict[str, list[float]] = {k: [] for k in ("request", "queued", "post", "messages", "commit",
                                                                  "allocate")}
                failed, worst = 0, 0.0
                positions = positions_within(n, kv_positions, cfg.kv_spec, seed=n)   # what decode returns
                for i in range(iters):
                    tokens = rng.integers(0, cfg.vocab_size, n)
                    # Alternate which runs first, so neither side always finds the GPU just warmed up.
                    if i % 2:
                        s_took, s_first, s_kv = single_process_ttft(ref_model, ref_manager, tokens, chunk, positions)
                    res = decode.generate(tokens, 1, return_kv=kv_positions)
                    if not i % 2:
                        s_took, s_first, s_kv = single_process_ttft(ref_model, ref_manager, tokens, chunk, positions)
                    assert res.prompt_kv is not None and s_kv is not None
                    if not np.array_equal(res.prompt_kv.positions, positions):
                        raise ConfigError("decode returned the prompt KV at other positions than the benchmark expects")
                    report = compare_kv(res.prompt_kv, s_kv, tolerance)
                    failed += not (report.ok and res.tokens == [s_first])
                    worst = max(worst, report.max_error)
                    d_ttft.append(res.ttft_s)
                    d_arrival.append(res.arrival_s)
                    d_xfer.append(res.transfer_s)
                    d_prefill.append(res.prefill_s)
                    d_tail.append(res.arrival_s - res.prefill_s)
                    d_verify.append(res.verify_s)
                    landing = one_host_landing_s(res.stats())   # both processes run on this host
                    if landing is not None:
                        d_after.append(res.arrived_at - res.prefill_computed_at)
                        d_landing.append(landing)
                    stages["request"].append(res.request_s)
                    stages["queued"].append(res.queued_s)
                    stages["post"].append(res.post_s)
                    stages["messages"].append(res.messages_s)
                    stages["commit"].append(res.commit_s)
                    stages["allocate"].append(res.allocate_s)
                    nbytes = res.bytes_moved
                    s_ttft.append(s_took)
                exact = len(d_after) == iters
                xfer = statistics.median(d_landing if exact else d_xfer)
                overhead_ms = statistics.median(d_tail) * 1e3
                tail_ms = statistics.median(d_after) * 1e3 if exact else overhead_ms
                verify_ms = statistics.median(d_verify) * 1e3
                goal_ms = 1.0 + nbytes / (0.8 * d2d) * 1e3 if d2d else None
                rows.append({"prompt_tokens": n, "kv_bytes": nbytes, "single_ttft_ms": statistics.median(s_ttft) * 1e3,
                             "disagg_ttft_ms": statistics.median(d_ttft) * 1e3,
                             "prefill_compute_ms": statistics.median(d_prefill) * 1e3,
                             "arrival_ms": statistics.median(d_arrival) * 1e3, "transfer_ms": xfer * 1e3,
                             "transfer_gbps": nbytes / xfer / 1e9 if xfer > 0 else 0.0,
                             "after_prefill_ms": tail_ms, "after_prefill_from": "clocks" if exact else "overhead",
                             "landing_ms": statistics.median(d_landing) * 1e3 if exact else None,
                             "overhead_ms": overhead_ms, "verify_ms": verify_ms,
                             "control_ms": statistics.median(t - x - v for t, x, v in zip(d_tail, d_xfer, d_verify,
                                                                                          strict=True)) * 1e3,
                             **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in stages.items()},
                             "after_prefill_goal_ms": goal_ms,
                             "ttft_ratio": statistics.median(d_ttft) / statistics.median(s_ttft),
                             # Each iteration ran both sides back to back: the median of their ratios, and every
                             # iteration's figures (prefill's compute alone spreads by tens of percent on a GPU).
                             "ttft_ratio_paired": statistics.median(d / s for d, s in zip(d_ttft, s_ttft, strict=True)),
                             "per_iteration_ms": {"single_ttft": [t * 1e3 for t in s_ttft],
                                                  "disagg_ttft": [t * 1e3 for t in d_ttft],
                                                  "prefill_compute": [t * 1e3 for t in d_prefill]},
                             "verified": failed == 0, "kv_max_error": worst})
                if on_row is not None:
                    on_row(rows[-1])
    finally:
        prefill.stop()
    return {"backend": backend, "mode": mode, "layerwise": layerwise, "model": model_name, "iters": iters,
            "device": device, "d2d_gbps": d2d / 1e9,
            "chunk_size": chunk, "tokens_per_block": tokens_per_block, "switch_interval_ms": switch_interval_ms,
            **layouts,   # the baseline uses prefill's; decode's KV is compared with it by logical position
            "prepare_writes": prepare_writes, "rows": rows,
            "checksum": "off" if checksum is None else checksum.describe(),
            "verified": all(r["verified"] for r in rows), "kv_positions": kv_positions,
            "verification": "every timed request: decode's prompt KV (kv_positions stratified positions) against "
                            "the single-process baseline run on the same prompt, by (layer, role, token, head), "
                            "and the first token",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


HEADER = (f"{'prompt':>7} {'KV MiB':>7} {'1-proc TTFT ms':>15} {'disagg TTFT ms':>15} {'ratio':>6} {'paired':>6} "
          f"{'prefill ms':>11} "
          f"{'arrival ms':>11} {'after prefill ms':>17} {'post':>7} {'transfer ms':>12} {'GB/s':>7} {'verify ms':>10} "
          f"{'goal ms':>8} {'overhead ms':>12} {'request':>8} {'queued':>7} {'messages':>9} {'commit ms':>10} "
          f"{'alloc ms':>9} KV check")


def format_row(r: dict[str, Any]) -> str:
    """One table line."""
    goal = r.get("after_prefill_goal_ms")
    return (f"{r['prompt_tokens']:>7} {r['kv_bytes'] / 2**20:>7.2f} {r['single_ttft_ms']:>15.1f} "
            f"{r['disagg_ttft_ms']:>15.1f} {r['disagg_ttft_ms'] / r['single_ttft_ms']:>6.3f} "
            f"{r.get('ttft_ratio_paired', float('nan')):>6.3f} "
            f"{r['prefill_compute_ms']:>11.1f} {r['arrival_ms']:>11.1f} "
            f"{r.get('after_prefill_ms', 0.0):>16.2f}{'' if r.get('after_prefill_from') == 'clocks' else '*'} "
            f"{r.get('post_ms', 0.0):>7.2f} {r['transfer_ms']:>12.2f} {r['transfer_gbps']:>7.1f} "
            f"{r.get('verify_ms', 0.0):>10.2f} {'-' if goal is None else f'{goal:.2f}':>8} "
            f"{r.get('overhead_ms', 0.0):>12.2f} {r.get('request_ms', 0.0):>8.2f} {r.get('queued_ms', 0.0):>7.2f} "
            f"{r.get('messages_ms', 0.0):>9.2f} {r.get('commit_ms', 0.0):>10.2f} {r.get('allocate_ms', 0.0):>9.2f} "
            f"{'ok' if r.get('verified', True) else 'MISMATCH'}"
            f" {r.get('kv_max_error', 0.0):.0e}")


def print_table(result: dict[str, Any]) -> None:
    """The figures as a plain table."""
    d2d = f" (D2D {result['d2d_gbps']:.0f} GB/s)" if result.get("d2d_gbps") else ""
    layouts = ""
    if "prefill_layout" in result:
        layouts = (f", prefill {layout_name(result['prefill_layout'])} -> decode "
                   f"{layout_name(result['decode_layout'])}")
    print(f"kvxfer bench e2e: model {result['model']} on {result.get('device', 'cpu')}{d2d}, "
          f"{result['backend']} {result['mode']}"
          f"{' layer-wise' if result['layerwise'] else ''}, chunk {result['chunk_size']}, median of {result['iters']}, "
          f"checksum {result.get('checksum', 'off')}{layouts}; ratio = of the medians, paired = median of each "
          f"iteration's; * after prefill = overhead (prefill reported no clock)")
    print(HEADER)
    for r in result["rows"]:
        print(format_row(r))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvxfer bench e2e``."""
    ap = argparse.ArgumentParser(prog="kvxfer bench e2e", description=__doc__)
    ap.add_argument("--lengths", default="1024,4096", help="comma-separated prompt lengths (e.g. 1024,...,32768)")
    ap.add_argument("--backend", default="auto", choices=("auto", *AUTO_PREFERENCE, "cuda_ipc"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N (both workers and the baseline share it)")
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="reference model preset")
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--iters", type=int, default=2,
                    help="timed requests per length, each beside a one-process run; on a GPU prefill's compute "
                         "alone spreads about +-15%% (1B at 4k tokens), so a 5%% ratio needs ~31")
    ap.add_argument("--chunk-size", type=int, default=1024, help="prefill chunk (bounds attention memory)")
    ap.add_argument("--checksum", type=parse_checksum, default=None, metavar="off|full|every:K|sample:F",
                    help="decode verifies each request's pages against prefill's blake3 digest")
    ap.add_argument("--kv-positions", type=int, default=DEFAULT_POSITIONS,
                    help="prompt positions whose KV every timed request is verified at (stratified sample)")
    ap.add_argument("--switch-interval-ms", type=float, default=0.5,
                    help="the GIL switch interval of both processes (kvxfer serve's, default 0.5)")
    ap.add_argument("--no-prepare-writes", action="store_true",
                    help="the prefill process writes its plan at the compute's end (no Transport.prepare): the A/B")
    ap.add_argument("--tokens-per-block", type=int, default=TOKENS_PER_BLOCK,
                    help="prefill's (and the one-process baseline's) cache block size in tokens")
    ap.add_argument("--head-order", choices=HEAD_ORDERS, default="HND",
                    help="prefill's (and the baseline's) page order: HND (heads outside tokens) or NHD")
    ap.add_argument("--decode-tokens-per-block", type=int, default=None, metavar="N",
                    help="decode's cache block size in tokens (default: prefill's); the transfers re-block")
    ap.add_argument("--decode-head-order", choices=HEAD_ORDERS, default=None,
                    help="decode's page order (default: prefill's); the other order transposes heads and tokens")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",") if x]
    except ValueError as exc:
        raise ConfigError(f"--lengths must be comma-separated ints, got {a.lengths!r}") from exc
    if not lengths or min(lengths) < 1 or a.iters < 1:
        raise ConfigError("--lengths must be >= 1 each and --iters >= 1")
    if a.kv_positions < 1:
        raise ConfigError("--kv-positions must be >= 1")
    for flag, tpb in (("--tokens-per-block", a.tokens_per_block), ("--decode-tokens-per-block",
                                                                  a.decode_tokens_per_block)):
        if tpb is not None and tpb < 1:
            raise ConfigError(f"{flag} must be >= 1, got {tpb}")
    if not 0 < a.switch_interval_ms <= 100:
        raise ConfigError(f"--switch-interval-ms must be in (0, 100], got {a.switch_interval_ms}")
    print(HEADER, file=sys.stderr, flush=True)   # each row on stderr as it is measured: a run cut short keeps them
    result = run(lengths, a.backend, a.mode, a.layerwise, a.iters, a.chunk_size, checksum=a.checksum,
                 kv_positions=a.kv_positions, model_name=a.model, device=a.device,
                 switch_interval_ms=a.switch_interval_ms, prepare_writes=not a.no_prepare_writes,
                 tokens_per_block=a.tokens_per_block, head_order=a.head_order,
                 decode_tokens_per_block=a.decode_tokens_per_block, decode_head_order=a.decode_head_order,
                 on_row=lambda r: print(format_row(r), file=sys.stderr, flush=True))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
    if a.json:
        rows = [{("transfer_gb_per_s" if k == "transfer_gbps" else k): v for k, v in r.items()} for r in result["rows"]]
        print_json("bench.e2e", result | {"rows": rows})
    else:
        print_table(result)
    return 0 if result["verified"] else 1
