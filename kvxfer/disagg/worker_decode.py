"""DecodeWorker: takes requests (Python API or ``generate`` from clients), gets their KV from one of its
prefill workers and continues generation.

Prefill peers (xPyD): a decode worker holds any number of prefill connections, one per address, each with
its own automatic reconnect. Each request goes to the prefill the caller names (a router's choice) when
that one is connected, else to the connected prefill with the fewest of this worker's requests in flight
(ties rotate). A request whose prefill is lost, removed or stopping before its KV arrived goes to another
connected prefill (failover, ``_retry``); it fails only when none can take it. The others keep serving,
and a prefill added while serving (``add_prefill``) takes the next request. ``drain`` stops taking requests
and lets those in flight finish; ``close`` fails the rest with WorkerShuttingDown.

Per request: send the prompt (``kv_request``) so prefill starts computing, then allocate caches on every
rank, matching the local prefix tree first, so the request only asks for the tokens it lacks (``skip``),
and send the destination block ids (``kv_blocks``) while prefill computes; then either
wait for prefill's writes (push: ``kv_pushed`` plus one transport notification per part) or read the
pages itself (pull: ``kv_pull`` -> ``transport.read`` -> ``kv_release``), renewing prefill's lease
meanwhile. Once the KV is in place: commit the prompt, run ``continue_greedy``, return the tokens.
A deadline, a failed transfer, a cancellation, or the prefill peer's loss fails only the affected
requests; their blocks are freed once nothing can write into them any more. With ``WorkerConfig.checksum``
set, decode digests its own destination pages by logical position (layer, role, head, token chunk) and
compares them with prefill's digest of its source pages before committing: a mismatch fails the request
with IntegrityError naming the cell, and nothing of it enters the prefix tree. Blocks decode already
holds from its prefix tree are read-only: ``kv_blocks`` names them as -1 (no page), so prefill cannot
plan a write there, and a pull's plan reaching into one is refused before the read is posted.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.kv_cache import KVCache
from kvxfer.disagg.control import ControlServer, PeerConnection, Secret, connect
from kvxfer.disagg.handshake import LocalIdentity
from kvxfer.disagg.messages import (
    MODES,
    SUPPORTED_VERSIONS,
    ControlMessage,
    Generate,
    GenerateCancel,
    Generated,
    GenerateFailed,
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
from kvxfer.disagg.oracle import PromptKV, positions_within, read_prompt_kv
from kvxfer.disagg.router import KVRouter, Route
from kvxfer.disagg.session import Session, SessionState
from kvxfer.disagg.worker import (
    Computed,
    ComputeThread,
    Engine,
    Event,
    Health,
    Lost,
    Received,
    Reconnected,
    Submitted,
    WorkerConfig,
    WorkerCounts,
    accept_loop,
    all_regions,
    held_slots,
    make_transport,
    now,
    plan_between,
    warm_up_model,
)
from kvxfer.disagg.worker_protocol import (
    NOTICE_MAGIC,
    decode_block_ids,
    decode_layouts,
    decode_notice,
    encode_block_ids,
    encode_checksum_policy,
    encode_layouts,
    encode_stats,
    encode_tokens,
    is_prefill_shutdown,
)
from kvxfer.errors import (
    CacheStateError,
    CapacityError,
    ConfigError,
    ControlTimeout,
    DecodeError,
    HandshakeRefused,
    IntegrityError,
    KvxferError,
    LayoutMismatch,
    OutOfSlotsError,
    PeerUnreachable,
    ProtocolError,
    RequestCancelled,
    SessionError,
    TransferFailed,
    TransferTimeout,
    WorkerShuttingDown,
    WorkerUnhealthy,
)
from kvxfer.extractor import check_writable, writable_block_ids
from kvxfer.model import Model
from kvxfer.transport import TransferHandle, TransferStatus, Transport
from kvxfer.transport.integrity import KVDigest, verify_kv

log = logging.getLogger("kvxfer.disagg.decode")

#: Longest wait of one automatic reconnect attempt, and the pause between two failed ones.
RECONNECT_ATTEMPT_S = 1.0
RECONNECT_PAUSE_S = 0.2


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """One finished request: its tokens, where its KV came from and the timings of each stage (built
    by keyword: the fields are many and several share a type)."""

    request_id: str
    tokens: list[int]
    prompt_tokens: int
    reused_tokens_decode: int
    """Prompt tokens decode already held (prefix hit): they did not travel."""
    reused_tokens_prefill: int
    """Prompt tokens prefill did not recompute (its own prefix hit)."""
    bytes_moved: int
    mode: str
    layerwise: bool
    prefill_s: float
    transfer_s: float
    """Data movement: prefill's first post to its last completion (push: from its ``kv_pushed``, which
    comes after the KV was taken at ``kv_posted`` and before the last token, unless the generation ends
    first: then decode's wait from ``kv_posted`` to the data in place, 0 when the data landed first), or
    decode's read (pull)."""
    arrival_s: float
    """Submit -> the KV is in decode's pages."""
    ttft_s: float
    """Submit -> the first generated token is known with its KV in place (and verified) on decode: when a
    streaming server would send it (decode then commits the prompt, ``commit_s``, before generating)."""
    verify_s: float = 0.0
    """Checking the destination pages against prefill's digest (0 without a checksum policy)."""
    prompt_kv: PromptKV | None = None
    """The committed prompt KV by logical position, read from decode's pages (only when the request
    asked for it with ``return_kv``: for the KV oracle of tests and the demo)."""
    prefill: str = ""
    """The address of the prefill worker that served the KV (xPyD: which one the request went to)."""
    request_s: float = 0.0
    """Submit -> ``kv_request`` sent (decode's queue, encoding the prompt)."""
    queued_s: float = 0.0
    """Prefill: the request's arrival -> its compute started."""
    post_s: float = 0.0
    """Prefill: its compute ended -> the last transfer posted (push) or ``kv_pull`` sent (pull)."""
    commit_s: float = 0.0
    """After the first token: decode commits the prompt's blocks into its cache (prefix tree, events)
    before generating the next one (as a one-process engine commits after its first token)."""
    messages_s: float = 0.0
    """What no stage above timed: arrival minus request, queued, prefill, post, transfer and verify (the
    control messages both ways, the completion notification, engine wake-ups)."""
    allocate_s: float = 0.0
    """Decode allocating the destination blocks (prefix match, eviction) after ``kv_request`` went out:
    it overlaps prefill's queue and compute, so it is no part of the sum above."""
    transfer_by_prefill: bool = False
    """Whether ``transfer_s`` is prefill's own figure (post to completion, from ``kv_pushed``)."""
    arrived_at: float = 0.0
    """Decode's monotonic clock when the KV was in place."""
    prefill_computed_at: float = 0.0
    """Prefill's monotonic clock at the end of its compute (push, protocol 2; else 0): with
    ``arrived_at``, the exact time after prefill's compute, but only when both run on one host."""
    prefill_posted_at: float = 0.0
    """Prefill's monotonic clock when its last write was posted (as ``prefill_computed_at``)."""

    def stats(self) -> dict[str, int | float | str]:
        """The figures of this result without the tokens (what ``generated.stats`` carries)."""
        return {k: v for k, v in asdict(self).items() if k not in ("tokens", "request_id", "prompt_kv")}


