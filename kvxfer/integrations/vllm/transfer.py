"""The vLLM connector's per-worker transfer engine, free of vLLM: one per tensor-parallel rank.

Every rank registers its KV memory with a kvxfer transport (NIXL by default) and serves kvxfer's
authenticated control plane (``ControlServer``: shared secret, sealed messages) announcing its layout
and transport metadata. Pull: a decode rank connects to the prefill ranks named in a request's
``kv_transfer_params``, learns their layouts and transport metadata from the handshake, plans each
read with ``plan_transfer`` (block sizes and tensor-parallel head slices paired there) for the
tokens it lacks, reads, and tells each prefill rank it is done (``vllm_kv_done``), which lets the
prefill free the request's blocks. A prefill holds a finished request's blocks until every decode
rank sharing its heads said done, or ``hold_timeout`` passed.

Push: the decode rank sends the prefill ranks its block ids and the tokens to fill (``vllm_kv_want``);
each prefill rank writes them from the held blocks (one-sided WRITE) and answers ``vllm_kv_pushed``;
a write counts as that decode rank's read for freeing the blocks.

Failures (a prefill gone, refused, timed out, a transfer failed) end a request's receive with a
reason instead of hanging: the connector reports its blocks as invalid so vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.engine_layouts import EngineKV
from kvxfer.disagg.control import ControlServer, PeerConnection, connect
from kvxfer.disagg.handshake import LocalIdentity
from kvxfer.disagg.messages import VllmKvDone, VllmKvPushed, VllmKvWant
from kvxfer.errors import ConfigError, KvxferError
from kvxfer.extractor import plan_transfer
from kvxfer.pagetable import TransferPlan
from kvxfer.transport import TransferHandle, Transport, create

log = logging.getLogger(__name__)

#: Heartbeats of the connector's control connections: a vLLM process holds the GIL through long
#: forward passes, so a peer is declared lost only after 5 missed 2-second heartbeats.
HEARTBEAT_S = 2.0
HEARTBEAT_MISSES = 5
#: How long ``close`` waits for the transfer pool's threads once their transfers are cancelled (a thread
#: inside a control-plane connect returns within that connect's own timeout).
CLOSE_WAIT_S = 10.0
#: The connector's messages (``kvxfer.disagg.messages``): decode -> prefill ``VllmKvDone`` (this decode rank
#: finished reading a request; ``ok``: the bytes landed; ``readers`` decode ranks read this prefill rank
#: for it) and, push, ``VllmKvWant`` (write tokens ``[start, stop)`` into these blocks of mine);
#: prefill -> decode ``VllmKvPushed`` (the write ended; ``reason`` when it failed).


@dataclass(frozen=True)
class RemoteKV:
    """Where a request's KV lies on the prefill: its request id there, each prefill rank's control
    address, its block ids there and how many prompt tokens it computed."""

    request_id: str
    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class _Held:
    """A finished prefill request whose blocks wait for the decode's reads."""

    deadline: float
    done: int = 0
    readers: int | None = None


@dataclass
class TransferStats:
    """Bytes and requests moved by one rank (read: pulled into this rank; written: pushed from it)."""

    bytes_read: int = 0
    bytes_written: int = 0
    requests_read: int = 0
    requests_written: int = 0
    failures: int = 0
    tokens_skipped: int = 0
    """Prompt tokens the decode already held (prefix cache hits), not moved."""
    bytes_written_layerwise: int = 0
    """Of ``bytes_written``: written layer by layer during the prefill's forward pass (``save_layer``)."""


def head_range(layout: CacheLayoutDesc) -> tuple[int, int, int]:
    """``(head_start, num_heads, total_heads)`` of a layout's buffers (all of one rank's agree)."""
    fmts = {(f.head_start, f.num_heads, f.total_heads) for _, f in layout.formats}
    if len(fmts) != 1:
        raise ConfigError(f"vLLM connector: buffers of one rank hold different head ranges {sorted(fmts)}")
    return next(iter(fmts))


