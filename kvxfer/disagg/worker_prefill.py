"""PrefillWorker: computes a request's KV (reusing its own prefix tree) and pushes it to decode, or holds
it under a lease for decode to pull.

Per request (``kv_request`` from an authenticated decode peer): allocate caches on every rank (prefix
match), run the model on the tokens not reused, then either write the token range decode lacks into
decode's blocks (push; layer-wise: one write per group of layers as soon as they are computed) and
report ``kv_pushed``, or answer ``kv_pull`` with the source block ids and keep the blocks until
``kv_release``. The model runs on a compute thread of its own (``ComputeThread``): the engine thread
keeps answering cancels, lease renewals, status and other peers during a long prefill, and posts the
layer-wise writes as the compute thread reports layers done. The source blocks are held under a lease
decode renews; expiry, ``kv_cancel``, a failed transfer or a lost peer frees every block of the
affected requests and nothing else. When decode asks
for checksums, the reply carries a position-keyed digest of the source pages decode needs (see
``kvxfer.transport.integrity``). The pages a transfer reads stay pinned until it completed or was
stopped, and the digest describes exactly those pages: a layer-wise push reads the request's own copy
of its last block, which the commit at the end of the prompt may swap for the prefix tree's identical
block (freeing the request's copy but for the pin). Who touches a request's pages is its ``PrefillState``,
moved only by ``PrefillWorker._move`` (docs/architecture.md, "A request's life is a written state machine").
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.pins import PinnedPages
from kvxfer.disagg.control import ControlServer, PeerConnection, Secret
from kvxfer.disagg.handshake import LocalIdentity, check_compatible
from kvxfer.disagg.messages import (
    ControlMessage,
    KvBlocks,
    KvCancel,
    KvFailed,
    KvPosted,
    KvPull,
    KvPushed,
    KvRanks,
    KvRelease,
    KvRequest,
    LeaseRenew,
    WorkerStatus,
    WorkerStatusReply,
)
from kvxfer.disagg.session import LeaseTable, Session, SessionState
from kvxfer.disagg.worker import (
    Computed,
    ComputeThread,
    Engine,
    Event,
    LayerDone,
    LayerwiseKV,
    Lost,
    Received,
    Reserved,
    StallWatch,
    WorkerBase,
    WorkerConfig,
    all_regions,
    check_transition,
    layer_groups,
    make_transport,
    now,
    peer_templates,
    phased_min_runs,
    plan_phased,
    release_managers,
    resume_ranks,
    warm_up_model,
)
from kvxfer.disagg.worker_protocol import (
    PREFILL_SHUTDOWN,
    BlockIdMaps,
    decode_block_ids,
    decode_checksum_policy,
    decode_layouts,
    decode_tokens,
    encode_block_ids,
    encode_layouts,
    encode_notice,
    encode_stats,
)
from kvxfer.errors import (
    CacheStateError,
    KvxferError,
    ProtocolError,
    RequestCancelled,
    SessionError,
    TransferFailed,
    WorkerUnhealthy,
)
from kvxfer.extractor import TemplateCache
from kvxfer.model import Model, greedy
from kvxfer.pagetable import PhasedPlan, TransferPlan
from kvxfer.transport import PreparedTransfer, TransferHandle, TransferStatus, Transport
from kvxfer.transport.integrity import ChecksumPolicy, digest_kv

log = logging.getLogger("kvxfer.disagg.prefill")


class PrefillState(enum.Enum):
    """What a prefill worker does with a request's pages. ``PREFILL_TRANSITIONS`` lists the moves;
    ``PrefillWorker._move`` makes every one of them and keeps ``_jobs`` (every request not yet FREED) in
    step. The request's ``Session`` says how its transfer ends (done, failed, cancelled); this says who
    still touches its pages."""

    NEW = "new"
    """Admitted: its caches are being allocated."""
    COMPUTING = "computing"
    """The compute thread writes its pages (a layer-wise push posts writes meanwhile)."""
    COMPUTED = "computed"
    """The first token is known; waiting for decode's destinations (``kv_blocks``) to send the KV."""
    SENDING = "sending"
    """Every write posted (push) or ``kv_pull`` sent (pull): waiting for the writes to complete or for
    decode's ``kv_release``."""
    ABANDONED = "abandoned"
    """Ended while the compute thread still writes its pages: they are freed once it reports back."""
    FREED = "freed"
    """Pages, pins and lease released; forgotten."""

    @property
    def terminal(self) -> bool:
        """Whether nothing more happens to a request in this state."""
        return not PREFILL_TRANSITIONS[self]


_P = PrefillState
PREFILL_TRANSITIONS: dict[PrefillState, frozenset[PrefillState]] = {
    _P.NEW: frozenset({_P.COMPUTING, _P.FREED}),
    _P.COMPUTING: frozenset({_P.COMPUTED, _P.ABANDONED}),
    _P.COMPUTED: frozenset({_P.SENDING, _P.FREED}),
    _P.SENDING: frozenset({_P.FREED}),
    _P.ABANDONED: frozenset({_P.FREED}),
    _P.FREED: frozenset(),
}
"""Every legal move of a prefill request. A request that ends while computing goes through ABANDONED:
its pages cannot be freed under the compute thread."""


