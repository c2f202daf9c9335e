"""KV-aware routing for xPyD: send each request to the prefill worker holding the longest cached prefix.

The router subscribes to every prefill's KV events (``kvxfer serve prefill --kv-events``: ZeroMQ PUB,
vLLM's wire format, see docs/events.md) and keeps, per worker, the block hashes it announced as stored
and not yet removed. For a request it computes the block hashes of the prompt's full blocks the way the
cache does (``kvxfer.cache.hashing.block_keys`` from the scope's root, published as
``block_hash_for_event``), counts for each worker how many leading blocks it holds, and picks the worker
with the most; ties go to the worker with the fewest requests this router has in flight there, then
rotate. Blocks of sliding-window layer groups do not count (a window drops early blocks, so they say
nothing about a reusable prefix). Events published before the subscription is live are missed (ZeroMQ
PUB/SUB); a worker added with its replay endpoint (``kvxfer serve --kv-events-replay``) is first asked for
every batch its publisher still buffers, live batches are held meanwhile, and each batch is applied once,
in sequence order. The choice is a preference: the decode worker falls back to the least
loaded connected prefill when the chosen one is gone (``DecodeWorker.submit(prefill=...)``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy.typing as npt
import zmq

from kvxfer.cache.event_publisher import END_SEQ
from kvxfer.cache.event_wire import (
    KIND_SLIDING,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    decode_batch,
)
from kvxfer.cache.hashing import (
    DEFAULT_HASH_ALGO,
    DEFAULT_SCOPE,
    ReuseScope,
    block_hash_for_event,
    block_keys,
)
from kvxfer.errors import ConfigError

log = logging.getLogger("kvxfer.disagg.router")

#: How often the subscriber thread looks up from its sockets (to add/remove workers, or stop).
POLL_S = 0.05
#: How long a worker's replay may take before the router gives up on it and uses the live events alone.
REPLAY_TIMEOUT_S = 2.0


def request_block_hashes(tokens: npt.ArrayLike, tokens_per_block: int, *, hash_algo: str = DEFAULT_HASH_ALGO,
                         scope: ReuseScope = DEFAULT_SCOPE) -> list[ExternalBlockHash]:
    """The published hashes of ``tokens``' full blocks, first block first, as a cache with this block size,
    hash option and reuse scope announces them (full-width options publish the key bytes)."""
    keys = block_keys(tokens, tokens_per_block, scope.root_key_for(hash_algo), algo=hash_algo, scope=scope)
    out: list[ExternalBlockHash] = []
    for key in keys:
        value = block_hash_for_event(key, hash_algo)
        out.append(bytes.fromhex(value) if isinstance(value, str) else value)
    return out


@dataclass
class WorkerIndex:
    """What one prefill worker announced: per block hash, the (layer group, medium) copies it holds."""

    blocks: dict[ExternalBlockHash, set[tuple[int, str]]] = field(default_factory=dict)
    sliding_groups: set[int] = field(default_factory=set)
    batches: int = 0
    gaps: int = 0
    """Sequence numbers skipped (batches lost to the subscriber: its view may miss blocks)."""
    last_seq: int = -1
    replaying: bool = False
    held: list[tuple[int, KVEventBatch]] = field(default_factory=list)
    """Live batches received while the replay runs (applied after it, in order)."""

    def apply(self, batch: KVEventBatch) -> None:
        """Fold one batch of events into the index."""
        self.batches += 1
        for ev in batch.events:
            group = int(ev.group_idx or 0) if not isinstance(ev, AllBlocksCleared) else 0
            if isinstance(ev, BlockStored):
                if ev.kv_cache_spec_kind == KIND_SLIDING:
                    self.sliding_groups.add(group)
                copy = (group, ev.medium or "")
                for h in ev.block_hashes:
                    self.blocks.setdefault(h, set()).add(copy)
            elif isinstance(ev, BlockRemoved):
                copy = (group, ev.medium or "")
                for h in ev.block_hashes:
                    held = self.blocks.get(h)
                    if held is not None:
                        held.discard(copy)
                        if not held:
                            del self.blocks[h]
            else:
                self.blocks.clear()

    def prefix_blocks(self, hashes: Sequence[ExternalBlockHash]) -> int:
        """How many leading blocks of ``hashes`` this worker holds (in a full-attention group)."""
        n = 0
        for h in hashes:
            held = self.blocks.get(h)
            if not held or all(g in self.sliding_groups for g, _ in held):
                break
            n += 1
        return n


@dataclass(frozen=True)
class Route:
    """A routing decision: the prefill's control address and why."""

    address: str
    cached_blocks: int
    """Leading blocks of the prompt the chosen worker announced as cached."""
    total_blocks: int
    load: int
    """Requests of this router in flight at the chosen worker before this one."""