def readers_of(remote: CacheLayoutDesc, local: CacheLayoutDesc) -> int:
    """How many ranks of the local tensor-parallel group (equal head slices, as ``local``'s) hold
    heads of ``remote``'s slice: each of them reads that remote rank."""
    start, num, _ = head_range(remote)
    _, per_rank, _ = head_range(local)
    return (start + num - 1) // per_rank - start // per_rank + 1


@dataclass
class _Want:
    """A push the decode asked for: where to write, and who asked."""

    conn: PeerConnection
    block_ids: list[int]
    start: int
    stop: int
    readers: int
    saved: dict[int, int] = field(default_factory=dict)
    """Layer-wise saves: per layer, the token up to which ``[start, ...)`` was written without a gap."""
    saved_bytes: int = 0


class TransferEngine:
    """One rank's transport, control server and transfers (see the module docstring)."""

    def __init__(self, name: str, kv: EngineKV, *, backend: str = "nixl", secret: str | bytes | None = None,
                 host: str = "127.0.0.1", port: int = 0, hold_timeout: float = 120.0, timeout: float = 30.0,
                 transport: Transport | None = None) -> None:
        if not hold_timeout > 0 or not timeout > 0:
            raise ConfigError(f"vLLM connector: hold_timeout and timeout must be > 0 s, got {hold_timeout!r}, "
                              f"{timeout!r}")
        self.name = name
        self.kv = kv
        self.layout = kv.layout
        self.backend = backend
        self.hold_timeout = hold_timeout
        self.timeout = timeout
        self._secret = secret
        self.transport = transport if transport is not None else create(backend, name)
        self.transport.register(kv.regions)
        self._identity = LocalIdentity("prefill", name, kv.layout, self.transport.backend, self.transport.metadata(),
                                       heartbeat_interval=HEARTBEAT_S)
        self.server = ControlServer(self._identity, secret, bind=f"tcp://{host}:{port}",
                                    heartbeat_misses=HEARTBEAT_MISSES)
        self.address = self.server.address
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._early: dict[str, _Held] = {}         # reads reported before the hold reached this rank
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed: dict[str, str] = {}
        self._wants: dict[str, list[_Want]] = {}
        self._ready: dict[str, list[int]] = {}     # prefill request id -> its block ids (push source)
        self._conns: dict[str, PeerConnection] = {}   # prefill control address -> connection
        self._transport_peers: set[str] = set()
        self._peers: dict[PeerConnection, None] = {}
        self._pushes: dict[str, tuple[int, float]] = {}   # decode request id -> (answers awaited, deadline)
        self._push_ids: dict[str, str] = {}        # prefill request id -> decode request id
        self._push_conns: dict[str, list[PeerConnection]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"kvxfer-vllm-{name}")
        self._tasks: set[Future[None]] = set()
        self._moving: set[TransferHandle] = set()   # transfers posted and not yet finished
        self._saves: list[tuple[_Want, int, int, int, TransferHandle]] = []   # this step's layer-wise writes
        self._layers = tuple(sorted({i for g in kv.layout.layer_groups for i in g.layer_ids}))
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvxfer-vllm-ctl-{name}", daemon=True)
        self._thread.start()

    # --- the control loop: accept peers, take their messages ----------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self.server.accept(0.0)
                self._watch(conn)
            except KvxferError:
                pass
            for conn in list(self._peers):
                self._drain(conn)
            self._expire()
            self._wake.wait(0.02)
            self._wake.clear()

    def _watch(self, conn: PeerConnection) -> None:
        self._peers[conn] = None
        conn.watch(self._wake.set)

    def _drain(self, conn: PeerConnection) -> None:
        try:
            while (msg := conn.poll()) is not None:
                match msg:
                    case VllmKvDone():
                        self._on_done(msg.request_id, msg.readers, msg.ok)
                    case VllmKvWant():
                        self._on_want(conn, msg.request_id, list(msg.block_ids), msg.start, msg.stop, msg.readers)
                    case VllmKvPushed():
                        self._on_pushed(msg.request_id, msg.ok, msg.nbytes, msg.reason)
                    case _:
                        log.warning("vLLM connector %s: unexpected %r from %s", self.name, msg.kind, conn.peer.name)
        except KvxferError as exc:
            self._peers.pop(conn, None)
            self._lost(conn, str(exc))

    def _lost(self, conn: PeerConnection, reason: str) -> None:
        """A peer went away: pushes it owed us fail now rather than at their deadline."""
        with self._lock:
            for rid, wants in list(self._wants.items()):
                self._wants[rid] = [w for w in wants if w.conn is not conn]
            awaited = [rid for rid in self._pushes if conn in self._push_conns.get(rid, [])]
            for rid in awaited:
                self._fail_locked(rid, f"prefill {conn.peer.name} lost: {reason}")

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rid, held in list(self._early.items()):
                if now > held.deadline:
                    del self._early[rid]
            for rid, held in list(self._held.items()):
                if now > held.deadline:
                    log.warning("vLLM connector %s: request %s held %.0f s without every read; freeing its blocks",
                                self.name, rid, self.hold_timeout)
                    del self._held[rid]
                    self._sent.add(rid)
            for rid, (_, deadline) in list(self._pushes.items()):
                if now > deadline:
                    self._fail_locked(rid, f"no push within {self.timeout:.0f} s")

    # --- prefill side --------------------------------------------------------------------------------
    def hold(self, request_id: str) -> None:
        """Keep ``request_id``'s blocks until the decode read them (``finished_sending`` says when)."""
        with self._lock:
            held = self._held.setdefault(request_id, _Held(time.monotonic() + self.hold_timeout))
            early = self._early.pop(request_id, None)
            if early is not None:
                held.done, held.readers = early.done, early.readers
                if early.readers is not None and held.done >= early.readers:
                    del self._held[request_id]
                    self._sent.add(request_id)
        self._wake.set()

    def _on_done(self, request_id: str, readers: int, ok: bool) -> None:
        with self._lock:
            held = self._held.get(request_id)
            if held is None:   # the decode was quicker than the scheduler's hold: kept until it comes
                held = self._early.setdefault(request_id, _Held(time.monotonic() + self.hold_timeout))
                held.done += 1
                held.readers = readers
                return
            held.done += 1
            held.readers = readers
            if held.done >= readers:
                del self._held[request_id]
                self._sent.add(request_id)
        if not ok:
            log.warning("vLLM connector %s: a decode rank failed reading %s", self.name, request_id)

    def finished_sending(self) -> set[str]:
        """Held requests every reader finished with (or that expired) since the last call."""
        with self._lock:
            out, self._sent = self._sent, set()
        return out

    def computed(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Push: ``request_id``'s prompt KV is in ``block_ids`` (held); serve the writes asked for it, now
        or when asked."""
        with self._lock:
            self._ready[request_id] = [int(b) for b in block_ids]
            wants = self._wants.pop(request_id, [])
        for w in wants:
            self._submit(self._pushed_layerwise if self._saved_whole(w) else self._push, request_id, w)

    # --- prefill side, layer-wise push -------------------------------------------------------------
    def save_layer(self, request_id: str, layer: int, block_ids: Sequence[int], start: int, stop: int) -> None:
        """Push, during the prefill's forward pass: layer ``layer`` of tokens ``[start, stop)`` of
        ``request_id`` (in ``block_ids``) is computed; write it now to every decode rank that already asked
        for it. Started, not awaited (``wait_saves``). A decode rank that asked later, or a range with a
        gap, gets the whole request written when the prefill finishes (``computed``), as without it."""
        with self._lock:
            wants = list(self._wants.get(request_id, ()))
        for w in wants:
            lo, hi = max(start, w.start), min(stop, w.stop)
            if hi <= lo or w.saved.get(layer, w.start) < lo:
                continue
            peer = w.conn.peer
            try:
                assert peer.layout is not None
                if peer.name not in self._transport_peers:
                    self.transport.connect(peer.name, peer.metadata)
                    self._transport_peers.add(peer.name)
                plan = plan_transfer(self.layout, {0: np.asarray(block_ids, dtype=np.int64)}, peer.layout,
                                     {0: np.asarray(w.block_ids, dtype=np.int64)}, layers=[layer],
                                     token_range=(lo, hi))
                handle = self.transport.write(peer.name, plan)
            except (KvxferError, AssertionError) as exc:
                log.warning("vLLM connector %s: layer %d of %s not saved to %s: %s", self.name, layer, request_id,
                            peer.name, exc)
                continue
            with self._lock:
                self._moving.add(handle)
            self._saves.append((w, layer, hi, plan.total_bytes, handle))

    def wait_saves(self) -> None:
        """Wait for the layer-wise writes ``save_layer`` started in this forward pass; one that failed or
        timed out is cancelled and leaves its layer to the whole-request write."""
        saves, self._saves = self._saves, []
        for w, layer, hi, nbytes, handle in saves:
            try:
                handle.wait(self.timeout)
            except KvxferError as exc:
                log.warning("vLLM connector %s: a layer-wise write to %s failed: %s", self.name, w.conn.peer.name,
                            exc)
                continue
            finally:
                with self._lock:
                    self._moving.discard(handle)
                if not handle.done():
                    handle.cancel()
            w.saved[layer] = hi
            w.saved_bytes += nbytes
            with self._lock:
                self.stats.bytes_written += nbytes
                self.stats.bytes_written_layerwise += nbytes

    def _saved_whole(self, want: _Want) -> bool:
        return all(want.saved.get(layer, want.start) >= want.stop for layer in self._layers)

    def _pushed_layerwise(self, request_id: str, want: _Want) -> None:
        """Every layer of ``want``'s tokens was written during the forward pass: tell the decode rank."""
        with self._lock:
            self.stats.requests_written += 1
        try:
            want.conn.send(VllmKvPushed(request_id=request_id, ok=True, nbytes=want.saved_bytes, reason=""))
        except KvxferError as exc:
            log.warning("vLLM connector %s: cannot tell %s the push ended: %s", self.name, want.conn.peer.name, exc)
        self._on_done(request_id, want.readers, True)

    def _on_want(self, conn: PeerConnection, request_id: str, block_ids: list[int], start: int, stop: int,
                 readers: int) -> None:
        want = _Want(conn, block_ids, start, stop, readers)
        with self._lock:
            ready = request_id in self._ready
            if not ready:
                self._wants.setdefault(request_id, []).append(want)
        if ready:
            self._submit(self._push, request_id, want)

    def _push(self, request_id: str, want: _Want) -> None:
        with self._lock:
            blocks = self._ready.get(request_id, [])
        peer = want.conn.peer
        nbytes, reason = 0, ""
        try:
            assert peer.layout is not None
            if peer.name not in self._transport_peers:
                self.transport.connect(peer.name, peer.metadata)
                self._transport_peers.add(peer.name)
            plan = plan_transfer(self.layout, {0: np.asarray(blocks, dtype=np.int64)}, peer.layout,
                                 {0: np.asarray(want.block_ids, dtype=np.int64)}, token_range=(want.start, want.stop))
            nbytes = plan.total_bytes
            if len(plan):
                self._move("write", peer.name, plan)
            with self._lock:
                self.stats.bytes_written += nbytes
                self.stats.requests_written += 1
        except (KvxferError, AssertionError) as exc:
            reason = f"{type(exc).__name__}: {exc}"[:1024]
            log.warning("vLLM connector %s: push of %s to %s failed: %s", self.name, request_id, peer.name, reason)
        try:
            want.conn.send(VllmKvPushed(request_id=request_id, ok=not reason, nbytes=nbytes, reason=reason[:1024]))
        except KvxferError as exc:
            log.warning("vLLM connector %s: cannot tell %s the push ended: %s", self.name, peer.name, exc)
        self._on_done(request_id, want.readers, not reason)

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the transfer pool; ``close`` waits for what runs there."""
        try:
            task = self._pool.submit(fn, *args)
        except RuntimeError:   # the pool was shut down: the engine is closing
            return
        with self._lock:
            self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: Future[None]) -> None:
        with self._lock:
            self._tasks.discard(task)

    def _move(self, op: str, peer: str, plan: TransferPlan) -> None:
        """Post one transfer and wait for it. One that does not finish (timed out, the engine closing) is
        cancelled before this returns, so that the transport never holds a transfer nobody waits for
        (NIXL's requests left in flight stall the peer's endpoint and abort UCX when the agent goes)."""
        handle = (self.transport.read if op == "read" else self.transport.write)(peer, plan)
        with self._lock:
            self._moving.add(handle)
        try:
            handle.wait(self.timeout)
        finally:
            with self._lock:
                self._moving.discard(handle)
            if not handle.done():
                handle.cancel()

    def release(self, request_id: str) -> None:
        """Push: forget ``request_id``'s source blocks (vLLM frees them)."""
        with self._lock:
            self._ready.pop(request_id, None)
            self._wants.pop(request_id, None)

    # --- decode side ---------------------------------------------------------------------------------
    def _connect(self, address: str) -> PeerConnection:
        """The live connection to the prefill rank at ``address``, made (and its transport peer connected)
        once: concurrent transfers share it (connecting the transport again would cut their reads)."""
        with self._connect_lock:
            return self._connect_locked(address)

    def _connect_locked(self, address: str) -> PeerConnection:
        with self._lock:
            conn = self._conns.get(address)
        if conn is not None and conn.alive:
            return conn
        identity = LocalIdentity("decode", self.name, self.layout, self.transport.backend, self.transport.metadata(),
                                 heartbeat_interval=HEARTBEAT_S)
        conn = connect(address, identity, self._secret, timeout=min(self.timeout, 10.0), expect_role="prefill",
                       heartbeat_misses=HEARTBEAT_MISSES)
        peer = conn.peer
        if peer.backend != self.transport.backend:
            conn.close("backend mismatch")
            raise ConfigError(f"vLLM connector: prefill {peer.name} at {address} uses backend {peer.backend!r}, "
                              f"this decode {self.transport.backend!r}")
        self.transport.connect(peer.name, peer.metadata)
        with self._lock:
            self._transport_peers.add(peer.name)
            self._conns[address] = conn
            self._peers[conn] = None
        conn.watch(self._wake.set)
        return conn

    def start_read(self, request_id: str, remote: RemoteKV, block_ids: Sequence[int], start: int) -> None:
        """Pull ``remote``'s tokens ``[start, remote.num_tokens)`` into this rank's ``block_ids`` (the
        request's whole block table); ``finished_receiving`` reports the end."""
        self._submit(self._read, request_id, remote, [int(b) for b in block_ids], start)

    def _read(self, request_id: str, remote: RemoteKV, block_ids: list[int], start: int) -> None:
        src = {0: np.asarray(remote.block_ids, dtype=np.int64)}
        dst = {0: np.asarray(block_ids, dtype=np.int64)}
        total = 0
        done_with: list[tuple[PeerConnection, int]] = []
        try:
            for address in remote.addresses:
                conn = self._connect(address)
                peer = conn.peer
                assert peer.layout is not None
                plan = plan_transfer(peer.layout, src, self.layout, dst, token_range=(start, remote.num_tokens))
                if len(plan) == 0:
                    continue
                self._move("read", peer.name, plan)
                total += plan.total_bytes
                done_with.append((conn, readers_of(peer.layout, self.layout)))
        except (KvxferError, AssertionError, OSError) as exc:
            self._fail(request_id, f"{type(exc).__name__}: {exc}")
            for conn, readers in done_with:
                self._tell_done(conn, remote.request_id, readers, ok=False)
            return
        for conn, readers in done_with:
            self._tell_done(conn, remote.request_id, readers, ok=True)
        with self._lock:
            self.stats.bytes_read += total
            self.stats.requests_read += 1
            self.stats.tokens_skipped += start
            self._received.add(request_id)

    def _tell_done(self, conn: PeerConnection, remote_id: str, readers: int, *, ok: bool) -> None:
        try:
            conn.send(VllmKvDone(request_id=remote_id, readers=readers, ok=ok))
        except KvxferError as exc:   # the prefill frees the blocks at its hold timeout
            log.warning("vLLM connector %s: cannot tell %s that %s was read: %s", self.name, conn.peer.name,
                        remote_id, exc)

    def start_push(self, request_id: str, remote: RemoteKV, block_ids: Sequence[int], start: int) -> None:
        """Push: ask every prefill rank of ``remote`` to write tokens ``[start, remote.num_tokens)`` into
        ``block_ids``; ``finished_receiving`` reports when every rank holding our heads answered."""
        self._submit(self._want, request_id, remote, [int(b) for b in block_ids], start)

    def _want(self, request_id: str, remote: RemoteKV, block_ids: list[int], start: int) -> None:
        try:
            conns = [self._connect(a) for a in remote.addresses]
            mine = head_range(self.layout)
            sharing = [c for c in conns if c.peer.layout is not None and _overlap(head_range(c.peer.layout), mine)]
            if not sharing:
                raise ConfigError(f"no prefill rank of {list(remote.addresses)} holds heads {mine[0]}..")
            with self._lock:
                self._pushes[request_id] = (len(sharing), time.monotonic() + self.timeout)
                self._push_conns[request_id] = sharing
                self._push_ids[remote.request_id] = request_id
                self.stats.tokens_skipped += start
            for c in sharing:
                assert c.peer.layout is not None
                c.send(VllmKvWant(request_id=remote.request_id, block_ids=block_ids, start=start,
                                  stop=remote.num_tokens, readers=readers_of(c.peer.layout, self.layout)))
        except (KvxferError, OSError) as exc:
            self._fail(request_id, f"{type(exc).__name__}: {exc}")

    def _on_pushed(self, remote_id: str, ok: bool, nbytes: int, reason: str) -> None:
        with self._lock:
            rid = self._push_ids.get(remote_id)
            if rid is None or rid not in self._pushes:
                return
            if not ok:
                self._push_ids.pop(remote_id, None)
                self._fail_locked(rid, f"prefill push failed: {reason}")
                return
            left, deadline = self._pushes[rid]
            self.stats.bytes_read += nbytes
            if left <= 1:
                del self._pushes[rid]
                self._push_conns.pop(rid, None)
                self._push_ids.pop(remote_id, None)
                self.stats.requests_read += 1
                self._received.add(rid)
            else:
                self._pushes[rid] = (left - 1, deadline)

    def _fail(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._fail_locked(request_id, reason)

    def _fail_locked(self, request_id: str, reason: str) -> None:
        log.warning("vLLM connector %s: KV of %s not received: %s", self.name, request_id, reason)
        self._pushes.pop(request_id, None)
        self._push_conns.pop(request_id, None)
        self._failed[request_id] = reason
        self.stats.failures += 1

    def finished_receiving(self) -> tuple[set[str], dict[str, str]]:
        """Requests whose KV landed, and those whose receive failed (with why), since the last call."""
        with self._lock:
            done, failed = self._received, self._failed
            self._received, self._failed = set(), {}
        return done, failed

    def close(self) -> None:
        """Stop the control loop, close connections, the server and the transport."""
        self._stop.set()
        self._wake.set()
        self._thread.join(2.0)
        # Ordered: no new work, the transfers in flight cancelled, the pool's threads seen out, and only
        # then the transport closed (closing it under a transfer in flight leaves NIXL requests behind).
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            moving, tasks = list(self._moving), list(self._tasks)
        for handle in moving:
            handle.cancel()
        wait_futures(tasks, timeout=CLOSE_WAIT_S)
        for conn in list(self._conns.values()):
            with contextlib.suppress(KvxferError):
                conn.close("closing")
        self.server.close()
        self.transport.close()


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


__all__ = ["RemoteKV", "TransferEngine", "TransferStats", "head_range",
           "readers_of"]