def one_host_landing_s(stats: Mapping[str, Any]) -> float | None:
    """Prefill's last post (or its compute's end, when later: layer-wise) -> the KV in place on decode,
    less decode's check, from a result's ``stats()``: prefill's clock readings against decode's, so valid
    only when both ran on one host (benchmarks, the demo). None when prefill reported no clock (pull,
    protocol 1)."""
    computed = float(stats.get("prefill_computed_at", 0.0))
    if computed <= 0:
        return None
    posted = max(float(stats.get("prefill_posted_at", 0.0)), computed)
    return max(0.0, float(stats.get("arrived_at", 0.0)) - posted - float(stats.get("verify_s", 0.0)))


@dataclass(eq=False)
class _Prefill:
    """One prefill peer of a decode worker: its address, its live connection and its reconnect loop.
    Mutated on the engine thread only (the reconnect thread reads ``alive`` and ``stop``)."""

    address: str
    conn: PeerConnection | None = None
    layouts: list[CacheLayoutDesc] = field(default_factory=list)
    reconnecting: threading.Thread | None = None
    reconnect_error: str = ""
    """Why the last automatic reconnect attempt failed ("" before any, or while the first one runs)."""
    stop: threading.Event = field(default_factory=threading.Event)
    draining: bool = False
    """The prefill said it is stopping (a ``PREFILL_SHUTDOWN`` refusal): new requests go elsewhere."""

    @property
    def alive(self) -> bool:
        """Whether the connection is up."""
        conn = self.conn
        return conn is not None and conn.alive


class JobState(enum.Enum):
    """Where a decode request is. ``JOB_TRANSITIONS`` lists the moves; ``DecodeWorker._move`` makes every
    one of them, and keeps the worker's collection of each state in step (``_waiting``, ``_parked``,
    ``_jobs``, ``_generating``, ``_zombies``)."""

    NEW = "new"
    """Submitted, not placed yet."""
    WAITING = "waiting"
    """No prefill connected: waits for the outcome of a reconnect attempt (within its deadline)."""
    PARKED = "parked"
    """A failover attempt waiting for pages that earlier attempts still hold (quarantined)."""
    REQUESTED = "requested"
    """Sent to a prefill: its KV is being computed, written (push) or read (pull)."""
    GENERATING = "generating"
    """The KV is in place and committed; the compute thread generates."""
    QUARANTINED = "quarantined"
    """Ended, its pages held while a prefill (or decode's own read) may still write into them."""
    DONE = "done"
    """Answered with its tokens; pages freed."""
    FAILED = "failed"
    """Answered with an error; pages freed."""
    RETRIED = "retried"
    """Handed to a fresh attempt on another prefill; its pages went to a stale copy of it."""
    FREED = "freed"
    """A quarantined request's (or a stale attempt's) pages freed."""

    @property
    def terminal(self) -> bool:
        """Whether nothing more happens to a request in this state."""
        return not JOB_TRANSITIONS[self]


_S = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.NEW: frozenset({_S.WAITING, _S.PARKED, _S.REQUESTED, _S.FAILED}),
    _S.WAITING: frozenset({_S.PARKED, _S.REQUESTED, _S.FAILED}),
    _S.PARKED: frozenset({_S.REQUESTED, _S.FAILED}),
    _S.REQUESTED: frozenset({_S.GENERATING, _S.QUARANTINED, _S.FAILED, _S.RETRIED, _S.FREED}),
    _S.GENERATING: frozenset({_S.DONE, _S.FAILED}),
    _S.QUARANTINED: frozenset({_S.FREED}),
    _S.DONE: frozenset(), _S.FAILED: frozenset(), _S.RETRIED: frozenset(), _S.FREED: frozenset(),
}
"""Every legal move of a decode request. REQUESTED -> FREED and -> QUARANTINED also serve the stale copy
of a retried attempt (``DecodeWorker._retry``)."""


def check_move(request_id: str, old: JobState, new: JobState) -> None:
    """SessionError unless ``JOB_TRANSITIONS`` allows a request in ``old`` to move to ``new``."""
    if new not in JOB_TRANSITIONS[old]:
        allowed = sorted(s.value for s in JOB_TRANSITIONS[old]) or "none (terminal)"
        raise SessionError(f"decode request {request_id!r}: illegal move {old.value} -> {new.value} "
                           f"(allowed from {old.value}: {allowed})")


