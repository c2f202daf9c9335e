"""Worker API around the request path: checksums carried by the worker protocol, cancellation,
``worker_status`` (in process, over a client connection, and ``kvxfer status``)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from kvxfer.cli import main as cli_main
from kvxfer.cli.serve import parse_checksum
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import GenerateClient, query_status
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.disagg.worker_protocol import (
    decode_checksum_policy,
    decode_tokens,
    encode_checksum_policy,
    encode_tokens,
)
from kvxfer.errors import (
    IntegrityError,
    PeerUnreachable,
    ProtocolError,
    RequestCancelled,
    TransferFailed,
    TransferTimeout,
)
from kvxfer.transport import LoopbackFaults
from kvxfer.transport.integrity import ChecksumPolicy
from tests.e2e.test_loopback import (  # noqa: F401 (_one_thread: autouse leak check)
    KV,
    NEW,
    SECRET,
    _one_thread,
    assert_idle,
    assert_matches_reference,
    name,
    prompts,
)


def wait_idle(*workers: PrefillWorker | DecodeWorker, timeout: float = 5.0) -> None:
    """Poll until no request holds anything (the peer's release/cancel may still be in flight), then assert."""
    deadline = time.monotonic() + timeout
    while any(w.held_slots() or w.num_open_caches() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_idle(*workers)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_checksummed_requests_match_and_a_corrupted_one_is_not_committed(mode: str) -> None:
    faults = LoopbackFaults()
    decode_opts = {"faults": faults} if mode == "pull" else None   # the side whose transport writes
    prefill_opts = {"faults": faults} if mode == "push" else None
    policy = ChecksumPolicy()
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET, transport_options=prefill_opts) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), checksum=policy), SECRET, prefill=prefill.address, mode=mode,
                         transport_options=decode_opts) as decode:
        good, bad = prompts(21, prefix=0, count=2)
        assert_matches_reference(decode.generate(good, NEW, timeout=60, return_kv=KV), good, NEW)
        faults.corrupt = (100, 1)
        with pytest.raises(IntegrityError, match=r"KV differs from the source at layer \d+ role '\w+' head \d+ tokens \[\d+, \d+\)"):
            decode.generate(bad, 6, timeout=60)
        faults.corrupt = None
        wait_idle(prefill, decode)
        again = decode.generate(bad, NEW, timeout=60, return_kv=KV)    # nothing of the corrupted request was kept
        assert again.reused_tokens_decode == 0
        assert_matches_reference(again, bad, NEW)
        assert again.verify_s > 0.0    # the check ran (and is reported)
        status = decode.status()
        assert status["integrity_failures"] == 1 and status["completed"] == 2 and status["failed"] == 1


def test_without_checksum_the_same_corruption_goes_unnoticed() -> None:
    """The control case: the checksum, not something else, catches the corruption above."""
    faults = LoopbackFaults(corrupt=(100, 1))
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET, transport_options={"faults": faults}) as prefill, \
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address) as decode:
        tokens = prompts(21, prefix=0, count=2)[1]
        res = decode.generate(tokens, 6, timeout=60)
        assert len(res.tokens) == 6 and res.verify_s == 0.0
        assert decode.status()["integrity_failures"] == 0


def test_cancel_fails_the_future_and_frees_both_sides() -> None:
    stall = LoopbackFaults(never_complete=True)
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET, transport_options={"faults": stall}) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), deadline_s=60.0), SECRET, prefill=prefill.address) as decode:
        tokens = prompts(22)[0]
        fut = decode.submit(tokens, 4, request_id="stuck")
        deadline = time.monotonic() + 10
        while prefill.status()["jobs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert decode.cancel("stuck", "user went away") is True
        with pytest.raises(RequestCancelled, match="stuck: user went away"):
            fut.result(5)
        assert decode.cancel("stuck") is False and decode.cancel("never-seen") is False
        wait_idle(prefill, decode)
        assert any("cancelled by decode" in r for r in prefill.stats.reasons)
        stall.never_complete = False
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)


