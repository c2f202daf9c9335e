"""``kvxfer demo``: a prefill and a decode process on 127.0.0.1 over the best installed UCX transport,
a batch of requests sharing prefixes, every request checked two ways against a single-process reference
run here: its tokens, and decode's committed prompt KV by logical position (``kvxfer.disagg.oracle``:
tokens cannot see a swapped block, the KV check can).

The requests come in two waves: one per prompt family first (nothing cached anywhere), then the rest,
which hit the prefix trees on both sides, so only the tokens decode lacks travel.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvxfer.cli.output import ms, print_json
from kvxfer.cli.serve import check_device, checked_model_name, parse_checksum
from kvxfer.disagg.auth import SECRET_ENV, AuthKey
from kvxfer.disagg.oracle import DEFAULT_POSITIONS, KVOracle
from kvxfer.disagg.worker_client import ClientResult, GenerateClient
from kvxfer.disagg.worker_decode import one_host_landing_s
from kvxfer.errors import ConfigError, KvxferError
from kvxfer.model import model_source
from kvxfer.transport import backend_names, best_backend, check_backend

MODEL = "tiny"
TOKENS_PER_BLOCK = 16
#: Where a request's time to first token went, as decode's result names the stages (``GenerationResult``):
#: decode's queue, prefill's queue, compute and post, the transfer, control messages, the digest check.
TTFT_STAGES = ("request", "queued", "prefill", "post", "transfer", "messages", "verify")


def transfer_s(stats: dict[str, Any]) -> float:
    """A request's transfer as the demo shows it: prefill's post to completion when decode got that
    figure (``kv_pushed`` came before the answer), else prefill's last post to the KV in place on decode
    from the two clocks (the demo's processes share this host; protocol 2 takes the KV on the write's
    notice, before ``kv_pushed``), else what decode reported."""
    landing = None if stats.get("transfer_by_prefill") else one_host_landing_s(stats)
    return float(stats.get("transfer_s", 0.0)) if landing is None else landing


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """``demo`` options."""
    p.add_argument("--device", default="cpu", help="cpu, or cuda:N (both worker processes share that GPU)")
    p.add_argument("--backend", default="auto", choices=("auto", *backend_names(cross_process=True)),
                   help="transport between the two processes (auto: nixl, else ucx; cuda_ipc needs --device cuda:N)")
    p.add_argument("--mode", choices=("push", "pull"), default="push")
    p.add_argument("--model", default=MODEL, type=checked_model_name, metavar="NAME|hf:PRESET|hf:DIR",
                   help="the model both workers serve (see kvxfer serve --help), e.g. hf:tiny")
    p.add_argument("--layerwise", action="store_true", help="send each layer as soon as it is computed")
    p.add_argument("--checksum", default="off", type=_checked_policy_text, metavar="off|full|every:K|sample:F",
                   help="decode verifies every request's pages against prefill's blake3 digest before commit")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of the decode worker (prefill: 1)")
    p.add_argument("--families", type=int, default=3, help="prompt families sharing a prefix")
    p.add_argument("--per-family", type=int, default=4, help="requests per family")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


@dataclass(frozen=True)
class DemoRequest:
    """One prompt of the batch."""

    family: int
    tokens: list[int]


def _checked_policy_text(text: str) -> str:
    """``--checksum`` as given, once it parses (the decode process gets the same text)."""
    parse_checksum(text)
    return text


def demo_prompts(families: int, per_family: int, seed: int, vocab: int) -> list[DemoRequest]:
    """``per_family`` prompts per family: a shared 40-90 token prefix plus a 3-40 token suffix each."""
    rng = np.random.default_rng(seed)
    out: list[DemoRequest] = []
    for f in range(families):
        prefix = rng.integers(0, vocab, int(rng.integers(40, 90))).tolist()
        out.extend(DemoRequest(f, prefix + rng.integers(0, vocab, int(rng.integers(3, 40))).tolist())
                   for _ in range(per_family))
    return out


class WorkerProcess:
    """A worker process started with ``kvxfer serve``; the line saying ``listening on`` gives its address."""

    def __init__(self, args: Sequence[str], env: dict[str, str], timeout: float, prefix: Sequence[str] = ()) -> None:
        """``prefix``: a command the worker runs under (e.g. ``ip netns exec NS`` for another network namespace)."""
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvxfer.cli", "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        assert self.proc.stderr is not None and self.proc.stdout is not None
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
        found: list[str] = []
        ready = threading.Event()

        def watch(stream: IO[str]) -> None:   # native libraries may log to stdout before our line
            for text in stream:
                if "listening on " in text and not ready.is_set():
                    found.append(text)
                    ready.set()
                else:
                    self.stderr.append(text)
            ready.set()

        threading.Thread(target=watch, args=(self.proc.stdout,), daemon=True).start()
        ready.wait(timeout)
        if not found:
            code = self.proc.poll()
            self.stop()
            what = f"exited with status {code}" if code is not None else f"did not start within {timeout:.0f} s"
            raise KvxferError(f"worker {' '.join(args[:1])} {what}: "
                              f"{''.join(self.stderr[-20:]).strip() or 'no output'}")
        line = found
        self.address = line[0].split("listening on ", 1)[1].split()[0]

    def _drain(self, stream: IO[str]) -> None:
        for text in stream:
            self.stderr.append(text)

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests) and reap."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM (the worker drains and exits), then SIGKILL after 10 s; the exit status (negative: the
        signal that ended it; None if it could not be reaped)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
        return self.proc.returncode


def run_demo(backend: str, mode: str, layerwise: bool, families: int, per_family: int, max_new_tokens: int,
             seed: int, timeout: float, progress: Progress | None = None, device: str = "cpu",
             checksum: str = "off", decode_tp: int = 1, model: str = MODEL) -> dict[str, Any]:
    """Run the demo and return its figures (``rows`` holds one dict per request)."""
    torch.set_num_threads(1)
    check_device(device)
    backend = best_backend() if backend == "auto" else backend
    check_backend(backend, device=device, cross_process=True)
    secret = secrets.token_hex(32)
    env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    common = ["--backend", backend, "--model", model, "--tokens-per-block", str(TOKENS_PER_BLOCK),
              "--device", device]
    source = model_source(model)
    requests = demo_prompts(families, per_family, seed, source.vocab_size)
    started = time.monotonic()
    prefill = WorkerProcess(["prefill", "--name", "demo-prefill", *common], env, timeout)
    decode: WorkerProcess | None = None
    exits: dict[str, int | None] = {}
    try:
        decode = WorkerProcess(["decode", "--name", "demo-decode", "--prefill", prefill.address, "--mode", mode,
                         *(["--layerwise"] if layerwise else []), "--checksum", checksum, "--tp-size", str(decode_tp),
                         *common], env, timeout)
        client = GenerateClient(decode.address, AuthKey.load(secret), name="demo-client")
        task = progress.add_task("requests", total=len(requests)) if progress is not None else None
        results: dict[int, ClientResult] = {}
        try:
            first: dict[int, int] = {}
            for i, r in enumerate(requests):
                first.setdefault(r.family, i)
            waves = [sorted(first.values()), [i for i in range(len(requests)) if i not in first.values()]]
            for wave in waves:
                ids = {client.submit(requests[i].tokens, max_new_tokens, return_kv=DEFAULT_POSITIONS): i for i in wave}
                while ids:
                    res = client.recv(max(0.1, timeout - (time.monotonic() - started)))
                    if res.request_id in ids:
                        results[ids.pop(res.request_id)] = res
                        if progress is not None and task is not None:
                            progress.advance(task)
        finally:
            client.close()
        elapsed = time.monotonic() - started
    finally:
        if decode is not None:
            exits["decode"] = decode.stop()
        exits["prefill"] = prefill.stop()
    oracle = KVOracle(source, device)   # the reference runs where the workers ran (same kernels)
    rows: list[dict[str, Any]] = []
    for i, r in enumerate(requests):
        res = results[i]
        check = oracle.check_request(r.tokens, max_new_tokens, res.tokens, res.kv) if res.ok else None
        s = res.stats
        rows.append({"request": i, "family": r.family, "prompt_tokens": len(r.tokens), "ok": res.ok,
                     "error": res.error, "match": check is not None and check.ok,
                     "tokens_match": check is not None and check.tokens_match,
                     "kv_match": check is not None and check.kv.ok,
                     "kv_max_error": check.kv.max_error if check is not None else None,
                     "kv_worst": list(check.kv.worst) if check is not None else None,
                     "kv_compared": check.kv.compared if check is not None else 0,
                     "kv_detail": check.kv.describe() if check is not None else "",
                     "reused_blocks_decode": int(s.get("reused_tokens_decode", 0)) // TOKENS_PER_BLOCK,
                     "reused_blocks_prefill": int(s.get("reused_tokens_prefill", 0)) // TOKENS_PER_BLOCK,
                     "bytes_moved": int(s.get("bytes_moved", 0)), "transfer_ms": ms(transfer_s(s)),
                     "ttft_ms": ms(float(s.get("ttft_s", 0.0))), "verify_ms": ms(float(s.get("verify_s", 0.0))),
                     "ttft_split_ms": {stage: ms(float(s.get(f"{stage}_s", 0.0))) for stage in TTFT_STAGES}})
    ok = [row for row in rows if row["ok"]]
    moved = sum(row["bytes_moved"] for row in ok)
    xfer_s = sum(row["transfer_ms"] for row in ok) / 1e3
    ttfts = sorted(row["ttft_ms"] for row in ok)
    return {
        "requests": len(rows), "device": device, "model": model, "mismatches": sum(1 for row in rows if not row["match"]),
        "token_mismatches": sum(1 for row in rows if row["ok"] and not row["tokens_match"]),
        "kv_mismatches": sum(1 for row in rows if row["ok"] and not row["kv_match"]),
        "kv_max_error": max((row["kv_max_error"] for row in ok), default=0.0), "kv_tolerance": oracle.tolerance,
        "failed": sum(1 for row in rows if not row["ok"]), "transport": backend, "mode": mode,
        "layerwise": layerwise, "checksum": checksum, "decode_tp": decode_tp, "bytes_moved": moved,
        "reused_blocks_decode": sum(row["reused_blocks_decode"] for row in ok),
        "reused_blocks_prefill": sum(row["reused_blocks_prefill"] for row in ok),
        "transfer_gb_per_s": moved / xfer_s / 1e9 if xfer_s > 0 else 0.0,
        "ttft_ms_p50": ttfts[len(ttfts) // 2] if ttfts else 0.0,
        "generated_tokens": max_new_tokens * len(ok), "elapsed_ms": ms(elapsed),
        "worker_exit_statuses": exits, "rows": rows,
    }


def print_table(summary: dict[str, Any], console: Console) -> None:
    """The per-request table and a summary line."""
    t = Table(caption="reused D/P: prompt blocks reused from the decode/prefill prefix tree; tokens: checked against "
                      "single-process generation; KV: decode's committed prompt KV by (layer, role, token, head) "
                      f"against a single-process prefill, max relative error (tolerance {summary['kv_tolerance']:.0e})",
              title=f"kvxfer demo: prefill -> decode over {summary['transport']} ({summary['mode']}"
                    f"{', layer-wise' if summary['layerwise'] else ''}"
                    f"{', decode TP ' + str(summary['decode_tp']) if summary['decode_tp'] > 1 else ''}"
                    f"{', checksum ' + summary['checksum'] if summary['checksum'] != 'off' else ''}) on 127.0.0.1")
    for col in ("req", "fam", "prompt", "new", "reused D", "reused P", "bytes", "GB/s", "TTFT ms", "tokens", "KV"):
        t.add_column(col, justify="right")
    for row in summary["rows"]:
        gbps = row["bytes_moved"] / row["transfer_ms"] / 1e6 if row["transfer_ms"] > 0 else 0.0
        if not row["ok"]:
            tokens_cell, kv_cell = f"[red]{row['error'][:40]}[/]", "[red]-[/]"
        else:
            tokens_cell = "[green]match[/]" if row["tokens_match"] else "[red]MISMATCH[/]"
            layer, role, token, head = row["kv_worst"]
            kv_cell = (f"[green]{row['kv_max_error']:.0e}[/]" if row["kv_match"] else
                       f"[red]{row['kv_max_error']:.1e} L{layer} {role[0].upper()} t{token} h{head}[/]")
        t.add_row(str(row["request"]), str(row["family"]), str(row["prompt_tokens"]),
                  str(summary["generated_tokens"] // max(1, summary["requests"] - summary["failed"])),
                  str(row["reused_blocks_decode"]), str(row["reused_blocks_prefill"]), f"{row['bytes_moved'] / 1024:.0f} KiB",
                  f"{gbps:.3f}", f"{row['ttft_ms']:.1f}", tokens_cell, kv_cell)
    console.print(t)
    console.print(f"{summary['requests']} requests, {summary['mismatches']} mismatches ({summary['token_mismatches']} "
                  f"tokens, {summary['kv_mismatches']} KV; max KV error {summary['kv_max_error']:.1e}), "
                  f"{summary['failed']} failed; "
                  f"{summary['bytes_moved']:,} bytes moved at {summary['transfer_gb_per_s']:.3f} GB/s; blocks reused: "
                  f"decode {summary['reused_blocks_decode']}, prefill {summary['reused_blocks_prefill']}; "
                  f"TTFT p50 {summary['ttft_ms_p50']:.1f} ms; {summary['elapsed_ms'] / 1e3:.1f} s in all")
    bad = {role: code for role, code in summary["worker_exit_statuses"].items() if code != 0}
    if bad:
        console.print(f"[red]worker processes exited with {bad} after SIGTERM (expected 0)[/]")


def demo(a: argparse.Namespace) -> int:
    """Run the demo; 0 when every request's tokens and prompt KV matched the single-process reference and both
    worker processes exited 0 on SIGTERM, 1 otherwise."""
    if a.families < 1 or a.per_family < 1 or a.max_new_tokens < 1 or a.decode_tp < 1:
        raise ConfigError("--families, --per-family, --max-new-tokens and --decode-tp must be >= 1")
    logging.getLogger("kvxfer").setLevel(logging.ERROR)   # peers closing at the end are expected
    console = Console(stderr=a.json)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        summary = run_demo(a.backend, a.mode, a.layerwise, a.families, a.per_family, a.max_new_tokens, a.seed,
                           a.timeout, progress, a.device, a.checksum, a.decode_tp, a.model)
    if a.json:
        print_json("demo", summary)
    else:
        print_table(summary, console)
    clean = all(code == 0 for code in summary["worker_exit_statuses"].values())
    return 0 if summary["mismatches"] == 0 and summary["failed"] == 0 and clean else 1
