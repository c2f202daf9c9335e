"""Worker-level faults over the loopback transport: a failed post, a lost or repeated notification, a
stalled or late transfer, corrupted bytes and cancellations, each aimed at one request of several in
flight. Every case checks the error (class, message, time), that the other requests get exact tokens and
the reference's prompt KV position by position (the KV oracle),
that both workers end holding nothing with balanced allocator accounting, and that the same pair then
serves a fresh request (the no-thread-left check is the directory's autouse fixture)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.disagg.messages import ControlMessage, KvCancel, KvPosted, KvPushed
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import IntegrityError, RequestCancelled, TransferFailed, TransferTimeout
from kvxfer.model import preset
from kvxfer.transport import LoopbackFaults
from kvxfer.transport.integrity import ChecksumPolicy
from tests.e2e.test_loopback import KV, NEW, SECRET, assert_matches_reference, kv_oracle, name, reference
from tests.faults.conftest import assert_settled

LAYERS = preset("tiny").num_layers
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4         # tiny: layers x (K, V) x kv heads x head_dim x float32
MARGIN = 3.0                                 # seconds past a deadline a failure may take on a loaded machine


def prompt(seed: int, length: int) -> npt.NDArray[np.int64]:
    """A prompt of ``length`` tokens sharing no prefix with other seeds' prompts."""
    return np.random.default_rng(1000 + seed).integers(0, 512, length).astype(np.int64)


def posted(prefill: PrefillWorker) -> bool:
    """Whether prefill posted a write (it computes off its engine thread: a job exists before that)."""
    return bool(prefill.engine.call(lambda: any(j.handles for j in prefill._jobs.values()), 5.0))


@contextlib.contextmanager
def pair(*, prefill_faults: LoopbackFaults | None = None, decode_faults: LoopbackFaults | None = None,
         mode: str = "push", layerwise: bool = False, deadline_s: float = 10.0,
         checksum: ChecksumPolicy | None = None) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    """A prefill/decode pair over loopback (one layer per layer-wise part) with faults on either side."""
    p_opts = None if prefill_faults is None else {"faults": prefill_faults}
    d_opts = None if decode_faults is None else {"faults": decode_faults}
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256), SECRET, transport_options=p_opts) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), num_blocks=256, deadline_s=deadline_s, checksum=checksum),
                         SECRET, prefill=prefill.address, mode=mode, layerwise=layerwise, layers_per_send=1,
                         transport_options=d_opts) as decode:
        yield prefill, decode


def submit_all(decode: DecodeWorker, requests: dict[str, npt.NDArray[np.int64]]) -> dict[str, Future[GenerationResult]]:
    """Submit every request (in order, under its key as request id) without waiting."""
    return {rid: decode.submit(tokens, NEW, request_id=rid, return_kv=KV) for rid, tokens in requests.items()}


def failure(fut: Future[GenerationResult], t0: float, timeout: float = 30.0) -> tuple[BaseException, float]:
    """The exception ``fut`` ends with and the seconds from ``t0`` until it did."""
    exc = fut.exception(timeout)
    assert exc is not None, f"request succeeded: {fut.result()}"
    return exc, time.monotonic() - t0


def assert_survivors(futures: dict[str, Future[GenerationResult]], requests: dict[str, npt.NDArray[np.int64]],
                     victims: tuple[str, ...]) -> None:
    """Every request but ``victims`` finished with the single-process tokens and prompt KV."""
    for rid, fut in futures.items():
        if rid not in victims:
            assert_matches_reference(fut.result(30), requests[rid], NEW)