@dataclass(eq=False, kw_only=True)
class _Job:
    request_id: str
    tokens: npt.NDArray[np.int64]
    max_new_tokens: int
    mode: str
    layerwise: bool
    future: Future[GenerationResult]
    session: Session
    submitted: float
    deadline: float
    reply: PeerConnection | None = None
    client_request_id: str = ""
    peer: str = ""
    """The prefill's transport name (its control-plane name)."""
    prefer: str | None = None
    """The prefill address the caller chose (a router), used when connected."""
    prefill: _Prefill | None = None
    conn: PeerConnection | None = None
    """The connection the request was sent over: only it may answer, and its loss fails the request."""
    src_layouts: list[CacheLayoutDesc] = field(default_factory=list)
    route: Route | None = None
    """The KV router's decision this request followed (counted in flight there until the KV is in place)."""
    caches: list[KVCache] = field(default_factory=list)
    skip: int = 0
    pushed: KvPosted | KvPushed | KvPull | None = None
    """Prefill's report of the KV: ``kv_posted`` (replaced by ``kv_pushed`` if it comes first), or ``kv_pull``."""
    parts: set[int] = field(default_factory=set)
    read: TransferHandle | None = None
    read_posted: float = 0.0
    posted_seen: float = 0.0
    """When prefill's ``kv_posted`` came (push, protocol 2)."""
    prefill_clock: tuple[float, float] = (0.0, 0.0)
    """``kv_posted``'s clock readings (compute end, last post): kept when ``kv_pushed`` replaces it."""
    requested: float = 0.0
    """When ``kv_request`` was sent."""
    allocated: float = 0.0
    """When ``kv_blocks`` was sent (the destination blocks allocated while prefill computes)."""
    last_renew: float = 0.0
    lease_until: float = 0.0
    """Prefill's lease on the source blocks lasts at least until then (renewals sent in time extend it)."""
    zombie_until: float = 0.0
    return_kv: int = 0
    """Prompt positions whose committed KV the result carries (0: none; see ``kvxfer.disagg.oracle``)."""
    result: GenerationResult | None = None
    """Set once the KV is in place; its tokens follow from the compute thread."""
    tried: set[str] = field(default_factory=set)
    """Prefill addresses this request was sent to (failover sends it to each at most once)."""
    attempt: int = 1
    failover_cause: KvxferError | None = None
    """Why the previous attempt's prefill was left (set on a failover's attempt)."""
    state: JobState = JobState.NEW
    """Where the request is; changed only by ``DecodeWorker._move``."""