class KVRouter:
    """Subscribes to prefill workers' KV events and routes requests by longest cached prefix; see the
    module docstring. ``workers`` maps each prefill's control address to its KV events endpoint."""

    def __init__(self, workers: Mapping[str, str], *, tokens_per_block: int = 16,
                 hash_algo: str = DEFAULT_HASH_ALGO, scope: ReuseScope = DEFAULT_SCOPE, topic: str = "",
                 zmq_context: zmq.Context[Any] | None = None) -> None:
        if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
            raise ConfigError(f"KVRouter: tokens_per_block must be an int > 0, got {tokens_per_block!r}")
        self.tokens_per_block, self.hash_algo, self.scope = tokens_per_block, hash_algo, scope
        request_block_hashes([0] * tokens_per_block, tokens_per_block, hash_algo=hash_algo, scope=scope)  # validates
        self._topic = topic.encode()
        self._zmq = zmq_context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._index: dict[str, WorkerIndex] = {}
        self._load: dict[str, int] = {}
        self._endpoints: dict[str, str] = {}
        self._pending: list[tuple[str, str | None, str | None]] = []   # (address, endpoint or None to remove,
        # replay endpoint), for the thread
        self._rotation = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        """What ended the subscriber thread, if anything did (routing then uses the last known state)."""
        for address, endpoint in workers.items():
            self.add_worker(address, endpoint)
        self._thread = threading.Thread(target=self._run, name="kvxfer-router", daemon=True)
        self._thread.start()

    # --- workers ----------------------------------------------------------------------------------
    def add_worker(self, address: str, endpoint: str, replay: str | None = None) -> None:
        """Route to the prefill at ``address`` too, learning its cache from the events at ``endpoint`` (and
        first from what its publisher's ``replay`` endpoint still buffers, when given)."""
        with self._lock:
            if address in self._endpoints:
                raise ConfigError(f"KVRouter: worker {address} is already routed to")
            self._endpoints[address] = endpoint
            self._index[address] = WorkerIndex(replaying=replay is not None)
            self._load[address] = 0
            self._pending.append((address, endpoint, replay))

    def remove_worker(self, address: str) -> bool:
        """Stop routing to ``address`` (a lost prefill) and forget its cache. False when unknown."""
        with self._lock:
            if self._endpoints.pop(address, None) is None:
                return False
            del self._index[address], self._load[address]
            self._pending.append((address, None, None))
            return True

    @property
    def workers(self) -> list[str]:
        """The routed prefill addresses, in the order added."""
        with self._lock:
            return list(self._endpoints)

    def cached_blocks(self, address: str) -> int:
        """How many block hashes the worker at ``address`` currently announces."""
        with self._lock:
            return len(self._index[address].blocks)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per worker: announced blocks, batches received, sequence gaps seen, requests in flight."""
        with self._lock:
            return {a: {"blocks": len(ix.blocks), "batches": ix.batches, "gaps": ix.gaps, "in_flight": self._load[a]}
                    for a, ix in self._index.items()}

    # --- routing ----------------------------------------------------------------------------------
    def route(self, tokens: npt.ArrayLike) -> Route:
        """Choose the prefill for a prompt and count the request in flight there until ``finished``."""
        hashes = request_block_hashes(tokens, self.tokens_per_block, hash_algo=self.hash_algo, scope=self.scope)
        with self._lock:
            if not self._index:
                raise ConfigError("KVRouter.route: no prefill worker to route to")
            addresses = list(self._index)
            self._rotation += 1
            n = len(addresses)

            def score(i: int) -> tuple[int, int, int]:
                a = addresses[i]
                return (-self._index[a].prefix_blocks(hashes), self._load[a], (i - self._rotation) % n)

            best = min(range(n), key=score)
            address = addresses[best]
            cached, load = -score(best)[0], self._load[address]
            self._load[address] += 1
        return Route(address, cached, len(hashes), load)

    def finished(self, route: Route) -> None:
        """The routed request is done at its prefill (its KV arrived, or it failed)."""
        with self._lock:
            if self._load.get(route.address, 0) > 0:
                self._load[route.address] -= 1

    # --- subscriber thread ------------------------------------------------------------------------
    def _run(self) -> None:
        sockets: dict[str, list[zmq.Socket[Any]]] = {}   # per worker: SUB, then the replay DEALER while it runs
        replay_until: dict[str, float] = {}
        poller = zmq.Poller()

        def drop(address: str, sock: zmq.Socket[Any]) -> None:
            poller.unregister(sock)
            sock.close(0)
            sockets[address].remove(sock)

        try:
            while not self._stop.is_set():
                with self._lock:
                    pending, self._pending = self._pending, []
                for address, endpoint, replay in pending:
                    for old in list(sockets.get(address, [])):
                        drop(address, old)
                    sockets.pop(address, None)
                    if endpoint is None:
                        continue
                    sub: zmq.Socket[Any] = self._zmq.socket(zmq.SUB)
                    sub.setsockopt(zmq.LINGER, 0)
                    sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                    sub.connect(endpoint)
                    sockets[address] = [sub]
                    poller.register(sub, zmq.POLLIN)
                    if replay is not None:   # after the SUB: what it misses meanwhile, the replay has
                        dealer: zmq.Socket[Any] = self._zmq.socket(zmq.DEALER)
                        dealer.setsockopt(zmq.LINGER, 0)
                        dealer.connect(replay)
                        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                        replay_until[address] = time.monotonic() + REPLAY_TIMEOUT_S
                        sockets[address].append(dealer)
                        poller.register(dealer, zmq.POLLIN)
                ready = dict(poller.poll(int(POLL_S * 1000))) if sockets else {}
                if not sockets:
                    self._stop.wait(POLL_S)
                for address, until in list(replay_until.items()):
                    socks = sockets.get(address, [])
                    if len(socks) < 2:
                        del replay_until[address]
                    elif time.monotonic() >= until and socks[1] not in ready:
                        log.warning("KV router: %s did not finish its replay within %.1f s; using live events only",
                                    address, REPLAY_TIMEOUT_S)
                        drop(address, socks[1])
                        del replay_until[address]
                        self._replayed(address)
                for address, socks in list(sockets.items()):
                    for sock in list(socks):
                        if sock not in ready:
                            continue
                        replayed = sock.type == zmq.DEALER
                        while True:
                            try:
                                frames = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if replayed and len(frames) == 3 and frames[1] == END_SEQ:
                                self._replayed(address)
                                drop(address, sock)
                                break
                            self._receive(address, frames, replayed=replayed)   # replay: [b"", seq, payload]
        except Exception as exc:   # reported: routing goes on with what is known, the error is visible
            self.error = exc
            log.exception("KV router: the event subscriber failed")
        finally:
            for socks in sockets.values():
                for sock in socks:
                    sock.close(0)

    def _receive(self, address: str, frames: list[bytes], *, replayed: bool = False) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("KV router: %s sent a message of %d frames, not [topic, seq, payload]; ignored",
                        address, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("KV router: %s sent an undecodable batch %d: %s; ignored", address, seq, exc)
            return
        with self._lock:
            index = self._index.get(address)
            if index is None:
                return
            if index.replaying and not replayed:
                index.held.append((seq, batch))
                return
            self._apply(index, seq, batch)

    @staticmethod
    def _apply(index: WorkerIndex, seq: int, batch: KVEventBatch) -> None:
        """Apply one batch unless already applied (a replayed batch also seen live); count skipped ones."""
        if seq <= index.last_seq:
            return
        if index.last_seq >= 0 and seq > index.last_seq + 1:
            index.gaps += seq - index.last_seq - 1
        index.last_seq = seq
        index.apply(batch)

    def _replayed(self, address: str) -> None:
        """The replay ended: apply the live batches held meanwhile, in order."""
        with self._lock:
            index = self._index.get(address)
            if index is None:
                return
            index.replaying = False
            held, index.held = sorted(index.held, key=lambda x: x[0]), []
            for seq, batch in held:
                self._apply(index, seq, batch)

    @property
    def running(self) -> bool:
        """Whether the subscriber thread still follows the workers' events."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the subscriber thread and close its sockets."""
        self._stop.set()
        self._thread.join(5.0)

    def __enter__(self) -> KVRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
