"""A decode worker's requests: their states and allowed moves (``JobState``, ``JOB_TRANSITIONS``), the
record of one request (``DecodeJob``), the result it ends with (``GenerationResult``) and the table that
holds every live request in the collection of its state (``JobTable``, whose ``move`` is the one place a
state changes). The request lifecycle that decides the moves is ``kvxfer.disagg.decode_requests``;
docs/architecture.md draws the whole."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.kv_cache import KVCache
from kvxfer.disagg.control import PeerConnection
from kvxfer.disagg.messages import KvPosted, KvPull, KvPushed
from kvxfer.disagg.oracle import PromptKV
from kvxfer.disagg.router import Route
from kvxfer.disagg.session import Session
from kvxfer.disagg.worker import check_transition
from kvxfer.errors import KvxferError
from kvxfer.extractor import TemplateCache
from kvxfer.transport import TransferHandle

if TYPE_CHECKING:   # the peer record (a request names the prefill it went to)
    from kvxfer.disagg.decode_peers import PrefillPeer


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


class JobState(enum.Enum):
    """Where a decode request is. ``JOB_TRANSITIONS`` lists the moves; ``JobTable.move`` makes every one of
    them, and keeps the table's collection of each state in step (``waiting``, ``parked``, ``requested``,
    ``generating``, ``quarantined``)."""

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
of a retried attempt (``DecodeRequests.retry``)."""


def check_move(request_id: str, old: JobState, new: JobState) -> None:
    """SessionError unless ``JOB_TRANSITIONS`` allows a request in ``old`` to move to ``new``."""
    check_transition(JOB_TRANSITIONS, "decode", request_id, old, new)


@dataclass(eq=False, kw_only=True)
class DecodeJob:
    """One attempt at one decode request: what it asked for, where it went and what came back."""

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
    prefill: PrefillPeer | None = None
    conn: PeerConnection | None = None
    """The connection the request was sent over: only it may answer, and its loss fails the request."""
    src_layouts: list[CacheLayoutDesc] = field(default_factory=list)
    templates: TemplateCache | None = None
    """The prefill peer's run templates (``PrefillPeer.templates``) when the request was sent."""
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
    """When ``kv_request`` was handed to the connection (before the send: prefill may start first)."""
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
    """Where the request is; changed only by ``JobTable.move``."""


class JobTable:
    """Every live request of a decode worker, in the collection of its state; ``move`` is the one place
    that changes a request's state, and keeps the collections in step (engine thread only). Terminal
    states have no collection: a request that reaches one is dropped."""

    def __init__(self) -> None:
        self.waiting: list[DecodeJob] = []
        """WAITING: requests waiting for a reconnect attempt."""
        self.parked: list[DecodeJob] = []
        """PARKED: failover attempts waiting for quarantined pages."""
        self.requested: dict[str, DecodeJob] = {}
        """REQUESTED: sent to a prefill, by request id (a prefill's load)."""
        self.generating: dict[str, DecodeJob] = {}
        """GENERATING: KV in place, tokens being generated on the compute thread."""
        self.quarantined: dict[str, DecodeJob] = {}
        """QUARANTINED: ended, pages held while something may still write into them."""

    def move(self, job: DecodeJob, state: JobState) -> None:
        """Move ``job`` to ``state`` (SessionError if ``JOB_TRANSITIONS`` does not allow it), taking it out
        of the collection of its old state and into that of the new one."""
        check_move(job.request_id, job.state, state)
        match job.state:
            case JobState.WAITING:
                self.waiting.remove(job)
            case JobState.PARKED:
                self.parked.remove(job)
            case JobState.REQUESTED if self.requested.get(job.request_id) is job:
                del self.requested[job.request_id]
            case JobState.GENERATING if self.generating.get(job.request_id) is job:
                del self.generating[job.request_id]
            case JobState.QUARANTINED if self.quarantined.get(job.request_id) is job:
                del self.quarantined[job.request_id]
        job.state = state
        match state:
            case JobState.WAITING:
                self.waiting.append(job)
            case JobState.PARKED:
                self.parked.append(job)
            case JobState.REQUESTED:
                self.requested[job.request_id] = job
            case JobState.GENERATING:
                self.generating[job.request_id] = job
            case JobState.QUARANTINED:
                self.quarantined[job.request_id] = job

    def cancellable(self, request_id: str) -> DecodeJob | None:
        """The request ``request_id`` while it has not got its KV yet (sent, waiting or parked), or None."""
        return self.requested.get(request_id) or next((j for j in self.waiting + self.parked
                                                       if j.request_id == request_id), None)

    def holds(self, request_id: str) -> bool:
        """Whether a request with this id is live in any state (a new one may not reuse the id)."""
        return request_id in self.requested or request_id in self.quarantined or request_id in self.generating \
            or any(j.request_id == request_id for j in self.waiting + self.parked)

    def in_flight(self) -> int:
        """Requests not answered yet (quarantined ones were: only their pages are held)."""
        return len(self.requested) + len(self.waiting) + len(self.parked) + len(self.generating)

    def load(self, conn: PeerConnection | None) -> int:
        """Requests sent over ``conn`` whose KV is not in place yet (a prefill's load)."""
        return sum(1 for j in self.requested.values() if j.conn is conn)