class DecodeWorker(WorkerCounts):
    """Serves requests with KV from a prefill worker; see the module docstring."""

    def __init__(self, config: WorkerConfig, secret: Secret = None, *, prefill: str | Sequence[str] | None = None,
                 bind: str | None = None, mode: str = "push", layerwise: bool = False, layers_per_send: int = 1,
                 transport_options: dict[str, Any] | None = None, versions: tuple[int, int] = SUPPORTED_VERSIONS,
                 connect_timeout: float = 5.0, model: Model | None = None, router: KVRouter | None = None) -> None:
        """``prefill``: one address (connected now; failing raises) or a list of them (each connected now; one
        that cannot be reached keeps reconnecting in the background, a refusal raises, and so does a list
        none of which is reachable). ``model``: an already loaded model (default: ``config.model`` loaded
        on ``config.device``). ``router``: a KV-aware router over (some of) these prefills' addresses;
        requests that name no prefill go where it says (when connected); the worker closes it."""
        if mode not in MODES:
            raise ConfigError(f"DecodeWorker.mode must be one of {MODES}, got {mode!r}")
        if isinstance(layers_per_send, bool) or not isinstance(layers_per_send, int) or layers_per_send <= 0:
            raise ConfigError(f"DecodeWorker.layers_per_send must be an int > 0, got {layers_per_send!r}")
        self.config = config
        self.mode, self.layerwise, self.layers_per_send = mode, layerwise, layers_per_send
        self.versions = versions
        self.connect_timeout = connect_timeout
        self._prefills: dict[str, _Prefill] = {}   # by address, in the order added (engine thread only)
        self._rotation = 0   # rotates the choice among equally loaded prefills
        self.router = router
        self._reconnect_stop = threading.Event()
        self._connect_lock = threading.Lock()
        self._waiting: list[_Job] = []   # requests waiting for a reconnect attempt (engine thread only)
        self._parked: list[_Job] = []   # failover attempts waiting for quarantined pages (engine thread only)
        self._draining = False   # set by drain: new requests fail with WorkerShuttingDown
        self._secret = secret
        self.managers = config.managers()
        self.layouts: list[CacheLayoutDesc] = [m.layout for m in self.managers]
        self.engine = Engine(config.name, self._on_event, self._tick,
                             on_error=lambda reason: self._fail_all(WorkerUnhealthy(f"decode worker unhealthy: "
                                                                                    f"{reason}")))
        self.server: ControlServer | None = None
        self.address: str | None = None
        self._accepting: threading.Thread | None = None
        try:   # a worker that cannot start releases what it took (engine, transport, socket, caches)
            self.model = config.load_model(model)
            self.transport: Transport = make_transport(config, transport_options)
            self.transport.register(all_regions(self.layouts))
            self.transport.on_notification(self.engine.wake)
        except BaseException:
            for m in self.managers:
                m.shutdown()
            if router is not None:
                router.close()
            raise
        self._jobs: dict[str, _Job] = {}
        self._zombies: dict[str, _Job] = {}
        self._generating: dict[str, _Job] = {}   # KV in place, tokens being generated on the compute thread
        self.compute: ComputeThread | None = None
        self.counts = {"requests": 0, "completed": 0, "failed": 0, "cancelled": 0, "integrity_failures": 0,
                       "peer_losses": 0, "bad_notices": 0, "failovers": 0}
        #: Called on the engine thread with each completed request's result (metrics); must not raise.
        self.result_observers: list[Callable[[GenerationResult], None]] = []
        self._ids = itertools.count(1)
        self._id_lock = threading.Lock()
        try:
            self.engine.start()
            self.compute = ComputeThread(config.name, self.engine)
            #: Seconds the model's warm-up took before this worker served (0.0 without one).
            self.warm_up_s = warm_up_model(self.model, config, self.compute)
            if bind is not None:
                identity = LocalIdentity("decode", config.name, self.layouts[0], config.backend, b"",
                                         config.heartbeat_interval)
                self.server = ControlServer(identity, secret, bind=bind, accept_roles=("client",))
                self.address = self.server.address
                self._accepting = threading.Thread(target=self._accept_loop, name=f"kvxfer-accept-{config.name}",
                                                   daemon=True)
                self._accepting.start()
            if isinstance(prefill, str):
                self.connect(prefill)
            elif prefill is not None:
                self._connect_many(list(prefill))
        except BaseException:
            self.close()
            raise

    # --- public -----------------------------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> None:
        """Make the prefill worker at ``address`` this worker's only prefill (the single-prefill API): once
        it is connected, requests in flight with any other (or a previous connection to it) fail and the
        others are dropped. Raises AuthenticationError / HandshakeRefused (with the reason) / ControlTimeout,
        and then changes nothing."""
        self._handshake_and_attach(address, timeout, only=True)

    def add_prefill(self, address: str, timeout: float | None = None) -> None:
        """Connect to one more prefill worker while serving; the next request may go there. Reconnecting to
        an address already known replaces that connection only. Raises like ``connect`` (then nothing is
        added)."""
        self._handshake_and_attach(address, timeout, only=False)

    def remove_prefill(self, address: str) -> bool:
        """Stop using the prefill at ``address``: its requests in flight fail, its connection closes and it
        is no longer reconnected. False when no such prefill is known."""
        return bool(self.engine.call(lambda: self._remove(address, "removed by the caller"), 10.0))

    @property
    def prefills(self) -> list[str]:
        """The known prefill addresses, in the order added (connected or reconnecting)."""
        return list(self._prefills)

    @property
    def prefill_address(self) -> str | None:
        """The first known prefill address (the one prefill of the single-prefill API), or None."""
        return next(iter(self._prefills), None)

    def prefill_load(self) -> dict[str, int]:
        """This worker's requests in flight (KV not yet in place) per connected prefill address."""
        return dict(self.engine.call(lambda: {p.address: self._load(p) for p in self._prefills.values() if p.alive},
                                     10.0))

    @property
    def connected(self) -> bool:
        """Whether at least one prefill peer is connected and alive."""
        return any(p.alive for p in list(self._prefills.values()))

    def _handshake(self, address: str, wait: float) -> tuple[PeerConnection, list[CacheLayoutDesc]]:
        """Open and authenticate a control connection to a prefill and exchange rank layouts."""
        identity = LocalIdentity("decode", self.config.name, self.layouts[0], self.config.backend,
                                 self.transport.metadata(), self.config.heartbeat_interval)
        conn = connect(address, identity, self._secret, timeout=wait, expect_role="prefill", versions=self.versions)
        try:
            conn.send(KvRanks(layouts=encode_layouts(self.layouts)))
            reply = conn.recv(wait)
            if not isinstance(reply, KvRanks):
                raise ProtocolError(f"prefill answered kv_ranks with {reply.kind!r}")
            return conn, decode_layouts(reply.layouts)
        except BaseException:
            conn.close("decode could not finish connecting")
            raise

    def _handshake_and_attach(self, address: str, timeout: float | None, *, only: bool,
                              reconnecting: bool = False) -> None:
        wait = self.connect_timeout if timeout is None else timeout
        # One handshake at a time (reconnect loops run on threads of their own): two handshakes with the same
        # prefill in flight present this transport's metadata twice, which the prefill's NIXL refuses.
        if not self._connect_lock.acquire(timeout=wait + 15.0):
            raise ControlTimeout(f"decode {self.config.name}: another connect to a prefill did not finish within "
                                 f"{wait + 15.0:.1f} s")
        try:
            peer = self._prefills.get(address)
            if peer is not None and peer.alive and (reconnecting or not only or list(self._prefills) == [address]):
                return   # connected meanwhile (a reconnect loop or another caller got there first)
            self._handshake_and_attach_locked(address, wait, only=only, reconnecting=reconnecting)
        finally:
            self._connect_lock.release()

    def _handshake_and_attach_locked(self, address: str, wait: float, *, only: bool, reconnecting: bool) -> None:
        conn, layouts = self._handshake(address, wait)
        try:
            self.engine.call(lambda: self._attach(address, conn, layouts, only=only, reconnecting=reconnecting),
                             wait + 10.0)
        except BaseException:
            conn.close("decode could not finish connecting")
            raise

    def _connect_many(self, addresses: list[str]) -> None:
        """Connect to each address; an unreachable one keeps reconnecting in the background. Raises a refusal
        at once, and the last error when none connected."""
        if not addresses:
            raise ConfigError("DecodeWorker.prefill: the list of prefill addresses is empty")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"DecodeWorker.prefill: duplicate addresses in {addresses}")
        errors: list[KvxferError] = []
        for address in addresses:
            try:
                self.add_prefill(address)
            except HandshakeRefused:
                raise
            except KvxferError as exc:
                log.warning("%s: prefill %s unreachable at start (%s); reconnecting in the background",
                            self.config.name, address, exc)
                errors.append(exc)
                self.engine.call(functools.partial(self._keep_reconnecting, address, exc), 10.0)
        if len(errors) == len(addresses):
            raise errors[-1]

    def submit(self, tokens: npt.ArrayLike, max_new_tokens: int, *, mode: str | None = None,
               layerwise: bool | None = None, request_id: str | None = None,
               return_kv: int = 0, prefill: str | None = None) -> Future[GenerationResult]:
        """Start a request; the future resolves to a GenerationResult or raises why it failed. ``return_kv``:
        the result carries the committed KV of up to that many prompt positions (``GenerationResult.prompt_kv``).
        ``prefill``: the address of the prefill to use (a router's choice; one of ``prefills``), honoured while
        it is connected, else the least loaded connected prefill serves the request."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not ids.size:
            raise CapacityError("submit: the prompt must hold at least one token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise CapacityError(f"submit: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        mode = self.mode if mode is None else mode
        if mode not in MODES:
            raise ConfigError(f"submit: mode must be one of {MODES}, got {mode!r}")
        with self._id_lock:
            rid = request_id or f"{self.config.name}-{next(self._ids)}"
        fut: Future[GenerationResult] = Future()
        t = now()
        job = _Job(request_id=rid, tokens=ids, max_new_tokens=max_new_tokens, mode=mode,
                   layerwise=self.layerwise if layerwise is None else layerwise, future=fut, session=Session(rid),
                   submitted=t, deadline=t + self.config.deadline_s, return_kv=max(0, int(return_kv)),
                   prefer=prefill)
        self.engine.post(Submitted(job))
        return fut

    def generate(self, tokens: npt.ArrayLike, max_new_tokens: int, timeout: float | None = None,
                 **kw: Any) -> GenerationResult:
        """``submit`` and wait for the result."""
        wait = self.config.deadline_s * 2 + 60.0 if timeout is None else timeout
        return self.submit(tokens, max_new_tokens, **kw).result(wait)

    def cancel(self, request_id: str, reason: str = "cancelled by the caller") -> bool:
        """Cancel a request in flight: its future raises RequestCancelled, prefill is told, and its blocks
        are freed once nothing can write into them. False when no such request is in flight."""
        return bool(self.engine.call(lambda: self._cancel(request_id, reason), 10.0))

    @property
    def health(self) -> Health:
        """Whether this worker can be trusted to serve (False after an unexpected error; see ``Health``)."""
        return self.engine.health

    def status(self) -> dict[str, int | float | str]:
        """Slot accounting and counters (what ``worker_status`` answers)."""
        return dict(self.engine.call(self._status, 10.0))

    def _status(self) -> dict[str, int | float | str]:
        return {"role": "decode", "name": self.config.name, **self.engine.health.as_dict(),
                "held_slots": held_slots(self.managers),
                "open_caches": sum(len(m.open_caches) for m in self.managers),
                "jobs": len(self._jobs) + len(self._waiting) + len(self._parked) + len(self._generating),
                "zombies": len(self._zombies), "connected": int(self.connected),
                "prefills": len(self._prefills), "prefills_connected": sum(p.alive for p in self._prefills.values()),
                "draining": int(self._draining), **self.counts}

    def _cancel(self, request_id: str, reason: str) -> bool:
        job = self._jobs.get(request_id) or next((w for w in self._waiting + self._parked
                                                  if w.request_id == request_id), None)
        if job is None:
            return False
        self.counts["cancelled"] += 1
        self._fail(job, RequestCancelled(f"request {request_id}: {reason}"))
        return True

    def drain(self, timeout: float, cancel: threading.Event | None = None) -> bool:
        """Stop taking requests (new ones fail with WorkerShuttingDown) and wait up to ``timeout`` s (less
        once ``cancel`` is set) for those in flight to finish, generation included; True when none is
        left. ``close`` fails the rest."""
        if self.engine.stopping:
            return True
        with contextlib.suppress(KvxferError):
            self.engine.call(lambda: setattr(self, "_draining", True), 10.0)
        deadline = now() + max(0.0, timeout)
        while True:
            try:
                left = int(self.engine.call(lambda: len(self._jobs) + len(self._waiting) + len(self._parked)
                                            + len(self._generating), 10.0))
            except KvxferError:
                return False
            if not left:
                return True
            if now() >= deadline or (cancel is not None and cancel.is_set()):
                log.warning("%s: %d request(s) still in flight after the %.1f s drain", self.config.name, left,
                            timeout)
                return False
            time.sleep(0.02)

    def close(self) -> None:
        """Fail open requests, stop the threads, close connections and the transport."""
        if self.engine.stopping:
            return
        self._reconnect_stop.set()
        stopping = WorkerShuttingDown(f"decode worker {self.config.name} shutting down")
        with contextlib.suppress(KvxferError):
            self.engine.call(lambda: self._fail_all(stopping), 10.0)
        peers = list(self._prefills.values())
        for peer in peers:
            peer.stop.set()
        for peer in peers:
            reconnecting = peer.reconnecting
            if reconnecting is not None:   # bounded by connect_timeout; it attaches through the engine
                reconnecting.join(self.connect_timeout + 15.0)
        if self.server is not None:
            self.server.close("decode worker shutting down")
        for peer in peers:
            if peer.conn is not None:
                peer.conn.close("decode worker shutting down")
        self.engine.stop()
        if self.compute is not None:
            self.compute.stop()   # the generation in progress finishes; the engine no longer answers it
        for job in list(self._generating.values()):
            self._close_caches(job)
            if not job.future.done():
                job.future.set_exception(stopping)
        self._generating.clear()
        if self._accepting is not None:
            self._accepting.join(5.0)
        self.transport.close()
        if self.router is not None:
            self.router.close()
        for m in self.managers:
            m.shutdown()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- engine thread ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self.server is not None
        accept_loop(self.engine, self.server)

    def _attach(self, address: str, conn: PeerConnection, layouts: list[CacheLayoutDesc], *, only: bool,
                reconnecting: bool) -> None:
        """Use a freshly handshaken connection for the prefill at ``address`` (engine thread)."""
        windowed = any(lg.window is not None for lg in self.layouts[0].layer_groups)
        src_tpb, dst_tpb = layouts[0].tokens_per_block, self.layouts[0].tokens_per_block
        if windowed and src_tpb % dst_tpb:
            raise LayoutMismatch(f"sliding-window layers need prefill's tokens_per_block ({src_tpb}) to be a multiple "
                                 f"of decode's ({dst_tpb}): otherwise decode keeps window blocks prefill has freed")
        peer = self._prefills.get(address)
        if reconnecting and (peer is None or peer.stop.is_set()):
            raise PeerUnreachable(f"prefill {address} was removed while decode reconnected to it")
        name = conn.peer.name
        for other in self._prefills.values():
            if other.address != address and other.alive and not only and other.conn is not None \
                    and other.conn.peer.name == name:
                raise ConfigError(f"prefill at {address} calls itself {name!r} like the one at {other.address}: "
                                  f"prefill workers of one decode need distinct names")
        if only:
            for other in [p for p in self._prefills.values() if p.address != address]:
                self._remove(other.address, "replaced by a new prefill connection")
        if peer is None:
            peer = self._prefills[address] = _Prefill(address)
        peer.stop.clear()
        peer.draining = False
        old = peer.conn
        if old is not None:
            self._on_prefill_lost(old, "replaced by a new prefill connection", reconnect=False)
            old.close("replaced by a new prefill connection")
        self.transport.connect(name, conn.peer.metadata)
        peer.conn, peer.layouts, peer.reconnect_error = conn, layouts, ""
        self.engine.read(conn)

    def _remove(self, address: str, reason: str) -> bool:
        """Drop a prefill peer: stop its reconnect loop, fail its requests, close its connection."""
        peer = self._prefills.pop(address, None)
        if peer is None:
            return False
        peer.stop.set()
        if peer.conn is not None:
            self._on_prefill_lost(peer.conn, reason, reconnect=False, peer=peer)
        return True

    def _peer_of(self, conn: PeerConnection) -> _Prefill | None:
        return next((p for p in self._prefills.values() if p.conn is conn), None)

    def _load(self, peer: _Prefill) -> int:
        conn = peer.conn
        return sum(1 for j in self._jobs.values() if j.conn is conn)

    def _on_event(self, ev: Event) -> None:
        match ev:
            case Submitted(job=job):
                self._start(job)
            case Computed(job=job, value=value, error=error):
                self._generated(job, value, error)
            case Reconnected():
                self._reconnected(ev)
            case Lost(conn=conn, reason=reason):
                self._on_prefill_lost(conn, reason)
            case Received(conn=conn, message=msg):
                try:
                    if conn.peer.role == "client":
                        self._on_client(conn, msg)
                    elif self._peer_of(conn) is not None:
                        self._on_prefill(conn, msg)
                except KvxferError as exc:   # the peer broke the protocol: end its connection, keep serving others
                    log.warning("%s: %s sent a bad %s: %s", self.config.name, conn.peer.name, msg.kind, exc)
                    conn.close(f"protocol error: {exc}")
                    self._on_prefill_lost(conn, f"protocol error: {exc}")
            case _:
                raise TypeError(f"decode worker {self.config.name}: no handler for a {type(ev).__name__} event")

    def _on_client(self, conn: PeerConnection, msg: ControlMessage) -> None:
        match msg:
            case WorkerStatus():
                with contextlib.suppress(KvxferError):
                    conn.send(WorkerStatusReply(stats=encode_stats(self._status())))
            case GenerateCancel(request_id=client_rid, reason=reason):
                rid = f"{conn.peer.name}/{client_rid}"
                owner = self._jobs.get(rid) or next((w for w in self._waiting + self._parked if w.request_id == rid),
                                                    None)
                if owner is not None and owner.reply is conn:   # a client cancels only what it submitted itself
                    self._cancel(rid, reason or "cancelled by the client")
            case Generate():
                rid = f"{conn.peer.name}/{msg.request_id}"
                t = now()
                job = _Job(request_id=rid, tokens=np.asarray(msg.tokens, dtype=np.int64),
                           max_new_tokens=msg.max_new_tokens, mode=msg.mode or self.mode,
                           layerwise=msg.layerwise or self.layerwise, future=Future(), session=Session(rid),
                           submitted=t, deadline=t + self.config.deadline_s, reply=conn,
                           client_request_id=msg.request_id, return_kv=msg.return_kv)
                if not job.tokens.size:
                    self._reply_failed(job, CapacityError("the prompt must hold at least one token"))
                    return
                self._start(job)
            case _:
                raise ProtocolError(f"unexpected message {msg.kind!r} from a client")

    def _start(self, job: _Job) -> None:
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

    def _keep_reconnecting(self, address: str, error: KvxferError) -> None:
        """Know ``address`` as a prefill that could not be reached, and retry it in the background."""
        if address not in self._prefills:
            self._prefills[address] = _Prefill(address)
        peer = self._prefills[address]
        peer.reconnect_error = f"; reconnecting failed: {type(error).__name__}: {error}"
        if peer.reconnecting is None and not self._reconnect_stop.is_set():
            self._start_reconnecting(peer, first_failed=True)

    def _start_reconnecting(self, peer: _Prefill, *, first_failed: bool = False) -> None:
        """Reconnect to the known prefill address (a restarted prefill) on a thread of its own, so the
        engine keeps serving ``cancel``, ``status`` and other requests, until it succeeds or the worker
        closes. Each attempt ends with a ``reconnected`` event. After a failed attempt the next follows
        in ``RECONNECT_PAUSE_S``, and ZeroMQ retries the TCP connection every 0.1 s within an attempt, so
        a prefill listening again is found within a fraction of a second (requests arriving meanwhile
        fail at once with the last attempt's reason). A refusal (wrong secret, incompatible layout) ends
        the loop: the next request starts it again. Each prefill peer has its own loop."""
        if not first_failed:
            peer.reconnect_error = ""
        address = peer.address

        def stopped() -> bool:
            return self._reconnect_stop.is_set() or peer.stop.is_set()

        def run() -> None:
            while not stopped() and not peer.alive:
                error: KvxferError | None = None
                started = now()
                try:
                    self._handshake_and_attach(address, min(self.connect_timeout, RECONNECT_ATTEMPT_S), only=False,
                                               reconnecting=True)
                except KvxferError as exc:
                    error = exc
                except Exception as exc:   # reported to the waiting requests, not lost
                    error = PeerUnreachable(f"{type(exc).__name__}: {exc}")
                last = error is None or isinstance(error, HandshakeRefused) or stopped()
                with contextlib.suppress(KvxferError):
                    self.engine._post_internal(Reconnected(peer, error, started, last))
                if last:
                    return
                peer.stop.wait(RECONNECT_PAUSE_S)
            with contextlib.suppress(KvxferError):
                self.engine._post_internal(Reconnected(peer, None, now(), True))

        peer.reconnecting = threading.Thread(target=run, name=f"kvxfer-reconnect-{self.config.name}", daemon=True)
        peer.reconnecting.start()

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

    def _pick(self, job: _Job) -> _Prefill | None:
        """The prefill for a request: the caller's choice when connected, else the least loaded (rotating
        among equals); never one the request was sent to before, nor a stopping one while another is
        connected; None when none is connected."""
        live = [p for p in self._prefills.values() if p.alive and p.address not in job.tried]
        live = [p for p in live if not p.draining] or live
        if not live:
            return None
        prefer = job.prefer
        if prefer is None and self.router is not None and self.router.workers:
            job.route = self.router.route(job.tokens)
            prefer = job.route.address
        if prefer is not None:
            chosen = self._prefills.get(prefer)
            if chosen is not None and chosen in live:
                return chosen
        self._rotation += 1
        n = len(live)
        order = {id(p): (i - self._rotation) % n for i, p in enumerate(live)}
        return min(live, key=lambda p: (self._load(p), order[id(p)]))

    def _no_prefill_reason(self) -> str:
        reasons = [p.reconnect_error for p in self._prefills.values() if p.reconnect_error]
        if len(self._prefills) <= 1:
            return reasons[0] if reasons else ""
        return "".join(f"; {p.address}{p.reconnect_error or ': not connected'}" for p in self._prefills.values())

    def _begin(self, job: _Job) -> None:
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
        job.tried.add(peer.address)
        self._move(job, JobState.REQUESTED)
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
        job.last_renew = job.requested = now()
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
                self._send(job, KvCancel(request_id=job.request_id, reason=f"decode could not allocate: {exc}"[:1000]))
            self._fail(job, self._after_failover(job, exc))

    def _allocate(self, job: _Job) -> None:
        """The request's destination caches on every rank, matched against the prefix tree (``job.skip``:
        the tokens decode already holds). Raises OutOfSlotsError / CacheStateError, leaving what it
        opened in ``job.caches`` for the caller to close."""
        # A failover's pages may still be held by its earlier attempt (quarantined): each attempt has its own.
        base = job.request_id if job.attempt == 1 else f"{job.request_id}~{job.attempt}"
        for i, m in enumerate(self.managers):
            job.caches.append(m.create_kv_cache_for_prompt(job.tokens, id=f"{base}/{i}"))
        for cache in job.caches:
            if not cache.resume():
                raise OutOfSlotsError(f"decode cache {cache.id}: no free slot for copy-on-write")
        reused = {c.num_reused_tokens for c in job.caches}
        if len(reused) != 1:
            raise CacheStateError(f"decode ranks reused different prefixes: {sorted(reused)} tokens")
        job.skip = reused.pop()
        for m, cache in zip(self.managers, job.caches, strict=True):
            if not cache.resize(int(job.tokens.size)):
                raise OutOfSlotsError(f"decode cache {cache.id}: no free slots for {job.tokens.size} tokens "
                                      f"({m.num_free_slots()} free)")

    @staticmethod
    def _after_failover(job: _Job, exc: KvxferError) -> KvxferError:
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

    def _on_prefill(self, conn: PeerConnection, msg: ControlMessage) -> None:
        if not isinstance(msg, KvPosted | KvPushed | KvPull | KvFailed):
            raise ProtocolError(f"unexpected message {msg.kind!r} from the prefill worker")
        rid = msg.request_id
        zombie = self._zombies.get(rid)
        if zombie is not None and zombie.conn is conn:
            match msg:
                case KvFailed():
                    self._bury(zombie)   # prefill will not write there any more
                case KvPushed() if zombie.read is None:
                    self._bury(zombie)
                case KvPull():
                    self._send_on(conn, KvRelease(request_id=rid))
            return
        generating = self._generating.get(rid)
        if isinstance(msg, KvPushed) and generating is not None and generating.conn is conn \
                and generating.result is not None:   # taken at kv_posted: prefill's copy time, for the result
            generating.result = replace(generating.result, transfer_s=msg.transfer_s, transfer_by_prefill=True)
            return
        job = self._jobs.get(rid)
        if job is None or job.conn is not conn or job.session.state is not SessionState.TRANSFERRING:
            if isinstance(msg, KvPull):
                self._send_on(conn, KvRelease(request_id=rid))
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
                    if self._retry(job, error):
                        return
                self._fail(job, error, remote_done=True)

    def _read(self, job: _Job, msg: KvPull) -> None:
        """Pull: read the request's KV from where prefill says it is (within prefill's lease)."""
        rid = job.request_id
        src_ids = decode_block_ids(msg.blocks, len(job.src_layouts), "kv_pull.blocks")
        if now() >= job.lease_until:
            self._send(job, KvRelease(request_id=rid))
            self._fail(job, TransferFailed(f"pull of request {rid}: prefill's {self.config.lease_s} s lease may "
                                           f"have expired before decode could read (decode stalled)"),
                       remote_done=True)
            return
        try:
            plan = plan_between(job.src_layouts, src_ids, self.layouts, job.caches,
                                token_range=(job.skip, int(job.tokens.size)), request_id=rid,
                                planner=self.config.planner)
            check_writable(plan.dst, self.layouts, job.caches)   # never read into a page we share
            job.read_posted = now()
            job.read = self.transport.read(job.peer, plan, f"{rid}#1".encode())
            job.read.add_done_callback(self.engine.wake)
        except KvxferError as exc:
            self._send(job, KvRelease(request_id=rid))
            self._fail(job, exc)

    def _tick(self) -> float:
        t = now()
        for peer, notes in self.transport.notifications().items():
            for note in notes:
                self._on_notice(peer, note)
        polled = self.transport.notifications_need_polling
        due = t + 1.0
        busy = False
        for job in list(self._jobs.values()):
            if job.session.state is not SessionState.TRANSFERRING:
                continue
            # Poll only for what cannot wake us: transfers that complete when polled, and a backend that
            # delivers notifications (and, for NIXL, finishes the peer's writes to us) only when polled.
            busy = busy or polled or (job.read is not None and job.read.completes_when_polled)
            if job.read is not None:
                status = job.read.status
                if status is TransferStatus.DONE:
                    self._send(job, KvRelease(request_id=job.request_id))
                    if t >= job.lease_until:   # prefill may have reused the pages before the read ended
                        self._fail(job, TransferFailed(
                            f"pull of request {job.request_id}: prefill's {self.config.lease_s} s lease may have "
                            f"expired before the read completed (decode stalled {t - job.last_renew:.1f} s); "
                            f"the data is not used"), remote_done=True)
                        continue
                    self._arrived(job, now() - job.read_posted)
                    continue
                if status.terminal:
                    self._send(job, KvRelease(request_id=job.request_id))
                    self._fail(job, TransferFailed(f"read of request {job.request_id}: {job.read.reason}"))
                    continue
            elif isinstance(job.pushed, KvPosted | KvPushed) and len(job.parts) >= job.pushed.parts:
                # kv_posted: prefill has not seen its writes complete yet; the notifications say they landed.
                self._arrived(job, job.pushed.transfer_s if isinstance(job.pushed, KvPushed)
                              else max(0.0, now() - job.posted_seen))
                continue
            if t >= job.deadline:
                self._fail(job, TransferTimeout(self._late(job)))
            elif t - job.last_renew >= self.config.lease_s / 3:
                if t < job.lease_until:   # renewals only extend a lease that has not run out
                    job.lease_until = t + self.config.lease_s
                job.last_renew = t
                self._send(job, LeaseRenew(request_id=job.request_id))
            due = min(due, job.deadline, job.last_renew + self.config.lease_s / 3)
        for zombie in list(self._zombies.values()):
            if zombie.read is not None and zombie.read.done():
                self._bury(zombie)
            elif t >= zombie.zombie_until:
                log.info("%s: freeing blocks of %s without prefill's confirmation (its lease has run out)",
                         self.config.name, zombie.request_id)
                self._bury(zombie)
            else:
                due = min(due, zombie.zombie_until if zombie.read is None or not zombie.read.completes_when_polled
                          else t + 0.001)
        for job in [j for j in self._parked if t >= j.deadline]:
            self._fail(job, self._after_failover(job, TransferTimeout(
                f"request {job.request_id}: its {self.config.deadline_s} s deadline passed while it waited for "
                f"decode's pages")))
        due = min([due, *(j.deadline for j in self._parked)])
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
            job = self._jobs.get(notice.request_id)
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
        job = self._jobs.get(rid)
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

    def _posted(self, job: _Job, msg: KvPosted) -> None:
        """Prefill posted every write of ``job`` (``kv_posted``, or a notice's summary)."""
        job.pushed, job.posted_seen = msg, now()
        job.prefill_clock = (msg.computed_at, msg.posted_at)

    def _late(self, job: _Job) -> str:
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

    def _verify(self, job: _Job) -> None:
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

    def _arrived(self, job: _Job, transfer_s: float) -> None:
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
                self._fail(job, error, remote_done=True)   # uncommitted: none of its pages enter the tree
                return
        arrived = now()
        # The first token (prefill's) is known and its KV is in place, verified: a streaming server would send
        # it now, as a one-process engine sends its first token before it commits the prompt into its cache.
        ttft = arrived - job.submitted
        job.session.done("KV in place")
        self._route_done(job)
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
            self.counts["failed"] += 1
            self._move(job, JobState.FAILED)
            self._close_caches(job)
            self._resolve_error(job, exc)
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

        assert self.compute is not None
        self._move(job, JobState.GENERATING)
        self.compute.submit(job, run)

    def _generated(self, job: _Job, tokens: list[int] | None, error: BaseException | None) -> None:
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

    def _prompt_kv(self, job: _Job) -> PromptKV:
        """The committed prompt KV at up to ``job.return_kv`` positions, read through decode's own pages and
        block ids (not through any transfer plan): what the KV oracle compares with a reference."""
        c = self.config.model.kv_spec
        positions = positions_within(int(job.tokens.size), job.return_kv, c, seed=int(job.tokens.size))
        return read_prompt_kv(list(zip(self.managers, job.caches, strict=True)), positions, c.num_layers,
                              c.num_kv_heads, c.head_dim)

    # --- request states ---------------------------------------------------------------------------
    def _move(self, job: _Job, state: JobState) -> None:
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

    # --- failure ----------------------------------------------------------------------------------
    def _fail(self, job: _Job, error: KvxferError, *, remote_done: bool = False, quarantine_until: float = 0.0) -> None:
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
            self._send(job, KvCancel(request_id=job.request_id, reason=str(error)[:1000]))
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

    def _route_done(self, job: _Job) -> None:
        """The request no longer waits on its prefill: it stops counting as load at the router."""
        route, job.route = job.route, None
        if route is not None and self.router is not None:
            self.router.finished(route)

    def _bury(self, job: _Job) -> None:
        self._move(job, JobState.FREED)
        self._close_caches(job)
        if self._parked:
            self._unpark()

    def _resolve_error(self, job: _Job, error: KvxferError) -> None:
        if not job.future.done():
            job.future.set_exception(error)
        self._reply_failed(job, error)

    def _reply_failed(self, job: _Job, error: KvxferError) -> None:
        if job.reply is not None:
            with contextlib.suppress(KvxferError):
                job.reply.send(GenerateFailed(request_id=job.client_request_id, error=type(error).__name__[:64],
                                              reason=str(error)[:1024]))

    def _close_caches(self, job: _Job) -> None:
        for cache in job.caches:
            with contextlib.suppress(KvxferError):
                cache.close()
        job.caches = []

    def _on_prefill_lost(self, conn: PeerConnection, reason: str, *, reconnect: bool = True,
                         peer: _Prefill | None = None) -> None:
        """Fail the lost prefill's requests. Pushed-to blocks are quarantined, not freed: a prefill that is
        only frozen or cut off may still write until its lease runs out (it checks before each write, but a
        write posted just before the loss can land later), so they stay held until the lease plus one more
        lease period (for writes already posted) has passed. Pull destinations are ours to free once our
        read is stopped."""
        peer = peer if peer is not None else self._peer_of(conn)
        if peer is None or peer.conn is not conn:
            return
        peer.conn = None
        self.counts["peer_losses"] += 1
        conn.close(f"prefill lost: {reason}"[:1000])   # ends the client endpoint and its I/O thread
        if reconnect and peer.reconnecting is None and not peer.stop.is_set() and not self._reconnect_stop.is_set():
            self._start_reconnecting(peer)
        name = conn.peer.name
        what = reason if reason.startswith(f"prefill {name!r}") else f"prefill {name!r} lost: {reason}"
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
        if not any(p.alive and p.conn is not None and p.conn.peer.name == name for p in self._prefills.values()):
            self.transport.disconnect(name)

    def _retry(self, job: _Job, error: KvxferError, *, quarantine_until: float = 0.0) -> bool:
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
        self._begin(_Job(request_id=job.request_id, tokens=job.tokens, max_new_tokens=job.max_new_tokens,
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

    def _send(self, job: _Job, message: ControlMessage) -> None:
        """Send to the prefill a request went to, over the connection it went over (if still up)."""
        if job.conn is not None:
            self._send_on(job.conn, message)

    def _send_on(self, conn: PeerConnection, message: ControlMessage) -> None:
        if conn.alive:
            with contextlib.suppress(KvxferError):
                conn.send(message)
