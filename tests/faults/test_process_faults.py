"""Faults of real worker processes over UCX on 127.0.0.1: a prefill or decode process SIGKILLed before,
during or after a transfer, or frozen with SIGSTOP past a deadline or lease and then resumed.

The surviving worker runs in this process wherever it can, so its slot accounting is read directly;
a frozen-then-resumed worker process is asked for its own figures (``query_status``). Every case checks
that the affected requests fail with a clear error in time, that the others still get the exact tokens
of single-process generation, that the survivor holds nothing afterwards and serves the next request,
and that no worker thread or child process is left behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.control import PeerConnection
from kvxfer.disagg.messages import ControlMessage, KvBlocks, KvPull
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import GenerateClient, query_status
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.disagg.worker_protocol import decode_notice
from kvxfer.errors import BackendUnavailable, KvxferError, PeerUnreachable, TransferFailed, TransferTimeout
from kvxfer.pagetable import TransferPlan
from kvxfer.transport import PreparedTransfer, TransferHandle, available_backends
from tests.e2e.test_loopback import (
    KV,
    NEW,
    _one_thread,  # noqa: F401 (autouse leak check)
    assert_matches_reference,
    prompts,
)
from tests.faults.conftest import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.ucx]
SECRET = "faults-proc-secret-0123456789abcdef"
HEARTBEAT_LIMIT = 3 * WorkerConfig("defaults").heartbeat_interval
"""A peer silent this long is lost (``kvxfer serve`` has no heartbeat option: the default applies)."""
MARGIN = 6.0
"""Slack for a loaded 2-core machine on every "within the limit" check."""
RECONNECT_S = 1.0
"""Decode's connect timeout: how long its automatic reconnect to a dead prefill address may try."""
LEASE_S = 1.0
"""Decode's lease in the cases that lose a prefill: decode quarantines a lost prefill's push destinations
until the lease could have run out (about two leases), so a short one keeps the cases short."""
_names = itertools.count()
_started: list[WorkerProcess] = []


@pytest.fixture(scope="module")
def backend() -> str:
    """The best UCX backend installed, or ``$KVXFER_FAULTS_BACKEND`` (nixl or ucx) to run the cases on another."""
    wanted = os.environ.get("KVXFER_FAULTS_BACKEND")
    if wanted:
        reason = available_backends().get(wanted, f"unknown backend {wanted!r}")
        if reason is not None:
            pytest.skip(f"KVXFER_FAULTS_BACKEND={wanted}: {reason}")
        return wanted
    try:
        return best_backend()
    except BackendUnavailable as exc:
        pytest.skip(f"needs a UCX transport (nixl or ucx): {exc}")


def _children() -> set[int]:
    """Live (not yet reaped) child processes of this process."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            out.add(int(entry))
    return out


@pytest.fixture(autouse=True)
def _no_child_left() -> Iterator[None]:
    """Every worker process a test starts is reaped by the test itself."""
    before = _children()
    yield
    alive = [p for p in _started if p.proc.returncode is None]
    for p in alive:
        reap(p)
    _started.clear()
    assert not alive, f"worker processes left running: {[p.proc.args for p in alive]}"
    assert _children() <= before, f"child processes left behind: {_children() - before}"


def name(role: str) -> str:
    return f"faults-{role}-{os.getpid()}-{next(_names)}"


def spawn(role: str, backend: str, *extra: str) -> WorkerProcess:
    """``kvxfer serve ROLE`` with the test secret, one torch thread, and this checkout on the path."""
    env = {**os.environ, "KVXFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = WorkerProcess([role, "--backend", backend, "--name", name(role), *extra], env, 60.0)
    _started.append(proc)
    return proc


def reap(*procs: WorkerProcess | None) -> None:
    """Resume (if frozen), stop and reap each process."""
    for p in procs:
        if p is None:
            continue
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGCONT)
        p.stop()


def assert_holds_nothing(worker: PrefillWorker | DecodeWorker) -> None:
    """No request holds a slot or an open cache, and every manager's accounting balances: each slot is
    free or kept by the prefix tree alone (``slot_accounting`` raises when the counts contradict). A decode
    first gets the time its quarantine of a lost prefill's push destinations may take."""
    if isinstance(worker, DecodeWorker):
        wait_until(lambda: worker.status()["zombies"] == 0, 2 * LEASE_S + MARGIN, "decode ends its quarantine")
    accounts = worker.engine.call(lambda: [m.slot_accounting(pg) for m in worker.managers
                                           for pg in range(len(m.layout.pool_groups))], 10.0)
    for acc in accounts:
        assert acc.request_only == 0 and acc.shared == 0, acc
        assert acc.free + acc.evictable == acc.total, acc
    assert worker.held_slots() == 0
    assert worker.num_open_caches() == 0


