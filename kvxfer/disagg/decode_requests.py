"""A decode worker's request lifecycle: a request is placed (``start``, ``begin``), sent to a prefill
with its destination pages, failed over (``retry``), failed (``fail``), quarantined while a prefill may
still write into its pages, and answered; every change of its ``JobState`` is made by ``JobTable.move``.
How its KV arrives is ``kvxfer.disagg.decode_receive``; the states: docs/architecture.md, "A request's
life is a written state machine"."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.control import PeerConnection
from kvxfer.disagg.decode_jobs import DecodeJob, GenerationResult, JobState, JobTable
from kvxfer.disagg.decode_peers import PrefillPeers
from kvxfer.disagg.messages import ControlMessage, Generated, GenerateFailed, KvBlocks, KvCancel, KvRequest
from kvxfer.disagg.session import Session, SessionState
from kvxfer.disagg.worker import WorkerConfig, now, resume_ranks, send_quietly
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

log = logging.getLogger("kvxfer.disagg.decode")


class DecodeRequests:
    """The lifecycle of a decode worker's requests (engine thread only): it decides every move of a request
    and makes it in ``table``. The worker builds it with what it needs: the caches (``managers``), the
    prefill peers to place requests on, ``on_unhealthy`` (the engine's health), ``draining`` (whether
    the worker still takes requests) and ``submit`` (runs a request's generation on the compute thread,
    whose answer comes back to ``generated``)."""

    def __init__(self, config: WorkerConfig, managers: list[KVCacheManager], table: JobTable, peers: PrefillPeers,
                 *, layers_per_send: int, counts: dict[str, int],
                 result_observers: list[Callable[[GenerationResult], None]], draining: Callable[[], bool],
                 on_unhealthy: Callable[[str], None], submit: Callable[[DecodeJob, Callable[[], list[int]]], None]
                 ) -> None:
        self.config = config
        self.managers = managers
        self.table = table
        self.peers = peers
        self.layers_per_send = layers_per_send
        self.counts = counts
        """The worker's counters (this part adds requests, completed, failed, cancelled, failovers)."""
        self.result_observers = result_observers
        """Called with each completed request's result (metrics); must not raise."""
        self._draining = draining
        self._on_unhealthy = on_unhealthy
        self._submit = submit

    def cancel(self, request_id: str, reason: str) -> bool:
        """Fail a request that has not got its KV yet with RequestCancelled; False when there is none."""
        job = self.table.cancellable(request_id)
        if job is None:
            return False
        self.counts["cancelled"] += 1
        self.fail(job, RequestCancelled(f"request {request_id}: {reason}"))
        return True

    def start(self, job: DecodeJob) -> None:
        """A new request: refused while draining or when its id is live, waits while no prefill is connected
        but one is being reconnected, else goes to a prefill (``begin``)."""
        self.counts["requests"] += 1
        if self._draining():
            self.fail(job, WorkerShuttingDown(f"decode worker {self.config.name} shutting down: draining, not "
                                              f"taking new requests"))
            return
        if self.table.holds(job.request_id):
            self.fail(job, ConfigError(f"request id {job.request_id!r} is already in flight"))
            return
        if not self.peers.connected and self.peers.reconnect_idle():
            # Wait for the outcome of a whole attempt begun after the request arrived (a prefill that comes
            # back between two attempts is then found), bounded by the request's deadline.
            self.table.move(job, JobState.WAITING)
            return
        self.begin(job)

    def reconnected(self, started: float) -> None:
        """An automatic reconnect attempt begun at ``started`` ended (the peers have noted it). Once a prefill
        is connected, or no loop runs any more, every waiting request starts; after a failed attempt, only
        those that were already waiting when it began (or whose deadline passed) start, and so fail with the
        reason: the others wait for the next attempt."""
        if self.peers.connected or not self.peers.reconnecting:
            ready = list(self.table.waiting)
        else:
            t = now()
            ready = [j for j in self.table.waiting if j.submitted <= started or t >= j.deadline]
        for job in ready:
            if job.state is JobState.WAITING:
                self.begin(job)

    def begin(self, job: DecodeJob) -> None:
        """Allocate the request's destination blocks and ask the prefill peer for its KV."""
        waited = now() - job.submitted
        if waited >= self.config.deadline_s:   # asking prefill now would only waste its compute
            self.fail(job, TransferTimeout(f"request {job.request_id}: its {self.config.deadline_s} s deadline "
                                           f"passed while it waited {waited:.1f} s in decode's queue; not sent"))
            return
        if job.failover_cause is not None and not job.caches:
            # A failover attempt takes its pages before a prefill computes for it: while earlier attempts' pages
            # are quarantined there may be none yet, and it then waits for them (within its deadline).
            try:
                self._allocate(job)
            except KvxferError as exc:
                self.close_caches(job)
                if isinstance(exc, OutOfSlotsError) and self.table.quarantined:
                    if job.state is not JobState.PARKED:   # tried again as quarantined pages are freed (``bury``)
                        self.table.move(job, JobState.PARKED)
                    return
                self.fail(job, self.after_failover(job, exc))
                return
        peer = self.peers.pick(job)
        conn = peer.conn if peer is not None else None
        if peer is None or conn is None:
            self.fail(job, self.after_failover(job, PeerUnreachable(f"no prefill worker connected"
                                                                     f"{self.peers.no_prefill_reason()}")))
            return
        job.peer, job.prefill, job.conn, job.src_layouts = conn.peer.name, peer, conn, peer.layouts
        job.templates = peer.templates
        job.tried.add(peer.address)
        self.table.move(job, JobState.REQUESTED)
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
            if not self.retry(job, exc):
                self.fail(job, exc)
            return
        except KvxferError as exc:
            self.fail(job, exc)
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
            if not self.retry(job, exc):
                self.fail(job, self.after_failover(job, exc))
        except KvxferError as exc:
            if not job.session.terminal and job.session.state is not SessionState.TRANSFERRING:
                # Prefill has the prompt but no destination: it must stop computing (nothing of ours to write).
                self.tell(job, KvCancel(request_id=job.request_id, reason=f"decode could not allocate: {exc}"[:1000]))
            self.fail(job, self.after_failover(job, exc))

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
    def after_failover(job: DecodeJob, exc: KvxferError) -> KvxferError:
        """The error of a failover attempt that could not go on: why its prefill was left, then why no other
        took it (``exc`` itself for a first attempt)."""
        cause = job.failover_cause
        if cause is None:
            return exc
        return type(cause)(f"{cause}; sending it to another prefill failed: {type(exc).__name__}: {exc}")

    def _unpark(self) -> None:
        """Failover attempts waiting for pages: try each again (pages were just freed)."""
        for job in list(self.table.parked):
            if job.state is JobState.PARKED:
                self.begin(job)

    def generate(self, job: DecodeJob, run: Callable[[], list[int]]) -> None:
        """The request's KV is in place and committed: ``run`` (on the compute thread) generates its tokens."""
        self.table.move(job, JobState.GENERATING)
        self._submit(job, run)

    def fail_in_place(self, job: DecodeJob, error: KvxferError) -> None:
        """Fail a request whose KV was in place (its transfer done: nothing for prefill to stop) and free it."""
        self.counts["failed"] += 1
        self.table.move(job, JobState.FAILED)
        self.close_caches(job)
        self.resolve_error(job, error)

    def generated(self, job: DecodeJob, tokens: list[int] | None, error: BaseException | None) -> None:
        """The compute thread finished a request's generation: free its pages, answer."""
        self.table.move(job, JobState.DONE if error is None and tokens is not None else JobState.FAILED)
        self.close_caches(job)
        if error is not None or tokens is None:
            self.counts["failed"] += 1
            if isinstance(error, KvxferError):
                self.resolve_error(job, error)
                return
            cause = f"{type(error).__name__}: {error}"
            log.error("%s: generating request %s failed", self.config.name, job.request_id, exc_info=error)
            self._on_unhealthy(f"decode generation failed: {cause}")
            self.resolve_error(job, WorkerUnhealthy(f"request {job.request_id}: generation failed: {cause}"))
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

    def fail(self, job: DecodeJob, error: KvxferError, *, remote_done: bool = False, quarantine_until: float = 0.0) -> None:
        """Fail one request now; its blocks are freed once nothing can still write into them (not before
        ``quarantine_until`` either: a lost prefill may still be writing)."""
        self.peers.route_done(job)
        self.counts["failed"] += 1
        if not job.session.terminal:
            job.session.fail(f"{type(error).__name__}: {error}")
        self.resolve_error(job, error)
        requested = (not remote_done and job.session.history[-2].state is SessionState.TRANSFERRING
                     and job.conn is not None and job.conn.alive)
        if requested:   # prefill still holds (pull) or may still write (push) this request: tell it
            self.tell(job, KvCancel(request_id=job.request_id, reason=str(error)[:1000]))
        remote_may_write = requested and job.mode == "push"
        if job.read is not None and not job.read.done() and not job.read.cancel():
            remote_may_write = True   # our own read could not be stopped: wait for it to end
        if remote_may_write:
            job.zombie_until = now() + self.config.lease_s + self.config.deadline_s
            self.table.move(job, JobState.QUARANTINED)
        elif quarantine_until > now():
            job.zombie_until = quarantine_until
            self.table.move(job, JobState.QUARANTINED)
        else:
            self.table.move(job, JobState.FAILED)
            self.close_caches(job)

    def kv_in_place(self, job: DecodeJob) -> None:
        """The request's KV is in decode's pages: its transfer session is done and it no longer waits on its
        prefill (nor counts as load at the router)."""
        job.session.done("KV in place")
        self.peers.route_done(job)

    def bury(self, job: DecodeJob) -> None:
        """Free a quarantined request's pages (nothing can write there any more); parked attempts may now fit."""
        self.table.move(job, JobState.FREED)
        self.close_caches(job)
        if self.table.parked:
            self._unpark()

    def resolve_error(self, job: DecodeJob, error: KvxferError) -> None:
        """Answer the request with ``error`` (its future, and the client that sent it)."""
        if not job.future.done():
            job.future.set_exception(error)
        self.reply_failed(job, error)

    def reply_failed(self, job: DecodeJob, error: KvxferError) -> None:
        """Tell the client that sent the request (if any) that it failed with ``error``."""
        if job.reply is not None:
            with contextlib.suppress(KvxferError):
                job.reply.send(GenerateFailed(request_id=job.client_request_id, error=type(error).__name__[:64],
                                              reason=str(error)[:1024]))

    def close_caches(self, job: DecodeJob) -> None:
        """Close the request's caches on every rank (its pages go back, committed ones to the prefix tree)."""
        for cache in job.caches:
            with contextlib.suppress(KvxferError):
                cache.close()
        job.caches = []

    def retry(self, job: DecodeJob, error: KvxferError, *, quarantine_until: float = 0.0) -> bool:
        """Failover: send a request whose KV has not reached decode, and never will from its prefill (lost,
        removed, stopping), to another connected prefill it was not sent to yet, as a fresh attempt with
        the same id, future and deadline; the client sees nothing of it. The attempt's destination pages
        hold nothing committed: they are freed, or held until ``quarantine_until`` (or until decode's own
        read ended) while the old prefill might still write there. False, changing nothing, when no other
        prefill can take it, the worker is closing, or the deadline has passed (a draining worker still
        fails over: its requests in flight should finish)."""
        if job.result is not None or now() >= job.deadline or self.peers.closing or not self.peers.can_take(job.tried):
            return False
        self.peers.route_done(job)
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
        self.table.move(job, JobState.RETRIED)
        self.table.move(stale, JobState.QUARANTINED if stale.zombie_until else JobState.FREED)
        if not stale.zombie_until:
            self.close_caches(stale)
        self.begin(DecodeJob(request_id=job.request_id, tokens=job.tokens, max_new_tokens=job.max_new_tokens,
                             mode=job.mode, layerwise=job.layerwise, future=job.future, session=Session(job.request_id),
                             submitted=job.submitted, deadline=job.deadline, reply=job.reply,
                             client_request_id=job.client_request_id, return_kv=job.return_kv, tried=job.tried,
                             attempt=job.attempt + 1, failover_cause=job.failover_cause or error))
        return True

    def fail_all(self, error: KvxferError) -> None:
        """Fail every request not yet generating with ``error`` and free every quarantined one's pages (after
        decode's own read, if one still runs, ended): the worker closes or met an unexpected error."""
        for job in self.table.waiting + self.table.parked:
            self.fail(job, error, remote_done=True)
        for job in list(self.table.requested.values()):
            self.fail(job, error, remote_done=True)
        for zombie in list(self.table.quarantined.values()):
            if zombie.read is not None and not zombie.read.done():
                with contextlib.suppress(KvxferError):
                    zombie.read.wait(self.config.lease_s)
            self.bury(zombie)

    def tell(self, job: DecodeJob, message: ControlMessage) -> None:
        """Send to the prefill a request went to, over the connection it went over (if still up)."""
        if job.conn is not None:
            send_quietly(job.conn, message)

    def requests_lost(self, conn: PeerConnection, what: str) -> None:
        """Fail over, or fail, the requests sent over a lost prefill's ``conn``. Pushed-to blocks are
        quarantined, not freed: a prefill that is only frozen or cut off may still write until its lease
        runs out (it checks before each write, but a write posted just before the loss can land later), so
        they stay held until the lease plus one more lease period (for writes already posted) has passed.
        Pull destinations are ours to free once our read is stopped."""
        for job in [j for j in self.table.requested.values() if j.conn is conn]:
            if job.read is not None and not job.read.done():
                job.read.cancel()
            pushing = job.mode == "push" and job.session.state is SessionState.TRANSFERRING and job.lease_until > 0
            quarantine = job.lease_until + self.config.lease_s if pushing else 0.0
            if not self.retry(job, PeerUnreachable(what), quarantine_until=quarantine):
                self.fail(job, PeerUnreachable(what), remote_done=True, quarantine_until=quarantine)
        for zombie in [z for z in self.table.quarantined.values() if z.conn is conn and z.read is None]:
            # No kv_failed will confirm these any more: hold them as long as the prefill's lease could last.
            zombie.zombie_until = min(zombie.zombie_until, zombie.lease_until + self.config.lease_s)

    def tick(self) -> float:
        """Free the pages of quarantined requests once nothing can write there (decode's read ended, or the
        time is up), fail parked attempts whose deadline passed; seconds until the next of these is due."""
        t = now()
        due = t + 1.0
        for zombie in list(self.table.quarantined.values()):
            if zombie.read is not None and zombie.read.done():
                self.bury(zombie)
            elif t >= zombie.zombie_until:
                log.info("%s: freeing blocks of %s without prefill's confirmation (its lease has run out)",
                         self.config.name, zombie.request_id)
                self.bury(zombie)
            else:
                due = min(due, zombie.zombie_until if zombie.read is None or not zombie.read.completes_when_polled
                          else t + 0.001)
        for job in [j for j in self.table.parked if t >= j.deadline]:
            self.fail(job, self.after_failover(job, TransferTimeout(
                f"request {job.request_id}: its {self.config.deadline_s} s deadline passed while it waited for "
                f"decode's pages")))
        due = min([due, *(j.deadline for j in self.table.parked)])
        return max(0.0, due - now())

    def abandon_generating(self, error: KvxferError) -> None:
        """The worker closed with generations in flight (the compute thread no longer reports back): free
        their pages and answer their callers with ``error``."""
        for job in list(self.table.generating.values()):
            self.close_caches(job)
            if not job.future.done():
                job.future.set_exception(error)
        self.table.generating.clear()