def assert_serves_again(decode: DecodeWorker, victim: npt.NDArray[np.int64], survivor: npt.NDArray[np.int64]) -> None:
    """The pair serves the failed prompt again from scratch (nothing of it was committed on decode), and
    a survivor's prompt from decode's prefix tree (so the first check could have seen a kept block)."""
    again = decode.generate(victim, NEW, timeout=30, return_kv=KV)
    assert_matches_reference(again, victim, NEW)
    assert again.reused_tokens_decode == 0 and again.bytes_moved == victim.size * BYTES_PER_TOKEN
    kept = decode.generate(survivor, NEW, timeout=30, return_kv=KV)
    assert_matches_reference(kept, survivor, NEW)
    assert kept.reused_tokens_decode > 0


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` until it holds (AssertionError naming ``what`` after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def three() -> dict[str, npt.NDArray[np.int64]]:
    """Requests A, B, C in submission order; B (the usual victim) is the longest, three full blocks."""
    return {"A": prompt(1, 20), "B": prompt(2, 60), "C": prompt(3, 24)}


# --- 1. the Nth post fails -----------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "layerwise", "post", "side"), [
    ("push", False, 2, "prefill"),               # B's only write
    ("push", True, LAYERS + 2, "prefill"),       # B's second layer, after its first landed on decode
    ("pull", False, 2, "decode"),                # decode's read of B
], ids=["push", "push-layerwise", "pull"])

def test_nth_post_fails_only_its_request(mode: str, layerwise: bool, post: int, side: str) -> None:
    faults = LoopbackFaults(fail_post=post)
    sides: dict[str, Any] = {f"{side}_faults": faults}
    with pair(mode=mode, layerwise=layerwise, **sides) as (prefill, decode):
        requests = three()
        t0 = time.monotonic()
        futures = submit_all(decode, requests)
        exc, took = failure(futures["B"], t0)
        assert isinstance(exc, TransferFailed)
        where = "read of request B" if mode == "pull" else "prefill failed request B: transfer failed"
        assert f"{where}: injected fault: post #{post} fails" in str(exc)
        assert took < decode.config.deadline_s                # failed at once, not at the deadline
        assert_survivors(futures, requests, ("B",))
        assert_settled(prefill, decode)
        assert_serves_again(decode, requests["B"], requests["A"])
        assert_settled(prefill, decode)


# --- 2. a notification is lost ---------------------------------------------------------------------
@pytest.mark.parametrize(("layerwise", "drop", "arrived"), [(False, 2, "0 of 1"), (True, LAYERS + 2, f"{LAYERS - 1} "
                                                                                                  f"of {LAYERS}")],
                         ids=["push", "push-layerwise"])
def test_lost_notification_times_out_only_its_request(layerwise: bool, drop: int, arrived: str) -> None:
    faults = LoopbackFaults(drop_notification=drop)
    with pair(prefill_faults=faults, layerwise=layerwise, deadline_s=2.0) as (prefill, decode):
        requests = three()
        t0 = time.monotonic()
        futures = submit_all(decode, requests)
        exc, took = failure(futures["B"], t0)
        assert isinstance(exc, TransferTimeout)
        assert f"request B: KV did not arrive within 2.0 s: prefill reported kv_pushed but only {arrived} " \
               f"transfer notifications arrived" in str(exc)
        assert 2.0 <= took < 2.0 + MARGIN
        assert_survivors(futures, requests, ("B",))
        assert_settled(prefill, decode)
        assert_serves_again(decode, requests["B"], requests["A"])
        assert_settled(prefill, decode)


# --- 3. a notification arrives twice ---------------------------------------------------------------
def test_duplicated_notification_is_harmless_and_not_counted_for_a_later_request() -> None:
    """B's notification is delivered twice: B is served. A later request reusing the id B loses its own
    notification: if the stray copy had been kept for the id, it would complete that request with a
    notification that was never sent for it; it must time out instead."""
    faults = LoopbackFaults(duplicate_notification=2, drop_notification=4)
    with pair(prefill_faults=faults, deadline_s=2.0) as (prefill, decode):
        requests = three()
        futures = submit_all(decode, requests)
        assert_survivors(futures, requests, ())
        assert_settled(prefill, decode)
        later = {"B": prompt(4, 30), "D": prompt(5, 18)}    # notifications 4 (dropped) and 5
        t0 = time.monotonic()
        futures = submit_all(decode, later)
        exc, took = failure(futures["B"], t0)
        assert isinstance(exc, TransferTimeout) and "only 0 of 1 transfer notifications arrived" in str(exc)
        assert 2.0 <= took < 2.0 + MARGIN
        assert_survivors(futures, later, ("B",))
        assert_settled(prefill, decode)
        assert_serves_again(decode, later["B"], requests["C"])
        assert_settled(prefill, decode)


def test_duplicated_part_does_not_stand_in_for_a_lost_one() -> None:
    """Layer-wise: B's part 1 arrives twice and its part 3 never: as many notifications as parts came,
    but not every part, so B must time out rather than continue on a layer that may be missing."""
    faults = LoopbackFaults(duplicate_notification=LAYERS + 1, drop_notification=LAYERS + 3)
    with pair(prefill_faults=faults, layerwise=True, deadline_s=2.0) as (prefill, decode):
        requests = three()
        t0 = time.monotonic()
        futures = submit_all(decode, requests)
        exc, took = failure(futures["B"], t0)
        assert isinstance(exc, TransferTimeout)
        assert f"only {LAYERS - 1} of {LAYERS} transfer notifications arrived" in str(exc)
        assert 2.0 <= took < 2.0 + MARGIN
        assert_survivors(futures, requests, ("B",))
        assert_settled(prefill, decode)
        assert_serves_again(decode, requests["B"], requests["C"])
        assert_settled(prefill, decode)


# --- 4. a transfer never completes (layer-wise) ----------------------------------------------------
def test_stalled_layerwise_push_fails_only_its_request() -> None:
    """B's layer writes stall; A and C, submitted while B waits, are served; B fails at its deadline
    and prefill cancels B's writes and frees its blocks when decode tells it."""
    faults = LoopbackFaults(never_complete=True)
    with pair(prefill_faults=faults, layerwise=True, deadline_s=2.0) as (prefill, decode):
        requests = three()
        t0 = time.monotonic()
        stalled = decode.submit(requests["B"], NEW, request_id="B")
        wait_for("prefill to post B's writes", lambda: posted(prefill))
        faults.never_complete = False          # read at each post: only B's writes stay stalled
        futures = submit_all(decode, {k: v for k, v in requests.items() if k != "B"})
        assert_survivors(futures, requests, ())
        assert not stalled.done()
        exc, took = failure(stalled, t0)
        assert isinstance(exc, TransferTimeout) and "request B: KV did not arrive within 2.0 s" in str(exc)
        assert 2.0 <= took < 2.0 + MARGIN
        assert_settled(prefill, decode)
        assert any(r.startswith("cancelled by decode") for r in prefill.stats.reasons)
        assert_serves_again(decode, requests["B"], requests["A"])
        assert_settled(prefill, decode)


# --- 5. a transfer completes late ------------------------------------------------------------------
def test_late_completion_within_the_deadline_succeeds_and_past_it_fails() -> None:
    faults = LoopbackFaults(delay_s=0.3)
    with pair(prefill_faults=faults, deadline_s=2.0) as (prefill, decode):
        requests = three()
        futures = submit_all(decode, requests)
        assert_survivors(futures, requests, ())
        # The delay did apply: the KV arrived at least 0.3 s after prefill's compute ended.
        assert all(f.result().arrival_s - f.result().prefill_s >= 0.3 for f in futures.values())
        assert_settled(prefill, decode)

        faults.delay_s = 5.0
        late = {"D": prompt(4, 40), "E": prompt(5, 20)}
        t0 = time.monotonic()
        slow = decode.submit(late["D"], NEW, request_id="D")
        wait_for("prefill to post D's write", lambda: posted(prefill))
        faults.delay_s = 0.0                    # read at each post: only D's write is late
        futures = submit_all(decode, {"E": late["E"]})
        assert_survivors(futures, late, ())
        exc, took = failure(slow, t0)
        assert isinstance(exc, TransferTimeout) and "request D: KV did not arrive within 2.0 s" in str(exc)
        assert 2.0 <= took < 2.0 + MARGIN
        assert_settled(prefill, decode)
        assert_serves_again(decode, late["D"], late["E"])
        assert_settled(prefill, decode)


# --- 6. integrity ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "layerwise", "offset"), [("push", False, 50_000), ("pull", False, 50_000),
                                                           ("push", True, 20_000)],
                         ids=["push", "pull", "push-layerwise"])
def test_corrupted_request_fails_integrity_and_is_not_committed(mode: str, layerwise: bool, offset: int) -> None:
    """The byte at ``offset`` of a transfer's destination stream arrives inverted. Only B's transfers
    reach that far (60 tokens: 122,880 bytes whole, 30,720 per layer; A and C, 20 and 24 tokens, at most
    49,152 whole and 12,288 per layer), so A and C are checked intact and served while B fails and
    leaves nothing in decode's prefix tree."""
    faults = LoopbackFaults(corrupt=(offset, 1))
    sides: dict[str, Any] = {"decode_faults" if mode == "pull" else "prefill_faults": faults}
    with pair(mode=mode, layerwise=layerwise, checksum=ChecksumPolicy(), **sides) as (prefill, decode):
        requests = three()
        t0 = time.monotonic()
        futures = submit_all(decode, requests)
        exc, took = failure(futures["B"], t0)
        assert isinstance(exc, IntegrityError)
        assert exc.args[0].startswith("transfer '") and "/B': KV differs from the source at layer " in str(exc)
        assert took < decode.config.deadline_s
        assert_survivors(futures, requests, ("B",))
        assert decode.status()["integrity_failures"] == 1
        assert_settled(prefill, decode)
        faults.corrupt = None
        assert_serves_again(decode, requests["B"], requests["A"])
        assert decode.status()["integrity_failures"] == 1
        assert_settled(prefill, decode)


@pytest.mark.parametrize(("offset", "oracle_sees_it"), [(50_000, False), (50_003, True)],
                         ids=["low-mantissa-byte", "sign-exponent-byte"])
def test_the_same_corruption_without_checksum(offset: int, oracle_sees_it: bool) -> None:
    """The control case: without a checksum B is served (wrongly) with the reference's tokens. Inverting
    the low mantissa byte of one float32 (offset 50,000) stays inside the KV oracle's tolerance, so only
    the checksum above fails it; inverting its sign/exponent byte (50,003) the oracle reports at its
    (layer, role, token, head)."""
    faults = LoopbackFaults(corrupt=(offset, 1))
    with pair(prefill_faults=faults) as (prefill, decode):
        tokens = prompt(2, 60)
        res = decode.generate(tokens, NEW, timeout=30, return_kv=KV)
        assert res.tokens == reference(tokens, NEW)
        report = kv_oracle().check(tokens, res.prompt_kv)
        assert report.ok is not oracle_sees_it, report.describe()
        if oracle_sees_it:
            assert report.bad == 1 and report.worst == (2, "key", 22, 0)   # 50,003 // 4 = float 12,500 of the stream
        assert decode.status()["integrity_failures"] == 0
        assert_settled(prefill, decode)


# --- 7. cancellation -------------------------------------------------------------------------------
def hold_cancel_answers(prefill: Any) -> threading.Event:
    """Prefill answers no ``kv_cancel`` until the returned event is set: a test can look at decode's
    zombies before the answer (which prefill sends at once, its compute being on another thread) buries
    them; otherwise the answer can win the race with the status query on a loaded machine."""
    answer, real_on_message = threading.Event(), prefill._on_message

    def held(conn: Any, msg: Any) -> None:
        if isinstance(msg, KvCancel):
            answer.wait(10)
        real_on_message(conn, msg)

    prefill._on_message = held
    return answer


def test_cancel_while_prefill_computes() -> None:
    """B is cancelled while prefill is inside its forward pass; prefill then writes into blocks decode
    must still hold, and frees its own; A and C wait behind B and are served."""
    entered, release = threading.Event(), threading.Event()
    with pair() as (prefill, decode):
        real = prefill.model.prefill

        def gated(*args: Any, **kw: Any) -> Any:
            if not entered.is_set():
                entered.set()
                release.wait(10)
            return real(*args, **kw)

        prefill.model.prefill = gated           # type: ignore[method-assign]
        answer = hold_cancel_answers(prefill)
        requests = {"B": prompt(2, 60), "A": prompt(1, 20), "C": prompt(3, 24)}
        futures = submit_all(decode, requests)
        assert entered.wait(10)
        assert decode.cancel("B", "user went away") is True
        exc = futures["B"].exception(5)
        assert isinstance(exc, RequestCancelled) and "request B: user went away" in str(exc)
        # Prefill is about to write B's KV: decode keeps B's blocks until prefill confirms it will not.
        assert decode.status()["zombies"] == 1
        answer.set()
        release.set()
        assert_survivors(futures, requests, ("B",))
        assert_settled(prefill, decode)
        assert decode.cancel("B") is False and decode.cancel("A") is False and decode.cancel("nobody") is False
        assert_serves_again(decode, requests["B"], requests["A"])
        assert_settled(prefill, decode)


def test_prefill_busy_past_the_deadline() -> None:
    """Prefill is stuck in one forward pass past decode's deadline with A and B queued behind it: both
    fail at the deadline, but decode keeps their blocks (prefill will still write them) until prefill,
    once free again, confirms; then everything is freed and the pair serves again."""
    entered, release = threading.Event(), threading.Event()
    with pair(deadline_s=1.5) as (prefill, decode):
        real = prefill.model.prefill

        def gated(*args: Any, **kw: Any) -> Any:
            if not entered.is_set():
                entered.set()
                release.wait(10)
            return real(*args, **kw)

        prefill.model.prefill = gated           # type: ignore[method-assign]
        answer = hold_cancel_answers(prefill)
        requests = {"A": prompt(1, 20), "B": prompt(2, 60)}
        t0 = time.monotonic()
        futures = submit_all(decode, requests)
        assert entered.wait(10)
        for rid, fut in futures.items():
            exc, took = failure(fut, t0)
            assert isinstance(exc, TransferTimeout)
            assert f"request {rid}: KV did not arrive within 1.5 s: no answer from prefill" in str(exc)
            assert 1.5 <= took < 1.5 + MARGIN
        status = decode.status()
        assert status["zombies"] == 2 and decode.held_slots() > 0 and status["jobs"] == 0
        answer.set()
        release.set()
        assert_settled(prefill, decode)
        for tokens in requests.values():        # nothing of either was committed on decode
            again = decode.generate(tokens, NEW, timeout=30, return_kv=KV)
            assert_matches_reference(again, tokens, NEW)
            assert again.reused_tokens_decode == 0
        assert_settled(prefill, decode)


def test_cancel_while_a_push_stalls() -> None:
    faults = LoopbackFaults(never_complete=True)
    with pair(prefill_faults=faults, deadline_s=30.0) as (prefill, decode):
        requests = three()
        stalled = decode.submit(requests["B"], NEW, request_id="B")
        wait_for("prefill to post B's write", lambda: posted(prefill))
        faults.never_complete = False
        futures = submit_all(decode, {"A": requests["A"]})
        assert_survivors(futures, requests, ())
        t0 = time.monotonic()
        assert decode.cancel("B", "user went away") is True
        exc, took = failure(stalled, t0, 5)
        assert isinstance(exc, RequestCancelled) and "request B: user went away" in str(exc)
        assert took < 5
        wait_for("prefill to free B", lambda: prefill.held_slots() == 0, 5)
        assert_settled(prefill, decode)
        assert any("cancelled by decode: request B: user went away" in r for r in prefill.stats.reasons)
        assert decode.cancel("B") is False
        assert_serves_again(decode, requests["B"], requests["A"])
        assert_settled(prefill, decode)


def test_cancel_while_a_pull_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = LoopbackFaults(never_complete=True)
    with pair(decode_faults=faults, mode="pull", deadline_s=30.0) as (prefill, decode):
        posted = threading.Event()
        real_read = decode.transport.read

        def read(*args: Any, **kw: Any) -> Any:
            handle = real_read(*args, **kw)
            posted.set()
            return handle

        monkeypatch.setattr(decode.transport, "read", read)
        requests = three()
        inflight = decode.submit(requests["B"], NEW, request_id="B")
        assert posted.wait(10)
        faults.never_complete = False
        futures = submit_all(decode, {"A": requests["A"]})
        assert_survivors(futures, requests, ())
        assert not inflight.done() and prefill.held_slots() > 0     # prefill holds B's pages for the read
        assert decode.cancel("B", "user went away") is True
        exc = inflight.exception(5)
        assert isinstance(exc, RequestCancelled) and "request B: user went away" in str(exc)
        wait_for("prefill to free B", lambda: prefill.held_slots() == 0, 5)
        assert_settled(prefill, decode)
        assert decode.cancel("B") is False
        assert_serves_again(decode, requests["B"], requests["A"])
        assert_settled(prefill, decode)



# --- notifications nobody reads --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_no_notification_is_left_pending_after_requests(mode: str) -> None:
    """Every transport notification a request causes is consumed (or dropped) by the side that gets it:
    one left pending per request is memory a long-running worker never gets back. Read on the engine
    threads, which drain in their periodic tick, after both sides settled."""
    with pair(mode=mode) as (prefill, decode):
        requests = three()
        assert_survivors(submit_all(decode, requests), requests, ())
        assert_settled(prefill, decode)
        for worker in (prefill, decode):
            assert worker.engine.call(worker.transport.notifications, 10.0) == {}, worker.config.name


# --- 7. protocol 2: decode takes the KV when it landed, not when prefill confirms --------------------
def record_sends(prefill: PrefillWorker, withhold: tuple[type[ControlMessage], ...] = ()) -> list[type[ControlMessage]]:
    """The types of every message prefill sends from now on; those in ``withhold`` are dropped."""
    sent: list[type[ControlMessage]] = []
    real = prefill._send

    def send(conn: Any, message: ControlMessage, *, urgent: bool = False) -> None:
        sent.append(type(message))
        if not isinstance(message, withhold):
            real(conn, message, urgent=urgent)
    prefill._send = send  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize(("layerwise", "checksum", "posted"), [
    (False, False, 0),   # one write, no digest: its tagged notice carries what kv_posted would
    (True, False, 3),    # layer-wise: kv_posted once every part is posted and the first token known
    (False, True, 3),    # with a digest: kv_posted carries it
], ids=["push", "push-layerwise", "push-checksum"])
def test_decode_takes_the_kv_when_it_landed_without_kv_pushed(layerwise: bool, checksum: bool, posted: int) -> None:
    """With ``kv_pushed`` withheld, every request still completes, exactly: ``kv_posted`` (sent while the
    writes are in flight) or the write's own tagged notice, plus the notices of every part, are what
    decode waits for. (Mutations: decode ignoring ``kv_posted``, or a notice's summary, times the
    requests out.)"""
    with pair(layerwise=layerwise, deadline_s=5.0, checksum=ChecksumPolicy() if checksum else None) \
            as (prefill, decode):
        sent = record_sends(prefill, (KvPushed,))
        requests = three()
        futures = submit_all(decode, requests)
        assert_survivors(futures, requests, ())
        wait_for("prefill to see its writes complete", lambda: sent.count(KvPushed) == 3)
        assert sent.count(KvPosted) == posted
        for fut in futures.values():   # one process: the two clocks are one
            r = fut.result()
            # layer-wise: the last write may be posted before the compute (the logits) ends
            assert 0 < r.prefill_computed_at <= r.arrived_at and 0 < r.prefill_posted_at <= r.arrived_at
            assert not r.transfer_by_prefill   # kv_pushed (prefill's own figure) never came
            assert r.arrived_at - r.prefill_computed_at <= r.arrival_s - r.prefill_s + 1e-3
        assert_settled(prefill, decode)


def test_a_protocol_1_decode_gets_no_kv_posted_and_waits_for_kv_pushed() -> None:
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET, prefill=prefill.address,
                         versions=(1, 1)) as decode:
        sent = record_sends(prefill)
        tokens = prompt(7, 40)
        res = decode.generate(tokens, NEW, timeout=30, return_kv=KV)
        assert_matches_reference(res, tokens, NEW)
        assert KvPosted not in sent and KvPushed in sent
        assert res.prefill_computed_at == 0.0 and res.arrived_at > 0
        assert_settled(prefill, decode)


# --- 8. the push's plan is built while prefill computes --------------------------------------------
def test_the_plan_built_during_the_compute_is_posted_when_the_source_ids_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode's kv_blocks comes while prefill computes (slowed here): the write's plan is built then and
    posted at the compute's end, and the KV is exact."""
    import kvxfer.disagg.worker_prefill as wp
    used: list[bool] = []
    real_reusable = wp.reusable_plan

    def spy(early: Any, src_ids: Any) -> Any:
        plan = real_reusable(early, src_ids)
        used.append(plan is not None)
        return plan
    monkeypatch.setattr(wp, "reusable_plan", spy)
    with pair() as (prefill, decode):
        real_prefill = prefill.model.prefill

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(0.3)   # decode's kv_blocks comes meanwhile
            return real_prefill(*a, **k)
        monkeypatch.setattr(prefill.model, "prefill", slow)
        pins = spy_pins(prefill)
        posts = spy_posts(prefill, monkeypatch)
        tokens = prompt(8, 50)
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert used and all(used)   # the ids held: the early plan (and its pin) served the post
        # The early plan's pages were pinned with it, while the model computed; the post pinned nothing.
        # (Mutation: pinning at the post regardless makes it two pins, the second after the compute.)
        assert pins == [True]
        # It was prepared while the model computed too, and the post was that prepared write, released after
        # (mutation: writing the plan at the post instead makes it ["write"]).
        assert posts == ["prepare while computing", "prepared post"]
        assert all(p.released for p in posts.prepared)   # type: ignore[attr-defined]
        assert_settled(prefill, decode)


def test_an_early_plan_whose_ids_changed_is_planned_and_pinned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute changed the request's ids after the early plan (as a commit swapping the last block
    does; simulated): the post plans and pins the ids it reads, the KV is exact, and both pins are
    released (no page held afterwards)."""
    import kvxfer.disagg.worker_prefill as wp
    monkeypatch.setattr(wp, "reusable_plan", lambda early, src_ids: None)
    with pair() as (prefill, decode):
        real_prefill = prefill.model.prefill

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(0.3)
            return real_prefill(*a, **k)
        monkeypatch.setattr(prefill.model, "prefill", slow)
        pins = spy_pins(prefill)
        posts = spy_posts(prefill, monkeypatch)
        tokens = prompt(9, 50)
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert pins == [True, False]   # the early pin while computing, the post's after it
        # The early prepared write is dropped (released, never posted) and the new plan written.
        assert posts == ["prepare while computing", "write"]
        assert all(p.released for p in posts.prepared)   # type: ignore[attr-defined]
        assert_settled(prefill, decode)


class _Posts(list[str]):
    prepared: list[Any]


def spy_posts(prefill: PrefillWorker, monkeypatch: pytest.MonkeyPatch) -> _Posts:
    """Record the prefill transport's prepares (computing or not), prepared posts and plain writes, in order;
    ``.prepared`` holds the PreparedTransfers made."""
    from kvxfer.transport import PreparedTransfer
    seen = _Posts()
    seen.prepared = []
    transport = prefill.transport
    real_prepare, real_write, real_post = transport.prepare, transport.write, PreparedTransfer.post

    def prepare(*a: Any, **k: Any) -> Any:
        seen.append("prepare while computing" if any(j.computing for j in prefill._jobs.values()) else "prepare")
        out = real_prepare(*a, **k)
        seen.prepared.append(out)
        return out

    def write(*a: Any, **k: Any) -> Any:
        seen.append("write")
        return real_write(*a, **k)

    def post(self: Any, *a: Any, **k: Any) -> Any:
        seen.append("prepared post")
        return real_post(self, *a, **k)
    monkeypatch.setattr(transport, "prepare", prepare)
    monkeypatch.setattr(transport, "write", write)
    monkeypatch.setattr(PreparedTransfer, "post", post)
    return seen


def spy_pins(prefill: PrefillWorker) -> list[bool]:
    """Record, for each ``pin_pages`` of the prefill worker, whether a request was being computed then."""
    seen: list[bool] = []
    manager = prefill.managers[0]
    real = manager.pin_pages

    def pin(ids: Any) -> Any:
        seen.append(any(job.computing for job in prefill._jobs.values()))
        return real(ids)
    manager.pin_pages = pin  # type: ignore[method-assign]
    return seen


def test_an_early_plan_is_used_only_for_the_exact_source_ids() -> None:
    ids = [{0: np.array([3, 4, 5]), 1: np.array([7])}]
    plan: Any = object()
    assert wp_reusable((ids, plan), [{0: np.array([3, 4, 5]), 1: np.array([7])}]) is plan
    assert wp_reusable(None, ids) is None
    for other in ([{0: np.array([3, 4, 6]), 1: np.array([7])}],     # the last block swapped at commit
                  [{0: np.array([3, 4, 5])}],                         # a layer group fewer
                  [{0: np.array([3, 4, 5]), 1: np.array([7])}] * 2,   # another rank count
                  [{0: np.array([3, 4]), 1: np.array([7])}]):         # fewer blocks
        assert wp_reusable((ids, plan), other) is None


def wp_reusable(early: Any, src_ids: Any) -> Any:
    from kvxfer.disagg.worker_prefill import reusable_plan
    return reusable_plan(early, src_ids)


# --- 9. notices: only the request's prefill can say its KV landed ----------------------------------
SUMMARY = KvPosted(request_id="F", first_token=1, parts=1, nbytes=1, reused_tokens=0, prefill_s=0.0, digest=b"",
                   queued_s=0.0, post_s=0.0, computed_at=1.0, posted_at=1.0)


def test_a_forged_or_untagged_notice_does_not_complete_a_request() -> None:
    """The real notice of request F is lost and kv_pushed withheld: a notice with a wrong tag, a
    protocol-1 notice and a malformed one complete nothing (each counted); a notice tagged by F's
    prefill connection then completes it. (Mutation: decode not checking the tag completes F with
    the forged notice, and the bad-notice count stays 1.)"""
    from kvxfer.disagg.worker_protocol import encode_notice
    with pair(prefill_faults=LoopbackFaults(drop_notification=1), deadline_s=10.0) as (prefill, decode):
        sent = record_sends(prefill, (KvPushed,))
        tokens = prompt(9, 40)
        fut = decode.submit(tokens, NEW, request_id="F", return_kv=KV)
        wait_for("F's write to complete on prefill", lambda: KvPushed in sent)
        src = prefill.transport.name
        for note in (encode_notice("F", 1, SUMMARY, lambda signed: bytes(16)),   # wrong tag
                     b"F#1",                                                      # protocol 1, untagged
                     b"KVX2" + bytes(40)):                                        # malformed
            decode.transport._deliver(src, note)
        decode.engine.wake()
        wait_for("decode to weigh the three notices", lambda: decode.counts["bad_notices"] == 3)
        time.sleep(0.2)
        assert not fut.done()
        conn = prefill.engine.call(lambda: next(iter(prefill._peers.values())), 5.0)
        decode.transport._deliver(src, encode_notice("F", 1, msgspec.structs.replace(
            SUMMARY, nbytes=int(tokens.size) * BYTES_PER_TOKEN, first_token=reference(tokens, 1)[0]), conn.sign_notice))
        decode.engine.wake()
        assert_matches_reference(fut.result(10), tokens, NEW)
        assert_settled(prefill, decode)


@pytest.mark.parametrize(("raw", "pattern"), [
    (b"KVX1" + bytes(40), "not a tagged"),
    (b"KVX2" + bytes(10), "not a tagged"),
    (b"KVX2" + bytes(3000), "not a tagged"),
    (b"KVX2" + b"\x93\xa1F\x01\xc0" + bytes(16), None),                      # well formed, no summary
    (b"KVX2" + b"\x93\xa1F\x00\xc0" + bytes(16), r"notice\.part"),
    (b"KVX2" + b"\x92\xa1F\x01" + bytes(16), r"expected \[request_id, part, summary\]"),
    (b"KVX2" + b"\x93\xa1F\x01\x81\xa5parts\x01" + bytes(16), r"notice\.summary.*missing required field"),
    (b"KVX2" + b"\x93\xa0\x01\xc0" + bytes(16), r"notice\.request_id"),
])
def test_malformed_notices_name_what_is_wrong(raw: bytes, pattern: str | None) -> None:
    from kvxfer.disagg.worker_protocol import decode_notice
    from kvxfer.errors import ProtocolError
    if pattern is None:
        notice = decode_notice(raw)
        assert (notice.request_id, notice.part, notice.summary, notice.tag) == ("F", 1, None, bytes(16))
    else:
        with pytest.raises(ProtocolError, match=pattern):
            decode_notice(raw)


@pytest.mark.parametrize("layerwise", [False, True], ids=["push", "push-layerwise"])
def test_only_a_write_after_the_whole_compute_is_posted_settled(layerwise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device copy may skip waiting for the model's stream only when the compute thread synchronized
    after writing the pages (the whole prompt, first token read): never for a layer group posted while
    the model still runs. (The one write goes as a plain write or as the early plan's prepared post,
    whichever the timing of decode's ``kv_blocks`` allowed: both are recorded.)"""
    from kvxfer.transport import PreparedTransfer
    with pair(layerwise=layerwise) as (prefill, decode):
        flags: list[bool] = []
        real_write, real_post = prefill.transport.write, PreparedTransfer.post

        def write(peer: str, plan: Any, notify: bytes | None = None, *, settled: bool = False) -> Any:
            flags.append(settled)
            return real_write(peer, plan, notify, settled=settled)

        def post(self: PreparedTransfer, notify: bytes | None = None, *, settled: bool = False) -> Any:
            flags.append(settled)
            return real_post(self, notify, settled=settled)
        monkeypatch.setattr(prefill.transport, "write", write)
        monkeypatch.setattr(PreparedTransfer, "post", post)
        tokens = prompt(10, 40)
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert flags == ([False] * LAYERS if layerwise else [True])
