"""Soak: many requests through a prefill process and a decode worker over UCX on 127.0.0.1, with
random prompt lengths and modes, random cancellations and injected prefill faults (SIGKILL + restart,
SIGSTOP past the deadline + SIGCONT). Every completed request is checked token for token against
single-process greedy generation (each generates at least 8 tokens), and decode's committed prompt KV at
up to ``--kv-positions`` stratified positions against a single-process prefill, by (layer, role, token,
head) (``kvxfer.disagg.oracle``); after the drain, both sides' slot accounting must be back to zero.

    PYTHONPATH=$PWD python benchmarks/soak.py [--requests 1000] [--concurrency 8] [--cancel-rate 0.05]
        [--faults 3] [--max-seconds 600] [--backend nixl|ucx] [--out benchmarks/results/soak.json]

Exit status 1 when a completed request's tokens or prompt KV differ from the reference, a slot or cache is still held
after the drain, or a request never got an answer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import heapq
import itertools
import json
import logging
import os
import pathlib
import platform
import re
import resource
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.auth import SECRET_ENV
from kvxfer.disagg.oracle import KVOracle
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import query_status
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.errors import BackendUnavailable, ConfigError, KvxferError, RequestCancelled
from kvxfer.model import preset

MODEL = "tiny"
TOKENS_PER_BLOCK = 16
MODES = (("push", False), ("pull", False), ("push", True))
"""(mode, layer-wise) drawn per request."""
FAULT_KINDS = ("kill", "stop")
MIN_NEW_TOKENS = 8
"""Fewest new tokens a request generates (the first comes from prefill: fewer would check little of decode)."""
DEFAULT_OUT = pathlib.Path(__file__).parent / "results" / "soak.json"


# --- the workload ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakRequest:
    """One request of the run, fully decided by the seed."""

    index: int
    family: int
    """Prompt family sharing a prefix (-1: an unrelated prompt)."""
    tokens: tuple[int, ...]
    max_new_tokens: int
    mode: str
    layerwise: bool
    cancel_after: float | None
    """Seconds after submit at which the request is cancelled (None: never)."""


def _loguniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(np.clip(round(float(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))), lo, hi))


def make_requests(n: int, seed: int, min_len: int, max_len: int, max_new: int, cancel_rate: float,
                  vocab: int, families: int = 16) -> list[SoakRequest]:
    """``n`` seeded requests: prompt lengths log-uniform in [min_len, max_len] (short ones dominate, as the
    model's cost grows with the square of the length); about half extend one of ``families`` shared
    prefixes (prefix reuse on both sides), a few repeat an earlier prompt exactly (a full prefix hit)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, _loguniform(rng, max(min_len, 16), max(min_len, max_len // 2))).tolist()
                for _ in range(families)]
    out: list[SoakRequest] = []
    for i in range(n):
        draw = rng.uniform()
        if out and draw < 0.05:
            earlier = out[int(rng.integers(0, len(out)))]
            family, tokens = earlier.family, list(earlier.tokens)
        elif draw < 0.55:
            family = int(rng.integers(0, families))
            prefix = prefixes[family]
            room = max(1, max_len - len(prefix))
            tokens = prefix + rng.integers(0, vocab, _loguniform(rng, 1, room)).tolist()
        else:
            family, tokens = -1, rng.integers(0, vocab, _loguniform(rng, min_len, max_len)).tolist()
        mode, layerwise = MODES[int(rng.integers(0, len(MODES)))]
        cancel = float(rng.uniform(0.0, 0.5)) if rng.uniform() < cancel_rate else None
        new = int(rng.integers(min(MIN_NEW_TOKENS, max_new), max_new + 1))
        out.append(SoakRequest(i, family, tuple(tokens), new, mode, layerwise, cancel))
    return out


def fault_schedule(n: int, faults: int, seed: int) -> list[tuple[int, str]]:
    """``faults`` (request index, kind) pairs, one at a seeded index in each of ``faults`` equal slices of
    the middle 80 % of the run (so that the run recovers between them), kinds alternating kill, stop,
    kill, ... (the index is the request submitted right after the fault)."""
    lo, hi = max(1, n // 10), max(2, n - n // 10)
    faults = min(max(0, faults), hi - lo)
    rng = np.random.default_rng(seed + 1)
    edges = np.linspace(lo, hi, faults + 1).astype(int)
    idx = [int(rng.integers(edges[k], max(edges[k] + 1, edges[k + 1]))) for k in range(faults)]
    return [(i, FAULT_KINDS[k % len(FAULT_KINDS)]) for k, i in enumerate(idx)]


_REASONS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"prefill .*lost"), "prefill lost"),
    (re.compile(r"no prefill worker connected"), "no prefill worker connected"),
    (re.compile(r"did not arrive within.*no answer from prefill"), "KV did not arrive within the deadline (no answer)"),
    (re.compile(r"did not arrive within.*notifications"), "KV did not arrive within the deadline (notifications missing)"),
    (re.compile(r"did not arrive within.*read"), "KV did not arrive within the deadline (read did not complete)"),
    (re.compile(r"did not arrive within.*never reported kv_pushed"),
     "KV did not arrive within the deadline (layer groups arrived, no kv_pushed)"),
    (re.compile(r"deadline passed while it waited"), "deadline passed in decode's queue (not sent)"),
    (re.compile(r"did not arrive within"), "KV did not arrive within the deadline"),
    (re.compile(r"lease may have expired"), "pull lease may have expired (decode stalled)"),
    (re.compile(r"shutting down"), "worker shutting down"),
    (re.compile(r"RemoteDisconnect|remote agent .* disconnected"), "peer disconnected during the transfer"),
    (re.compile(r"no free slots?"), "out of slots"),
]


