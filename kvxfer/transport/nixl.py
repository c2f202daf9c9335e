"""NIXL backend: one-sided UCX READ/WRITE on registered host (DRAM) or GPU (VRAM) memory.

Descriptor lists are prepared once per (peer, memory type, unit) as a grid: every region of that
memory type cut into ``unit``-byte descriptors. A plan is posted by index into the two grids
(``make_prepped_xfer``), so posting costs index arithmetic, not descriptor preparation; the unit is
the largest that divides every offset and length of the plan, so coalesced plans use few, large
descriptors. The notification travels with the transfer. A prepared transfer (``Transport.prepare``)
makes its NIXL requests once and each post reposts them with its own notification (``transfer(req,
notif)``), as NIXL intends prepared requests to be used. NIXL's UCX endpoints are created with
error handling off (so UCX may use shared memory and CMA on one host, not only tcp): a dead peer is
therefore detected by the caller's deadline (TransferTimeout), as the control plane owns failure
detection (docs/architecture.md, "Decisions": failures bounded in time).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import BackendUnavailable, PeerUnreachable, TransferFailed, TransportError
from kvxfer.pagetable import BlockPlan, PageTable, TransferPlan
from kvxfer.transport.base import Op, Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.metadata import TransportMetadata
from kvxfer.transport.prepared import PreparedTransfer
from kvxfer.transport.ucx_env import NIXL_MODULES, load_nixl_api, nixl_module

#: Largest descriptor grid prepared for one (side, memory type, unit); beyond it the plan's own
#: descriptors are prepared for that post alone.
MAX_GRID_DESCRIPTORS = 1 << 20
#: Prepared grids kept per transport (least recently used are released first).
MAX_CACHED_GRIDS = 32
_LOCAL = ""


__all__ = ["NIXL_MODULES", "NixlTransport", "nixl_logs_to_stderr", "nixl_module", "nixl_unavailable_reason"]


def nixl_logs_to_stderr() -> None:
    """Point the ``nixl`` Python logger's console handlers at stderr: NIXL configures them on sys.stdout,
    which would mix its INFO lines into a command's machine-readable output."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stdout,
                                                                                               sys.__stdout__):
            handler.setStream(sys.stderr)


def nixl_unavailable_reason() -> str | None:
    """None when the NIXL binding is installed, else why not (found without importing it)."""
    if nixl_module() is None:
        return "no NIXL binding is installed (pip install nixl-cu12, or nixl-cu13 for CUDA 13)"
    return None


def _mem_type(region: MemoryRegion) -> str:
    return "VRAM" if region.memory_kind == "cuda" else "DRAM"


