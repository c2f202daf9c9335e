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
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import BackendUnavailable, PageTableError, PeerUnreachable, TransferFailed, TransportError
from kvxfer.pagetable import BlockPlan, PageTable, PhasedPlan, TransferPlan
from kvxfer.transport.base import MAX_NOTIFY_BYTES, Op, Transport
from kvxfer.transport.handle import TransferHandle, TransferStatus
from kvxfer.transport.metadata import TransportMetadata
from kvxfer.transport.prepared import PreparedTransfer
from kvxfer.transport.ucx_env import NIXL_MODULES, load_nixl_api, nixl_module

#: Largest descriptor grid prepared for one (side, memory type, unit); beyond it the plan's own
#: descriptors are prepared for that post alone.
MAX_GRID_DESCRIPTORS = 1 << 20
#: Prepared grids kept per transport (least recently used are released first).
MAX_CACHED_GRIDS = 32
#: Plans of at most this many entries are checked and indexed in one pass over Python ints (numpy's
#: per-call cost would be most of a one-page post); larger ones with arrays.
SMALL_POST_ENTRIES = 16
#: Plans of the KV pool's shape (``NixlTransport._cells``) of at most this many entries are checked through
#: lists (C loops over Python ints); larger ones through arrays (a handful of numpy calls whatever their size).
LIST_CELLS = 128
#: BlockPlans of at most this many runs are posted as their expansion when it has the KV pool's shape
#: (``NixlTransport._cells``): measured cheaper up to a few thousand runs than the O(blocks + template)
#: checks, and alike above (where NIXL's own per-descriptor work decides).
EXPANDED_BLOCK_RUNS = 4096
#: The byte order of the plans' columns (native), for comparing a column with a repeated value as bytes.
_ORDER: Literal["little", "big"] = sys.byteorder
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


class _Side:
    """One side's registered regions as the post path reads them, worked out once per registration (this
    transport's) or connection (a peer's): bounds as Python ints and as arrays, memory types, and the one
    memory type every region shares (None when they differ)."""

    __slots__ = ("base", "base_np", "end", "mem", "mems", "regions", "vram_np")

    def __init__(self, regions: tuple[MemoryRegion, ...]) -> None:
        self.regions = regions
        self.base = [r.base_address for r in regions]
        self.end = [r.end_address for r in regions]
        self.base_np = np.array(self.base, dtype=np.uint64)
        self.mems = [_mem_type(r) for r in regions]
        self.vram_np = np.array([m == "VRAM" for m in self.mems], dtype=bool)
        kinds = set(self.mems)
        self.mem: str | None = kinds.pop() if len(kinds) == 1 else None


