"""A decode worker's request lifecycle: a request is placed (``_start``, ``_begin``), sent to a prefill
with its destination pages, failed over (``_retry``), failed (``_fail``), quarantined while a prefill may
still write into its pages, and answered; ``_move`` is the one place that changes its ``JobState``.
How its KV arrives is ``kvxfer.disagg.decode_receive``; the states: docs/architecture.md, "A request's
life is a written state machine"."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from kvxfer.disagg.control import PeerConnection
from kvxfer.disagg.decode_jobs import DecodeJob, GenerationResult, JobState, check_move
from kvxfer.disagg.decode_peers import PrefillPeers
from kvxfer.disagg.messages import ControlMessage, Generated, GenerateFailed, KvBlocks, KvCancel, KvRequest
from kvxfer.disagg.session import Session, SessionState
from kvxfer.disagg.worker import ComputeThread, Reconnected, WorkerConfig, now, resume_ranks
from kvxfer.disagg.worker_protocol import (
    encode_block_ids,
    encode_checksum_policy,
    encode_stats,
    encode_tokens,
)
from kvxfer.errors import (
    ConfigError,
    KvxferError,
    OutOfSlotsError,
    PeerUnreachable,
    RequestCancelled,
    TransferTimeout,
    WorkerShuttingDown,
    WorkerUnhealthy,
)
from kvxfer.extractor import writable_block_ids
from kvxfer.model import Model

log = logging.getLogger("kvxfer.disagg.decode")


class DecodeRequests(PrefillPeers):
    """The requests of a decode worker, in the collection of their state (engine thread only)."""

    config: WorkerConfig
    model: Model
    compute: ComputeThread | None
    layers_per_send: int
    result_observers: list[Callable[[GenerationResult], None]]
    _waiting: list[DecodeJob]
    """WAITING: requests waiting for a reconnect attempt."""
    _parked: list[DecodeJob]
    """PARKED: failover attempts waiting for quarantined pages."""
    _generating: dict[str, DecodeJob]
    """GENERATING: KV in place, tokens being generated on the compute thread."""
    _zombies: dict[str, DecodeJob]
    """QUARANTINED: ended, pages held while something may still write into them."""

    def _cancel(self, request_id: str, reason: str) -> bool:
        job = self._jobs.get(request_id) or next((w for w in self._waiting + self._parked
                                                  if w.request_id == request_id), None)
        if job is None:
            return False
        self.counts["cancelled"] += 1
        self._fail(job, RequestCancelled(f"request {request_id}: {reason}"))
        return True

    def _start(self, job: DecodeJob) -> None:
        self.counts["requests"] += 1
        if self._draining:
            self._fail(job, WorkerShuttingDown(f"decode worker {self.config.name} shutting down: draining, not "
                                               f"taking new requests"))
            return
        if job.request_id in self._jobs or job.request_id in self._zombies or job.request_id in self._generating \
                or any(w.request_id == job.request_id for w in self._waiting + self._parked):
            self._fail(job, ConfigError(f"request id {job.request_id!r} is already in flight"))
            return
        if not self.connected and self._prefills:
            for peer in self._prefills.values():
                if peer.reconnecting is None and not peer.stop.is_set():
                    self._start_reconnecting(peer)
            if any(p.reconnecting is not None for p in self._prefills.values()):
                # Wait for the outcome of a whole attempt begun after the request arrived (a prefill that comes
                # back between two attempts is then found), bounded by the request's deadline.
                self._move(job, JobState.WAITING)
                return
        self._begin(job)

    def _reconnected(self, outcome: Reconnected) -> None:
        """An automatic reconnect attempt (begun at ``started``) ended. Once a prefill is connected, or no
        loop runs any more, every waiting request starts; after a failed attempt, only those that were
        already waiting when it began (or whose deadline passed) start, and so fail with the reason: the
        others wait for the next attempt."""
        peer, error, started, last = outcome.peer, outcome.error, outcome.started, outcome.last
        if last:
            peer.reconnecting = None
        if error is not None:
            peer.reconnect_error = f"; reconnecting failed: {type(error).__name__}: {error}"
        if self.connected or not any(p.reconnecting is not None for p in self._prefills.values()):
            ready = list(self._waiting)
        else:
            t = now()
            ready = [j for j in self._waiting if j.submitted <= started or t >= j.deadline]
        for job in ready:
            if job.state is JobState.WAITING:
                self._begin(job)

    def _begin(self, job: DecodeJob) -> None:
        """Allocate the request's destination blocks and ask the prefill peer for its KV."""
        waited = now() - job.submitted
        if waited >= self.config.deadline_s:   # asking prefill now would only waste its compute
            self._fail(job, TransferTimeout(f"request {job.request_id}: its {self.config.deadline_s} s deadline "
                                            f"passed while it waited {waited:.1f} s in decode's queue; not sent"))
            return
        if job.failover_cause is not None and not job.caches:
            # A failover attempt takes its pages before a prefill computes for it: while earlier attempts' pages
            # are quarantined there may be none yet, and it then waits for them (within its deadline).
            try:
                self._allocate(job)
            except KvxferError as exc:
                self._close_caches(job)
                if isinstance(exc, OutOfSlotsError) and self._zombies:
                    if job.state is not JobState.PARKED:   # tried again as quarantined pages are freed (``_bury``)
                        self._move(job, JobState.PARKED)
                    return
                self._fail(job, self._after_failover(job, exc))
                return
        peer = self._pick(job)
        conn = peer.conn if peer is not None else None
        if peer is None or conn is None:
            self._fail(job, self._after_failover(job, PeerUnreachable(f"no prefill worker connected"
                                                                      f"{self._no_prefill_reason()}")))
            return
        job.peer, job.prefill, job.conn, job.src_layouts = conn.peer.name, peer, conn, peer.layouts
        job.templates = peer.templates
        job.tried.add(peer.address)
        self._move(job, JobState.REQUESTED)
        asked = now()   # request_s ends as the prompt is handed over: prefill may start before the send returns
        try:
            # The prompt goes first: prefill computes while decode allocates (and evicts for) the destination
            # blocks, which follow in kv_blocks long before a prompt worth disaggregating is computed.
            conn.send_urgent(KvRequest(request_id=job.request_id, tokens=encode_tokens(job.tokens),
                                       mode=job.mode,  # type: ignore[arg-type]
                                       layerwise=job.layerwise, layers_per_send=self.layers_per_send,
                                       lease_s=self.config.lease_s,
                                       checksum=encode_checksum_policy(self.config.checksum)))
        except PeerUnreachable as exc:   # the prefill went away before it got the prompt: try another
            if not self._retry(job, exc):
                self._fail(job, exc)
            return
        except KvxferError as exc:
            self._fail(job, exc)
            return
        job.requested, job.last_renew = asked, now()
        job.lease_until = job.last_renew + self.config.lease_s
        try:
            if not job.caches:
                self._allocate(job)
            job.session.ready("destination blocks allocated")
            writable = [writable_block_ids(m.layout, c) for m, c in zip(self.managers, job.caches, strict=True)]
            job.session.start_transfer("KV requested from prefill")
            conn.send_urgent(KvBlocks(request_id=job.request_id, skip=job.skip, blocks=encode_block_ids(writable)))
            job.allocated = now()
        except PeerUnreachable as exc:
            # The prefill went away before the destination blocks could be queued to it (the connection
            # raises before it enqueues): it never learnt them, so their pages are freed and another takes it.
            if not self._retry(job, exc):
                self._fail(job, self._after_failover(job, exc))
        except KvxferError as exc:
            if not job.session.terminal and job.session.state is not SessionState.TRANSFERRING:
                # Prefill has the prompt but no destination: it must stop computing (nothing of ours to write).
                self._tell(job, KvCancel(request_id=job.request_id, reason=f"decode could not allocate: {exc}"[:1000]))
            self._fail(job, self._after_failover(job, exc))

    def _allocate(self, job: DecodeJob) -> None:
        """The request's destination caches on every rank, matched against the prefix tree (``job.skip``:
        the tokens decode already holds). Raises OutOfSlotsError / CacheStateError, leaving what it
        opened in ``job.caches`` for the caller to close."""
        # A failover's pages may still be held by its earlier attempt (quarantined): each attempt has its own.
        base = job.request_id if job.attempt == 1 else f"{job.request_id}~{job.attempt}"
        for i, m in enumerate(self.managers):
            job.caches.append(m.create_kv_cache_for_prompt(job.tokens, id=f"{base}/{i}"))
        job.skip = resume_ranks(job.caches, "decode")
        for m, cache in zip(self.managers, job.caches, strict=True):
            if not cache.resize(int(job.tokens.size)):
                raise OutOfSlotsError(f"decode cache {cache.id}: no free slots for {job.tokens.size} tokens "
                                      f"({m.num_free_slots()} free)")

    @staticmethod
    def _after_failover(job: DecodeJob, exc: KvxferError) -> KvxferError:
        """The error of a failover attempt that could not go on: why its prefill was left, then why no other
        took it (``exc`` itself for a first attempt)."""
        cause = job.failover_cause
        if cause is None:
            return exc
        return type(cause)(f"{cause}; sending it to another prefill failed: {type(exc).__name__}: {exc}")

    def _unpark(self) -> None:
        """Failover attempts waiting for pages: try each again (pages were just freed)."""
        for job in list(self._parked):
            if job.state is JobState.PARKED:
                self._begin(job)

    def _generated(self, job: DecodeJob, tokens: list[int] | None, error: BaseException | None) -> None:
        """The compute thread finished a request's generation: free its pages, answer."""
        self._move(job, JobState.DONE if error is None and tokens is not None else JobState.FAILED)
        self._close_caches(job)
        if error is not None or tokens is None:
            self.counts["failed"] += 1
            if isinstance(error, KvxferError):
                self._resolve_error(job, error)
                return
            cause = f"{type(error).__name__}: {error}"
            log.error("%s: generating request %s failed", self.config.name, job.request_id, exc_info=error)
            self.engine.mark_unhealthy(f"decode generation failed: {cause}")
            self._resolve_error(job, WorkerUnhealthy(f"request {job.request_id}: generation failed: {cause}"))
            return
        assert job.result is not None
        self.counts["completed"] += 1
        result = replace(job.result, tokens=tokens)
        if not job.future.done():
            job.future.set_result(result)
        for observe in self.result_observers:
            try:
                observe(result)
            except Exception:
                log.exception("%s: a result observer failed", self.config.name)
        if job.reply is not None:
            with contextlib.suppress(KvxferError):
                job.reply.send(Generated(request_id=job.client_request_id, tokens=tokens,
                                         stats=encode_stats(result.stats()),
                                         kv=result.prompt_kv.to_bytes() if result.prompt_kv is not None else b""))

    def _move(self, job: DecodeJob, state: JobState) -> None:
        """Move ``job`` to ``state`` (SessionError if ``JOB_TRANSITIONS`` does not allow it), taking it out
        of the collection of its old state and into that of the new one (engine thread only)."""
        check_move(job.request_id, job.state, state)
        match job.state:
            case JobState.WAITING:
                self._waiting.remove(job)
            case JobState.PARKED:
                self._parked.remove(job)
            case JobState.REQUESTED if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]
            case JobState.GENERATING if self._generating.get(job.request_id) is job:
                del self._generating[job.request_id]
            case JobState.QUARANTINED if self._zombies.get(job.request_id) is job:
                del self._zombies[job.request_id]
        job.state = state
        match state:
            case JobState.WAITING:
                self._waiting.append(job)
            case JobState.PARKED:
                self._parked.append(job)
            case JobState.REQUESTED:
                self._jobs[job.request_id] = job
            case JobState.GENERATING:
                self._generating[job.request_id] = job
            case JobState.QUARANTINED:
                self._zombies[job.request_id] = job

    def _fail(self, job: DecodeJob, error: KvxferError, *, remote_done: bool = False, quarantine_until: float = 0.0) -> None:
        """Fail one request now; its blocks are freed once nothing can still write into them (not before
        ``quarantine_until`` either: a lost prefill may still be writing)."""
        self._route_done(job)
        self.counts["failed"] += 1
        if not job.session.terminal:
            job.session.fail(f"{type(error).__name__}: {error}")
        self._resolve_error(job, error)
        requested = (not remote_done and job.session.history[-2].state is SessionState.TRANSFERRING
                     and job.conn is not None and job.conn.alive)
        if requested:   # prefill still holds (pull) or may still write (push) this request: tell it
            self._tell(job, KvCancel(request_id=job.request_id, reason=str(error)[:1000]))
        remote_may_write = requested and job.mode == "push"
        if job.read is not None and not job.read.done() and not job.read.cancel():
            remote_may_write = True   # our own read could not be stopped: wait for it to end
        if remote_may_write:
            job.zombie_until = now() + self.config.lease_s + self.config.deadline_s
            self._move(job, JobState.QUARANTINED)
        elif quarantine_until > now():
            job.zombie_until = quarantine_until
            self._move(job, JobState.QUARANTINED)
        else:
            self._move(job, JobState.FAILED)
            self._close_caches(job)

    def _route_done(self, job: DecodeJob) -> None:
        """The request no longer waits on its prefill: it stops counting as load at the router."""
        route, job.route = job.route, None
        if route is not None and self.router is not None:
            self.router.finished(route)

    def _bury(self, job: DecodeJob) -> None:
        self._move(job, JobState.FREED)
        self._close_caches(job)
        if self._parked:
            self._unpark()

    def _resolve_error(self, job: DecodeJob, error: KvxferError) -> None:
        if not job.future.done():
            job.future.set_exception(error)
        self._reply_failed(job, error)

    def _reply_failed(self, job: DecodeJob, error: KvxferError) -> None:
        if job.reply is not None:
            with contextlib.suppress(KvxferError):
                job.reply.send(GenerateFailed(request_id=job.client_request_id, error=type(error).__name__[:64],
                                              reason=str(error)[:1024]))

    def _close_caches(self, job: DecodeJob) -> None:
        for cache in job.caches:
            with contextlib.suppress(KvxferError):
                cache.close()
        job.caches = []

    def _retry(self, job: DecodeJob, error: KvxferError, *, quarantine_until: float = 0.0) -> bool:
        """Failover: send a request whose KV has not reached decode, and never will from its prefill (lost,
        removed, stopping), to another connected prefill it was not sent to yet, as a fresh attempt with
        the same id, future and deadline; the client sees nothing of it. The attempt's destination pages
        hold nothing committed: they are freed, or held until ``quarantine_until`` (or until decode's own
        read ended) while the old prefill might still write there. False, changing nothing, when no other
        prefill can take it, the worker is closing, or the deadline has passed (a draining worker still
        fails over: its requests in flight should finish)."""
        if job.result is not None or now() >= job.deadline or self._reconnect_stop.is_set() \
                or not any(p.alive and p.address not in job.tried for p in self._prefills.values()):
            return False
        self._route_done(job)
        if not job.session.terminal:
            job.session.fail(f"{type(error).__name__}: {error}; sent to another prefill")
        self.counts["failovers"] += 1
        log.info("%s: request %s goes to another prefill (attempt %d): %s", self.config.name, job.request_id,
                 job.attempt + 1, error)
        stale = replace(job, request_id=f"{job.request_id}~{job.attempt}", future=Future(), reply=None)
        if job.read is not None and not job.read.done() and not job.read.cancel():
            stale.zombie_until = now() + self.config.lease_s + self.config.deadline_s   # our read still runs
        elif quarantine_until > now():
            stale.zombie_until = quarantine_until
        self._move(job, JobState.RETRIED)
        self._move(stale, JobState.QUARANTINED if stale.zombie_until else JobState.FREED)
        if not stale.zombie_until:
            self._close_caches(stale)
        self._begin(DecodeJob(request_id=job.request_id, tokens=job.tokens, max_new_tokens=job.max_new_tokens,
                         mode=job.mode, layerwise=job.layerwise, future=job.future, session=Session(job.request_id),
                         submitted=job.submitted, deadline=job.deadline, reply=job.reply,
                         client_request_id=job.client_request_id, return_kv=job.return_kv, tried=job.tried,
                         attempt=job.attempt + 1, failover_cause=job.failover_cause or error))
        return True

    def _fail_all(self, error: KvxferError) -> None:
        for job in self._waiting + self._parked:
            self._fail(job, error, remote_done=True)
        for job in list(self._jobs.values()):
            self._fail(job, error, remote_done=True)
        for zombie in list(self._zombies.values()):
            if zombie.read is not None and not zombie.read.done():
                with contextlib.suppress(KvxferError):
                    zombie.read.wait(self.config.lease_s)
            self._bury(zombie)

    def _tell(self, job: DecodeJob, message: ControlMessage) -> None:
        """Send to the prefill a request went to, over the connection it went over (if still up)."""
        if job.conn is not None:
            self._send(job.conn, message)

    def _requests_lost(self, conn: PeerConnection, what: str) -> None:
        """Fail over, or fail, the requests sent over a lost prefill's ``conn``. Pushed-to blocks are
        quarantined, not freed: a prefill that is only frozen or cut off may still write until its lease
        runs out (it checks before each write, but a write posted just before the loss can land later), so
        they stay held until the lease plus one more lease period (for writes already posted) has passed.
        Pull destinations are ours to free once our read is stopped."""
        for job in [j for j in self._jobs.values() if j.conn is conn]:
            if job.read is not None and not job.read.done():
                job.read.cancel()
            pushing = job.mode == "push" and job.session.state is SessionState.TRANSFERRING and job.lease_until > 0
            quarantine = job.lease_until + self.config.lease_s if pushing else 0.0
            if not self._retry(job, PeerUnreachable(what), quarantine_until=quarantine):
                self._fail(job, PeerUnreachable(what), remote_done=True, quarantine_until=quarantine)
        for zombie in [z for z in self._zombies.values() if z.conn is conn and z.read is None]:
            # No kv_failed will confirm these any more: hold them as long as the prefill's lease could last.
            zombie.zombie_until = min(zombie.zombie_until, zombie.lease_until + self.config.lease_s)