class _Grid:
    """A prepared descriptor list covering every region of one memory type in ``unit`` steps."""

    def __init__(self, handle: Any, first: npt.NDArray[np.int64], units: int) -> None:
        self.handle = handle
        self.first = first  # per region index: grid index of its first unit (-1: other memory type)
        self.units = units

    def indices(self, table: PageTable, unit: int, regions: tuple[MemoryRegion, ...]) -> npt.NDArray[np.int32]:
        """Grid indices of every unit of every entry, in entry order."""
        base = np.array([r.base_address for r in regions], dtype=np.uint64)[table.region]
        start = self.first[table.region] + ((table.addr - base) // np.uint64(unit)).astype(np.int64)
        count = (table.nbytes // np.uint64(unit)).astype(np.int64)
        if np.all(count == 1):
            return start.astype(np.int32)
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        return (np.repeat(start, count) + within).astype(np.int32)


class NixlTransport(Transport):
    """One-sided transport over a NIXL agent (name = agent name) with a UCX backend."""

    backend = "nixl"

    def __init__(self, name: str, *, num_threads: int = 0, progress_thread: bool = True,
                 error_handling: bool = False) -> None:
        """``progress_thread``: NIXL's own thread progresses UCX (and delivers notifications) while
        this process computes; ``error_handling``: UCX endpoints with peer-failure handling
        (``ucx_error_handling_mode=peer``: a dead peer fails transfers instead of stalling them, but on
        one host UCX then avoids shared memory and CMA; see docs/transport.md for both costs)."""
        super().__init__(name)
        reason = nixl_unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(reason)
        module = nixl_module()
        try:
            api = load_nixl_api()
            nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        except Exception as exc:
            raise BackendUnavailable(f"{module} is not importable: {exc}") from exc
        nixl_logs_to_stderr()

        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
        params = {"ucx_error_handling_mode": "peer" if error_handling else "none"}
        if num_threads > 0:
            params["num_threads"] = str(num_threads)
        try:
            self._agent.create_backend("UCX", params)
        except Exception as exc:
            raise BackendUnavailable(f"NIXL UCX backend could not start: {exc}") from exc
        self._reg_descs: list[Any] = []
        self._grids: OrderedDict[tuple[str, str, int], _Grid] = OrderedDict()
        self._grid_lock = threading.Lock()

    # --- registration and peers ---------------------------------------------------------------------
    def _backend_register(self, regions: tuple[MemoryRegion, ...]) -> None:
        for mem in ("DRAM", "VRAM"):
            descs = [(r.base_address, r.nbytes, r.device_id, "") for r in regions if _mem_type(r) == mem]
            if descs:
                try:
                    self._reg_descs.append(self._agent.register_memory(descs, mem))
                except Exception as exc:
                    raise TransportError(f"nixl {self.name!r}: registering {len(descs)} {mem} regions "
                                         f"failed: {exc}") from exc

    def _backend_blob(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _backend_connect(self, peer: str, md: TransportMetadata) -> None:
        try:
            loaded = self._agent.add_remote_agent(md.backend_blob)
        except Exception as exc:
            raise PeerUnreachable(f"nixl {self.name!r}: peer {peer!r} metadata rejected by NIXL: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != peer:
            self._agent.remove_remote_agent(loaded)
            raise PeerUnreachable(f"nixl {self.name!r}: NIXL metadata names agent {loaded!r}, expected {peer!r}")

    def _backend_disconnect(self, peer: str) -> None:
        with self._grid_lock:
            for key in [k for k in self._grids if k[0] == peer]:
                self._grids.pop(key).handle.release()
        # The agent may already be gone on the NIXL side; forgetting it locally is what matters.
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer)

    def _backend_close(self) -> None:
        with self._grid_lock:
            for grid in self._grids.values():
                grid.handle.release()
            self._grids.clear()
        for descs in self._reg_descs:
            self._agent.deregister_memory(descs)
        self._reg_descs.clear()

    def _backend_poll_notifications(self) -> None:
        for peer, messages in self._agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            for msg in messages:
                self._deliver(name, msg)

    # --- transfers ----------------------------------------------------------------------------------
    def _grid(self, side: str, mem: str, unit: int, regions: tuple[MemoryRegion, ...]) -> _Grid | None:
        key = (side, mem, unit)
        with self._grid_lock:
            grid = self._grids.get(key)
            if grid is not None:
                self._grids.move_to_end(key)
                return grid
        same = np.array([_mem_type(r) == mem for r in regions], dtype=bool)
        counts = np.array([r.nbytes // unit for r in regions], dtype=np.int64) * same
        total = int(counts.sum())
        if total == 0 or total > MAX_GRID_DESCRIPTORS:
            return None
        first = np.where(same, np.cumsum(counts) - counts, -1).astype(np.int64)
        sel = np.flatnonzero(same)
        base = np.array([regions[i].base_address for i in sel], dtype=np.uint64)
        dev = np.array([regions[i].device_id for i in sel], dtype=np.uint64)
        within = np.arange(total, dtype=np.uint64) - np.repeat(
            (np.cumsum(counts[sel]) - counts[sel]).astype(np.uint64), counts[sel])
        descs = np.stack([np.repeat(base, counts[sel]) + within * np.uint64(unit),
                          np.full(total, unit, dtype=np.uint64), np.repeat(dev, counts[sel])], axis=1)
        handle = self._agent.prep_xfer_dlist(side or "NIXL_INIT_AGENT", descs, mem)
        grid = _Grid(handle, first, total)
        with self._grid_lock:
            self._grids[key] = grid
            while len(self._grids) > MAX_CACHED_GRIDS:
                self._grids.popitem(last=False)[1].handle.release()
        return grid

    def _prepare(self, op: Op, peer: str, plan: TransferPlan, notify: bytes) -> list[Any]:
        """NIXL transfer requests for the plan: one per (local, remote) memory-type pair."""
        md = self._peer(peer)
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        lmem = np.array([_mem_type(r) == "VRAM" for r in self._regions], dtype=bool)[local.region]
        rmem = np.array([_mem_type(r) == "VRAM" for r in md.regions], dtype=bool)[remote.region]
        groups = [(lv, rv) for lv in (False, True) for rv in (False, True)
                  if np.any((lmem == lv) & (rmem == rv))]
        requests = []
        for lv, rv in groups:
            sel = np.flatnonzero((lmem == lv) & (rmem == rv))
            whole = sel.size == len(local)
            lt = local if whole else _take(local, sel)
            rt = remote if whole else _take(remote, sel)
            lm, rm = ("VRAM" if lv else "DRAM"), ("VRAM" if rv else "DRAM")
            msg = notify if len(groups) == 1 else b""
            requests.append(self._request(op.upper(), peer, lt, lm, rt, rm, md.regions, msg))
        return requests

    def _request(self, nixl_op: str, peer: str, lt: PageTable, lm: str, rt: PageTable, rm: str,
                 remote_regions: tuple[MemoryRegion, ...], notify: bytes) -> Any:
        unit = _unit(lt, self._regions, rt, remote_regions)
        lg = self._grid(_LOCAL, lm, unit, self._regions)
        rg = self._grid(peer, rm, unit, remote_regions)
        if lg is not None and rg is not None:
            return self._agent.make_prepped_xfer(nixl_op, lg.handle, lg.indices(lt, unit, self._regions),
                                                 rg.handle, rg.indices(rt, unit, remote_regions), notify)
        ldev = np.array([r.device_id for r in self._regions], dtype=np.uint64)[lt.region]
        rdev = np.array([r.device_id for r in remote_regions], dtype=np.uint64)[rt.region]
        ldescs = self._agent.get_xfer_descs(np.stack([lt.addr, lt.nbytes, ldev], axis=1), lm)
        rdescs = self._agent.get_xfer_descs(np.stack([rt.addr, rt.nbytes, rdev], axis=1), rm)
        return self._agent.initialize_xfer(nixl_op, ldescs, rdescs, peer, notify)

    def _backend_post(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                      transfer_id: int, *, settled: bool = False) -> TransferHandle:
        if not len(plan):
            handle = TransferHandle(transfer_id, peer, 0, op)
            if notify is not None:
                self._agent.send_notif(peer, notify)
            handle._finish(TransferStatus.DONE)
            return handle
        try:
            requests = self._prepare(op, peer, plan, notify or b"")
        except TransportError:
            raise
        except Exception as exc:
            return _failed(transfer_id, peer, plan.total_bytes, op, f"NIXL could not prepare {len(plan)} "
                           f"descriptors: {exc!r}", exc)
        return self._start(op, peer, plan.total_bytes, requests, notify, transfer_id, per_post_notify=False)

    def _backend_prepare(self, op: Op, peer: str, plan: TransferPlan | BlockPlan) -> Any:
        """The plan's NIXL requests, made once (indices into the prepared grids) and reposted by each post
        with that post's notification, as NIXL's prepared transfers are meant to be used."""
        if isinstance(plan, BlockPlan):
            plan = plan.expand()
        if not len(plan):
            return None
        try:
            return _PreparedRequests(self._prepare(op, peer, plan, b""))
        except TransportError:
            raise
        except Exception as exc:
            raise TransferFailed(f"nixl {self.name!r}: NIXL could not prepare {len(plan)} descriptors for "
                                 f"peer {peer!r}: {exc!r}") from exc

    def _backend_post_prepared(self, prepared: PreparedTransfer, notify: bytes | None, transfer_id: int, *,
                               settled: bool = False) -> TransferHandle:
        """Repost the prepared requests; when they are still in flight (an earlier post), or this post
        carries no notification after one that did (a request keeps its last one), the plan is posted
        with requests of its own."""
        state, op, peer = prepared.backend_state, prepared.op, prepared.peer
        if not isinstance(state, _PreparedRequests):   # released by another thread since the post began
            raise TransportError(f"nixl {self.name!r}: prepared {op} to peer {peer!r} was released")
        requests = state.take(bool(notify))
        if requests is None:
            return self._backend_post(op, peer, prepared.expanded(), notify, transfer_id, settled=settled)
        return self._start(op, peer, prepared.nbytes, requests, notify, transfer_id, per_post_notify=True,
                           give_back=state.give_back)

    def _start(self, op: Op, peer: str, nbytes: int, requests: list[Any], notify: bytes | None, transfer_id: int,
               *, per_post_notify: bool, give_back: Callable[[list[Any]], None] | None = None) -> TransferHandle:
        """Post ``requests`` (one per memory-type pair) and return the handle that polls them. One request
        carries the notification (``per_post_notify``: given to this post, else made into the request);
        several are followed by it once all are done. ``give_back``: finished requests go back to their
        prepared transfer instead of being released (a failure releases them all)."""
        pending = list(requests)
        lock = threading.Lock()
        follow_up = notify if (notify is not None and len(requests) > 1) else None
        post_notify = (notify or b"") if per_post_notify and len(requests) == 1 else b""

        def fail(handle: TransferHandle, what: str, exc: Exception | None) -> None:
            _release_all(pending)
            handle._finish(TransferStatus.FAILED, f"{what}{f': {exc!r}' if exc else ''}", _error_type(exc))

        def poll(handle: TransferHandle) -> None:
            with lock:
                for req in list(pending):
                    try:
                        state = self._agent.check_xfer_state(req)
                    except Exception as exc:
                        fail(handle, "NIXL transfer state check failed", exc)
                        return
                    if state == "DONE":
                        pending.remove(req)
                        if give_back is None:
                            req.release()
                    elif state == "ERR":
                        fail(handle, "NIXL reported a transfer error", None)
                        return
                if not pending and not handle._status.terminal:
                    if follow_up is not None:
                        self._agent.send_notif(peer, follow_up)
                    if give_back is not None:
                        give_back(requests)
                    handle._finish(TransferStatus.DONE)

        def abort(handle: TransferHandle) -> bool:
            poll(handle)  # a request NIXL already finished cannot be cancelled any more
            if handle._status.terminal:
                return False
            with lock:
                _release_all(pending)
            return True

        handle = _NixlHandle(transfer_id, peer, nbytes, op, poll=poll, abort=abort)
        for req in requests:
            try:
                state = self._agent.transfer(req, post_notify)   # b"": the request's own notification, if any
            except Exception as exc:
                with lock:
                    fail(handle, "NIXL refused to post the transfer", exc)
                return handle
            if state == "ERR":
                with lock:
                    fail(handle, "NIXL refused to post the transfer", None)
                return handle
        return handle


class _PreparedRequests:
    """nixl's state of a prepared transfer: its NIXL requests, held by one post at a time. NIXL refuses to
    repost a request in flight, and a request keeps the last notification a post gave it; ``take`` returns
    None then (the post makes requests of its own). A post that fails releases the requests: later posts
    make their own."""

    __slots__ = ("_idle", "_lock", "_notified")

    def __init__(self, requests: list[Any]) -> None:
        self._idle: list[Any] | None = requests
        self._notified = False
        self._lock = threading.Lock()

    def take(self, notifies: bool) -> list[Any] | None:
        """The requests for one post (``notifies``: it gives them a notification), or None."""
        with self._lock:
            requests = self._idle
            if requests is None or (self._notified and not notifies):
                return None
            self._idle = None
            self._notified = self._notified or (notifies and len(requests) == 1)
            return requests

    def give_back(self, requests: list[Any]) -> None:
        """The requests' post finished: the next post may take them."""
        with self._lock:
            self._idle = requests


class _NixlHandle(TransferHandle):
    """NIXL reports completion only when asked (``check_xfer_state``): ``wait`` asks back to back, as
    NIXL's own examples do, instead of sleeping between asks (a sleep that backs off to a millisecond adds
    up to that to every transfer). Between asks it yields the CPU with the GIL released
    (``os.sched_yield``, ~1 us); every ``WAIT_SLEEP_EVERY_S`` it sleeps once (``time.sleep(0)``, 55-75 us of
    Linux timer slack) so that the process's other threads get the GIL. Against sleeping between every two
    asks it measures alike (docs/gpu.md "NIXL"); it stays, being the loop NIXL's examples use."""

    def wait(self, timeout: float | None = None) -> None:
        now = time.monotonic()
        deadline = None if timeout is None else now + max(0.0, timeout)
        slept = now
        while not self._poll_once().terminal:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if now - slept >= WAIT_SLEEP_EVERY_S:
                time.sleep(0)
                slept = now
            else:
                _yield_cpu()
        self._raise_unless_done(timeout)


#: How long ``_NixlHandle.wait`` yields between asks before it sleeps once (0: sleep between every two).
WAIT_SLEEP_EVERY_S = 0.0005


#: Gives the CPU and the GIL up for a moment: ``os.sched_yield`` (no timer slack) where the OS has it.
_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _error_type(exc: Exception | None) -> type[TransportError]:
    """PeerUnreachable for NIXL's disconnect errors, TransferFailed for anything else."""
    return PeerUnreachable if exc is not None and "DISCONNECT" in f"{type(exc).__name__}{exc}".upper() else TransferFailed


def _failed(transfer_id: int, peer: str, nbytes: int, op: Op, reason: str, exc: Exception) -> TransferHandle:
    handle = TransferHandle(transfer_id, peer, nbytes, op)
    handle._finish(TransferStatus.FAILED, reason, _error_type(exc))
    return handle


def _release_all(requests: list[Any]) -> None:
    """Release (and so abort) every request still held; one that cannot be aborted stays with NIXL."""
    while requests:
        req = requests.pop()
        # NIXL keeps a request it cannot abort in its own leak list and frees it at agent exit.
        with contextlib.suppress(Exception):
            req.release()


def _take(table: PageTable, sel: npt.NDArray[np.intp]) -> PageTable:
    return PageTable(table.addr[sel], table.nbytes[sel], table.region[sel])


def _unit(lt: PageTable, lregions: tuple[MemoryRegion, ...], rt: PageTable,
          rregions: tuple[MemoryRegion, ...]) -> int:
    """Largest unit dividing every entry length and every entry offset inside its region (both sides)."""
    lbase = np.array([r.base_address for r in lregions], dtype=np.uint64)[lt.region]
    rbase = np.array([r.base_address for r in rregions], dtype=np.uint64)[rt.region]
    parts = [int(np.gcd.reduce(lt.nbytes)), int(np.gcd.reduce(lt.addr - lbase)),
             int(np.gcd.reduce(rt.addr - rbase))]
    return max(1, math.gcd(*parts))
