"""What prefill and decode workers share: configuration, tensor-parallel rank sets, the layer-wise write
hook, and the single engine thread that owns a worker's cache and model.

A worker holds one or more tensor-parallel ranks in one process (one KVCacheManager each) and one
transport that registers every rank's pools, in rank order; cross-rank transfer plans come from
``kvxfer.extractor.multirank`` (``plan_between``, ``all_regions``, ``region_offsets``).
"""

from __future__ import annotations

import abc
import contextlib
import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import numpy as np
import torch

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.control import ControlServer, PeerConnection
from kvxfer.disagg.health import HealthState
from kvxfer.disagg.messages import ControlMessage
from kvxfer.errors import (
    CacheStateError,
    CapacityError,
    ConfigError,
    ControlTimeout,
    KvxferError,
    OutOfSlotsError,
    SessionError,
    WorkerUnhealthy,
)
from kvxfer.extractor import TemplateCache, multirank
from kvxfer.extractor.multirank import all_regions as all_regions  # the workers' planning helpers
from kvxfer.extractor.multirank import region_offsets as region_offsets
from kvxfer.model import KVSpec, Model, ModelSource, PagedKV, preset
from kvxfer.pagetable import PhasedPlan, TransferPlan
from kvxfer.transport import Transport, create
from kvxfer.transport.integrity import ChecksumPolicy

log = logging.getLogger("kvxfer.disagg.worker")


class Planner(Protocol):
    """What builds a worker's transfer plans (``WorkerConfig.planner``): ``plan_between``'s arguments, plus the
    request the plan is for."""

    def __call__(self, src_layouts: Sequence[CacheLayoutDesc], src_ids: Sequence[Any],
                 dst_layouts: Sequence[CacheLayoutDesc], dst_ids: Sequence[Any], *, token_range: tuple[int, int],
                 layers: Sequence[int] | None = None, dst_committed: Sequence[int | None] | None = None,
                 request_id: str = "") -> TransferPlan: ...