class _Grid:
    """A prepared descriptor list covering every region of one memory type in ``unit`` steps."""

    def __init__(self, handle: Any, first: npt.NDArray[np.int64], units: int) -> None:
        self.handle = handle
        #: NIXL's own number for the list (what its binding takes), or None where the wrapper hides it.
        self.raw: int | None = getattr(handle, "_handle", None)
        self.first = first  # per region index: grid index of its first unit (-1: other memory type)
        self.first_list: list[int] = first.tolist()
        self.units = units

    def indices(self, table: PageTable, unit: int, base: npt.NDArray[np.uint64]) -> npt.NDArray[np.int32]:
        """Grid indices of every unit of every entry, in entry order (``base``: the regions' base addresses)."""
        start: npt.NDArray[np.int64]
        if base.size == 1:   # one region: scalars, no gathers
            start = ((table.addr - base[0]) // np.uint64(unit)).astype(np.int64) + int(self.first[0])
        else:
            start = self.first[table.region] + ((table.addr - base[table.region]) // np.uint64(unit)).astype(np.int64)
        count = (table.nbytes // np.uint64(unit)).astype(np.int64)
        if int(count.min()) == 1 and int(count.max()) == 1:
            return start.astype(np.int32)
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        return (np.repeat(start, count) + within).astype(np.int32)


class NixlTransport(Transport):
    """One-sided transport over a NIXL agent (name = agent name) with a UCX backend."""

    backend = "nixl"
    #: NIXL's agent lock. Without a listen thread NIXL's default is none, and its UCX worker is then
    #: created for serialized use (one thread in it at a time): two threads posting or polling one agent at
    #: once (a vLLM rank's concurrent reads, a worker's pushes) corrupted UCX's worker, so transfers
    #: stalled or the process crashed (docs/transport.md "Threads"). STRICT: NIXL serializes every call.
    _THREAD_SYNC = "NIXL_THREAD_SYNC_STRICT"

    def __init__(self, name: str, *, num_threads: int = 0, progress_thread: bool = False,
                 error_handling: bool = False) -> None:
        """``progress_thread``: NIXL's own thread progresses UCX (and delivers notifications) while this
        process computes. Off by default, by measurement (docs/transport.md "Defaults"): NIXL's thread
        polls without pausing, so it takes a core while idle and, on a 2-core host, cut bandwidth 2.5-4x
        (4096 x 16 KiB writes 0.7-1.5 GB/s on, 2.4-3.8 GB/s off, raw NIXL alike) with no gain in one-page
        latency; without it, posting and ``wait``/``notifications()`` progress UCX, which one-sided
        shared memory, CMA and RDMA need and TCP (``error_handling``) gets from a peer that polls, as
        kvxfer's workers do. ``num_threads``: NIXL's UCX worker threads (0: NIXL's default; 2 measured
        alike on 2 cores). ``error_handling``: UCX endpoints with peer-failure handling
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

        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        sync = getattr(api, "nixl_thread_sync_t", None)
        if sync is not None:   # bindings that predate the choice lock as they always did
            config.sync_mode = getattr(sync, self._THREAD_SYNC)
        self._agent = nixl_agent(name, config)
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
        self._local = _Side(())
        self._sides: dict[str, _Side] = {}
        self._core = _Core.of(api, self._agent)

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
        self._local = _Side(regions)

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
        self._sides[peer] = _Side(md.regions)

    def _backend_disconnect(self, peer: str) -> None:
        self._sides.pop(peer, None)
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
    def _post(self, op: Op, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan, notify: bytes | None,
              settled: bool = False) -> TransferHandle:
        """A per-request plan of one entry (a page, or a coalesced run: the one-page post of a decode step,
        a layer chunk that coalesced into one run) is checked and posted by ``_post_one`` in straight-line
        code, one of 2-16 entries by ``_post_small``; anything they do not take (more entries, a fault to
        name, no grid yet) goes the general way, which checks everything again before a byte moves."""
        if (type(plan) is TransferPlan and self._core is not None and not self._closed
                and (notify is None or (type(notify) is bytes and len(notify) <= MAX_NOTIFY_BYTES))):
            n = plan.src.addr.size
            if n == 1:
                handle = self._post_one(op, peer, plan, notify)
                if handle is not None:
                    return handle
            elif n > 1:
                handle = self._post_cells(op, peer, plan, notify)
                if handle is not None:
                    return handle
                if n <= SMALL_POST_ENTRIES:
                    handle = self._post_small(op, peer, plan, notify)
                    if handle is not None:
                        return handle
        elif (type(plan) in (BlockPlan, PhasedPlan) and 0 < len(plan) <= EXPANDED_BLOCK_RUNS and self._core is not None
              and not self._closed and (notify is None or (type(notify) is bytes and len(notify) <= MAX_NOTIFY_BYTES))):
            # A small BlockPlan (or PhasedPlan) costs less as its expansion on the per-entry path than through
            # the template's checks (some thirty numpy calls); a fault, or another shape, goes the plan's own
            # way below, which names a fault by block and template run.
            assert isinstance(plan, BlockPlan | PhasedPlan)
            handle = self._post_cells(op, peer, plan.expand(), notify)
            if handle is not None:
                return handle
        return super()._post(op, peer, plan, notify, settled)

    def _post_cells(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None) -> TransferHandle | None:
        """Post a plan of the KV pool's shape (``_cells``: one region a side, every entry one grid cell)
        straight through NIXL's binding; None, before anything is made, for a fault (the general path names
        it) or a plan of another shape."""
        side = self._sides.get(peer)
        if side is None or peer not in self._peers:
            return None
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        cells = self._cells(op, peer, local, remote, side)
        if cells is None or cells is _FAULT:
            return None
        lg, li, rg, ri, nbytes = cells
        transfer_id = next(self._ids)
        core = self._core
        try:
            if core is None or lg.raw is None or rg.raw is None:
                return self._launch(op, peer, nbytes, self._make(op, lg, li, rg, ri, notify or b""), transfer_id)
            # ``_make`` and ``_launch`` inline (a chunk's post pays each frame): made, posted, and released at
            # once when NIXL finished it within the post.
            req = core.make(core.write if op == "write" else core.read, lg.raw, li, rg.raw, ri, notify or b"",
                            [], False)
        except Exception as exc:
            return _failed(transfer_id, peer, nbytes, op, f"NIXL could not prepare {len(plan)} "
                           f"descriptors: {exc!r}", exc)
        try:
            state = core.post(req, b"")
        except Exception as exc:
            return self._pending(op, peer, nbytes, req, transfer_id, None, exc)
        if state == core.success:
            core.release(req)
            return TransferHandle.completed(transfer_id, peer, nbytes, op)
        return self._pending(op, peer, nbytes, req, transfer_id, state, None)

    def _post_small(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None) -> TransferHandle | None:
        """``_post_one`` for a plan of a few entries (a layer-wise chunk of a short prompt): ``_small_request``
        checks (bounds, regions, no destination byte twice) and indexes it over ints, and its one request is
        launched; None, before anything is made, for a fault (the general path names it) or a plan that
        needs the general path."""
        side = self._sides.get(peer)
        if side is None or peer not in self._peers:
            return None
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        try:
            request, nbytes = self._small_request(op, peer, local, remote, side, notify or b"")
        except Exception as exc:
            return _failed(next(self._ids), peer, plan.total_bytes, op, f"NIXL could not prepare {len(plan)} "
                           f"descriptors: {exc!r}", exc)
        if request is _FAULT or request is None:
            return None
        return self._launch(op, peer, nbytes, request, next(self._ids))

    def _post_one(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None) -> TransferHandle | None:
        """Post a one-entry plan straight through NIXL's binding: both sides checked against the bounds
        worked out at registration/connection (an entry of a one-entry plan overlaps nothing), the grid
        indices computed in ints, the request made and posted, and released at once when NIXL finished it
        within the post (small transfers do). None, before anything is made, when the plan is not for this
        path (unknown peer, outside a region, several grid units, no grid prepared for its unit yet)."""
        side = self._sides.get(peer)
        if side is None or peer not in self._peers:
            return None
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        a, b, r = local.addr.item(), local.nbytes.item(), local.region.item()
        c, q = remote.addr.item(), remote.region.item()
        mine = self._local
        if r >= len(mine.base) or q >= len(side.base):
            return None
        lo, ro = a - mine.base[r], c - side.base[q]
        if b <= 0 or lo < 0 or ro < 0 or a + b > mine.end[r] or c + b > side.end[q]:
            return None
        unit = math.gcd(b, lo, ro)
        if unit != b:
            return None
        lg = self._grids.get((_LOCAL, mine.mems[r], unit))
        rg = self._grids.get((peer, side.mems[q], unit))
        if lg is None or rg is None:
            return None
        transfer_id = next(self._ids)
        try:
            req = self._make(op, lg, [lg.first_list[r] + lo // unit], rg, [rg.first_list[q] + ro // unit],
                             notify or b"")
        except Exception as exc:
            return _failed(transfer_id, peer, b, op, f"NIXL could not prepare 1 descriptor: {exc!r}", exc)
        return self._launch(op, peer, b, req, transfer_id)

    def _make(self, op: Op, lg: _Grid, li: Any, rg: _Grid, ri: Any, notify: bytes) -> Any:
        """The NIXL request moving grid cells ``li`` to ``ri`` (write; ``ri`` to ``li`` for a read): NIXL's
        own number for it when the binding is at hand (``_launch`` posts it), else the agent's handle."""
        core = self._core
        if core is not None and lg.raw is not None and rg.raw is not None:
            return core.make(core.write if op == "write" else core.read, lg.raw, li, rg.raw, ri, notify, [], False)
        return self._agent.make_prepped_xfer("WRITE" if op == "write" else "READ", lg.handle, li, rg.handle, ri,
                                             notify)

    def _launch(self, op: Op, peer: str, nbytes: int, req: Any, transfer_id: int) -> TransferHandle:
        """Post one request ``_make`` made (its notification, if any, travels with it): released at once when
        NIXL finished it within the post (small transfers do), a handle already done returned; else the
        handle that polls it (``_pending``)."""
        core = self._core
        if type(req) is not int or core is None:
            return self._start(op, peer, nbytes, [req], None, transfer_id, per_post_notify=False)
        try:
            state = core.post(req, b"")
        except Exception as exc:
            return self._pending(op, peer, nbytes, req, transfer_id, None, exc)
        if state == core.success:
            core.release(req)
            return TransferHandle.completed(transfer_id, peer, nbytes, op)
        return self._pending(op, peer, nbytes, req, transfer_id, state, None)

    def _pending(self, op: Op, peer: str, nbytes: int, req: int, transfer_id: int, state: Any,
                 exc: Exception | None) -> TransferHandle:
        """The handle of a request posted through the binding that NIXL did not finish within the post:
        polled to completion while in progress, failed when NIXL refused it (``exc``: the post raised)."""
        core = self._core
        assert core is not None
        handle = _NixlHandle(self, transfer_id, peer, nbytes, op, [core.wrap(core.agent, req)], None, None)
        if exc is not None or state != core.in_progress:
            with handle._req_lock:
                handle._fail("NIXL refused to post the transfer", exc)
        return handle

    def _grid(self, side: str, mem: str, unit: int, regions: tuple[MemoryRegion, ...]) -> _Grid | None:
        key = (side, mem, unit)
        grid = self._grids.get(key)   # one dict lookup on the post path; the lock guards making one
        if grid is not None:
            return grid
        with self._grid_lock:
            grid = self._grids.get(key)
            if grid is not None:
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
            made = self._grids.get(key)
            if made is not None:   # another thread made it meanwhile: one grid per key, ours released
                handle.release()
                return made
            self._grids[key] = grid
            while len(self._grids) > MAX_CACHED_GRIDS:   # the oldest made goes first
                self._grids.popitem(last=False)[1].handle.release()
        return grid

    def _backend_post_blocks(self, op: Op, peer: str, plan: BlockPlan, notify: bytes | None, transfer_id: int,
                             check: Callable[[], None], *, settled: bool = False) -> TransferHandle | None:
        """A BlockPlan posted without its expansion: checked in O(blocks + template) (``check``: bounds per
        template run at the extreme slots, destination disjoint by the template's shape), and its grid cells
        computed from the template straight into the index arrays NIXL takes (``_block_cells``: one outer
        sum a side), so no TransferPlan of B x T entries is made, checked or indexed. None, before anything
        is made, where the template's sides mix memory types or the grid would be too fine (the caller
        checks the plan and posts its expansion)."""
        return self._post_templates(op, peer, [plan], notify, transfer_id, check)

    def _backend_post_phases(self, op: Op, peer: str, plan: PhasedPlan, notify: bytes | None, transfer_id: int,
                             check: Callable[[], None], *, settled: bool = False) -> TransferHandle | None:
        """A PhasedPlan as one request: ``_backend_post_blocks`` over every phase, their cells side by side
        (one grid unit for all: the gcd over every phase's template)."""
        return self._post_templates(op, peer, [p for p in plan.phases if len(p)], notify, transfer_id, check)

    def _post_templates(self, op: Op, peer: str, plans: list[BlockPlan], notify: bytes | None, transfer_id: int,
                        check: Callable[[], None]) -> TransferHandle | None:
        """``check`` (O(blocks + template)), then one request over the cells of every plan (``_block_cells``)."""
        side = self._sides.get(peer)
        if side is None or not sum(len(p) for p in plans):
            return None
        check()
        nbytes = sum(p.total_bytes for p in plans)
        try:
            cells = self._block_cells(op, peer, plans, side)
            if cells is None:
                return None
            request = self._make(op, cells[0], cells[1], cells[2], cells[3], notify or b"")
        except Exception as exc:
            return _failed(transfer_id, peer, nbytes, op, f"NIXL could not prepare {sum(len(p) for p in plans)} "
                           f"descriptors: {exc!r}", exc)
        return self._launch(op, peer, nbytes, request, transfer_id)

    def _block_cells(self, op: Op, peer: str, plans: list[BlockPlan], side: _Side
                     ) -> tuple[_Grid, Any, _Grid, Any] | None:
        """(local grid, local cells, remote grid, remote cells) of checked BlockPlans, in their expansions'
        order (plan after plan, block by block, template order inside a block): the unit is the gcd of every
        template run's length, step and offset inside its region on both sides (it divides every run's
        offset, whatever the slot), each template run becomes its cells of one slot, and run (b, t)'s cells
        are block b's slot x the run's step in cells plus those. O(T) work on the templates, then one outer
        sum per plan and side. None when a side's runs lie in regions of several memory types or no grid
        serves the unit."""
        mine = self._local
        sides = []
        for plan in plans:
            src = (plan.src_slots, plan.src_step, plan.src_offset, plan.src_region)
            dst = (plan.dst_slots, plan.dst_step, plan.dst_offset, plan.dst_region)
            sides.append((src, dst) if op == "write" else (dst, src))
        lregs = np.concatenate([lt[3] for lt, _ in sides])
        rregs = np.concatenate([rt[3] for _, rt in sides])
        lm = mine.mem or _one_mem(mine.mems, lregs)
        rm = side.mem or _one_mem(side.mems, rregs)
        if lm is None or rm is None:
            return None
        # Offsets inside their regions, signed: a template offset may lie below its region's base when no
        # block of slot 0 is moved (the check bounded every run at the slots the plan names).
        rels = [(lt[2].astype(np.int64) - mine.base_np[lt[3]].astype(np.int64),
                 rt[2].astype(np.int64) - side.base_np[rt[3]].astype(np.int64)) for lt, rt in sides]
        unit = int(np.gcd.reduce(np.concatenate([a for plan, (lt, rt), (lr, rr) in zip(plans, sides, rels, strict=True)
                                                 for a in (plan.nbytes.astype(np.int64), lt[1].astype(np.int64), lr,
                                                           rt[1].astype(np.int64), rr)])))
        if unit <= 0:
            return None
        lg = self._grid(_LOCAL, lm, unit, mine.regions)
        rg = self._grid(peer, rm, unit, side.regions)
        if lg is None or rg is None:
            return None
        lcells: list[npt.NDArray[np.int32]] = []
        rcells: list[npt.NDArray[np.int32]] = []
        for plan, (lt, rt), (lrel, rrel) in zip(plans, sides, rels, strict=True):
            count = plan.nbytes.astype(np.int64) // unit
            pick: Any = slice(None)
            within: Any = 0
            if int(count.max()) != 1 or int(count.min()) != 1:   # runs of several cells: the template cut into cells
                pick = np.repeat(np.arange(count.size), count)
                within = np.arange(pick.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
            for (slots, step, _, region), rel, grid, out in ((lt, lrel, lg, lcells), (rt, rrel, rg, rcells)):
                first = grid.first[region[pick]] + rel[pick] // unit + within
                cells: npt.NDArray[np.int64] = slots.astype(np.int64)[:, None] \
                    * (step[pick].astype(np.int64) // unit)[None, :] + first[None, :]
                out.append(cells.ravel().astype(np.int32))
        li = lcells[0] if len(lcells) == 1 else np.concatenate(lcells)
        ri = rcells[0] if len(rcells) == 1 else np.concatenate(rcells)
        return lg, li, rg, ri

    def _backend_post_checking(self, op: Op, peer: str, plan: TransferPlan, notify: bytes | None,
                               transfer_id: int, check: Callable[[], None], *,
                               settled: bool = False) -> TransferHandle | None:
        """The post path of a per-request plan: a few entries are checked and turned into grid indices in
        one pass over Python ints (``check`` runs only to name a fault that pass found); more entries are
        checked by ``check`` (vectorised) and indexed with arrays. Everything that depends only on the
        registrations (bounds, memory types, the prepared grids) was worked out before."""
        n = len(plan.src)
        side = self._sides.get(peer)
        if n == 0 or side is None:
            return None
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        if n <= SMALL_POST_ENTRIES:
            try:
                request, nbytes = (self._one_request if n == 1 else self._small_request)(
                    op, peer, local, remote, side, notify or b"")
            except Exception as exc:
                return _failed(transfer_id, peer, plan.total_bytes, op, f"NIXL could not prepare {n} "
                               f"descriptors: {exc!r}", exc)
            if request is _FAULT:
                check()   # raises, naming the entry and the side
                raise PageTableError(f"{op} with peer {peer!r}: the plan lies outside the registered regions")
            if request is None:
                return None
            return self._launch(op, peer, nbytes, request, transfer_id)
        else:
            nbytes = plan.total_bytes
            try:
                cells = self._cells(op, peer, local, remote, side)
                request = None if cells is None or cells is _FAULT else \
                    self._make(op, cells[0], cells[1], cells[2], cells[3], notify or b"")
            except Exception as exc:
                return _failed(transfer_id, peer, nbytes, op, f"NIXL could not prepare {n} "
                               f"descriptors: {exc!r}", exc)
            if cells is _FAULT:
                check()
                raise PageTableError(f"{op} with peer {peer!r}: the plan lies outside the registered regions "
                                     f"or writes a destination byte twice")
            if request is not None:
                return self._launch(op, peer, nbytes, request, transfer_id)
            check()
            try:
                requests = self._requests(op, peer, local, remote, side, notify or b"")
            except Exception as exc:
                return _failed(transfer_id, peer, nbytes, op, f"NIXL could not prepare {n} "
                               f"descriptors: {exc!r}", exc)
        return self._start(op, peer, nbytes, requests, notify, transfer_id, per_post_notify=False)

    def _one_request(self, op: Op, peer: str, local: PageTable, remote: PageTable, side: _Side,
                     notify: bytes) -> tuple[Any, int]:
        """``_small_request`` for a plan of one entry (a page, or a coalesced run), in straight-line code:
        the one-page post of a decode step pays this path."""
        mine = self._local
        a, = local.addr.tolist()
        b, = local.nbytes.tolist()
        r, = local.region.tolist()
        c, = remote.addr.tolist()
        q, = remote.region.tolist()
        if r >= len(mine.base) or q >= len(side.base):
            return _FAULT, 0
        lo, ro = a - mine.base[r], c - side.base[q]
        if lo < 0 or a + b > mine.end[r] or ro < 0 or c + b > side.end[q]:
            return _FAULT, 0
        lm, rm = mine.mems[r], side.mems[q]
        unit = math.gcd(b, lo, ro) or 1
        lg = self._grids.get((_LOCAL, lm, unit)) or self._grid(_LOCAL, lm, unit, mine.regions)
        rg = self._grids.get((peer, rm, unit)) or self._grid(peer, rm, unit, side.regions)
        if lg is None or rg is None:
            return None, 0
        if b == unit:
            li: Any = [lg.first_list[r] + lo // unit]
            ri: Any = [rg.first_list[q] + ro // unit]
        else:
            li = np.arange(lg.first_list[r] + lo // unit, lg.first_list[r] + (lo + b) // unit, dtype=np.int32)
            ri = np.arange(rg.first_list[q] + ro // unit, rg.first_list[q] + (ro + b) // unit, dtype=np.int32)
        return self._make(op, lg, li, rg, ri, notify), b

    def _cells(self, op: Op, peer: str, local: PageTable, remote: PageTable, side: _Side) -> Any:
        """The grid cells of a plan of the KV pool's shape - every entry of a side in one registered region,
        one length throughout that is also the grid unit (a layer-wise chunk, a page table of whole blocks,
        a layer's pages in an engine that registers a tensor per layer) - checked on the way: regions,
        bounds, no destination cell twice. No Python work per entry beyond one division, and nothing that
        depends only on the registrations: a few entries go through lists (C loops: ``min``, ``max``,
        ``sum``, ``set``), more through one (2, n) array of both sides' offsets (a handful of numpy calls
        whatever n). Returns (local grid, local cells, remote grid, remote cells, bytes); ``_FAULT`` when a
        check fails; None when the plan is not of that shape (the general path takes it)."""
        mine = self._local
        nb, lreg, rreg = local.nbytes, local.region, remote.region
        n = nb.size
        length, r, q = nb.item(0), lreg.item(0), rreg.item(0)
        # One length, and one region a side, compared as bytes: a memcmp each where numpy's comparison and
        # reduction are two calls (the columns are C-contiguous and native: PageTable).
        if length <= 0 or nb.tobytes() != length.to_bytes(8, _ORDER) * n:
            return None
        if lreg.tobytes() != r.to_bytes(4, _ORDER) * n or rreg.tobytes() != q.to_bytes(4, _ORDER) * n:
            return None
        if r >= len(mine.base) or q >= len(side.base):
            return _FAULT
        lb, rb = mine.base[r], side.base[q]
        ltop, rtop = mine.end[r] - length, side.end[q] - length   # the highest address an entry may start at
        lm, rm = mine.mems[r], side.mems[q]
        lg = self._grids.get((_LOCAL, lm, length)) or self._grid(_LOCAL, lm, length, mine.regions)
        rg = self._grids.get((peer, rm, length)) or self._grid(peer, rm, length, side.regions)
        if lg is None or rg is None:
            return None
        lf, rf = lg.first_list[r], rg.first_list[q]
        li: Any
        ri: Any
        if n <= LIST_CELLS:
            # Python's C loops over the addresses (numpy's per-call cost, ~3-6 us each once the copy of the
            # post before has flushed the caches, would be most of a chunk's post): bounds by the extremes,
            # each entry's cell by one division, the offsets on the cell grid when the cells account for
            # every byte of them (a remainder is never negative above the base), no cell twice.
            la, ra = local.addr.tolist(), remote.addr.tolist()
            if min(la) < lb or max(la) > ltop or min(ra) < rb or max(ra) > rtop:
                return _FAULT
            li = [(a - lb) // length + lf for a in la]
            ri = [(a - rb) // length + rf for a in ra]
            if (sum(li) - n * lf) * length != sum(la) - n * lb or (sum(ri) - n * rf) * length != sum(ra) - n * rb:
                return None   # an offset off the cell grid: a smaller unit (the general path)
            if len(set(ri if op == "write" else li)) != n:   # distinct cells: no destination byte twice
                return _FAULT
            return lg, li, rg, ri, length * n
        offsets = np.concatenate((local.addr, remote.addr)).reshape(2, n)
        offsets -= np.array(((lb,), (rb,)), dtype=np.uint64)
        # An address below the base wraps to an offset above 2**63: the one maximum catches both ends.
        lmax, rmax = offsets.max(axis=1).tolist()
        if lmax > ltop - lb or rmax > rtop - rb:
            return _FAULT
        if not length & (length - 1):   # a power of two: the offsets' low bits, then a shift
            if int(np.bitwise_or.reduce(offsets, axis=None)) & (length - 1):
                return None
            offsets >>= np.uint64(length.bit_length() - 1)
        else:
            if math.gcd(int(np.gcd.reduce(offsets, axis=None)), length) != length:
                return None
            offsets //= np.uint64(length)
        cells = offsets.astype(np.uint32)   # below the grid's size (<= MAX_GRID_DESCRIPTORS)
        if lf:
            cells[0] += np.uint32(lf)
        if rf:
            cells[1] += np.uint32(rf)
        dst, dst_grid = (cells[1], rg) if op == "write" else (cells[0], lg)
        if n * 16 < dst_grid.units:   # few entries in a large grid: sort them
            ordered = np.sort(dst)
            if bool((ordered[1:] == ordered[:-1]).any()):
                return _FAULT
        else:
            seen = np.zeros(dst_grid.units, dtype=np.bool_)
            seen[dst] = True
            if int(np.count_nonzero(seen)) != n:
                return _FAULT
        return lg, cells[0], rg, cells[1], length * n

    def _small_request(self, op: Op, peer: str, local: PageTable, remote: PageTable, side: _Side,
                       notify: bytes) -> tuple[Any, int]:
        """The NIXL request of a plan of a few entries and its bytes, checked on the way: bounds on both sides
        and no destination byte written twice. ``_FAULT`` when a check fails; None when the plan needs the
        general path (memory types mixed inside one side, or no grid for its unit)."""
        mine = self._local
        la, ln, lr = local.addr.tolist(), local.nbytes.tolist(), local.region.tolist()
        ra, rr = remote.addr.tolist(), remote.region.tolist()
        lbase, lend, rbase, rend = mine.base, mine.end, side.base, side.end
        nl, nr = len(lbase), len(rbase)
        g = 0
        for a, b, r in zip(la, ln, lr, strict=True):
            if r >= nl or a < lbase[r] or a + b > lend[r]:
                return _FAULT, 0
            g = math.gcd(g, b, a - lbase[r])
        for a, b, r in zip(ra, ln, rr, strict=True):
            if r >= nr or a < rbase[r] or a + b > rend[r]:
                return _FAULT, 0
            g = math.gcd(g, a - rbase[r])
        if len(la) > 1 and not _disjoint(ra if op == "write" else la, ln):
            return _FAULT, 0
        lm, rm = mine.mem, side.mem
        if lm is None:
            kinds = {mine.mems[r] for r in lr}
            lm = kinds.pop() if len(kinds) == 1 else None
        if rm is None:
            kinds = {side.mems[r] for r in rr}
            rm = kinds.pop() if len(kinds) == 1 else None
        if lm is None or rm is None:
            return None, 0
        unit = max(1, g)
        lg = self._grid(_LOCAL, lm, unit, mine.regions)
        rg = self._grid(peer, rm, unit, side.regions)
        if lg is None or rg is None:
            return None, 0
        if all(b == unit for b in ln):
            lf, rf = lg.first_list, rg.first_list
            li = [lf[r] + (a - lbase[r]) // unit for a, r in zip(la, lr, strict=True)]
            ri = [rf[r] + (a - rbase[r]) // unit for a, r in zip(ra, rr, strict=True)]
            return self._make(op, lg, li, rg, ri, notify), sum(ln)
        return self._make(op, lg, lg.indices(local, unit, mine.base_np), rg, rg.indices(remote, unit, side.base_np),
                          notify), sum(ln)

    def _requests(self, op: Op, peer: str, local: PageTable, remote: PageTable, side: _Side,
                  notify: bytes) -> list[Any]:
        """NIXL transfer requests for a checked plan: one per (local, remote) memory-type pair."""
        mine = self._local
        if mine.mem is not None and side.mem is not None:
            return [self._request(op.upper(), peer, local, mine.mem, remote, side.mem, side, notify)]
        lmem = np.broadcast_to(mine.vram_np[0], len(local)) if mine.mem is not None else mine.vram_np[local.region]
        rmem = np.broadcast_to(side.vram_np[0], len(remote)) if side.mem is not None else side.vram_np[remote.region]
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
            requests.append(self._request(op.upper(), peer, lt, lm, rt, rm, side, msg))
        return requests

    def _prepare(self, op: Op, peer: str, plan: TransferPlan, notify: bytes) -> list[Any]:
        """NIXL transfer requests for a checked plan (``_requests`` with the plan's sides in place)."""
        side = self._sides.get(peer)
        if side is None:
            raise PeerUnreachable(f"nixl {self.name!r}: peer {peer!r} is not connected")
        local, remote = (plan.src, plan.dst) if op == "write" else (plan.dst, plan.src)
        return self._requests(op, peer, local, remote, side, notify)

    def _request(self, nixl_op: str, peer: str, lt: PageTable, lm: str, rt: PageTable, rm: str,
                 side: _Side, notify: bytes) -> Any:
        mine = self._local
        unit = _unit(lt, mine.base_np, rt, side.base_np)
        lg = self._grid(_LOCAL, lm, unit, mine.regions)
        rg = self._grid(peer, rm, unit, side.regions)
        if lg is not None and rg is not None:
            return self._agent.make_prepped_xfer(nixl_op, lg.handle, lg.indices(lt, unit, mine.base_np),
                                                 rg.handle, rg.indices(rt, unit, side.base_np), notify)
        ldev = np.array([r.device_id for r in mine.regions], dtype=np.uint64)[lt.region]
        rdev = np.array([r.device_id for r in side.regions], dtype=np.uint64)[rt.region]
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

    def _backend_prepare(self, op: Op, peer: str, plan: TransferPlan | BlockPlan | PhasedPlan) -> Any:
        """The plan's NIXL requests, made once (indices into the prepared grids) and reposted by each post
        with that post's notification, as NIXL's prepared transfers are meant to be used (a phased plan as
        its expansion: ``prepare`` hands this backend none)."""
        if isinstance(plan, PhasedPlan):
            plan = plan.expand()
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
        follow_up = notify if (notify is not None and len(requests) > 1) else None
        post_notify = (notify or b"") if per_post_notify and len(requests) == 1 else b""
        handle = _NixlHandle(self, transfer_id, peer, nbytes, op, requests, follow_up, give_back)
        agent = self._agent
        done = 0
        for req in requests:
            try:
                state = agent.transfer(req, post_notify)   # b"": the request's own notification, if any
            except Exception as exc:
                with handle._req_lock:
                    handle._fail("NIXL refused to post the transfer", exc)
                return handle
            if state == "ERR":
                with handle._req_lock:
                    handle._fail("NIXL refused to post the transfer", None)
                return handle
            done += state == "DONE"
        if done == len(requests) and give_back is None:
            # NIXL finished them within the post (small transfers do): released now, no ask needed. (A
            # prepared transfer's requests go back when its handle is seen done, as before.)
            handle._complete()
        return handle


class _Core:
    """NIXL's binding under its Python agent, for the per-request post path: the calls ``make_prepped_xfer``,
    ``transfer`` and a request's ``release`` make, without their wrappers' frames (a one-page post pays
    each). ``of`` returns None when the binding does not have that shape (the wrapped calls serve then)."""

    __slots__ = ("agent", "in_progress", "make", "post", "read", "release", "success", "wrap", "write")

    def __init__(self, api: Any, agent: Any) -> None:
        bind, core = api.nixlBind, agent.agent
        self.agent = core
        self.make, self.post, self.release = core.makeXferReq, core.postXferReq, core.releaseXferReq
        self.write, self.read = agent.nixl_ops["WRITE"], agent.nixl_ops["READ"]
        self.success, self.in_progress = bind.NIXL_SUCCESS, bind.NIXL_IN_PROG
        self.wrap = api.nixl_xfer_handle   # a request in flight goes on as the agent's own handle

    @classmethod
    def of(cls, api: Any, agent: Any) -> _Core | None:
        try:
            return cls(api, agent)
        except (AttributeError, KeyError, TypeError):
            return None


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


class _PollingHandle(TransferHandle):
    """A handle whose completion NIXL reports only when asked: ``wait`` asks back to back, as NIXL's own
    examples do, instead of sleeping between asks (a sleep that backs off to a millisecond adds up to that
    to every transfer). For the first ``WAIT_SPIN_S`` it only asks; then it yields the CPU between asks
    with the GIL released (``os.sched_yield``, ~1 us), and every ``WAIT_SLEEP_EVERY_S`` it sleeps once
    (``time.sleep(0)``, 55-75 us of Linux timer slack) so that the process's other threads get the GIL.
    Against sleeping between every two asks it measured alike (docs/gpu.md "NIXL")."""

    def wait(self, timeout: float | None = None) -> None:
        if self._poll_once() is TransferStatus.DONE:
            return
        now = time.monotonic()
        deadline = None if timeout is None else now + max(0.0, timeout)
        spin_until = now + WAIT_SPIN_S
        slept = now
        while not self._status.terminal:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if now >= spin_until:
                if now - slept >= WAIT_SLEEP_EVERY_S:
                    time.sleep(0)
                    slept = now
                else:
                    _yield_cpu()
            self._poll_once()
        self._raise_unless_done(timeout)


class _NixlHandle(_PollingHandle):
    """A posted transfer's NIXL requests, polled to completion (``check_xfer_state``). ``follow_up``: the
    notification sent once every request is done (several requests); ``give_back``: where finished
    requests go instead of being released (a prepared transfer's)."""

    def __init__(self, transport: NixlTransport, transfer_id: int, peer: str, nbytes: int, op: str,
                 requests: list[Any], follow_up: bytes | None,
                 give_back: Callable[[list[Any]], None] | None) -> None:
        super().__init__(transfer_id, peer, nbytes, op, poll=_POLL_REQUESTS, abort=_ABORT_REQUESTS)
        self._agent = transport._agent
        self._requests = requests
        self._pending = list(requests)
        self._req_lock = threading.Lock()
        self._follow_up = follow_up
        self._give_back = give_back

    def _fail(self, what: str, exc: Exception | None) -> None:
        """Release every request still pending and fail the transfer (the caller holds ``_req_lock``)."""
        _release_all(self._pending)
        self._finish(TransferStatus.FAILED, f"{what}{f': {exc!r}' if exc else ''}", _error_type(exc))

    def _poll_requests(self) -> None:
        with self._req_lock:
            pending, agent = self._pending, self._agent
            for req in list(pending) if len(pending) > 1 else pending[:1]:
                try:
                    state = agent.check_xfer_state(req)
                except Exception as exc:
                    self._fail("NIXL transfer state check failed", exc)
                    return
                if state == "DONE":
                    pending.remove(req)
                    if self._give_back is None:
                        req.release()
                elif state == "ERR":
                    self._fail("NIXL reported a transfer error", None)
                    return
            if not pending and not self._status.terminal:
                self._done()

    def _complete(self) -> None:
        """Every request (none a prepared transfer's) reported DONE when posted: release them and finish."""
        with self._req_lock:
            if self._status.terminal:
                return
            for req in self._pending:
                req.release()
            self._pending.clear()
            self._done()

    def _done(self) -> None:
        """Finish a transfer whose requests are all done (the caller holds ``_req_lock``)."""
        if self._follow_up is not None:
            self._agent.send_notif(self.peer, self._follow_up)
        if self._give_back is not None:
            self._give_back(self._requests)
        self._finish(TransferStatus.DONE)

    def _abort_requests(self) -> bool:
        self._poll_requests()   # a request NIXL already finished cannot be cancelled any more
        if self._status.terminal:
            return False
        with self._req_lock:
            _release_all(self._pending)
        return True


#: ``_NixlHandle``'s poll and abort as the handle's hooks (made once: a subscripted Callable is built anew
#: each time it is evaluated).
_POLL_REQUESTS = cast(Callable[[TransferHandle], None], _NixlHandle._poll_requests)
_ABORT_REQUESTS = cast(Callable[[TransferHandle], bool], _NixlHandle._abort_requests)


#: How long ``_NixlHandle.wait`` asks back to back, before it starts yielding between asks: a small
#: transfer completes within it without giving the core away (a yield on a busy machine can cost a
#: scheduler slice, tens of microseconds or more, to a transfer of ten).
WAIT_SPIN_S = 0.0001


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


def _unit(lt: PageTable, lbase: npt.NDArray[np.uint64], rt: PageTable, rbase: npt.NDArray[np.uint64]) -> int:
    """Largest unit dividing every entry length and every entry offset inside its region (both sides);
    ``lbase``/``rbase``: the sides' region base addresses."""
    loff = lt.addr - (lbase[0] if lbase.size == 1 else lbase[lt.region])
    roff = rt.addr - (rbase[0] if rbase.size == 1 else rbase[rt.region])
    g = np.gcd.reduce(np.concatenate([lt.nbytes, loff, roff]))
    return max(1, int(g))


def _one_mem(mems: list[str], regions: npt.NDArray[np.uint32]) -> str | None:
    """The memory type every region of ``regions`` has (indices into ``mems``), or None when they differ."""
    kinds = {mems[r] for r in np.unique(regions).tolist()}
    return kinds.pop() if len(kinds) == 1 else None


def _disjoint(addr: list[int], nbytes: list[int]) -> bool:
    """No two of a few entries ``[addr, addr + nbytes)`` share a byte (empty entries share none)."""
    spans = sorted((a, a + b) for a, b in zip(addr, nbytes, strict=True) if b)
    return all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


#: What ``_small_request`` returns for a plan that fails a check.
_FAULT = object()
