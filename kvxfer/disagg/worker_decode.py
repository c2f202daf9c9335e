"""DecodeWorker: takes requests (Python API or ``generate`` from clients), gets their KV from one of its
prefill workers and continues generation.

Prefill peers (xPyD): a decode worker holds any number of prefill connections, one per address, each with
its own automatic reconnect. Each request goes to the prefill the caller names (a router's choice) when
that one is connected, else to the connected prefill with the fewest of this worker's requests in flight
(ties rotate). A request whose prefill is lost, removed or stopping before its KV arrived goes to another
connected prefill (failover, ``DecodeRequests.retry``); it fails only when none can take it. The others keep serving,
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
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.disagg.control import ControlServer, PeerConnection, Secret
from kvxfer.disagg.decode_jobs import (
    JOB_TRANSITIONS,
    DecodeJob,
    GenerationResult,
    JobState,
    JobTable,
    check_move,
    one_host_landing_s,
)
from kvxfer.disagg.decode_peers import RECONNECT_ATTEMPT_S, RECONNECT_PAUSE_S, PrefillPeer, PrefillPeers
from kvxfer.disagg.decode_receive import DecodeReceive
from kvxfer.disagg.decode_requests import DecodeRequests
from kvxfer.disagg.handshake import LocalIdentity
from kvxfer.disagg.messages import (
    MODES,
    SUPPORTED_VERSIONS,
    ControlMessage,
    Generate,
    GenerateCancel,
    WorkerStatus,
    WorkerStatusReply,
)
from kvxfer.disagg.router import KVRouter
from kvxfer.disagg.session import Session
from kvxfer.disagg.worker import (
    Computed,
    ComputeThread,
    Engine,
    Event,
    Lost,
    Received,
    Reconnected,
    Submitted,
    WorkerBase,
    WorkerConfig,
    all_regions,
    make_transport,
    now,
    release_managers,
    warm_up_model,
)
from kvxfer.disagg.worker_protocol import encode_stats
from kvxfer.errors import (
    CapacityError,
    ConfigError,
    KvxferError,
    ProtocolError,
    WorkerShuttingDown,
    WorkerUnhealthy,
)
from kvxfer.model import Model
from kvxfer.transport import Transport

log = logging.getLogger("kvxfer.disagg.decode")

__all__ = ["JOB_TRANSITIONS", "RECONNECT_ATTEMPT_S", "RECONNECT_PAUSE_S", "DecodeJob", "DecodeWorker",
           "GenerationResult", "JobState", "PrefillPeer", "check_move", "one_host_landing_s"]


class DecodeWorker(WorkerBase):
    """Serves requests with KV from a prefill worker; see the module docstring. It owns its concerns as
    parts, each built here with only what it needs: ``peers`` (``PrefillPeers``, decode_peers.py: the
    prefill connections), ``jobs`` (``JobTable``, decode_jobs.py: every live request by state),
    ``requests`` (``DecodeRequests``, decode_requests.py: the lifecycle) and ``receive``
    (``DecodeReceive``, decode_receive.py: how the KV arrives). The worker itself holds the public API,
    the engine's event dispatch and the client messages."""

    role = "decode"

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
        self.router = router
        self._draining = False   # set by drain: new requests fail with WorkerShuttingDown
        self.managers = config.managers()
        self.layouts: list[CacheLayoutDesc] = [m.layout for m in self.managers]
        self.engine = Engine(config.name, self._on_event, self._tick,
                             on_error=lambda reason: self.requests.fail_all(WorkerUnhealthy(
                                 f"decode worker unhealthy: {reason}")))
        self.server: ControlServer | None = None
        self.address: str | None = None
        self._accepting: threading.Thread | None = None
        try:   # a worker that cannot start releases what it took (engine, transport, socket, caches)
            self.model = config.load_model(model)
            self.transport: Transport = make_transport(config, transport_options)
            self.transport.register(all_regions(self.layouts))
            self.transport.on_notification(self.engine.wake)
        except BaseException:
            release_managers(self.managers)
            if router is not None:
                router.close()
            raise
        self.compute: ComputeThread | None = None
        self.counts = {"requests": 0, "completed": 0, "failed": 0, "cancelled": 0, "integrity_failures": 0,
                       "peer_losses": 0, "bad_notices": 0, "failovers": 0}
        #: Called on the engine thread with each completed request's result (metrics); must not raise.
        self.result_observers: list[Callable[[GenerationResult], None]] = []
        self._ids = itertools.count(1)
        self._id_lock = threading.Lock()
        self.jobs = JobTable()
        self.peers = PrefillPeers(config, self.engine, self.transport, self.layouts, secret, versions=versions,
                                  connect_timeout=connect_timeout, router=router, counts=self.counts,
                                  load=self.jobs.load,
                                  on_requests_lost=lambda conn, what: self.requests.requests_lost(conn, what))
        self.requests = DecodeRequests(config, self.managers, self.jobs, self.peers, layers_per_send=layers_per_send,
                                       counts=self.counts, result_observers=self.result_observers,
                                       draining=lambda: self._draining, on_unhealthy=self.engine.mark_unhealthy,
                                       submit=self._generate_on_compute)
        self.receive = DecodeReceive(config, self.managers, self.layouts, self.model, self.transport, self.jobs,
                                     self.requests, counts=self.counts, wake=self.engine.wake)
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
                self._accepting = self._start_accepting()
            if isinstance(prefill, str):
                self.connect(prefill)
            elif prefill is not None:
                self.peers.connect_many(list(prefill))
        except BaseException:
            self.close()
            raise

    # --- prefill peers ------------------------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> None:
        """Make the prefill worker at ``address`` this worker's only prefill (the single-prefill API): once
        it is connected, requests in flight with any other (or a previous connection to it) fail and the
        others are dropped. Raises AuthenticationError / HandshakeRefused (with the reason) / ControlTimeout,
        and then changes nothing."""
        self.peers.connect(address, timeout)

    def add_prefill(self, address: str, timeout: float | None = None) -> None:
        """Connect to one more prefill worker while serving; the next request may go there. Reconnecting to
        an address already known replaces that connection only. Raises like ``connect`` (then nothing is
        added)."""
        self.peers.add(address, timeout)

    def remove_prefill(self, address: str) -> bool:
        """Stop using the prefill at ``address``: its requests in flight fail, its connection closes and it
        is no longer reconnected. False when no such prefill is known."""
        return self.peers.remove(address)

    @property
    def prefills(self) -> list[str]:
        """The known prefill addresses, in the order added (connected or reconnecting)."""
        return self.peers.addresses

    @property
    def prefill_address(self) -> str | None:
        """The first known prefill address (the one prefill of the single-prefill API), or None."""
        return next(iter(self.peers.addresses), None)

    def prefill_load(self) -> dict[str, int]:
        """This worker's requests in flight (KV not yet in place) per connected prefill address."""
        return self.peers.load_by_address()

    @property
    def connected(self) -> bool:
        """Whether at least one prefill peer is connected and alive."""
        return self.peers.connected

    # --- requests -----------------------------------------------------------------------------------
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
        job = DecodeJob(request_id=rid, tokens=ids, max_new_tokens=max_new_tokens, mode=mode,
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
        return bool(self.engine.call(lambda: self.requests.cancel(request_id, reason), 10.0))

    # --- what the worker says about itself, and how it ends -----------------------------------------
    def _own_status(self) -> dict[str, int | float | str]:
        return {"jobs": self._in_flight(), "zombies": len(self.jobs.quarantined), "connected": int(self.connected),
                "prefills": len(self.peers.addresses), "prefills_connected": self.peers.num_connected,
                **self.counts}

    def _in_flight(self) -> int:
        return self.jobs.in_flight()

    def close(self) -> None:
        """Fail open requests, stop the threads, close connections and the transport."""
        if self.engine.stopping:
            return
        self.peers.stop_reconnecting()
        stopping = WorkerShuttingDown(f"decode worker {self.config.name} shutting down")
        with contextlib.suppress(KvxferError):
            self.engine.call(lambda: self.requests.fail_all(stopping), 10.0)
        self.peers.end_reconnects()
        if self.server is not None:
            self.server.close("decode worker shutting down")
        self.peers.close_connections("decode worker shutting down")
        self.engine.stop()
        if self.compute is not None:
            self.compute.stop()   # the generation in progress finishes; the engine no longer answers it
        self.requests.abandon_generating(stopping)
        if self._accepting is not None:
            self._accepting.join(5.0)
        self.transport.close()
        if self.router is not None:
            self.router.close()
        release_managers(self.managers)

    # --- engine thread ------------------------------------------------------------------------------
    def _generate_on_compute(self, job: DecodeJob, run: Callable[[], list[int]]) -> None:
        """Hand a request's generation to the compute thread (its tokens come back as a ``Computed``)."""
        assert self.compute is not None
        self.compute.submit(job, run)

    def _tick(self) -> float:
        return min(self.receive.tick(), self.requests.tick())

    def _on_event(self, ev: Event) -> None:
        match ev:
            case Submitted(job=job):
                self.requests.start(job)
            case Computed(job=job, value=value, error=error):
                self.requests.generated(job, value, error)
            case Reconnected(started=started):
                self.peers.reconnected(ev)
                self.requests.reconnected(started)
            case Lost(conn=conn, reason=reason):
                self.peers.lost(conn, reason)
            case Received(conn=conn, message=msg):
                self._received(conn, msg, lambda: self._on_message(conn, msg))
            case _:
                raise TypeError(f"decode worker {self.config.name}: no handler for a {type(ev).__name__} event")

    def _on_message(self, conn: PeerConnection, msg: ControlMessage) -> None:
        if conn.peer.role == "client":
            self._on_client(conn, msg)
        elif self.peers.peer_of(conn) is not None:
            self.receive.on_prefill(conn, msg)

    def _on_protocol_error(self, conn: PeerConnection, reason: str) -> None:
        self.peers.lost(conn, reason)

    def _on_client(self, conn: PeerConnection, msg: ControlMessage) -> None:
        match msg:
            case WorkerStatus():
                with contextlib.suppress(KvxferError):
                    conn.send(WorkerStatusReply(stats=encode_stats(self._status())))
            case GenerateCancel(request_id=client_rid, reason=reason):
                rid = f"{conn.peer.name}/{client_rid}"
                owner = self.jobs.cancellable(rid)
                if owner is not None and owner.reply is conn:   # a client cancels only what it submitted itself
                    self.requests.cancel(rid, reason or "cancelled by the client")
            case Generate():
                rid = f"{conn.peer.name}/{msg.request_id}"
                t = now()
                job = DecodeJob(request_id=rid, tokens=np.asarray(msg.tokens, dtype=np.int64),
                                max_new_tokens=msg.max_new_tokens, mode=msg.mode or self.mode,
                                layerwise=msg.layerwise or self.layerwise, future=Future(), session=Session(rid),
                                submitted=t, deadline=t + self.config.deadline_s, reply=conn,
                                client_request_id=msg.request_id, return_kv=msg.return_kv)
                if not job.tokens.size:
                    self.requests.reply_failed(job, CapacityError("the prompt must hold at least one token"))
                    return
                self.requests.start(job)
            case _:
                raise ProtocolError(f"unexpected message {msg.kind!r} from a client")