@dataclass(eq=False)
class _Job:
    """One request being served to one decode peer."""

    peer: str
    request_id: str
    conn: PeerConnection
    session: Session
    caches: list[KVCache]
    mode: str
    dst_ids: BlockIdMaps | None = None
    """Decode's destination blocks per rank: None until its ``kv_blocks`` came."""
    span: tuple[int, int] = (0, 0)
    """The tokens decode asked for: ``(skip, prompt length)`` (skip 0 until ``kv_blocks``)."""
    checksum: ChecksumPolicy | None = None
    handles: list[TransferHandle] = field(default_factory=list)
    src_ids: BlockIdMaps = field(default_factory=list)
    """Per rank, the block ids the request's transfers read (fixed at the first post, pinned until freed)."""
    pins: list[PinnedPages] = field(default_factory=list)
    first_token: int = -1
    reused_tokens: int = 0
    prefill_s: float = 0.0
    compute_started: float = 0.0
    """When the compute thread began the request (``queued_s`` = this minus ``started``)."""
    posted_at: float = 0.0
    last_posted: float = 0.0
    """When the request's last transfer was handed to the transport: ``post_s`` ends there (the post
    itself counts as transfer time)."""
    groups: dict[int, list[int]] = field(default_factory=dict)
    """Layer-wise push: last layer of each group -> the group's layers."""
    waiting_layers: list[int] = field(default_factory=list)
    """Layer-wise push: groups computed before decode's ``kv_blocks`` came (by their last layer)."""
    parts: int = 0
    announced: bool = False
    """Push, protocol 2: ``kv_posted`` went to decode (every write posted, the first token known)."""
    digest: bytes | None = None
    """The digest of the source pages, once taken (``kv_posted`` and ``kv_pushed`` carry the same)."""
    reserved: bool = False
    """Push, one write: the compute thread holds every page of the prompt (``_on_reserved``)."""
    early_plan: tuple[BlockIdMaps, TransferPlan | PhasedPlan] | None = None
    """Push, not layer-wise: the write's plan, built while the compute ran (decode's ``kv_blocks`` came
    then), with the source ids it read (pinned then, in ``pins``); the post uses it when they are still
    the ids (``reusable_plan``)."""
    early_prepared: PreparedTransfer | None = None
    """The early plan prepared for the write (``Transport.prepare``: checked, cuda_ipc's kernel table
    uploaded) while the compute ran, so the post at its end is one launch."""
    started: float = field(default_factory=now)
    """When the request arrived: a process stall after this may have made decode give its blocks away."""
    state: PrefillState = PrefillState.NEW
    """Who touches the request's pages; changed only by ``PrefillWorker._move``."""

    @property
    def computing(self) -> bool:
        """The compute thread writes the request's pages now: they are freed once it is done with them."""
        return self.state in (PrefillState.COMPUTING, PrefillState.ABANDONED)