def long_prompts(seed: int, count: int, length: int) -> list[np.ndarray]:
    """``count`` distinct prompts of ``length`` tokens (no shared prefix)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, length) for _ in range(count)]


def outcome(fut: Future[GenerationResult], timeout: float) -> GenerationResult | KvxferError:
    """The request's result or the exception it failed with."""
    try:
        return fut.result(timeout=timeout)
    except KvxferError as exc:
        return exc


def test_prefill_killed_while_idle_fails_the_next_submit_fast(backend: str) -> None:
    """Connected and idle, prefill dies: the next request fails with PeerUnreachable (heartbeat loss, or
    the automatic reconnect to the dead address failing); decode holds nothing and serves a new prefill."""
    first = spawn("prefill", backend)
    second: WorkerProcess | None = None
    try:
        cfg = WorkerConfig(name("decode"), backend=backend, lease_s=LEASE_S)
        with DecodeWorker(cfg, SECRET, connect_timeout=RECONNECT_S) as decode:
            decode.connect(first.address, timeout=30.0)
            tokens = prompts(11)[0]
            assert_matches_reference(decode.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW)
            first.kill()
            t0 = time.monotonic()
            with pytest.raises(PeerUnreachable, match=r"lost: .*silent|no prefill worker connected"):
                decode.generate(tokens, 4, timeout=60)
            took = time.monotonic() - t0
            assert took < HEARTBEAT_LIMIT + RECONNECT_S + MARGIN, f"failed {took:.1f} s after the kill"
            wait_until(lambda: not decode.connected, HEARTBEAT_LIMIT + MARGIN, "decode notices the lost prefill")
            t0 = time.monotonic()       # not connected: the submit tries the dead address once, then fails
            with pytest.raises(PeerUnreachable, match="no prefill worker connected"):
                decode.generate(tokens, 4, timeout=60)
            assert time.monotonic() - t0 < RECONNECT_S + MARGIN
            assert_holds_nothing(decode)
            second = spawn("prefill", backend)
            decode.connect(second.address, timeout=30.0)
            other = prompts(12)[1]
            assert_matches_reference(decode.generate(other, NEW, timeout=60, return_kv=KV), other, NEW)
            assert_holds_nothing(decode)
    finally:
        reap(first, second)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pull", "push-layerwise"])