def normalise_reason(exc: BaseException) -> str:
    """``Class: reason`` with ids, names and numbers taken out, so that failures group by cause."""
    msg = str(exc)
    for pattern, label in _REASONS:
        if pattern.search(msg):
            return f"{type(exc).__name__}: {label}"
    generic = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", msg)
    generic = re.sub(r"\d+(\.\d+)?", "N", generic)
    return f"{type(exc).__name__}: {generic[:80]}".rstrip(": ")


# --- process figures ------------------------------------------------------------------------------------
def proc_kib(pid: int | str, key: str) -> int:
    """A ``/proc/PID/status`` figure in KiB (VmRSS, VmHWM); 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_kib() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank; 0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(np.ceil(q / 100 * len(ordered))) - 1))]


class Prefill:
    """The prefill process, restarted after a kill; remembers every process's peak RSS."""

    def __init__(self, backend: str, blocks: int, lease: float, secret: str) -> None:
        self.args = ["prefill", "--backend", backend, "--model", MODEL, "--tokens-per-block", str(TOKENS_PER_BLOCK),
                     "--blocks", str(blocks), "--lease", str(lease)]
        self.env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[1]),
                                                   os.environ.get("PYTHONPATH", "")])}
        self.peaks: dict[int, int] = {}
        self.proc: WorkerProcess | None = None
        self.stopped = False
        self.start()

    def start(self) -> None:
        """Start a fresh process (the previous one must be gone)."""
        self.proc = WorkerProcess(self.args, self.env, 120.0)
        self.stopped = False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return int(self.proc.proc.pid)

    @property
    def address(self) -> str:
        assert self.proc is not None
        return self.proc.address

    def sample(self) -> None:
        """Record the current process's peak RSS (VmHWM)."""
        if self.proc is not None and self.proc.proc.poll() is None:
            self.peaks[self.pid] = max(self.peaks.get(self.pid, 0), proc_kib(self.pid, "VmHWM"))

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the current process."""
        assert self.proc is not None
        if self.proc.proc.poll() is None:
            self.proc.proc.send_signal(sig)
        if sig is signal.SIGSTOP:
            self.stopped = True
        elif sig is signal.SIGCONT:
            self.stopped = False

    def kill(self) -> None:
        """SIGKILL and reap (after recording its peak RSS)."""
        assert self.proc is not None
        self.sample()
        self.proc.kill()

    def stop(self) -> None:
        """Resume if frozen, record its peak RSS, SIGTERM (SIGKILL after 10 s), reap."""
        if self.proc is None:
            return
        if self.stopped:
            self.send(signal.SIGCONT)
        self.sample()
        self.proc.stop()
        self.proc = None


class _WarningCounter(logging.Handler):
    """Counts kvxfer's warnings by normalised text (freed-without-confirmation and the like)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = re.sub(r"\d+(\.\d+)?", "N", re.sub(r"'[^']*'", "'_'", record.getMessage()))
        self.counts[f"{record.name}: {text[:100]}"] += 1


# --- the run --------------------------------------------------------------------------------------------
@dataclass
class _Record:
    req: SoakRequest
    rid: str
    submitted: float
    finished: float = 0.0
    outcome: str = ""
    """completed / cancelled / failed / hung"""
    reason: str = ""
    result: GenerationResult | None = None
    cancel_sent: bool | None = None
    """None: no cancel; True: cancel() found it in flight; False: it had finished."""


@dataclass
class _Run:
    args: argparse.Namespace
    decode: DecodeWorker
    prefill: Prefill
    start: float
    records: list[_Record] = field(default_factory=list)
    pending: dict[Future[GenerationResult], _Record] = field(default_factory=dict)
    actions: list[tuple[float, int, str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    seq: Any = field(default_factory=itertools.count)
    cancel_errors: Counter[str] = field(default_factory=Counter)
    timers: list[threading.Timer] = field(default_factory=list)
    probes: int = 0
    """Requests submitted one a second while decode had no prefill connection."""
    cancel_error_times: list[float] = field(default_factory=list)
    finished: int = 0
    rss_mark: tuple[int, int] | None = None
    """(requests finished, decode VmRSS KiB) when the first ``rss_mark`` requests had finished."""

    def t(self) -> float:
        return time.monotonic() - self.start

    def schedule(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.actions, (at, next(self.seq), kind, payload))


def _classify(rec: _Record, fut: Future[GenerationResult]) -> None:
    exc = fut.exception()
    if exc is None:
        rec.outcome, rec.result = "completed", fut.result()
    elif isinstance(exc, RequestCancelled):
        rec.outcome, rec.reason = "cancelled", normalise_reason(exc)
    else:
        rec.outcome, rec.reason = "failed", normalise_reason(exc)


def _inject(run: _Run, kind: str, index: int) -> None:
    a = run.args
    fault: dict[str, Any] = {"kind": kind, "request_index": index, "t_s": round(run.t(), 3), "pid": run.prefill.pid,
                             "in_flight": len(run.pending)}
    if kind == "kill":
        run.prefill.kill()
        t0 = time.monotonic()
        run.prefill.start()
        run.decode.connect(run.prefill.address, timeout=30.0)
        fault |= {"restart_s": round(time.monotonic() - t0, 3), "new_pid": run.prefill.pid,
                  "end_t_s": round(run.t(), 3)}
    else:
        pid = run.prefill.pid
        run.prefill.send(signal.SIGSTOP)

        def resume() -> None:   # on its own thread: a main loop waiting on decode must not stretch the freeze
            if run.prefill.proc is not None and run.prefill.pid == pid:
                run.prefill.send(signal.SIGCONT)
            fault["end_t_s"] = round(run.t(), 3)

        timer = threading.Timer(a.freeze_s, resume)
        timer.daemon = True
        run.timers.append(timer)
        fault |= {"frozen_s": a.freeze_s, "end_t_s": round(run.t() + a.freeze_s, 3)}
        timer.start()
    run.faults.append(fault)


def _run_action(run: _Run, kind: str, payload: Any) -> None:
    if kind == "cancel":
        rec: _Record = payload
        if not rec.outcome:
            try:
                rec.cancel_sent = run.decode.cancel(rec.rid, "soak: random cancellation")
            except KvxferError as exc:   # e.g. the engine did not answer in time: counted, the run goes on
                run.cancel_errors[normalise_reason(exc)] += 1
                run.cancel_error_times.append(round(run.t(), 3))


def _reap(run: _Run, done: set[Future[GenerationResult]]) -> None:
    for fut in done:
        rec = run.pending.pop(fut)
        rec.finished = rec.finished or time.monotonic()
        _classify(rec, fut)
        run.finished += 1
        if run.rss_mark is None and run.finished >= run.args.rss_mark:
            run.rss_mark = (run.finished, proc_kib("self", "VmRSS"))


def _submit(run: _Run, req: SoakRequest) -> None:
    rid = f"soak-{req.index}"
    rec = _Record(req, rid, time.monotonic())
    run.records.append(rec)
    try:
        fut = run.decode.submit(np.asarray(req.tokens, dtype=np.int64), req.max_new_tokens, mode=req.mode,
                                layerwise=req.layerwise, request_id=rid, return_kv=run.args.kv_positions)
    except KvxferError as exc:
        rec.finished, rec.outcome, rec.reason = time.monotonic(), "failed", normalise_reason(exc)
        run.finished += 1
        return

    def stamp(_: Future[GenerationResult]) -> None:
        rec.finished = time.monotonic()    # on the engine thread, the moment the result is known

    fut.add_done_callback(stamp)
    run.pending[fut] = rec
    if req.cancel_after is not None:
        run.schedule(rec.submitted + req.cancel_after, "cancel", rec)


def _loop(run: _Run, requests: list[SoakRequest], schedule: list[tuple[int, str]], progress: Callable[[], None]) -> None:
    """Submit with at most ``concurrency`` in flight until every request is submitted or time is up;
    inject the faults at their indices; run the cancels and SIGCONTs when due; then drain."""
    a = run.args
    faults = list(schedule)
    nxt = 0
    last_sample = 0.0
    drain_until: float | None = None
    next_probe = 0.0
    while True:
        now = time.monotonic()
        while run.actions and run.actions[0][0] <= now:
            _, _, kind, payload = heapq.heappop(run.actions)
            _run_action(run, kind, payload)
        if now - last_sample >= 1.0:
            run.prefill.sample()
            last_sample = now
            progress()
        out_of_time = run.t() >= a.max_seconds
        # Without a prefill, requests fail at once: probe with one request a second (each submit lets decode
        # try to reconnect) instead of running through the workload, as a router would.
        probing = not run.decode.connected
        limit = 1 if probing else a.concurrency
        while (not out_of_time and nxt < len(requests) and len(run.pending) < limit
               and (not probing or time.monotonic() >= next_probe)):
            while faults and faults[0][0] <= nxt:
                for timer in run.timers:   # faults do not overlap: a freeze ends before the next fault
                    timer.join()
                idx, kind = faults.pop(0)
                _inject(run, kind, idx)
            _submit(run, requests[nxt])
            nxt += 1
            if probing:
                run.probes += 1
                next_probe = time.monotonic() + 1.0
        if out_of_time or nxt >= len(requests):
            drain_until = drain_until or time.monotonic() + a.drain_timeout
            if not run.pending or time.monotonic() >= drain_until:
                break
        timeout = 0.25
        if run.actions:
            timeout = max(0.0, min(timeout, run.actions[0][0] - time.monotonic()))
        done, _ = wait(list(run.pending), timeout=timeout, return_when=FIRST_COMPLETED)
        _reap(run, done)
    for timer in run.timers:   # the pending SIGCONT: a frozen prefill would not answer the status query
        timer.join()
    for fut, rec in list(run.pending.items()):
        rec.finished, rec.outcome, rec.reason = time.monotonic(), "hung", "no answer within the drain timeout"
        run.finished += 1
        del run.pending[fut]


def _leaks(run: _Run, settle_s: float) -> dict[str, Any]:
    """Poll both sides until nothing is held or ``settle_s`` passes; what is still held is leaked."""
    deadline = time.monotonic() + settle_s
    while True:
        out: dict[str, Any] = {"decode_held_slots": run.decode.held_slots(),
                               "decode_open_caches": run.decode.num_open_caches()}
        st = run.decode.status()
        out["decode_jobs"], out["decode_zombies"] = int(st["jobs"]), int(st["zombies"])
        out |= _prefill_status(run)
        held = sum(int(v) for k, v in out.items() if isinstance(v, int) and k != "prefill_status_error")
        if held == 0 or time.monotonic() >= deadline:
            out["settle_s"] = round(settle_s - max(0.0, deadline - time.monotonic()), 3)
            return out
        time.sleep(0.25)


def _prefill_status(run: _Run) -> dict[str, Any]:
    try:
        st = query_status(run.prefill.address, run.args.secret, timeout=10.0)
    except KvxferError as exc:   # counted as a leak: the prefill side could not be checked
        return {"prefill_unchecked": 1, "prefill_status_error": normalise_reason(exc)}
    return {"prefill_held_slots": int(st["held_slots"]), "prefill_open_caches": int(st["open_caches"]),
            "prefill_jobs": int(st["jobs"])}


def _check(records: list[_Record]) -> dict[str, Any]:
    """Check every completed request against a single-process reference run here (no prefix reuse): its
    tokens against greedy generation, its returned prompt KV against the reference prefill, position by
    position. Counts requests failing either check (``mismatches``) and each check apart."""
    oracle = KVOracle(preset(MODEL))
    bad = tokens_bad = kv_bad = checked = 0
    worst = 0.0
    examples: list[str] = []
    t0 = time.monotonic()
    for rec in records:
        if rec.outcome != "completed" or rec.result is None:
            continue
        check = oracle.check_request(np.asarray(rec.req.tokens, dtype=np.int64), rec.req.max_new_tokens,
                                     rec.result.tokens, rec.result.prompt_kv)
        checked += 1
        bad += not check.ok
        tokens_bad += not check.tokens_match
        kv_bad += not check.kv.ok
        worst = max(worst, check.kv.max_error)
        if not check.ok and len(examples) < 10:
            examples.append(f"{rec.rid}: {check.describe()}")
        rec.result = dataclasses.replace(rec.result, prompt_kv=None)   # free it: only the verdict is kept
    return {"mismatches": bad, "token_mismatches": tokens_bad, "kv_mismatches": kv_bad, "kv_checked": checked,
            "kv_max_error": worst, "kv_tolerance": oracle.tolerance, "mismatch_examples": examples,
            "check_s": round(time.monotonic() - t0, 3)}


def run_soak(a: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run the soak described by ``a`` and return its figures (see ``summarise``)."""
    torch.set_num_threads(1)
    backend = best_backend() if a.backend == "auto" else a.backend
    a.secret = secrets.token_hex(32)
    requests = make_requests(a.requests, a.seed, a.min_prompt, a.max_prompt, a.max_new_tokens, a.cancel_rate,
                             preset(MODEL).vocab_size)
    schedule = fault_schedule(a.requests, a.faults, a.seed)
    warnings = _WarningCounter()
    kv_log = logging.getLogger("kvxfer")
    old_level, old_propagate = kv_log.level, kv_log.propagate
    kv_log.addHandler(warnings)
    kv_log.setLevel(logging.WARNING)
    kv_log.propagate = False
    prefill: Prefill | None = None
    decode: DecodeWorker | None = None
    run: _Run | None = None
    try:
        prefill = Prefill(backend, a.blocks, a.lease, a.secret)
        cfg = WorkerConfig(f"soak-decode-{os.getpid()}", preset(MODEL), TOKENS_PER_BLOCK, a.blocks, backend=backend,
                           lease_s=a.lease, deadline_s=a.deadline)
        decode = DecodeWorker(cfg, a.secret, prefill=prefill.address, connect_timeout=a.connect_timeout)
        run = _Run(a, decode, prefill, time.monotonic())

        def progress() -> None:
            if console is not None and console.is_terminal:
                counts = Counter(r.outcome or "in flight" for r in run.records)
                console.print(f"[dim]{run.t():6.1f} s  submitted {len(run.records)}  "
                              + "  ".join(f"{k} {v}" for k, v in sorted(counts.items())) + "[/]", end="\r")

        _loop(run, requests, schedule, progress)
        duration = run.t()
        rss_end = proc_kib("self", "VmRSS")
        leaks = _leaks(run, a.lease + a.deadline + 10.0)
        decode_peak = peak_rss_kib()
        engine_error = "" if decode.health.ok else decode.health.reason
        prefill.sample()
    finally:
        for timer in run.timers if run is not None else []:
            timer.cancel()
        if decode is not None:
            decode.close()
        if prefill is not None:
            prefill.stop()
        kv_log.removeHandler(warnings)
        kv_log.setLevel(old_level)
        kv_log.propagate = old_propagate
    checks = _check(run.records)
    return summarise(run, schedule, backend, duration, checks, leaks, decode_peak, rss_end,
                     engine_error, dict(warnings.counts))


def summarise(run: _Run, schedule: list[tuple[int, str]], backend: str, duration: float, checks: dict[str, Any],
              leaks: dict[str, Any], decode_peak_kib: int, rss_end_kib: int, engine_error: str,
              warnings: dict[str, int]) -> dict[str, Any]:
    """The run's figures as one JSON-able dict."""
    a = run.args
    recs = run.records
    outcomes = Counter(r.outcome for r in recs)
    done = [r for r in recs if r.outcome == "completed" and r.result is not None]
    lat = [(r.finished - r.submitted) * 1e3 for r in done]
    failed = Counter(r.reason for r in recs if r.outcome in ("failed", "hung"))
    cancels = [r for r in recs if r.req.cancel_after is not None]
    leaked = sum(int(v) for k, v in leaks.items() if isinstance(v, int) and k != "settle_s")
    windows = [(f["t_s"], f["end_t_s"] + a.deadline + 5.0) for f in run.faults]
    outside = sum(1 for r in recs if r.outcome == "failed"
                  and not any(lo <= r.finished - run.start <= hi for lo, hi in windows))
    results = [r.result for r in done if r.result is not None]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "cpus": os.cpu_count(), "load_avg_end": list(os.getloadavg()),
        "command": " ".join(sys.argv), "backend": backend, "model": MODEL,
        "args": {k: v for k, v in vars(a).items() if k != "secret"},
        "requests_planned": a.requests, "submitted": len(recs), "completed": outcomes["completed"],
        "cancelled": outcomes["cancelled"], "failed": outcomes["failed"] + outcomes["hung"], "hung": outcomes["hung"],
        "failed_by_reason": dict(failed.most_common()), "failed_outside_fault_windows": outside,
        "probes_while_disconnected": run.probes,
        "cancel": {"scheduled": len(cancels), "sent_in_flight": sum(1 for r in cancels if r.cancel_sent is True),
                   "too_late": sum(1 for r in cancels if r.cancel_sent is False),
                   "cancelled": outcomes["cancelled"], "errors": dict(run.cancel_errors),
                   "error_times_s": run.cancel_error_times},
        "modes": dict(Counter(f"{r.req.mode}{' layer-wise' if r.req.layerwise else ''}" for r in done)),
        **checks,
        "faults_scheduled": [{"request_index": i, "kind": k} for i, k in schedule],
        "faults": run.faults,
        "leaks": leaks, "leaked": leaked,
        "decode_peak_rss_mib": round(decode_peak_kib / 1024, 1),
        "prefill_peak_rss_mib": round(max(run.prefill.peaks.values(), default=0) / 1024, 1),
        "prefill_processes": len(run.prefill.peaks),
        "decode_rss_growth": {"after_requests": run.rss_mark[0] if run.rss_mark else 0,
                              "rss_then_mib": round(run.rss_mark[1] / 1024, 1) if run.rss_mark else 0.0,
                              "rss_end_mib": round(rss_end_kib / 1024, 1),
                              "growth_mib": round((rss_end_kib - run.rss_mark[1]) / 1024, 1) if run.rss_mark else 0.0},
        "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                       "max": max(lat, default=0.0)},
        "duration_s": round(duration, 3),
        "throughput": {"requests_per_s": len(done) / duration if duration > 0 else 0.0,
                       "prompt_tokens_per_s": sum(r.prompt_tokens for r in results) / duration if duration else 0.0,
                       "generated_tokens_per_s": sum(len(r.tokens) for r in results) / duration if duration else 0.0},
        "bytes_moved": sum(r.bytes_moved for r in results),
        "reused_tokens": {"decode": sum(r.reused_tokens_decode for r in results),
                          "prefill": sum(r.reused_tokens_prefill for r in results)},
        "prompt_tokens": {"min": min((len(r.req.tokens) for r in recs), default=0),
                          "max": max((len(r.req.tokens) for r in recs), default=0),
                          "mean": float(np.mean([len(r.req.tokens) for r in recs])) if recs else 0.0},
        "engine_error": engine_error, "warnings": warnings,
        "rows": [{"i": r.req.index, "len": len(r.req.tokens), "new": r.req.max_new_tokens,
                  "mode": r.req.mode + ("+lw" if r.req.layerwise else ""), "family": r.req.family,
                  "t_submit": round(r.submitted - run.start, 3), "t_end": round(r.finished - run.start, 3),
                  "outcome": r.outcome, "reason": r.reason, "cancel": r.cancel_sent} for r in recs],
    }


def healthy(summary: dict[str, Any]) -> bool:
    """No mismatch, no leaked slot, no request without an answer, no engine failure."""
    return (summary["mismatches"] == 0 and summary["leaked"] == 0 and summary["hung"] == 0
            and not summary["engine_error"]
            and summary["completed"] + summary["cancelled"] + summary["failed"] == summary["submitted"])


def print_report(s: dict[str, Any], console: Console) -> None:
    """The figures as a rich table."""
    t = Table(title=f"kvxfer soak: prefill process -> decode over {s['backend']} on 127.0.0.1 "
                    f"({s['submitted']} requests, concurrency {s['args']['concurrency']})")
    t.add_column("figure")
    t.add_column("value", justify="right")
    lat, tp, rss = s["latency_ms"], s["throughput"], s["decode_rss_growth"]
    rows: list[tuple[str, str]] = [
        ("submitted / completed / cancelled / failed",
         f"{s['submitted']} / {s['completed']} / {s['cancelled']} / {s['failed']}"),
        *((f"  failed: {reason}", str(n)) for reason, n in s["failed_by_reason"].items()),
        ("  failed outside fault windows", str(s["failed_outside_fault_windows"])),
        ("cancels scheduled / in flight / too late",
         f"{s['cancel']['scheduled']} / {s['cancel']['sent_in_flight']} / {s['cancel']['too_late']}"),
        ("mismatches vs single-process reference (tokens / KV)",
         f"{s['mismatches']} ({s['token_mismatches']} / {s['kv_mismatches']})"),
        ("KV checked: requests, max rel. error (tolerance)",
         f"{s['kv_checked']}, {s['kv_max_error']:.1e} ({s['kv_tolerance']:.0e})"),
        ("faults injected", ", ".join(f"{f['kind']}@{f['t_s']:.0f}s" for f in s["faults"]) or "none"),
        ("leaked after drain", f"{s['leaked']}  " + ", ".join(f"{k}={v}" for k, v in s["leaks"].items())),
        ("peak RSS decode / prefill (max of processes)",
         f"{s['decode_peak_rss_mib']:.0f} / {s['prefill_peak_rss_mib']:.0f} MiB"),
        (f"decode RSS after {rss['after_requests']} requests -> end",
         f"{rss['rss_then_mib']:.0f} -> {rss['rss_end_mib']:.0f} MiB ({rss['growth_mib']:+.1f})"),
        ("latency p50 / p90 / p99 / max", f"{lat['p50']:.0f} / {lat['p90']:.0f} / {lat['p99']:.0f} / {lat['max']:.0f} ms"),
        ("throughput", f"{tp['requests_per_s']:.2f} req/s, {tp['prompt_tokens_per_s']:.0f} prompt tok/s"),
        ("reused prompt tokens decode / prefill", f"{s['reused_tokens']['decode']} / {s['reused_tokens']['prefill']}"),
        ("duration (+ reference check)", f"{s['duration_s']:.1f} s (+ {s['check_s']:.1f} s)"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if s["warnings"]:
        console.print("kvxfer warnings: " + "; ".join(f"{n} x {w}" for w, n in s["warnings"].items()))
    if s["engine_error"]:
        console.print(f"[red]decode engine failed: {s['engine_error']}[/]")


def parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    ap.add_argument("--cancel-rate", type=float, default=0.05, help="share of requests cancelled after a short delay")
    ap.add_argument("--faults", type=int, default=3, help="prefill faults (kill+restart, stop past the deadline, ...)")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop submitting after this many seconds")
    ap.add_argument("--drain-timeout", type=float, default=None,
                    help="seconds to wait for the requests in flight after the bound (default: deadline + 30)")
    ap.add_argument("--backend", default="auto", choices=("auto", "nixl", "ucx"), help="auto: nixl, else ucx")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=16, help=f"each request draws {MIN_NEW_TOKENS}..this")
    ap.add_argument("--kv-positions", type=int, default=64,
                    help="prompt positions (stratified; all of shorter prompts) whose KV each request returns")
    ap.add_argument("--blocks", type=int, default=2048, help="cache blocks of each worker")
    ap.add_argument("--deadline", type=float, default=10.0, help="decode's per-request KV deadline (s)")
    ap.add_argument("--lease", type=float, default=10.0, help="prefill's source-block lease (s)")
    ap.add_argument("--freeze-s", type=float, default=None, help="SIGSTOP length (default: deadline + 2)")
    ap.add_argument("--connect-timeout", type=float, default=2.0, help="decode's (re)connect timeout (s)")
    ap.add_argument("--rss-mark", type=int, default=100, help="decode RSS growth is measured from this request on")
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="JSON figures")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run, print, write the JSON; 0 when healthy (see ``healthy``)."""
    a = parser().parse_args(argv)
    if a.requests < 1 or a.concurrency < 1 or not 0 <= a.cancel_rate <= 1 or a.faults < 0 or a.max_seconds <= 0:
        raise ConfigError("--requests and --concurrency must be >= 1, --cancel-rate in [0, 1], --faults >= 0, "
                          "--max-seconds > 0")
    if not 1 <= a.min_prompt <= a.max_prompt:
        raise ConfigError("need 1 <= --min-prompt <= --max-prompt")
    if a.max_new_tokens < MIN_NEW_TOKENS or a.kv_positions < 1:
        raise ConfigError(f"--max-new-tokens must be >= {MIN_NEW_TOKENS} and --kv-positions >= 1")
    a.freeze_s = a.deadline + 2.0 if a.freeze_s is None else a.freeze_s
    a.drain_timeout = a.deadline + 30.0 if a.drain_timeout is None else a.drain_timeout
    console = Console() if sys.stdout.isatty() else Console(width=120)
    try:
        summary = run_soak(a, console)
    except BackendUnavailable as exc:
        console.print(f"[yellow]soak skipped: {exc}[/]")
        return 2
    print_report(summary, console)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2, default=str))
    console.print(f"wrote {a.out}")
    ok = healthy(summary)
    if not ok:
        console.print("[red]soak failed: mismatches, leaked slots, unanswered requests or an engine failure[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