@dataclass
class PrefillStats:
    """Counters over the worker's life."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    bytes_sent: int = 0
    reused_tokens: int = 0
    peer_losses: int = 0
    reasons: deque[str] = field(default_factory=lambda: deque(maxlen=256))
    """The latest failure reasons (bounded: a long-running worker must not grow without limit)."""


class PrefillWorker(WorkerBase):
    """Serves decode peers on ``address``; see the module docstring. ``drain`` makes each new
    ``kv_request`` fail with a ``PREFILL_SHUTDOWN`` reason, which sends it to another prefill of its decode."""

    role = "prefill"

    def __init__(self, config: WorkerConfig, secret: Secret = None, *, bind: str = "tcp://127.0.0.1:0",
                 transport_options: dict[str, Any] | None = None, versions: tuple[int, int] | None = None,
                 handshake_timeout: float = 5.0, model: Model | None = None) -> None:
        """``handshake_timeout``: how long a connecting peer may take to authenticate before it is dropped.
        ``model``: an already loaded model (default: ``config.model`` loaded on ``config.device``)."""
        self.config = config
        self.managers = config.managers()
        self.layouts: list[CacheLayoutDesc] = [m.layout for m in self.managers]
        self.leases = LeaseTable()
        self.stats = PrefillStats()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._draining = False   # set by drain: new requests are refused (engine thread reads it)
        self._peer_layouts: dict[str, list[CacheLayoutDesc]] = {}
        self._peer_templates: dict[str, TemplateCache] = {}   # run templates of (these layouts, the peer's)
        self._peers: dict[str, PeerConnection] = {}
        self.engine = Engine(config.name, self._on_event, self._tick, on_receive=self._on_receive,
                             on_error=lambda reason: self._fail_all(f"prefill worker unhealthy: {reason}"))
        try:
            self.model = config.load_model(model)
            self.transport: Transport = make_transport(config, transport_options)
        except BaseException:
            release_managers(self.managers)
            raise
        self.server: ControlServer | None = None
        self.stall_watch: StallWatch | None = None
        self.compute: ComputeThread | None = None
        self._accepting: threading.Thread | None = None
        try:   # a worker that cannot start releases what it took (engine, transport, socket, caches)
            self.compute = ComputeThread(config.name, self.engine)
            #: Seconds the model's warm-up took before this worker served (0.0 without one).
            self.warm_up_s = warm_up_model(self.model, config, self.compute)
            self.transport.register(all_regions(self.layouts))
            self.transport.on_notification(self.engine.wake)
            identity = LocalIdentity("prefill", config.name, self.layouts[0], config.backend,
                                     self.transport.metadata(), config.heartbeat_interval)
            kw: dict[str, Any] = {} if versions is None else {"versions": versions}
            self.server = ControlServer(identity, secret, bind=bind, accept_roles=("decode", "client"),
                                        handshake_timeout=handshake_timeout, **kw)
            # Decode declares us lost after heartbeat_misses silent intervals; silence runs up to one interval
            # longer than a stall, so a stall of (misses - 1) intervals may already have cost us the peer.
            self.stall_watch = StallWatch(max(0.2, (self.server.heartbeat_misses - 1) * config.heartbeat_interval))
            self.stall_watch.start()
            self.address = self.server.address
            self.engine.start()
            self._accepting = self._start_accepting()
        except BaseException:
            self._release()
            raise

    # --- public -----------------------------------------------------------------------------------
    @property
    def num_jobs(self) -> int:
        """Requests whose source blocks are held now."""
        return int(self.engine.call(lambda: len(self._jobs), 10.0))

    def _own_status(self) -> dict[str, int | float | str]:
        return {"jobs": len(self._jobs), "peers": len(self._peers), "requests": self.stats.requests,
                "completed": self.stats.completed, "failed": self.stats.failed, "bytes_sent": self.stats.bytes_sent,
                "reused_tokens": self.stats.reused_tokens, "peer_losses": self.stats.peer_losses}

    def _in_flight(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Fail every open request, stop the threads, close the server and transport."""
        if self.engine.stopping:
            return
        with contextlib.suppress(KvxferError):
            self.engine.call(lambda: self._fail_all(f"{PREFILL_SHUTDOWN} ({self.config.name})"), 10.0)
        self._release()

    def _release(self) -> None:
        """Stop every thread and free the socket, transport and caches (whatever was started)."""
        if self.server is not None:
            self.server.close("prefill worker shutting down")
        self.engine.stop()
        if self.compute is not None:
            self.compute.stop()   # the prompt in progress finishes (a layer-wise one stops at its next layer)
        for job in list(self._jobs.values()):   # ended while computing: the engine no longer frees them
            self._free(job)
            if job.state is PrefillState.ABANDONED:
                self._drop_pages(job)
        if self.stall_watch is not None:
            self.stall_watch.stop()
        if self._accepting is not None:
            self._accepting.join(5.0)
        self.transport.close()
        release_managers(self.managers)

    # --- engine thread ----------------------------------------------------------------------------
    def _on_event(self, ev: Event) -> None:
        match ev:
            case Computed(job=job, value=value, error=error):
                self._computed(job, value, error)
            case Reserved(job=job):
                self._on_reserved(job)
            case LayerDone(job=job, layer=layer):
                self._on_layer(job, layer)
            case Lost(conn=conn, reason=reason):
                self._on_lost(conn, reason)
            case Received(conn=conn, message=msg):
                self._received(conn, msg, lambda: self._on_message(conn, msg))
            case _:
                raise TypeError(f"prefill worker {self.config.name}: no handler for a {type(ev).__name__} event")

    def _on_protocol_error(self, conn: PeerConnection, reason: str) -> None:
        self._on_lost(conn, reason)

    def _on_receive(self, conn: PeerConnection, msg: ControlMessage) -> bool:
        """Reader thread: a decode peer's lease renewal takes effect on arrival, even while the engine
        computes a long prompt (queued, it would let the lease run out before the write is posted)."""
        if not isinstance(msg, LeaseRenew) or conn.peer.role != "decode":
            return False
        with contextlib.suppress(SessionError):   # unknown, released or expired: nothing to extend
            self.leases.renew((conn.peer.name, msg.request_id))
        return True

    def _on_message(self, conn: PeerConnection, msg: ControlMessage) -> None:
        peer = conn.peer.name
        if isinstance(msg, WorkerStatus):
            self._send(conn, WorkerStatusReply(stats=encode_stats(self._status())))
            return
        if conn.peer.role != "decode":
            raise ProtocolError(f"a {conn.peer.role} may only ask for worker_status, not send {msg.kind!r}")
        if isinstance(msg, KvRanks):
            self._on_ranks(conn, msg)
            return
        if peer not in self._peer_layouts:
            raise ProtocolError(f"{msg.kind!r} before kv_ranks")
        match msg:
            case KvRequest():
                self._on_request(conn, msg)
            case KvBlocks(request_id=rid):
                job = self._jobs.get((peer, rid))
                if job is not None:   # else ended already (kv_failed is on its way to decode)
                    self._on_destinations(job, msg)
            case KvRelease(request_id=rid):
                job = self._jobs.get((peer, rid))
                if job is not None:
                    self._finish(job, None)
            case KvCancel(request_id=rid, reason=reason):
                job = self._jobs.get((peer, rid))
                if job is not None:
                    self._end(job, SessionState.CANCELLED, f"cancelled by decode: {reason}", tell=False)
                # Acknowledge even unknown ids: decode may free its blocks once we will not write there.
                self._send(conn, KvFailed(request_id=rid, reason=f"cancelled: {reason}"[:1024]))
            case _:
                raise ProtocolError(f"unexpected message {msg.kind!r} from a decode peer")

    def _on_ranks(self, conn: PeerConnection, msg: KvRanks) -> None:
        peer = conn.peer.name
        layouts = decode_layouts(msg.layouts)
        for i, lay in enumerate(layouts):
            try:
                check_compatible(self.layouts[0], lay)
            except KvxferError as exc:
                raise ProtocolError(f"kv_ranks.layouts[{i}] incompatible: {exc}") from exc
        if conn.peer.layout is None or layouts[0].fingerprint != conn.peer.layout.fingerprint:
            raise ProtocolError("kv_ranks.layouts[0] differs from the layout of the handshake")
        old = self._peers.get(peer)
        if old is not None and old is not conn:
            self._on_lost(old, "replaced by a new connection with the same name")
        self.transport.connect(peer, conn.peer.metadata)
        self._peer_layouts[peer] = layouts
        self._peer_templates[peer] = peer_templates(self.layouts, layouts) if self.config.planner is None \
            else peer_templates()
        self._peers[peer] = conn
        self._send(conn, KvRanks(layouts=encode_layouts(self.layouts)))

    # --- requests ---------------------------------------------------------------------------------
    def _on_request(self, conn: PeerConnection, msg: KvRequest) -> None:
        peer, rid = conn.peer.name, msg.request_id
        self.stats.requests += 1
        if (peer, rid) in self._jobs:
            self._send(conn, KvFailed(request_id=rid, reason="duplicate request id"))
            return
        if self._draining:
            self._send(conn, KvFailed(request_id=rid, reason=f"{PREFILL_SHUTDOWN} ({self.config.name}): draining, "
                                                             f"not taking new requests"))
            return
        try:
            tokens = decode_tokens(msg.tokens, "kv_request.tokens")
        except ProtocolError as exc:
            self._send(conn, KvFailed(request_id=rid, reason=str(exc)[:1024]))
            return
        checksum = decode_checksum_policy(msg.checksum)
        session = Session(rid, lease=self.leases.grant((peer, rid), msg.lease_s))
        job = _Job(peer, rid, conn, session, [], msg.mode, None, (0, int(tokens.size)), checksum)
        self._jobs[(peer, rid)] = job   # NEW: every state but FREED is in ``_jobs``
        try:
            self._allocate(job, tokens)
        except KvxferError as exc:
            self._end(job, SessionState.FAILED, f"{type(exc).__name__}: {exc}")
            return
        self._start_compute(job, tokens, msg)

    def _on_destinations(self, job: _Job, msg: KvBlocks) -> None:
        """Decode's destination blocks (``kv_blocks``, sent while this side computes): what was waiting for
        them (layer groups done, the whole compute done) is posted now."""
        if job.dst_ids is not None:
            raise ProtocolError(f"kv_blocks: a second one for request {job.request_id!r}")
        skip, size = msg.skip, job.span[1]
        if not 0 <= skip < size:
            self._end(job, SessionState.FAILED, f"kv_blocks.skip={skip} outside [0, {size})")
            return
        job.dst_ids = decode_block_ids(msg.blocks, len(self._peer_layouts[job.peer]), "kv_blocks.blocks")
        job.span = (skip, size)
        if job.session.terminal:   # ended meanwhile; its pages are freed where it ended
            return
        if job.reserved and job.computing:
            self._plan_early(job)
        waiting, job.waiting_layers = job.waiting_layers, []
        for layer in waiting:
            self._on_layer(job, layer)
        if job.first_token >= 0 and not job.computing:
            self._send_kv(job)

    def _allocate(self, job: _Job, tokens: np.ndarray) -> None:
        """The request's source caches on every rank, reusing the prefix every rank holds: the ranks' prefix
        trees can differ (a rank evicted, or freed its pinned pages at another moment), so a rank that
        matched more than another is matched again against the common part only."""
        for i, m in enumerate(self.managers):
            job.caches.append(m.create_kv_cache_for_prompt(tokens, id=f"{job.peer}/{job.request_id}/{i}"))
        common = min(c.num_reused_tokens for c in job.caches)
        for i, (m, c) in enumerate(zip(self.managers, job.caches, strict=True)):
            if c.num_reused_tokens > common:   # the last token given is never reused: at most ``common`` are
                c.close()
                job.caches[i] = m.create_kv_cache_for_prompt(tokens[:common + 1], id=f"{job.peer}/{job.request_id}/{i}",
                                                  expected_prompt_length=len(tokens))
        job.reused_tokens = resume_ranks(job.caches, "prefill")
        self.stats.reused_tokens += job.reused_tokens
        job.session.ready("source blocks allocated")

    def _start_compute(self, job: _Job, tokens: np.ndarray, msg: KvRequest) -> None:
        """Hand the model work to the compute thread; its layers (layer-wise push) and its end come back
        as ``layer_done`` and ``computed`` events."""
        assert self.compute is not None
        shards = list(zip(self.managers, job.caches, strict=True))
        if msg.mode == "push" and msg.layerwise:
            job.groups = {g[-1]: g for g in layer_groups(self.model.kv_spec.num_layers, msg.layers_per_send)}
        model, chunk, engine = self.model, self.config.chunk_size, self.engine
        plan_early = msg.mode == "push" and not job.groups

        def on_layer(layer: int) -> None:   # compute thread
            if job.session.terminal:
                raise RequestCancelled(f"request {job.request_id}: {job.session.reason}; computing stopped")
            if layer in job.groups:
                # Take (and pin) the pages the writes read now, on this thread: the commit at the end of the
                # prompt may swap the last block for the prefix tree's copy before the engine posts them.
                self._source_ids(job)
                engine.post_internal(LayerDone(job, layer))

        def run() -> tuple[int, float]:   # compute thread: only this request's pages are touched
            started = job.compute_started = now()
            kv: Any = LayerwiseKV(shards, self.model.kv_spec, int(tokens.size), on_layer) if job.groups \
                else model.bind(shards)
            if plan_early:   # every page of the prompt now (the model would take them chunk by chunk)
                kv.reserve(int(tokens.size))
                engine.post_internal(Reserved(job))
            with torch.inference_mode():
                logits = model.prefill(kv, tokens[job.reused_tokens:], chunk, last_only=True)
            return greedy(logits[-1]), now() - started

        self._move(job, PrefillState.COMPUTING)
        self.compute.submit(job, run)

    def _on_layer(self, job: _Job, layer: int) -> None:
        """A group of layers is in the pages (layer-wise push): write it to decode."""
        if job.session.terminal or job.state.terminal:
            return
        if job.dst_ids is None:   # decode's kv_blocks has not come yet: posted when it does
            job.waiting_layers.append(layer)
            return
        try:
            if job.session.state is SessionState.READY:
                job.session.start_transfer("layer-wise writes posted")
                job.posted_at = now()
            plan = plan_phased(self.layouts, job.src_ids, self._peer_layouts[job.peer], job.dst_ids,
                               token_range=job.span, layers=job.groups[layer], request_id=job.request_id,
                               planner=self.config.planner, templates=self._peer_templates.get(job.peer),
                               min_runs=phased_min_runs(self.transport))
            job.parts += 1
            self._check_may_write(job)
            job.last_posted = now()
            self._track(job, self.transport.write(job.peer, plan, self._notice(job, job.parts)))
        except KvxferError as exc:
            self._end(job, SessionState.FAILED, f"{type(exc).__name__}: {exc}")
            return
        self._announce(job)

    def _computed(self, job: _Job, result: tuple[int, float] | None, error: BaseException | None) -> None:
        """The compute thread is done with the request's pages: free them if the request ended meanwhile,
        else send (pull: tell decode where to read; push: write what layer-wise writes did not)."""
        if job.state is PrefillState.ABANDONED:   # ended while computing: nothing touches the pages now
            self._drop_pages(job)
            return
        self._move(job, PrefillState.COMPUTED)
        if job.session.terminal:
            self._free(job)
            return
        if error is not None:
            if not isinstance(error, KvxferError):   # a bug or CUDA out of memory: the worker is suspect
                cause = f"{type(error).__name__}: {error}"
                log.error("%s: computing request %s failed", self.config.name, job.request_id, exc_info=error)
                self.engine.mark_unhealthy(f"prefill compute failed: {cause}")
                self._end(job, SessionState.FAILED, f"{WorkerUnhealthy.__name__}: prefill compute failed: {cause}")
                return
            self._end(job, SessionState.FAILED, f"{type(error).__name__}: {error}")
            return
        assert result is not None
        job.first_token, job.prefill_s = result
        self.engine.wake()   # layer-wise writes that already finished: the tick reports them now
        if job.dst_ids is not None:   # else decode's kv_blocks posts it
            self._send_kv(job)
            self._announce(job)   # layer-wise: every write may have been posted during the compute

    def _send_kv(self, job: _Job) -> None:
        """The request is computed and decode's destinations are known: pull: tell decode where to read;
        push: write what layer-wise writes did not."""
        assert job.dst_ids is not None
        self._move(job, PrefillState.SENDING)
        try:
            if job.mode == "pull":
                src_ids = self._source_ids(job)
                digest = self._digest(job)   # before decode may read: the pages are final
                job.session.start_transfer("waiting for decode to read")
                queued_s, post_s = self._stages(job, now())
                self._send(job.conn, KvPull(request_id=job.request_id, first_token=job.first_token,
                                            blocks=encode_block_ids(src_ids), reused_tokens=job.reused_tokens,
                                            prefill_s=job.prefill_s, digest=digest, queued_s=queued_s, post_s=post_s),
                           urgent=True)
                return
            if not job.groups:
                src_ids = self._source_ids(job)
                early, job.early_plan = job.early_plan, None
                prepared = self._take_prepared(job)
                plan = reusable_plan(early, src_ids)
                if plan is None:
                    if prepared is not None:
                        prepared.release()
                        prepared = None
                    plan = plan_phased(self.layouts, src_ids, self._peer_layouts[job.peer], job.dst_ids,
                                       token_range=job.span, request_id=job.request_id,
                                       planner=self.config.planner, templates=self._peer_templates.get(job.peer),
                                       min_runs=phased_min_runs(self.transport))
                self._check_may_write(job)
                job.session.start_transfer("write posted")
                job.posted_at = now()
                job.last_posted = job.posted_at
                summary = None
                if job.checksum is None and job.conn.peer.version >= 2:
                    # No digest to take: the write's own notice tells decode all that kv_posted would.
                    summary = self._posted(job, 1, plan.total_bytes, b"")
                    job.announced = True
                # Settled: the compute thread read the first token, a device sync after every kernel that
                # wrote these pages; the copy need not wait for what it queued since (the next prompt).
                notice = self._notice(job, 1, summary)
                if prepared is not None:
                    try:
                        handle = prepared.post(notice, settled=True)
                    finally:   # the copy keeps what it reads alive; the prepared transfer is not posted again
                        prepared.release()
                else:
                    handle = self.transport.write(job.peer, plan, notice, settled=True)
                self._track(job, handle)
        except KvxferError as exc:
            self._end(job, SessionState.FAILED, f"{type(exc).__name__}: {exc}")
            return
        self._announce(job)

    def _track(self, job: _Job, handle: TransferHandle) -> None:
        """A transfer of ``job`` was posted: the request waits for it, and its end wakes the engine."""
        job.handles.append(handle)
        handle.add_done_callback(self.engine.wake)

    def _announce(self, job: _Job) -> None:
        """Push: once every write is posted and the first token is known, tell decode (``kv_posted``,
        protocol 2) while the data moves: decode then takes the KV when the transport's (tagged)
        notices say it landed, without waiting for this side to see its writes complete and send
        ``kv_pushed`` (a hop through both engines and both control threads, ~1-2 ms). The digest is
        taken here, after the posts, so it overlaps the copy. (A request's one write without a digest
        needs no message: its notice carries the same, ``_send_kv``.)"""
        expected = len(job.groups) if job.groups else 1
        if job.announced or job.mode != "push" or job.first_token < 0 or len(job.handles) < expected \
                or job.conn.peer.version < 2 or job.session.terminal:
            return
        job.announced = True
        try:
            digest = self._job_digest(job)
        except KvxferError as exc:
            self._end(job, SessionState.FAILED, f"checksum of the source pages failed: {exc}")
            return
        self._send(job.conn, self._posted(job, expected, sum(h.nbytes for h in job.handles), digest), urgent=True)

    def _posted(self, job: _Job, parts: int, nbytes: int, digest: bytes) -> KvPosted:
        """What ``kv_posted`` says (a notice's summary too, without the digest)."""
        queued_s, post_s = self._stages(job, job.last_posted)
        return KvPosted(request_id=job.request_id, first_token=job.first_token, parts=parts, nbytes=nbytes,
                        reused_tokens=job.reused_tokens, prefill_s=job.prefill_s, digest=digest, queued_s=queued_s,
                        post_s=post_s, computed_at=job.compute_started + job.prefill_s, posted_at=job.last_posted)

    @staticmethod
    def _notice(job: _Job, part: int, summary: KvPosted | None = None) -> bytes:
        """The notification that follows part ``part`` of a request's KV: ``"<request id>#<part>"`` for a
        protocol-1 peer, else a notice tagged with the connection's key (``encode_notice``), which decode
        trusts as "landed" only once the tag checks."""
        if job.conn.peer.version < 2:
            return f"{job.request_id}#{part}".encode()
        return encode_notice(job.request_id, part, summary, job.conn.sign_notice)

    def _on_reserved(self, job: _Job) -> None:
        """The compute thread holds every page of the prompt (push, one write): plan the write now if
        decode's destinations are known (else when its ``kv_blocks`` comes)."""
        job.reserved = True
        if job.dst_ids is not None and job.computing and not job.session.terminal:
            self._plan_early(job)

    def _plan_early(self, job: _Job) -> None:
        """Build the push's plan now, while the compute thread runs, from the block ids the request holds
        now, pinned as they are read (the planning, ~0.3-0.5 ms, and the pin, ~0.1 ms, then leave the path
        from the compute's end to the post). The compute may still change the ids (its commit at the
        prompt's end may swap the last block for the prefix tree's copy): the post checks them first
        (``reusable_plan``), and plans and pins again if they changed (the early pin is released with
        the request's others)."""
        assert job.dst_ids is not None
        ids: BlockIdMaps = []
        for m, c in zip(self.managers, job.caches, strict=True):   # ids and pin together: the compute frees
            rank_ids, pin = m.pin_cache_pages(c)                   # pages meanwhile (sliding windows)
            job.pins.append(pin)
            ids.append({g: np.asarray(x, dtype=np.int64) for g, x in rank_ids.items()})
        try:
            plan = plan_phased(self.layouts, ids, self._peer_layouts[job.peer], job.dst_ids, token_range=job.span,
                               request_id=job.request_id, planner=self.config.planner,
                               templates=self._peer_templates.get(job.peer), min_runs=phased_min_runs(self.transport))
        except KvxferError as exc:   # the post plans (and pins) again, and reports what is wrong
            log.debug("%s: request %s: no early plan: %s", self.config.name, job.request_id, exc)
            return
        job.early_plan = ids, plan
        if not self.config.prepare_writes:
            return
        try:   # checked and made ready now too: the post is then one launch (cuda_ipc)
            job.early_prepared = self.transport.prepare("write", job.peer, plan)
        except KvxferError as exc:   # the post writes the plan instead, and reports what is wrong
            log.debug("%s: request %s: early plan not prepared: %s", self.config.name, job.request_id, exc)

    @staticmethod
    def _take_prepared(job: _Job) -> PreparedTransfer | None:
        """The job's prepared early write, now owned by the caller (the job no longer holds it)."""
        prepared, job.early_prepared = job.early_prepared, None
        return prepared

    def _source_ids(self, job: _Job) -> BlockIdMaps:
        """The block ids the request's transfers read: taken (and pinned on every rank, unless the early
        plan pinned these very ids) at the first post; a later post must read the same pages, or its
        digest could not describe them all."""
        now_ids = [{g: np.asarray(ids, dtype=np.int64) for g, ids in c.block_id_map().items()} for c in job.caches]
        if not job.src_ids:
            if reusable_plan(job.early_plan, now_ids) is None:
                job.pins.extend(m.pin_pages(ids) for m, ids in zip(self.managers, now_ids, strict=True))
            job.src_ids = now_ids
        elif any(not np.array_equal(a[g], b[g]) for a, b in zip(job.src_ids, now_ids, strict=True) for g in a):
            raise CacheStateError(f"request {job.request_id}: its block ids changed between two posts of its "
                                  f"transfer (a commit in the middle of a layer-wise push)")
        return job.src_ids

    @staticmethod
    def _stages(job: _Job, posted: float) -> tuple[float, float]:
        """(queued_s, post_s) of a request: its arrival to the compute thread starting it, and the end of
        its compute to ``posted`` (the last transfer posted, or the ``kv_pull`` about to be sent): the
        control time around prefill's compute that decode cannot see (0 where they overlap, layer-wise)."""
        queued = max(0.0, job.compute_started - job.started)
        return queued, max(0.0, posted - (job.compute_started + job.prefill_s))

    def _check_may_write(self, job: _Job) -> None:
        """Refuse to write into decode's blocks once decode may have given them away: after the connection
        ended, after the lease ran out, or after this process stalled long enough for decode to declare it
        lost (decode keeps a lost prefill's push destinations only until the lease could have run out)."""
        if not job.conn.alive:
            raise TransferFailed(f"request {job.request_id}: not writing into the blocks of decode {job.peer!r}, "
                                 f"its connection ended: {job.conn.lost_reason}")
        if job.session.lease is not None and job.session.lease.expired:
            raise TransferFailed(f"request {job.request_id}: not writing into the blocks of decode {job.peer!r}, "
                                 f"its lease expired")
        assert self.stall_watch is not None
        stalled = self.stall_watch.stalled_since(job.started)
        if stalled:
            raise TransferFailed(f"request {job.request_id}: not writing into the blocks of decode {job.peer!r}: "
                                 f"this process stalled {stalled:.1f} s (over {self.stall_watch.threshold:.1f} s) "
                                 f"while serving it, so decode may have declared it lost and reused them")

    # --- completion and failure -------------------------------------------------------------------
    def _tick(self) -> float:
        # Prefill expects no notification, but each pull's read sends one (and any peer may send more):
        # drop them, or the transport's inbox grows by one per request for the worker's whole life.
        self.transport.notifications()
        for key in (self.leases.pop_expired() if not self.engine.backlog else []):
            job = next((j for k, j in self._jobs.items() if k == key), None)
            if job is not None:
                self._end(job, SessionState.FAILED, "lease expired: decode stopped renewing it")
        busy = False
        polled = self.transport.notifications_need_polling
        for job in list(self._jobs.values()):
            if job.mode == "pull" and polled and job.session.state is SessionState.TRANSFERRING:
                busy = True   # NIXL: decode's read of our pages may need this side to progress
            if job.mode != "push" or not job.handles or job.session.state is not SessionState.TRANSFERRING:
                continue
            if job.computing:   # layer-wise: the last write may end before the first token is known
                busy = busy or any(h.completes_when_polled for h in job.handles)
                continue
            statuses = [h.status for h in job.handles]
            failed = [h for h, s in zip(job.handles, statuses, strict=True)
                      if s in (TransferStatus.FAILED, TransferStatus.CANCELLED)]
            if failed:
                self._end(job, SessionState.FAILED, f"transfer failed: {failed[0].reason}")
            elif all(s is TransferStatus.DONE for s in statuses):
                # When the backend saw the last write complete: the engine may look much later (busy
                # with other requests' digests and posts).
                self._finish(job, max(h.finished_at for h in job.handles) - job.posted_at)
            elif any(h.completes_when_polled for h in job.handles):
                busy = True   # the others wake the engine when they finish
        if busy:
            return 0.001
        nxt = self.leases.next_deadline()
        return 1.0 if nxt is None else max(0.0, nxt - now())

    def _job_digest(self, job: _Job) -> bytes:
        """``_digest`` of a push, taken once (the pages are final and pinned by then)."""
        if job.digest is None:
            job.digest = self._digest(job)
        return job.digest

    def _digest(self, job: _Job) -> bytes:
        """The position-keyed digest of the pages the request's transfers read (pinned), over the tokens
        decode asked for (empty when decode asked for no checksum)."""
        if job.checksum is None:
            return b""
        return digest_kv(self.layouts, job.src_ids, job.span, job.checksum,
                         f"{job.peer}/{job.request_id}").to_bytes()

    def _finish(self, job: _Job, transfer_s: float | None) -> None:
        """The request's KV reached decode: report (push), free the source blocks, end the session."""
        nbytes = sum(h.nbytes for h in job.handles)
        if transfer_s is not None:
            try:
                digest = self._job_digest(job)
            except KvxferError as exc:
                self._end(job, SessionState.FAILED, f"checksum of the source pages failed: {exc}")
                return
            p = self._posted(job, len(job.handles), nbytes, digest)
            # Announced (kv_posted or the notice's summary): decode has, or is about to take, the KV without
            # it, so it is no longer urgent (it frees a cancelled request's blocks; its transfer time is
            # for the statistics). kv_pushed: kv_posted's fields but the clocks, and the transfer time.
            self._send(job.conn, KvPushed(request_id=p.request_id, first_token=p.first_token, parts=p.parts,
                                          nbytes=p.nbytes, reused_tokens=p.reused_tokens, prefill_s=p.prefill_s,
                                          transfer_s=transfer_s, digest=p.digest, queued_s=p.queued_s,
                                          post_s=p.post_s), urgent=not job.announced)
        self.stats.bytes_sent += nbytes
        self.stats.completed += 1
        job.session.done("decode has the KV" if transfer_s is None else "written")
        self._free(job)

    def _end(self, job: _Job, state: SessionState, reason: str, *, tell: bool = True) -> None:
        """Fail or cancel one request: stop its transfers, free its blocks, tell decode (when asked)."""
        if job.session.terminal:   # ended before (its pages may wait for the compute thread)
            self._free(job)
            return
        for h in job.handles:
            h.cancel()
        if not job.session.terminal:
            job.session.transition(state, reason)
        self.stats.failed += 1
        self.stats.reasons.append(reason)
        log.info("%s: request %s of %s ended: %s", self.config.name, job.request_id, job.peer, reason)
        if tell:
            self._send(job.conn, KvFailed(request_id=job.request_id, reason=reason[:1024]))
        self._free(job)

    def _free(self, job: _Job) -> None:
        """Give up the request's lease and prepared write, and its pages once nothing touches them (a
        request still computing is ABANDONED: ``_computed`` frees it)."""
        if job.state is PrefillState.FREED:
            return
        prepared = self._take_prepared(job)
        if prepared is not None:
            prepared.release()
        self.leases.release((job.peer, job.request_id))
        if job.state is PrefillState.COMPUTING:
            self._move(job, PrefillState.ABANDONED)
        if job.state is not PrefillState.ABANDONED:
            self._drop_pages(job)

    def _drop_pages(self, job: _Job) -> None:
        """Free the request's caches and pins once every transfer reading them ended; FREED."""
        pending = [h for h in job.handles if not h.done()]
        if pending:   # a transfer that could not be cancelled still reads our pages: wait for it
            for h in pending:
                with contextlib.suppress(KvxferError):
                    h.wait(self.config.lease_s)
        self._move(job, PrefillState.FREED)
        for cache in job.caches:
            with contextlib.suppress(KvxferError):
                cache.close()
        for pin in job.pins:   # after every transfer reading the pages ended (or was given up on above)
            with contextlib.suppress(KvxferError):
                pin.release()

    def _move(self, job: _Job, state: PrefillState) -> None:
        """Move ``job`` to ``state`` (SessionError if ``PREFILL_TRANSITIONS`` does not allow it); a FREED
        request leaves ``_jobs`` (engine thread only)."""
        check_prefill_move(job.request_id, job.state, state)
        job.state = state
        if state is PrefillState.FREED and self._jobs.get((job.peer, job.request_id)) is job:
            del self._jobs[(job.peer, job.request_id)]

    def _on_lost(self, conn: PeerConnection, reason: str) -> None:
        peer = conn.peer.name
        if self._peers.get(peer) is not conn:
            return
        self.stats.peer_losses += 1
        for job in [j for j in self._jobs.values() if j.peer == peer]:
            self._end(job, SessionState.FAILED, f"decode peer lost: {reason}", tell=False)
        self._peers.pop(peer, None)
        self._peer_layouts.pop(peer, None)
        self._peer_templates.pop(peer, None)
        self.transport.disconnect(peer)

    def _fail_all(self, reason: str) -> None:
        for job in list(self._jobs.values()):
            self._end(job, SessionState.FAILED, reason)


def check_prefill_move(request_id: str, old: PrefillState, new: PrefillState) -> None:
    """SessionError unless ``PREFILL_TRANSITIONS`` allows a request in ``old`` to move to ``new``."""
    check_transition(PREFILL_TRANSITIONS, "prefill", request_id, old, new)


def reusable_plan(early: tuple[BlockIdMaps, TransferPlan | PhasedPlan] | None,
                  src_ids: BlockIdMaps) -> TransferPlan | PhasedPlan | None:
    """The early plan when the source ids it was built from are exactly ``src_ids`` (every rank, every
    layer group), else None: the pages it would read are no longer the request's."""
    if early is None:
        return None
    ids, plan = early
    same = len(ids) == len(src_ids) and all(
        a.keys() == b.keys() and all(np.array_equal(a[g], b[g]) for g in a) for a, b in zip(ids, src_ids, strict=True))
    return plan if same else None