def test_prefill_killed_during_transfers_fails_only_requests_in_flight(backend: str, mode: str) -> None:
    """Several long requests in flight; prefill is SIGKILLed at a transfer of the second one (pull: just
    before decode reads the offered pages, so the read runs against a dead process; layer-wise push:
    once the first layer group arrived, the others still to come). The request served before still
    has its exact tokens; the victim and those queued behind it fail with PeerUnreachable or
    TransferFailed within the heartbeat limit; decode frees every block and serves a new prefill."""
    pull = mode == "pull"
    first = spawn("prefill", backend)
    second: WorkerProcess | None = None
    killed_at: list[float] = []
    try:
        cfg = WorkerConfig(name("decode"), backend=backend, num_blocks=512, deadline_s=60.0, lease_s=LEASE_S)
        with DecodeWorker(cfg, SECRET, prefill=first.address, mode="pull" if pull else "push",
                          layerwise=not pull, connect_timeout=30.0) as decode:
            def kill_first() -> None:
                if not killed_at:
                    first.kill()         # SIGKILL and reap: the peer is gone before the engine goes on
                    killed_at.append(time.monotonic())

            if pull:
                post_read = decode.transport.read

                def read(peer: str, plan: TransferPlan, notify: bytes | None = None) -> TransferHandle:
                    if notify is not None and notify.startswith(b"victim#"):
                        kill_first()
                    return post_read(peer, plan, notify)
                decode.transport.read = read  # type: ignore[method-assign]
            else:
                poll_notes = decode.transport.notifications

                def notifications() -> dict[str, list[bytes]]:
                    notes = poll_notes()
                    if any(decode_notice(n).request_id == "victim" for ns in notes.values() for n in ns):
                        kill_first()
                    return notes
                decode.transport.notifications = notifications  # type: ignore[method-assign]

            served, victim, *queued = long_prompts(21, 3, 400)
            # Served to the end first: prefill computes off its engine thread, so the victim's first layers
            # could otherwise reach decode before the served request's own completion does.
            futures = [decode.submit(served, NEW, request_id="served", return_kv=KV)]
            outcome(futures[0], 120.0)
            futures += [decode.submit(victim, NEW, request_id="victim", return_kv=KV)]
            futures += [decode.submit(p, NEW, request_id=f"queued-{i}") for i, p in enumerate(queued)]
            results = [outcome(f, 120.0) for f in futures]
            assert killed_at, "the victim's transfer never started"
            assert isinstance(results[0], GenerationResult)
            assert_matches_reference(results[0], served, NEW)
            got = results[1]
            if pull:                     # the pages' owner is dead before the read is posted: it cannot succeed
                assert isinstance(got, TransferFailed | PeerUnreachable), got
                assert "read of request victim" in str(got) or "lost" in str(got), got
            elif isinstance(got, GenerationResult):   # every layer may have arrived before the kill
                assert_matches_reference(got, victim, NEW)
            else:
                assert isinstance(got, PeerUnreachable) and "lost" in str(got), got
            for res in results[2:]:
                assert isinstance(res, PeerUnreachable) and "lost" in str(res), res
            took = time.monotonic() - killed_at[0]
            assert took < HEARTBEAT_LIMIT + MARGIN, f"in-flight requests failed {took:.1f} s after the kill"
            # Every block is freed once nothing can write into it (a pending read must end first).
            wait_until(lambda: decode.held_slots() == 0, HEARTBEAT_LIMIT + 2 * LEASE_S + MARGIN, "decode frees every block")
            assert_holds_nothing(decode)
            second = spawn("prefill", backend)
            decode.connect(second.address, timeout=30.0)
            assert_matches_reference(decode.generate(victim, NEW, timeout=60, return_kv=KV), victim, NEW)
            assert_holds_nothing(decode)
    finally:
        reap(first, second)


def test_prefill_killed_after_the_transfer_the_request_still_completes(backend: str) -> None:
    """Prefill dies once a request's KV is in decode's pages (decode is about to generate): that request
    completes with its exact tokens; one still being computed fails; later submits fail clearly until a
    prefill listens again at the same address, which decode then reconnects to by itself."""
    first = spawn("prefill", backend)
    second: WorkerProcess | None = None
    generating = threading.Event()
    resume = threading.Event()
    try:
        cfg = WorkerConfig(name("decode"), backend=backend, deadline_s=60.0, lease_s=LEASE_S)
        with DecodeWorker(cfg, SECRET, prefill=first.address, mode="pull", connect_timeout=RECONNECT_S) as decode:
            greedy = decode.model.continue_greedy

            def continue_greedy(*args: object, **kw: object) -> list[int]:
                if not generating.is_set():   # hold the first generation until prefill is dead
                    generating.set()
                    assert resume.wait(60.0)
                return greedy(*args, **kw)  # type: ignore[arg-type]
            decode.model.continue_greedy = continue_greedy  # type: ignore[method-assign]

            short, = prompts(31, count=1)
            long, = long_prompts(32, 1, 1200)
            done = decode.submit(short, 24, return_kv=KV)
            computing = decode.submit(long, 4)
            assert generating.wait(60.0), "the first request's KV never arrived"
            first.kill()
            resume.set()
            assert_matches_reference(done.result(timeout=60), short, 24)
            with pytest.raises(PeerUnreachable, match="lost"):
                computing.result(timeout=HEARTBEAT_LIMIT + MARGIN)
            with pytest.raises(PeerUnreachable, match="no prefill worker connected"):
                decode.generate(short, 4, timeout=60)
            assert_holds_nothing(decode)
            second = spawn("prefill", backend, "--listen", first.address)
            # Decode reconnects by itself on a submit, once its back-off after the failed attempt
            # (2 x connect timeout) has passed: until then a submit fails fast.
            t0 = time.monotonic()
            while True:
                try:
                    res = decode.generate(long, NEW, timeout=60, return_kv=KV)
                    break
                except PeerUnreachable as exc:
                    assert "no prefill worker connected" in str(exc), exc
                    assert time.monotonic() - t0 < 2 * RECONNECT_S + MARGIN, "decode never reconnected"
                    time.sleep(0.2)
            assert_matches_reference(res, long, NEW)
            assert decode.connected
            assert_holds_nothing(decode)
    finally:
        resume.set()
        reap(first, second)