@dataclass(frozen=True)
class WorkerConfig:
    """One worker: its model, cache shape, tensor-parallel ranks held here, transport and deadlines."""

    name: str
    model: ModelSource = field(default_factory=lambda: preset("tiny"))
    """The model: a reference ``ModelConfig``, ``kvxfer.model.hf.HFSource``, any ``ModelSource``, or a
    loaded ``Model``; the worker builds its caches from ``model.kv_spec`` and loads it on ``device``."""
    tokens_per_block: int = 16
    num_blocks: int = 512
    head_order: str = "HND"
    tp_size: int = 1
    device: str = "cpu"
    backend: str = "loopback"
    lease_s: float = 10.0
    """How long prefill holds a request's source blocks without a renewal from decode."""
    deadline_s: float = 30.0
    """How long decode waits for one request's KV (reply + data) before failing it."""
    heartbeat_interval: float = 0.5
    chunk_size: int | None = None
    """Prefill chunk size in tokens (None: the whole prompt in one forward)."""
    checksum: ChecksumPolicy | None = None
    """Decode: verify each request's pages against a blake3 digest from prefill before committing them
    (None: no checksum). Prefill follows what each decode peer asks for."""
    prepare_writes: bool = True
    """Prefill, push: prepare the write's early plan while the model computes (``Transport.prepare``), so the
    post at the compute's end is one launch; False writes the plan then (the A/B of ``bench e2e``)."""
    warm_up: bool = True
    """Run one short generation on the compute thread before serving (``warm_up_model``, on scratch caches):
    a GPU process's first forward sets up cuBLAS and loads kernels (over half a second on an H100),
    which no request should wait for."""
    planner: Planner | None = None
    """Builds the worker's transfer plans; None: ``kvxfer.extractor.multirank.plan_between``. Tests pass a
    planner that injects pairing bugs, to prove that the checks (KV oracle, ``--checksum full``) catch them."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "num_blocks", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"WorkerConfig.{name} must be an int > 0, got {v!r}")
        for name in ("lease_s", "deadline_s", "heartbeat_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1e6:
                raise ConfigError(f"WorkerConfig.{name} must be a number of seconds in (0, 1e6), got {v!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size <= 0):
            raise ConfigError(f"WorkerConfig.chunk_size must be None or an int > 0, got {self.chunk_size!r}")
        if not isinstance(self.model, ModelSource):
            raise ConfigError(f"WorkerConfig.model must be a ModelSource (ModelConfig, HFSource, a Model), "
                              f"got {type(self.model).__name__}")
        if self.checksum is not None and not isinstance(self.checksum, ChecksumPolicy):
            raise ConfigError(f"WorkerConfig.checksum must be None or a ChecksumPolicy, got {self.checksum!r}")
        if not isinstance(self.warm_up, bool):
            raise ConfigError(f"WorkerConfig.warm_up must be a bool, got {self.warm_up!r}")
        if self.planner is not None and not callable(self.planner):
            raise ConfigError(f"WorkerConfig.planner must be None or a callable Planner, got {self.planner!r}")

    def managers(self, num_blocks: int | None = None, **options: Any) -> list[KVCacheManager]:
        """One cache manager per tensor-parallel rank held by this worker (``num_blocks`` and ``options``
        of ``CacheConfig`` other than the worker's: the warm-up's scratch caches)."""
        spec = self.model.kv_spec
        blocks = self.num_blocks if num_blocks is None else num_blocks
        return [KVCacheManager(spec.cache_config(self.tokens_per_block, blocks, self.device, head_order=self.head_order,
                                                 tp_rank=r, tp_size=self.tp_size, **options))
                for r in range(self.tp_size)]

    def load_model(self, model: Model | None = None) -> Model:
        """The worker's model: ``model`` when given (its KV shape must be ``self.model``'s), else
        ``self.model`` loaded on ``device``."""
        if model is None:
            return self.model.load(self.device)
        if not isinstance(model, Model):
            raise ConfigError(f"{self.name}: model must be a kvxfer.model.Model, got {type(model).__name__}")
        if model.kv_spec != self.model.kv_spec:
            raise ConfigError(f"{self.name}: the model's KV shape {model.kv_spec} differs from WorkerConfig.model's "
                              f"{self.model.kv_spec}")
        return model


def make_transport(config: WorkerConfig, options: Mapping[str, Any] | None) -> Transport:
    """The worker's transport (not yet registered). NIXL runs with UCX peer-failure handling (a killed
    peer fails transfers instead of taking this process down) and without its own progress thread
    (which spins a core the model needs: the engine polls while transfers are pending, and the model
    runs on another thread), unless ``options`` say otherwise; docs/transport.md has the costs."""
    opts = dict(options or {})
    if config.backend == "nixl":
        opts.setdefault("progress_thread", False)
        opts.setdefault("error_handling", True)
    return create(config.backend, config.name, **opts)


def held_slots(managers: Sequence[KVCacheManager]) -> int:
    """Slots referenced by requests (alone or shared with the prefix tree) over every manager and pool group."""
    total = 0
    for m in managers:
        for pg in range(len(m.layout.pool_groups)):
            acc = m.slot_accounting(pg)
            total += acc.request_only + acc.shared
    return total


def resume_ranks(caches: Sequence[KVCache], role: str) -> int:
    """Resume a request's caches on every rank (copy-on-write of a reused partial block) and return the
    prompt tokens they reused, which must be the same on every rank (OutOfSlotsError / CacheStateError
    naming ``role`` otherwise; the caller closes what it opened)."""
    for cache in caches:
        if not cache.resume():
            raise OutOfSlotsError(f"{role} cache {cache.id}: no free slot for copy-on-write of a reused block")
    reused = {c.num_reused_tokens for c in caches}
    if len(reused) != 1:
        raise CacheStateError(f"{role} ranks reused different prefixes: {sorted(reused)} tokens")
    return reused.pop()


def plan_between(src_layouts: Sequence[CacheLayoutDesc], src_ids: Sequence[Any],
                 dst_layouts: Sequence[CacheLayoutDesc], dst_ids: Sequence[Any], *,
                 token_range: tuple[int, int], layers: Sequence[int] | None = None,
                 dst_committed: Sequence[int | None] | None = None, request_id: str = "",
                 planner: Planner | None = None, templates: TemplateCache | None = None) -> TransferPlan:
    """The plan of one transfer of request ``request_id``: ``planner``'s (the worker's
    ``WorkerConfig.planner``) when given, else ``kvxfer.extractor.multirank.plan_between``'s, rank pairs of
    differing layouts planned from run templates kept in ``templates`` (the peer's: ``peer_templates``)."""
    if planner is not None:
        return planner(src_layouts, src_ids, dst_layouts, dst_ids, token_range=token_range, layers=layers,
                       dst_committed=dst_committed, request_id=request_id)
    return multirank.plan_between(src_layouts, src_ids, dst_layouts, dst_ids, token_range=token_range,
                                  layers=layers, dst_committed=dst_committed, templates=templates)


#: Plans between differing layouts of more runs than this are posted as phases. Below it the expansion
#: costs less than the phases' checks (a layer chunk of 256-4,096 tokens over nixl: plan + post 0.88-1.01x
#: as phases against the expansion); above it the expansion's arrays grow with the mismatch (2 million runs
#: for HND -> NHD at 4k tokens on the 8B shape: 18 ms of planning against 0.4 ms as phases).
PHASED_MIN_RUNS = 1 << 16


def plan_phased(src_layouts: Sequence[CacheLayoutDesc], src_ids: Sequence[Any],
                dst_layouts: Sequence[CacheLayoutDesc], dst_ids: Sequence[Any], *,
                token_range: tuple[int, int], layers: Sequence[int] | None = None, request_id: str = "",
                planner: Planner | None = None, templates: TemplateCache | None = None,
                min_runs: int = PHASED_MIN_RUNS) -> TransferPlan | PhasedPlan:
    """``plan_between``, except that where a rank pair's layouts differ (and no ``planner`` is set) a plan
    of more than ``min_runs`` runs is its phases (``multirank.plan_phased``: no expansion; the transport
    posts it as one transfer and ``check_writable_phased`` checks it). ``phased_min_runs(transport)`` is
    the workers' ``min_runs``."""
    if planner is None and templates is not None and \
            any(s.fingerprint != d.fingerprint for s in src_layouts for d in dst_layouts):
        phased = multirank.plan_phased(src_layouts, src_ids, dst_layouts, dst_ids, token_range=token_range,
                                       layers=layers, templates=templates)
        return phased if len(phased) > min_runs else phased.expand()
    return plan_between(src_layouts, src_ids, dst_layouts, dst_ids, token_range=token_range, layers=layers,
                        request_id=request_id, planner=planner, templates=templates)


def phased_min_runs(transport: Transport) -> int:
    """Above how many runs a worker hands ``transport`` a differing-layout plan as phases: always where the
    transport forms the runs on the device (``posts_templates``), else above ``PHASED_MIN_RUNS``."""
    return 0 if transport.posts_templates else PHASED_MIN_RUNS


#: Run templates a worker keeps per peer: (its ranks x the peer's) pairs x layer groups sent x segment shapes.
PEER_TEMPLATES_KEPT = 1024


def peer_templates(src_layouts: Sequence[CacheLayoutDesc] = (),
                   dst_layouts: Sequence[CacheLayoutDesc] = ()) -> TemplateCache:
    """The template cache of one peer connection, made anew when the peer's layouts are learned, with the
    templates of whole transfers from ``src_layouts`` to ``dst_layouts`` made at once
    (``multirank.warm_templates``: the handshake pays for them, not the peer's first request)."""
    templates = TemplateCache(PEER_TEMPLATES_KEPT)
    multirank.warm_templates(src_layouts, dst_layouts, templates)
    return templates


class LayerwiseKV(PagedKV):
    """PagedKV that reports each layer once the KV of its last prompt token is in the pages, so that
    layers can be sent while the model computes the next ones."""

    def __init__(self, shards: Sequence[Any], model: KVSpec, end: int,
                 on_layer_done: Callable[[int], None]) -> None:
        super().__init__(shards, model.num_layers, model.num_kv_heads, model.head_dim)
        self.end = end
        self.on_layer_done = on_layer_done

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        """Store the KV, then report ``layer`` when this write reached the end of the prompt."""
        super().write(layer, key, value, start)
        if start + int(key.shape[0]) == self.end:
            if key.is_cuda:   # the copy engine reads the pages: the kernels writing them must have run
                torch.cuda.current_stream(key.device).synchronize()
            self.on_layer_done(layer)


def layer_groups(num_layers: int, per_send: int) -> list[list[int]]:
    """Consecutive layers in groups of ``per_send`` (the last may be shorter)."""
    return [list(range(i, min(i + per_send, num_layers))) for i in range(0, num_layers, per_send)]


@dataclass(frozen=True, slots=True)
class Received:
    """A peer's application message, taken from its connection by the engine."""

    conn: PeerConnection
    message: ControlMessage


@dataclass(frozen=True, slots=True)
class Lost:
    """A peer's connection ended (after every message before the end was taken)."""

    conn: PeerConnection
    reason: str


@dataclass(frozen=True, slots=True)
class Computed:
    """The compute thread finished the work submitted for ``job``: ``value``, or the ``error`` it raised."""

    job: Any
    value: Any
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``run`` on the engine thread (``Engine.call``)."""

    run: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Submitted:
    """Decode: a request submitted through the worker's API."""

    job: Any


@dataclass(frozen=True, slots=True)
class Reconnected:
    """Decode: an automatic reconnect attempt to ``peer`` begun at ``started`` ended (``error`` None: it
    connected); ``last``: its loop ends with it."""

    peer: Any
    error: KvxferError | None
    started: float
    last: bool


@dataclass(frozen=True, slots=True)
class LayerDone:
    """Prefill, layer-wise push: the compute thread finished ``layer`` of ``job``."""

    job: Any
    layer: int


@dataclass(frozen=True, slots=True)
class Reserved:
    """Prefill, one write: the compute thread holds every page of ``job``'s prompt."""

    job: Any


#: What the engine thread handles, one at a time, in arrival order.
Event = Received | Lost | Computed | Call | Submitted | Reconnected | LayerDone | Reserved


@dataclass(frozen=True)
class Health:
    """Whether a worker can be trusted to serve (what ``status``, metrics and ``/health`` report).

    ``ok`` turns False for good once the engine met an error it did not expect (a bug, CUDA out of
    memory): every request in flight was failed with that cause, and ``reason`` names it. A supervisor
    should restart such a worker (``kvxfer serve`` exits non-zero)."""

    ok: bool = True
    reason: str = ""
    since: float = 0.0
    """Monotonic time of the change (0.0 while healthy)."""

    def as_dict(self) -> dict[str, int | float | str]:
        """Flat form for status maps and metrics: ``healthy`` (0/1) and ``health_reason``."""
        return {"healthy": int(self.ok), "health_reason": self.reason}


#: Events handled before the engine looks at its connections again, and messages taken from one
#: connection per round (so one busy peer cannot starve the others).
_EVENT_BURST = 256
_MESSAGES_PER_ROUND = 16
#: Longest sleep between ticks when nothing is due (a safety net: every event wakes the engine).
_MAX_SLEEP_S = 1.0


class Engine:
    """One thread owning a worker's caches, model and transport; everything else talks to it through
    ``post`` and ``call``.

    Nothing polls on the serving path: posted events, messages on watched connections, ended
    connections, finished transfers (``wake`` as a done callback) and transport notifications wake the
    thread, which then runs ``tick`` and handles what is waiting; it sleeps until the next deadline
    ``tick`` returns otherwise. Connections are not read by threads of their own: the engine takes
    messages from their bounded inboxes, at most ``_MESSAGES_PER_ROUND`` per connection per round, so
    the control plane's inbox bound holds while the engine is busy, and a connection that ended
    leaves nothing behind. Every event is handled under its own exception guard: an unexpected error
    marks the worker unhealthy and fails its requests with the cause (``on_error``); the engine goes on
    serving ``status``, cancels and ``close``.
    """

    def __init__(self, name: str, handle: Callable[[Event], None], tick: Callable[[], float],
                 on_receive: Callable[[PeerConnection, ControlMessage], bool] | None = None, *,
                 on_error: Callable[[str], None] | None = None, max_events: int = 65536) -> None:
        """``handle(event)`` runs each event; ``tick()`` does periodic work and returns how long the
        engine may sleep before the next call. ``on_receive(conn, msg)`` runs on the control plane's I/O
        thread as each message arrives and returns True when it dealt with it (it is then not queued):
        for what must take effect on arrival even while the engine is busy, such as lease renewals.
        ``on_error(reason)`` (engine thread) fails every request in flight after an unexpected error.
        ``max_events``: events waiting before ``post`` refuses more (CapacityError)."""
        self.name = name
        self._handle = handle
        self._tick = tick
        self._on_receive = on_receive
        self._on_error = on_error
        self.max_events = max_events
        self._events: deque[Event] = deque()
        self._ready: dict[PeerConnection, None] = {}   # connections with something to take, in order
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-engine-{name}", daemon=True)
        self._health = Health()
        self._dead: str | None = None

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called."""
        return self._stop.is_set()

    @property
    def health(self) -> Health:
        """Healthy until an unexpected error (see ``Health``)."""
        return self._health

    def state(self) -> HealthState:
        """The health reading of ``kvxfer.disagg.health.HealthSource`` (what ``/health`` serves)."""
        h = self._health
        return HealthState(h.ok, h.reason)

    def set_unhealthy(self, reason: str) -> None:
        """``HealthSource``'s report of a failure outside the engine (e.g. KV event publishing stopped)."""
        self.mark_unhealthy(reason)

    def mark_unhealthy(self, reason: str) -> None:
        """Record that the worker cannot be trusted any more (the first reason is kept)."""
        if self._health.ok:
            self._health = Health(False, reason, time.monotonic())
            log.error("%s: worker unhealthy: %s", self.name, reason)

    def wake(self, *_: object) -> None:
        """Make the engine run its tick and look for work now (any thread; usable as a callback)."""
        self._wakeup.set()

    def post(self, ev: Event) -> None:
        """Queue an event for the engine thread; CapacityError when ``max_events`` already wait."""
        with self._lock:
            if len(self._events) >= self.max_events:
                raise CapacityError(f"{self.name}: engine busy, {self.max_events} events already waiting")
            self._events.append(ev)
        self._wakeup.set()

    def post_internal(self, ev: Event) -> None:
        """Queue what the engine itself must learn (results of its own work): never refused."""
        with self._lock:
            self._events.append(ev)
        self._wakeup.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on the engine thread and return its result (re-raising its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._dead is not None:
            raise WorkerUnhealthy(f"{self.name}: engine thread ended: {self._dead}")
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        self.post_internal(Call(run))
        if not done.wait(timeout):
            if self._dead is not None:
                raise WorkerUnhealthy(f"{self.name}: engine thread ended: {self._dead}")
            raise ControlTimeout(f"{self.name}: engine did not answer within {timeout:.1f} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def read(self, conn: PeerConnection) -> None:
        """Serve ``conn``: its messages become ``Received`` events and its end one ``Lost`` event (then the
        engine forgets it)."""
        conn.watch(lambda: self._mark_ready(conn), self._on_receive)

    def _mark_ready(self, conn: PeerConnection) -> None:
        with self._lock:
            self._ready[conn] = None
        self._wakeup.set()

    @property
    def backlog(self) -> int:
        """Events and connections waiting (a tick with a backlog must not expire leases whose renewals
        may be queued)."""
        return len(self._events) + len(self._ready)

    @property
    def num_connections_waiting(self) -> int:
        """Connections with messages not yet taken (0 when idle: ended connections are forgotten)."""
        return len(self._ready)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                try:
                    wait = self._tick()   # periodic work (transfers, leases, deadlines); seconds until the next
                except Exception as exc:
                    self._unexpected("periodic work", exc)
                    wait = 0.01
                if not self._serve() and not self._stop.is_set():
                    self._wakeup.wait(min(_MAX_SLEEP_S, max(0.0, wait)))
        except BaseException as exc:   # the loop's own machinery failed: nothing can be served any more
            log.exception("%s: engine thread failed", self.name)
            self._dead = f"{type(exc).__name__}: {exc}"
            self.mark_unhealthy(f"engine thread ended: {self._dead}")
            self._fail_waiting_calls()
            raise

    def _serve(self) -> bool:
        """Handle waiting events, then a round of messages from ready connections; True if any."""
        with self._lock:
            n = min(len(self._events), _EVENT_BURST)
            events = [self._events.popleft() for _ in range(n)]
            ready = list(self._ready)
            self._ready.clear()
        for ev in events:
            self._dispatch(ev)
        for conn in ready:
            for _ in range(_MESSAGES_PER_ROUND):
                try:
                    msg = conn.poll()
                except KvxferError as exc:   # ended: one Lost event, then it is forgotten
                    self._dispatch(Lost(conn, str(exc)))
                    break
                if msg is None:
                    break
                self._dispatch(Received(conn, msg))
            else:
                self._mark_ready(conn)   # more waiting: after the other connections
        return bool(events or ready)

    def _dispatch(self, ev: Event) -> None:
        try:
            if isinstance(ev, Call):
                ev.run()
            else:
                self._handle(ev)
        except KvxferError as exc:   # a handler that let a request's failure escape: report, keep serving
            log.warning("%s: %s event failed: %s", self.name, type(ev).__name__, exc)
        except Exception as exc:
            self._unexpected(f"handling a {type(ev).__name__} event", exc)

    def _unexpected(self, where: str, exc: Exception) -> None:
        """An error the worker did not expect: mark it unhealthy, fail every request with the cause."""
        log.error("%s: unexpected error while %s", self.name, where, exc_info=exc)
        reason = f"unexpected error while {where}: {type(exc).__name__}: {exc}"
        self.mark_unhealthy(reason)
        if self._on_error is not None:
            try:
                self._on_error(reason)
            except Exception:
                log.exception("%s: failing the requests after an unexpected error failed too", self.name)

    def _fail_waiting_calls(self) -> None:
        with self._lock:
            events, self._events = list(self._events), deque()
        for ev in events:
            if isinstance(ev, Call):
                with contextlib.suppress(BaseException):
                    ev.run()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (the caller closes connections first)."""
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class ComputeThread:
    """Runs model work off the engine thread, one job at a time, so the engine keeps serving cancels,
    lease renewals, status and other peers meanwhile; each result comes back as an engine event."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self._engine = engine
        # (key, fn, reply): the result goes to the engine, or to ``reply`` for ``call``
        self._jobs: queue.Queue[tuple[Any, Callable[[], Any], Future[Any] | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-compute-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: Any, fn: Callable[[], Any]) -> None:
        """Run ``fn()``; the engine then gets ``Computed(key, value, None)`` or ``Computed(key, None,
        exception)``."""
        self._jobs.put((key, fn, None))

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn()`` on this thread and return its value or raise its exception, the engine not told:
        work before serving that must run where requests will (CUDA library handles are per thread).
        ControlTimeout when it takes longer than ``timeout`` seconds."""
        reply: Future[Any] = Future()
        self._jobs.put((None, fn, reply))
        try:
            return reply.result(timeout)
        except TimeoutError:
            raise ControlTimeout(f"compute thread of {self.name!r}: work before serving took more than "
                                 f"{timeout:.1f} s") from None

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            key, fn, reply = item
            try:
                result: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:   # handed to the engine (or the caller), which fails the job with the cause
                result = (None, exc)
            if reply is None:
                self._engine.post_internal(Computed(key, *result))
            elif result[1] is None:
                reply.set_result(result[0])
            else:
                reply.set_exception(result[1])

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the job in progress (the engine no longer waits for it), then end the thread."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


#: The warm-up's prompt: two blocks and a token (a full block and a partly filled one), then 2 new tokens.
WARM_UP_BLOCKS = 2


def warm_up_model(model: Model, config: WorkerConfig, compute: ComputeThread) -> float:
    """Run one greedy generation on ``compute`` over scratch caches of the worker's layout (same device,
    block size, head order and ranks; 4 blocks, prefix reuse off), then free them: the worker's own caches,
    prefix tree, events and statistics see nothing of it. Seconds taken; a model that cannot run it fails
    the worker's start with the cause. 0.0 and nothing run when ``config.warm_up`` is off."""
    if not config.warm_up:
        return 0.0
    n = WARM_UP_BLOCKS * config.tokens_per_block + 1
    tokens = np.arange(n, dtype=np.int64) % model.vocab_size
    started = now()
    scratch = config.managers(num_blocks=WARM_UP_BLOCKS + 2, enable_prefix_reuse=False)
    try:
        compute.call(lambda: model.generate(scratch, tokens, 2, config.chunk_size), config.deadline_s)
    except Exception as exc:   # any failure here is the model's or the device's: this worker cannot serve
        raise ConfigError(f"{config.name}: the model's warm-up ({n}-token prompt, 2 new tokens) failed: {exc}") \
            from exc
    finally:
        for m in scratch:
            with contextlib.suppress(KvxferError):   # a generation still running (timed out) holds its cache
                m.shutdown()
    return now() - started


def now() -> float:
    """Monotonic seconds."""
    return time.monotonic()


class StallWatch:
    """Notices when this whole process stopped running (SIGSTOP, a VM pause, swap storms) for longer
    than ``threshold`` seconds: a thread ticks every ``period`` s, and a gap between ticks is a stall.

    A peer that heard nothing from us for that long may have declared us lost and reused memory we were
    about to write into, so a worker asks ``stalled_since(t)`` before each write of work begun at ``t``.
    A stall still in progress (the ticker has not run for ``threshold`` s) counts too, so the answer
    is right even when the asking thread resumes before the ticker does.
    """

    def __init__(self, threshold: float, period: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < period < threshold:
            raise ConfigError(f"StallWatch: need 0 < period < threshold, got period={period!r}, "
                              f"threshold={threshold!r}")
        self.threshold = threshold
        self.period = period
        self._clock = clock
        self._last = clock()
        self._stalls: deque[tuple[float, float]] = deque(maxlen=64)   # (ended at, length)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StallWatch:
        """Start the ticker thread (daemon); returns self."""
        self._last = self._clock()
        self._thread = threading.Thread(target=self._run, name="kvxfer-stall-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the ticker thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def tick(self) -> None:
        """Record that the process ran now (the ticker calls this every ``period`` s)."""
        t = self._clock()
        gap = t - self._last
        if gap > self.threshold:
            self._stalls.append((t, gap))
            log.warning("process stalled for %.2f s (threshold %.2f s)", gap, self.threshold)
        self._last = t

    def stalled_since(self, start: float) -> float:
        """The longest stall over ``threshold`` that ended after ``start``, or is still going; 0.0 if none."""
        ongoing = self._clock() - self._last
        worst = ongoing if ongoing > self.threshold else 0.0
        return max([worst] + [gap for ended, gap in list(self._stalls) if ended > start])

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.tick()


def accept_loop(engine: Engine, server: ControlServer) -> None:
    """Hand every accepted control connection to the engine until it stops (a worker thread's body;
    ``server.close`` ends the wait at once)."""
    while not engine.stopping:
        try:
            conn = server.accept(_MAX_SLEEP_S)
        except ControlTimeout:
            continue
        except KvxferError:
            return
        engine.read(conn)


def check_transition(table: Mapping[Any, frozenset[Any]], role: str, request_id: str, old: enum.Enum,
                     new: enum.Enum) -> None:
    """SessionError unless ``table`` (a worker's transition table) allows a ``role`` request in ``old`` to
    move to ``new``."""
    if new not in table[old]:
        allowed = sorted(s.value for s in table[old]) or "none (terminal)"
        raise SessionError(f"{role} request {request_id!r}: illegal move {old.value} -> {new.value} "
                           f"(allowed from {old.value}: {allowed})")


class WorkerBase(abc.ABC):
    """What both workers share around their engine: health, status, drain, the accept thread, protocol
    errors and the leak checks. A subclass sets ``config``, ``engine``, ``managers``, ``server`` and
    ``_draining`` and says what it has in flight (``_in_flight``), what its status adds (``_own_status``)
    and how it ends (``close``, ``_on_protocol_error``)."""

    role: str
    config: WorkerConfig
    engine: Engine
    managers: list[KVCacheManager]
    server: ControlServer | None
    _draining: bool

    # --- what a worker says about itself -----------------------------------------------------------
    @property
    def health(self) -> Health:
        """Whether this worker can be trusted to serve (False after an unexpected error; see ``Health``)."""
        return self.engine.health

    def status(self) -> dict[str, int | float | str]:
        """Slot accounting and counters (what ``worker_status`` answers)."""
        return dict(self.engine.call(self._status, 10.0))

    def _status(self) -> dict[str, int | float | str]:
        return {"role": self.role, "name": self.config.name, **self.engine.health.as_dict(),
                "held_slots": held_slots(self.managers),
                "open_caches": sum(len(m.open_caches) for m in self.managers), **self._own_status(),
                "draining": int(self._draining)}

    @abc.abstractmethod
    def _own_status(self) -> dict[str, int | float | str]:
        """The role's own entries of ``status`` (engine thread)."""

    @abc.abstractmethod
    def _in_flight(self) -> int:
        """Requests not finished yet (engine thread): what ``drain`` waits for."""

    def held_slots(self) -> int:
        """Slots held by open requests on every rank and pool group (0 when idle: nothing leaked;
        blocks kept only by the prefix tree do not count). Checks the allocator accounting."""
        return int(self.engine.call(lambda: held_slots(self.managers), 10.0))

    def num_open_caches(self) -> int:
        """Caches open on every rank together (0 when idle)."""
        return int(self.engine.call(lambda: sum(len(m.open_caches) for m in self.managers), 10.0))

    # --- lifecycle ----------------------------------------------------------------------------------
    def drain(self, timeout: float, cancel: threading.Event | None = None) -> bool:
        """Stop taking requests (what a new one meets is the role's: see its class) and wait up to
        ``timeout`` s (less once ``cancel`` is set) for those in flight to finish; True when none is left.
        ``close`` fails the rest."""
        if self.engine.stopping:
            return True
        with contextlib.suppress(KvxferError):
            self.engine.call(lambda: setattr(self, "_draining", True), 10.0)
        deadline = now() + max(0.0, timeout)
        while True:
            try:
                left = int(self.engine.call(self._in_flight, 10.0))
            except KvxferError:
                return False
            if not left:
                return True
            if now() >= deadline or (cancel is not None and cancel.is_set()):
                log.warning("%s: %d request(s) still in flight after the %.1f s drain", self.config.name, left,
                            timeout)
                return False
            time.sleep(0.02)

    @abc.abstractmethod
    def close(self) -> None:
        """Fail what is open, stop the threads, close connections, transport and caches."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_accepting(self) -> threading.Thread:
        """The thread that hands every accepted control connection to the engine (``accept_loop``)."""
        server = self.server
        assert server is not None
        thread = threading.Thread(target=accept_loop, args=(self.engine, server),
                                  name=f"kvxfer-accept-{self.config.name}", daemon=True)
        thread.start()
        return thread

    # --- engine thread ------------------------------------------------------------------------------
    def _received(self, conn: PeerConnection, msg: ControlMessage, handle: Callable[[], None]) -> None:
        """Run ``handle`` for a peer's message; a peer that broke the protocol (KvxferError) loses its
        connection, the others are served on."""
        try:
            handle()
        except KvxferError as exc:
            log.warning("%s: %s sent a bad %s: %s", self.config.name, conn.peer.name, msg.kind, exc)
            conn.close(f"protocol error: {exc}")
            self._on_protocol_error(conn, f"protocol error: {exc}")

    @abc.abstractmethod
    def _on_protocol_error(self, conn: PeerConnection, reason: str) -> None:
        """A peer's connection was closed for ``reason``: end what was served over it (engine thread)."""

    @staticmethod
    def _send(conn: PeerConnection, message: ControlMessage, *, urgent: bool = False) -> None:
        """``send_quietly``."""
        send_quietly(conn, message, urgent=urgent)


def send_quietly(conn: PeerConnection, message: ControlMessage, *, urgent: bool = False) -> None:
    """Send, ignoring a lost peer (its ``Lost`` event handles it); ``urgent``: on a request's critical
    path, handed to the I/O thread before the engine goes on (``send_urgent``)."""
    if not conn.alive:
        return
    with contextlib.suppress(KvxferError):
        (conn.send_urgent if urgent else conn.send)(message)


def release_managers(managers: Sequence[KVCacheManager]) -> None:
    """Shut down every cache manager (a worker that could not start, or one closing)."""
    for m in managers:
        m.shutdown()