def test_status_in_process_over_a_client_connection_and_from_the_cli(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_SECRET", SECRET)
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address,
                         bind="tcp://127.0.0.1:0") as decode:
        assert decode.address is not None
        tokens = prompts(23)[0]
        client = GenerateClient(decode.address, SECRET)
        try:
            rid = client.submit(tokens, NEW, return_kv=KV)
            client.cancel("r999")                       # not in flight: ignored
            res = client.recv(60)
            assert res.request_id == rid
            assert_matches_reference(res, tokens, NEW)
            over_client = client.status()
        finally:
            client.close()
        assert over_client["role"] == "decode" and over_client["completed"] == 1 and over_client["held_slots"] == 0
        remote = query_status(prefill.address, SECRET)
        assert remote == prefill.status()
        assert remote["role"] == "prefill" and remote["completed"] == 1 and remote["jobs"] == 0
        assert remote["held_slots"] == 0 and remote["open_caches"] == 0
        assert cli_main(["status", prefill.address, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["status"]["completed"] == 1
        assert_idle(prefill, decode)


def test_a_status_client_cannot_ask_prefill_for_kv() -> None:
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill:
        from kvxfer.disagg import LocalIdentity, connect
        from kvxfer.disagg.messages import KvRelease
        conn = connect(prefill.address, LocalIdentity("client", "nosy"), SECRET)
        try:
            conn.send(KvRelease(request_id="x"))
            with pytest.raises(PeerUnreachable, match="may only ask for worker_status"):
                for _ in range(50):
                    conn.recv(0.2)
        finally:
            conn.close()
        assert prefill.status()["jobs"] == 0


def test_prompt_tokens_travel_as_int32_bytes_and_malformed_ones_are_refused() -> None:
    tokens = np.array([0, 5, 128255, (1 << 31) - 1], dtype=np.int64)
    data = encode_tokens(tokens)
    assert len(data) == 16 and np.array_equal(decode_tokens(data, "t"), tokens)
    assert decode_tokens(b"", "t").size == 0
    with pytest.raises(ProtocolError, match=r"t: 7 bytes is not a whole number"):
        decode_tokens(data[:7], "t")
    with pytest.raises(ProtocolError, match=r"t: token id -3 is negative"):
        decode_tokens(encode_tokens([1, -3]), "t")


def test_checksum_policy_codec_and_cli_parsing() -> None:
    for policy in (None, ChecksumPolicy(), ChecksumPolicy.every(4, seed=1), ChecksumPolicy.sample(0.25, seed=9)):
        assert decode_checksum_policy(encode_checksum_policy(policy)) == policy
    for bad in (b"\x93\x01\x02\x03", b"\xc1", encode_checksum_policy(ChecksumPolicy())[:-1]):
        with pytest.raises(ProtocolError, match=r"kv_request\.checksum"):
            decode_checksum_policy(bad)
    assert parse_checksum("off") is None and parse_checksum("full") == ChecksumPolicy()
    assert parse_checksum("every:8") == ChecksumPolicy.every(8)
    assert parse_checksum("sample:0.5") == ChecksumPolicy.sample(0.5, seed=0)
    import argparse
    for bad_text in ("every:0", "sample:2", "fast", "full:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--checksum"):
            parse_checksum(bad_text)
    np.testing.assert_equal(ChecksumPolicy.every(8).select(20), np.arange(0, 20, 8))
    for text in ("full", "every:8", "sample:0.25"):
        assert parse_checksum(text).describe() == text  # type: ignore[union-attr]
    assert ChecksumPolicy.every(4, seed=3).describe() == "every:4 (seed=3)"


def test_pulled_data_is_refused_when_decode_stalled_past_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's engine stalls (as under SIGSTOP or a long step) right after posting a read: prefill's
    lease runs out and it frees the source pages, so the data read cannot be trusted; decode must fail
    the request rather than commit it, and serve the next one."""
    lease = 0.4
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), lease_s=lease), SECRET, prefill=prefill.address,
                         mode="pull") as decode:
        real_read = decode.transport.read
        stalls = [1]

        def stalling_read(*args: object, **kw: object) -> object:
            handle = real_read(*args, **kw)  # type: ignore[arg-type]
            if stalls:
                stalls.pop()
                time.sleep(lease * 3)         # on decode's engine thread: no renewal goes out
            return handle

        monkeypatch.setattr(decode.transport, "read", stalling_read)
        tokens = prompts(24)[0]
        # Refused by decode's own check, or by prefill's expiry notice if that is handled first.
        with pytest.raises(TransferFailed, match=r"lease may have expired before the read completed|"
                                                 r"lease expired: decode stopped renewing it"):
            decode.generate(tokens, 4, timeout=30)
        wait_idle(prefill, decode)
        assert any("lease expired" in r for r in prefill.stats.reasons)
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)


def test_a_request_whose_deadline_passed_in_decode_queue_is_not_sent() -> None:
    """Decode's engine is held busy for longer than the deadline; the request queued behind it fails
    with TransferTimeout naming the queue, and prefill never computes it."""
    deadline = 0.5
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), deadline_s=deadline), SECRET, prefill=prefill.address) as decode:
        busy_engine = threading.Event()
        release = threading.Event()

        def hold() -> None:   # runs on decode's engine thread: everything posted meanwhile waits
            busy_engine.set()
            assert release.wait(30)
        holder = threading.Thread(target=lambda: decode.engine.call(hold, 30))
        holder.start()
        first, second = prompts(25, count=2)
        assert busy_engine.wait(30)
        queued = decode.submit(second, 4)
        time.sleep(3 * deadline)   # the engine stays held this long (the premise, not a synchronisation)
        release.set()
        holder.join(30)
        with pytest.raises(TransferTimeout, match=r"deadline passed while it waited \d+\.\d s in decode's queue"):
            queued.result(30)
        assert prefill.status()["requests"] == 0
        assert_matches_reference(decode.generate(first, NEW, timeout=30, return_kv=KV), first, NEW)
        assert_matches_reference(decode.generate(second, NEW, timeout=30, return_kv=KV), second, NEW)
        wait_idle(prefill, decode)


def test_decode_request_states_move_only_as_the_table_says() -> None:
    """The decode request lifecycle: every state reaches a terminal one, terminal states never move, and
    a move the table does not list is refused naming the request, both states and what was allowed."""
    from kvxfer.disagg.worker_decode import JOB_TRANSITIONS, JobState, check_move
    from kvxfer.errors import SessionError
    assert {s for s in JobState if s.terminal} == {JobState.DONE, JobState.FAILED, JobState.RETRIED, JobState.FREED}
    for start in JobState:
        seen, todo = {start}, [start]
        while todo:
            for nxt in JOB_TRANSITIONS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert any(s.terminal for s in seen), start
    check_move("r", JobState.REQUESTED, JobState.GENERATING)
    with pytest.raises(SessionError, match=r"decode request 'r': illegal move done -> requested \(allowed from "
                                           r"done: none \(terminal\)\)"):
        check_move("r", JobState.DONE, JobState.REQUESTED)
    with pytest.raises(SessionError, match=r"illegal move generating -> quarantined \(allowed from generating: "
                                           r"\['done', 'failed'\]\)"):
        check_move("r", JobState.GENERATING, JobState.QUARANTINED)


def test_prefill_request_states_move_only_as_the_table_says() -> None:
    """The prefill request lifecycle: every state reaches FREED, FREED never moves, a computing request
    can end only through ABANDONED (its pages are under the compute thread), and a move the table does
    not list is refused naming the request and both states."""
    from kvxfer.disagg.worker_prefill import PREFILL_TRANSITIONS, PrefillState, check_prefill_move
    from kvxfer.errors import SessionError
    assert {s for s in PrefillState if s.terminal} == {PrefillState.FREED}
    for start in PrefillState:
        seen, todo = {start}, [start]
        while todo:
            for nxt in PREFILL_TRANSITIONS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert PrefillState.FREED in seen, start
    check_prefill_move("r", PrefillState.COMPUTING, PrefillState.ABANDONED)
    with pytest.raises(SessionError, match=r"prefill request 'r': illegal move computing -> freed \(allowed from "
                                           r"computing: \['abandoned', 'computed'\]\)"):
        check_prefill_move("r", PrefillState.COMPUTING, PrefillState.FREED)
    with pytest.raises(SessionError, match=r"illegal move freed -> sending \(allowed from freed: none"):
        check_prefill_move("r", PrefillState.FREED, PrefillState.SENDING)


def test_a_prefill_request_cancelled_while_computing_keeps_its_pages_until_the_compute_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled by decode while the model computes: prefill holds the request ABANDONED (its pages still
    open: the compute thread writes them) and frees them once the compute reports back."""
    from kvxfer.disagg.worker_prefill import PrefillState
    gate, inside = threading.Event(), threading.Event()
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address) as decode:
        real = prefill.model.prefill

        def held(*a: object, **k: object) -> object:
            inside.set()
            assert gate.wait(30)
            return real(*a, **k)   # type: ignore[arg-type]
        monkeypatch.setattr(prefill.model, "prefill", held)

        def states() -> list[PrefillState]:
            return list(prefill.engine.call(lambda: [j.state for j in prefill._jobs.values()], 5.0))
        tokens = prompts(23, prefix=0, count=1)[0]
        fut = decode.submit(tokens, NEW, request_id="held")
        assert inside.wait(30)
        assert states() == [PrefillState.COMPUTING]
        assert decode.cancel("held")
        deadline = time.monotonic() + 10
        while states() != [PrefillState.ABANDONED] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert states() == [PrefillState.ABANDONED]
        assert prefill.num_open_caches() == 1   # not freed under the compute thread
        gate.set()
        with pytest.raises(RequestCancelled):
            fut.result(30)
        wait_idle(prefill, decode)
        assert states() == []