@pytest.mark.slow
def test_decode_killed_before_during_and_after_transfers_prefill_frees_everything(backend: str) -> None:
    """Prefill (this process) serving decode processes, each SIGKILLed at another point: idle; right after
    prefill posted a request's KV write (others queued behind it, one held for a pull); while generating
    after the transfer. Each time prefill drops the peer within the heartbeat limit and frees every
    block; then a fresh decode process serves a client the exact tokens."""
    cfg = WorkerConfig(name("prefill"), backend=backend, num_blocks=512)
    decodes: list[WorkerProcess] = []
    with PrefillWorker(cfg, SECRET) as prefill:
        try:
            def start_decode(*extra: str) -> tuple[WorkerProcess, GenerateClient]:
                proc = spawn("decode", backend, "--prefill", prefill.address, "--listen", "tcp://127.0.0.1:0",
                             *extra)
                decodes.append(proc)
                wait_until(lambda: len(prefill.server.peers) == 1, 30.0, "the decode process connects")
                return proc, GenerateClient(proc.address, SECRET, name=name("client"))

            def killed_and_freed(proc: WorkerProcess) -> None:
                proc.kill()
                wait_until(lambda: not prefill.server.peers, HEARTBEAT_LIMIT + MARGIN, "prefill drops the peer")
                wait_until(lambda: prefill.held_slots() == 0, cfg.lease_s + MARGIN, "prefill frees every block")
                assert_holds_nothing(prefill)

            # Before: connected, idle.
            proc, client = start_decode()
            client.close()
            killed_and_freed(proc)

            # During: the decode process dies as soon as prefill posted the write of the first request (a
            # plain write, or the early plan's prepared post).
            proc, client = start_decode()
            post_write, post_prepared = prefill.transport.write, PreparedTransfer.post

            def write(peer: str, plan: TransferPlan, notify: bytes | None = None, *,
                      settled: bool = False) -> TransferHandle:
                handle = post_write(peer, plan, notify, settled=settled)
                if proc.proc.returncode is None:
                    proc.kill()
                return handle

            def prepared_post(self: PreparedTransfer, notify: bytes | None = None, *,
                              settled: bool = False) -> TransferHandle:
                handle = post_prepared(self, notify, settled=settled)
                if proc.proc.returncode is None:
                    proc.kill()
                return handle
            prefill.transport.write = write  # type: ignore[method-assign]
            PreparedTransfer.post = prepared_post  # type: ignore[method-assign]
            try:
                held = long_prompts(41, 3, 500)
                client.submit(held[0], 4)
                client.submit(held[1], 4, mode="pull")
                client.submit(held[2], 4)
                with pytest.raises(PeerUnreachable):
                    while True:
                        client.recv(60.0)
                client.close()
            finally:
                prefill.transport.write = post_write  # type: ignore[method-assign]
                PreparedTransfer.post = post_prepared  # type: ignore[method-assign]
            killed_and_freed(proc)

            # After: the KV is on decode (prefill finished the request), decode generates when killed.
            proc, client = start_decode()
            completed = prefill.stats.completed
            client.submit(held[0], 400)
            wait_until(lambda: prefill.stats.completed > completed, 60.0, "prefill finishes the request")
            assert prefill.held_slots() == 0
            client.close()
            killed_and_freed(proc)

            proc, client = start_decode()
            try:
                tokens = held[1]
                assert_matches_reference(client.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW)
            finally:
                client.close()
            assert_holds_nothing(prefill)
        finally:
            reap(*decodes)


