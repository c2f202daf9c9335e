"""How a decode request's KV arrives: prefill's answers (``kv_posted``, ``kv_pushed``, ``kv_pull``,
``kv_failed``), decode's own read (pull), the transport's tagged notices (push), the tick that watches
transfers, deadlines and lease renewals, and the check and commit once the KV is in place (``_arrived``),
which hands the request to the generation. A part the decode worker owns (``DecodeReceive``), built on the
request table and lifecycle (docs/architecture.md draws the data flow)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.control import PeerConnection
from kvxfer.disagg.decode_jobs import DecodeJob, GenerationResult, JobTable
from kvxfer.disagg.decode_requests import DecodeRequests
from kvxfer.disagg.messages import ControlMessage, KvFailed, KvPosted, KvPull, KvPushed, KvRelease, LeaseRenew
from kvxfer.disagg.oracle import PromptKV, positions_within, read_prompt_kv
from kvxfer.disagg.session import SessionState
from kvxfer.disagg.worker import WorkerConfig, now, phased_min_runs, plan_phased, send_quietly
from kvxfer.disagg.worker_protocol import NOTICE_MAGIC, decode_block_ids, decode_notice, is_prefill_shutdown
from kvxfer.errors import (
    DecodeError,
    IntegrityError,
    KvxferError,
    ProtocolError,
    TransferFailed,
    TransferTimeout,
)
from kvxfer.extractor import check_writable, check_writable_phased
from kvxfer.model import Model
from kvxfer.pagetable import PhasedPlan
from kvxfer.transport import TransferStatus, Transport
from kvxfer.transport.integrity import KVDigest, verify_kv

log = logging.getLogger("kvxfer.disagg.decode")


class DecodeReceive:
    """The receive paths of a decode worker (engine thread). The worker builds it with what it needs: the
    caches and model the KV lands in and is generated from, the transport it arrives by, the request
    table (to find a request) and lifecycle (to fail, fail over, free or generate it) and ``wake`` (the
    engine's, for decode's own reads)."""

    def __init__(self, config: WorkerConfig, managers: list[KVCacheManager], layouts: list[CacheLayoutDesc],
                 model: Model, transport: Transport, table: JobTable, requests: DecodeRequests, *,
                 counts: dict[str, int], wake: Callable[..., None]) -> None:
        self.config = config
        self.managers = managers
        self.layouts = layouts
        self.model = model
        self.transport = transport
        self.table = table
        self.requests = requests
        self.counts = counts
        """The worker's counters (this part adds integrity_failures and bad_notices)."""
        self._wake = wake

    def on_prefill(self, conn: PeerConnection, msg: ControlMessage) -> None:
        """A message from a prefill peer about one of its requests (or a stale or quarantined one)."""
        if not isinstance(msg, KvPosted | KvPushed | KvPull | KvFailed):
            raise ProtocolError(f"unexpected message {msg.kind!r} from the prefill worker")
        rid = msg.request_id
        zombie = self.table.quarantined.get(rid)
        if zombie is not None and zombie.conn is conn:
            match msg:
                case KvFailed():
                    self.requests.bury(zombie)   # prefill will not write there any more
                case KvPushed() if zombie.read is None:
                    self.requests.bury(zombie)
                case KvPull():
                    send_quietly(conn, KvRelease(request_id=rid))
            return
        generating = self.table.generating.get(rid)
        if isinstance(msg, KvPushed) and generating is not None and generating.conn is conn \
                and generating.result is not None:   # taken at kv_posted: prefill's copy time, for the result
            generating.result = replace(generating.result, transfer_s=msg.transfer_s, transfer_by_prefill=True)
            return
        job = self.table.requested.get(rid)
        if job is None or job.conn is not conn or job.session.state is not SessionState.TRANSFERRING:
            if isinstance(msg, KvPull):
                send_quietly(conn, KvRelease(request_id=rid))
            return
        match msg:
            case KvPosted():
                if job.pushed is None:
                    self._posted(job, msg)
            case KvPushed():
                job.pushed = msg   # replaces kv_posted: the same fields, and prefill's transfer time
            case KvPull():
                job.pushed = msg
                self._read(job, msg)
            case KvFailed(reason=reason):
                error = TransferFailed(f"prefill failed request {rid}: {reason}")
                if is_prefill_shutdown(reason):   # it is stopping: nothing of this request will come from it
                    if job.prefill is not None:
                        job.prefill.draining = True
                    if self.requests.retry(job, error):
                        return
                self.requests.fail(job, error, remote_done=True)

    def _read(self, job: DecodeJob, msg: KvPull) -> None:
        """Pull: read the request's KV from where prefill says it is (within prefill's lease)."""
        rid = job.request_id
        src_ids = decode_block_ids(msg.blocks, len(job.src_layouts), "kv_pull.blocks")
        if now() >= job.lease_until:
            self.requests.tell(job, KvRelease(request_id=rid))
            self.requests.fail(job, TransferFailed(f"pull of request {rid}: prefill's {self.config.lease_s} s lease "
                                                   f"may have expired before decode could read (decode stalled)"),
                               remote_done=True)
            return
        try:
            plan = plan_phased(job.src_layouts, src_ids, self.layouts, job.caches,
                               token_range=(job.skip, int(job.tokens.size)), request_id=rid,
                               planner=self.config.planner, templates=job.templates,
                               min_runs=phased_min_runs(self.transport))
            # Never read into a page we share (a phased plan: checked on its templates, not run by run).
            if isinstance(plan, PhasedPlan):
                check_writable_phased(plan, self.layouts, job.caches)
            else:
                check_writable(plan.dst, self.layouts, job.caches)
            job.read_posted = now()
            job.read = self.transport.read(job.peer, plan, f"{rid}#1".encode())
            job.read.add_done_callback(self._wake)
        except KvxferError as exc:
            self.requests.tell(job, KvRelease(request_id=rid))
            self.requests.fail(job, exc)

    def tick(self) -> float:
        """Take the transport's notices, finish requests whose KV is in place, fail late or failed transfers,
        renew prefill's leases; seconds until the next of these is due (a short poll while a transfer
        completes only when polled)."""
        t = now()
        for peer, notes in self.transport.notifications().items():
            for note in notes:
                self._on_notice(peer, note)
        polled = self.transport.notifications_need_polling
        due = t + 1.0
        busy = False
        for job in list(self.table.requested.values()):
            if job.session.state is not SessionState.TRANSFERRING:
                continue
            # Poll only for what cannot wake us: transfers that complete when polled, and a backend that
            # delivers notifications (and, for NIXL, finishes the peer's writes to us) only when polled.
            busy = busy or polled or (job.read is not None and job.read.completes_when_polled)
            if job.read is not None:
                status = job.read.status
                if status is TransferStatus.DONE:
                    self.requests.tell(job, KvRelease(request_id=job.request_id))
                    if t >= job.lease_until:   # prefill may have reused the pages before the read ended
                        self.requests.fail(job, TransferFailed(
                            f"pull of request {job.request_id}: prefill's {self.config.lease_s} s lease may have "
                            f"expired before the read completed (decode stalled {t - job.last_renew:.1f} s); "
                            f"the data is not used"), remote_done=True)
                        continue
                    self._arrived(job, now() - job.read_posted)
                    continue
                if status.terminal:
                    self.requests.tell(job, KvRelease(request_id=job.request_id))
                    self.requests.fail(job, TransferFailed(f"read of request {job.request_id}: {job.read.reason}"))
                    continue
            elif isinstance(job.pushed, KvPosted | KvPushed) and len(job.parts) >= job.pushed.parts:
                # kv_posted: prefill has not seen its writes complete yet; the notifications say they landed.
                self._arrived(job, job.pushed.transfer_s if isinstance(job.pushed, KvPushed)
                              else max(0.0, now() - job.posted_seen))
                continue
            if t >= job.deadline:
                self.requests.fail(job, TransferTimeout(self._late(job)))
            elif t - job.last_renew >= self.config.lease_s / 3:
                if t < job.lease_until:   # renewals only extend a lease that has not run out
                    job.lease_until = t + self.config.lease_s
                job.last_renew = t
                self.requests.tell(job, LeaseRenew(request_id=job.request_id))
            due = min(due, job.deadline, job.last_renew + self.config.lease_s / 3)
        return 0.001 if busy else max(0.0, due - now())

    def _on_notice(self, peer: str, note: bytes) -> None:
        """A transport notification from ``peer``: a part of a request's KV landed. On a protocol-2
        connection only a notice tagged by the request's prefill counts (``decode_notice``): with
        ``kv_posted`` (or the notice's own summary) it completes the request, so a forged one would make
        decode take pages the data has not reached. A protocol-1 peer sends ``"<request id>#<part>"``,
        which completes nothing without its ``kv_pushed`` (sent once its writes completed)."""
        if note.startswith(NOTICE_MAGIC):
            try:
                notice = decode_notice(note)
            except ProtocolError as exc:
                self._bad_notice(peer, str(exc))
                return
            job = self.table.requested.get(notice.request_id)
            if job is None or job.peer != peer or job.conn is None or job.conn.peer.version < 2:
                return   # ended (a late or duplicated notice), or another peer's request
            if not job.conn.verify_notice(notice.signed, notice.tag):
                self._bad_notice(peer, f"notice of request {notice.request_id} part {notice.part} does not "
                                       f"authenticate (forged, altered, or tagged for another connection)")
                return
            job.parts.add(notice.part)
            if notice.summary is not None and job.pushed is None:
                self._posted(job, notice.summary)
            return
        rid, _, part = note.decode("utf-8", "replace").rpartition("#")
        job = self.table.requested.get(rid)
        if job is None or job.peer != peer or job.conn is None:
            return
        if job.conn.peer.version >= 2:
            self._bad_notice(peer, f"untagged notification {note[:64]!r} on a protocol-2 connection")
        elif part.isascii() and part.isdigit() and len(part) < 8:   # str.isdigit() accepts "²", int() does not
            job.parts.add(int(part))

    def _bad_notice(self, peer: str, reason: str) -> None:
        """Count and log a notification that completes nothing (``bad_notices`` in ``status``)."""
        self.counts["bad_notices"] += 1
        log.warning("%s: notification from %s ignored: %s", self.config.name, peer, reason)

    def _posted(self, job: DecodeJob, msg: KvPosted) -> None:
        """Prefill posted every write of ``job`` (``kv_posted``, or a notice's summary)."""
        job.pushed, job.posted_seen = msg, now()
        job.prefill_clock = (msg.computed_at, msg.posted_at)

    def _late(self, job: DecodeJob) -> str:
        """What is missing when a request's deadline passes."""
        what = f"request {job.request_id}: KV did not arrive within {self.config.deadline_s} s"
        if isinstance(job.pushed, KvPosted | KvPushed):
            return (f"{what}: prefill reported {job.pushed.kind} but only {len(job.parts)} of {job.pushed.parts} "
                    f"transfer notifications arrived")
        if job.read is not None:
            return f"{what}: decode's read from prefill did not complete"
        if job.parts:
            return (f"{what}: {len(job.parts)} layer group(s) arrived but prefill never reported kv_pushed "
                    f"(stalled or lost mid-push)")
        return f"{what}: no answer from prefill"

    def _verify(self, job: DecodeJob) -> None:
        """Digest the destination pages by logical position and compare with prefill's digest of its source
        pages (IntegrityError naming the first differing cell)."""
        policy = self.config.checksum
        assert job.pushed is not None and policy is not None
        raw = job.pushed.digest
        if not raw:
            raise IntegrityError(f"request {job.request_id}: decode asked for checksums, prefill sent no digest")
        try:
            digest = KVDigest.from_bytes(raw)
        except DecodeError as exc:
            raise IntegrityError(f"request {job.request_id}: {exc}") from exc
        if digest.policy != policy:
            raise IntegrityError(f"request {job.request_id}: prefill's digest uses {digest.policy}, decode asked "
                                 f"for {policy}")
        verify_kv(self.layouts, job.caches, digest, token_range=(job.skip, int(job.tokens.size)))

    def _arrived(self, job: DecodeJob, transfer_s: float) -> None:
        """The KV is in place: verify it (when asked), commit the prompt, generate, answer, free."""
        assert job.pushed is not None
        verify_s = 0.0
        if self.config.checksum is not None:
            started = now()
            try:
                self._verify(job)
                verify_s = now() - started
            except KvxferError as exc:
                self.counts["integrity_failures"] += 1
                error = exc if isinstance(exc, IntegrityError) else IntegrityError(f"request {job.request_id}: {exc}")
                self.requests.fail(job, error, remote_done=True)   # uncommitted: none of its pages enter the tree
                return
        arrived = now()
        # The first token (prefill's) is known and its KV is in place, verified: a streaming server would send
        # it now, as a one-process engine sends its first token before it commits the prompt into its cache.
        ttft = arrived - job.submitted
        self.requests.kv_in_place(job)
        try:
            for cache in job.caches:
                # Release the sliding-window pages the prompt no longer needs before they are committed:
                # prefill released those too, so nothing was written there.
                cache.history_length = int(job.tokens.size)
                cache.commit(job.tokens[job.skip:])
            kv = self.model.bind(list(zip(self.managers, job.caches, strict=True)))
            first = job.pushed.first_token
            commit_s = now() - arrived
            prompt_kv = self._prompt_kv(job) if job.return_kv else None   # after TTFT: a check, not serving
        except KvxferError as exc:
            self.requests.fail_in_place(job, exc)
            return
        pushed = job.pushed
        nbytes = pushed.nbytes if isinstance(pushed, KvPosted | KvPushed) else \
            (job.read.nbytes if job.read is not None else 0)
        prefill_s, request_s = pushed.prefill_s, job.requested - job.submitted
        queued_s, post_s, arrival_s = pushed.queued_s, pushed.post_s, arrived - job.submitted
        job.result = GenerationResult(
            request_id=job.request_id, tokens=[], prompt_tokens=int(job.tokens.size), reused_tokens_decode=job.skip,
            reused_tokens_prefill=pushed.reused_tokens, bytes_moved=nbytes, mode=job.mode, layerwise=job.layerwise,
            prefill_s=prefill_s, transfer_s=transfer_s, arrival_s=arrival_s, ttft_s=ttft, verify_s=verify_s,
            prompt_kv=prompt_kv, prefill=job.prefill.address if job.prefill is not None else "",
            request_s=request_s, queued_s=queued_s, post_s=post_s, commit_s=commit_s,
            messages_s=max(0.0, arrival_s - request_s - queued_s - prefill_s - post_s - transfer_s - verify_s),
            allocate_s=job.allocated - job.requested, transfer_by_prefill=isinstance(pushed, KvPushed),
            arrived_at=arrived, prefill_computed_at=job.prefill_clock[0], prefill_posted_at=job.prefill_clock[1])
        model, max_new = self.model, job.max_new_tokens

        def run() -> list[int]:   # compute thread: only this request's pages (and the allocator, locked)
            with torch.inference_mode():
                return model.continue_greedy(kv, first, max_new)

        self.requests.generate(job, run)

    def _prompt_kv(self, job: DecodeJob) -> PromptKV:
        """The committed prompt KV at up to ``job.return_kv`` positions, read through decode's own pages and
        block ids (not through any transfer plan): what the KV oracle compares with a reference."""
        c = self.config.model.kv_spec
        positions = positions_within(int(job.tokens.size), job.return_kv, c, seed=int(job.tokens.size))
        return read_prompt_kv(list(zip(self.managers, job.caches, strict=True)), positions, c.num_layers,
                              c.num_kv_heads, c.head_dim)