def test_prefill_frozen_past_the_deadline_then_resumed(backend: str) -> None:
    """Prefill SIGSTOPped with requests in flight: decode fails them (heartbeat loss or its 2 s deadline)
    and frees their blocks; once resumed, prefill reports nothing held, and decode reconnects to it by
    itself for the next request."""
    deadline_s = 2.0
    proc = spawn("prefill", backend)
    try:
        cfg = WorkerConfig(name("decode"), backend=backend, deadline_s=deadline_s, lease_s=LEASE_S)
        with DecodeWorker(cfg, SECRET, prefill=proc.address, connect_timeout=30.0) as decode:
            first, second = long_prompts(51, 2, 300)
            assert_matches_reference(decode.generate(first, NEW, timeout=60, return_kv=KV), first, NEW)
            proc.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            futures = [decode.submit(first, 4), decode.submit(second, 4, mode="pull")]
            for fut in futures:
                with pytest.raises((PeerUnreachable, TransferTimeout), match=r"lost: .*silent|did not arrive within"):
                    fut.result(timeout=deadline_s + HEARTBEAT_LIMIT + MARGIN)
            took = time.monotonic() - t0
            assert took < min(deadline_s, HEARTBEAT_LIMIT) + MARGIN, f"requests failed after {took:.1f} s"
            wait_until(lambda: decode.held_slots() == 0, cfg.lease_s + deadline_s + MARGIN, "decode frees its blocks")
            assert_holds_nothing(decode)
            assert decode.status()["jobs"] == 0 and decode.status()["zombies"] == 0
            proc.proc.send_signal(signal.SIGCONT)

            def prefill_idle() -> bool:
                status = query_status(proc.address, SECRET)
                return status["held_slots"] == 0 and status["jobs"] == 0 and status["open_caches"] == 0
            wait_until(prefill_idle, HEARTBEAT_LIMIT + MARGIN, "the resumed prefill frees its blocks")
            assert_matches_reference(decode.generate(second, NEW, timeout=60, return_kv=KV), second, NEW)
            assert decode.connected
            assert_holds_nothing(decode)
    finally:
        reap(proc)


def test_decode_frozen_past_the_pull_lease_then_resumed(backend: str) -> None:
    """A decode process (pull, 1 s lease) SIGSTOPped just before prefill offers a request's pages: prefill
    frees them at lease expiry (or when the peer goes silent); once resumed, decode refuses to read
    pages whose lease ran out, so the request fails clearly (or the client loses the frozen decode) and
    never returns wrong tokens; decode then holds nothing and serves the next request."""
    lease_s = 1.0
    cfg = WorkerConfig(name("prefill"), backend=backend)
    decode: WorkerProcess | None = None
    with PrefillWorker(cfg, SECRET) as prefill:
        try:
            decode = spawn("decode", backend, "--prefill", prefill.address, "--listen", "tcp://127.0.0.1:0",
                           "--mode", "pull", "--lease", str(lease_s))
            frozen = decode
            send = prefill._send
            stopped: list[float] = []

            def freeze_then_send(conn: Any, message: ControlMessage, *, urgent: bool = False) -> None:
                if isinstance(message, KvPull) and not stopped:
                    frozen.proc.send_signal(signal.SIGSTOP)
                    stopped.append(time.monotonic())
                send(conn, message, urgent=urgent)
            prefill._send = freeze_then_send  # type: ignore[method-assign]
            client = GenerateClient(decode.address, SECRET, name=name("client"))
            tokens, nxt = long_prompts(61, 2, 300)
            try:
                rid = client.submit(tokens, NEW, return_kv=KV)
                wait_until(lambda: bool(stopped), 60.0, "prefill offers the pages")
                took = wait_until(lambda: prefill.held_slots() == 0, lease_s + HEARTBEAT_LIMIT + MARGIN,
                                  "prefill frees the pages of the frozen decode")
                assert any("lease expired" in r or "decode peer lost" in r for r in prefill.stats.reasons)
                assert_holds_nothing(prefill)
                decode.proc.send_signal(signal.SIGCONT)
                try:
                    res = client.recv(60.0)
                except PeerUnreachable:      # frozen past the heartbeat limit: the client lost decode first
                    res = None
                if res is not None:
                    assert res.request_id == rid
                    if res.ok:
                        assert_matches_reference(res, tokens, NEW)
                    if not res.ok:   # decode's own lease check, prefill's lease-expiry notice, or a lost peer
                        assert any(why in res.error for why in ("lease may have expired", "lease expired", "lost")), \
                            res.error
            finally:
                client.close()
            prefill._send = send  # type: ignore[method-assign]

            def decode_idle() -> bool:
                status = query_status(frozen.address, SECRET)
                return status["held_slots"] == 0 and status["jobs"] == 0 and status["zombies"] == 0
            wait_until(decode_idle, HEARTBEAT_LIMIT + MARGIN, f"the resumed decode frees its blocks ({took:.1f} s)")
            client = GenerateClient(decode.address, SECRET, name=name("client"))
            try:
                assert_matches_reference(client.generate(nxt, NEW, timeout=60, return_kv=KV), nxt, NEW)
            finally:
                client.close()
            assert_holds_nothing(prefill)
        finally:
            reap(decode)


def test_resumed_prefill_cannot_write_into_blocks_decode_gave_away(backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill is SIGSTOPped while it serves a layer-wise push into decode's blocks (frozen as decode hands
    them over in ``kv_blocks``, so before its last write: it computes for some 100 ms more); decode loses
    it, fails the request and reuses its blocks for a request served by another prefill (kept in decode's
    prefix tree). When the frozen prefill resumes, none of its writes may reach those blocks: a later
    request reusing the cached prefix still gets the exact tokens. (Freezing on the first layer group's
    notice instead raced the push: on a loaded machine every group could land before decode's engine
    looked.) If the whole push still landed (the request completes), the freeze came too late: prefill is
    resumed and a fresh prompt tried, up to 3 times."""
    frozen = spawn("prefill", backend)
    other: WorkerProcess | None = None
    try:
        cfg = WorkerConfig(name("decode"), backend=backend, num_blocks=70, deadline_s=30.0, lease_s=LEASE_S)
        with DecodeWorker(cfg, SECRET, prefill=frozen.address, layerwise=True, connect_timeout=30.0) as decode:
            stale, kept = long_prompts(71, 2, 1000)      # 63 of the 70 blocks each: the second reuses the first's
            stopped: list[float] = []
            send_urgent = PeerConnection.send_urgent

            def freeze_after_blocks(conn: PeerConnection, message: ControlMessage) -> None:
                send_urgent(conn, message)
                if isinstance(message, KvBlocks) and not stopped:
                    frozen.proc.send_signal(signal.SIGSTOP)
                    stopped.append(time.monotonic())
            monkeypatch.setattr(PeerConnection, "send_urgent", freeze_after_blocks)
            lost: PeerUnreachable | None = None
            for attempt in range(3):
                try:
                    decode.generate(stale if not attempt else long_prompts(171 + attempt, 1, 1000)[0], 4, timeout=60)
                except PeerUnreachable as exc:
                    lost = exc
                    break
                assert stopped          # the freeze came after the whole push
                frozen.proc.send_signal(signal.SIGCONT)
                stopped.clear()
            assert lost is not None and "lost" in str(lost), "prefill was never frozen in the middle of its push"
            assert_holds_nothing(decode)
            other = spawn("prefill", backend)
            decode.connect(other.address, timeout=30.0)
            assert_matches_reference(decode.generate(kept, NEW, timeout=60, return_kv=KV), kept, NEW)
            frozen.proc.send_signal(signal.SIGCONT)

            def frozen_done() -> bool:
                status = query_status(frozen.address, SECRET)
                return status["held_slots"] == 0 and status["jobs"] == 0
            wait_until(frozen_done, HEARTBEAT_LIMIT + MARGIN, "the resumed prefill settles")
            longer = np.concatenate([kept, long_prompts(72, 1, 5)[0]])
            res = decode.generate(longer, NEW, timeout=60, return_kv=KV)
            assert res.reused_tokens_decode == 992       # 62 full blocks of the kept prompt stayed on decode
            assert_matches_reference(res, longer, NEW)
            assert_holds_nothing(decode)
    finally:
        reap(frozen, other)
