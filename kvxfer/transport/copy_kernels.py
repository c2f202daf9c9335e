"""The Triton kernel of ``cuda_copy`` for block plans (``copy_block_runs``).

Like the run-list kernel in ``cuda_copy`` (whose body ``copy_piece`` repeats: that kernel stays as the last
H200 run validated it until a device run has validated this module), it gives every program one
``CHUNK``-byte piece of one run (2-D grid: run x piece): addresses become int64 offsets from ``anchor`` (any device buffer) so loads use
typed pointers whose 16-byte alignment the compiler is told about (it then emits 16-byte vector loads
and stores), and a run not inside its registered regions on both sides (tables of (delta, start, end)
per region) is not copied, so the host may check a plan while the kernel runs (``RegionTable``).
Importing this module needs Triton (``cuda_copy`` imports it only when present).

Triton resolves annotations as kernel globals: only constexpr parameters are annotated. Counts are not
specialised (a count of 1 or a multiple of 16 would be compiled in, and the launcher reuses the compiled
kernel for every count).
"""

# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_piece(s, d, n, start, r, q, remote_table, local_table, remote_count, local_count, anchor8, anchor32,
               anchor_addr, REMOTE_SRC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Bytes [start, start + CHUNK) of the ``n``-byte run from ``s`` to ``d`` (the remote side's address
    advertised: translated through region ``r`` of ``remote_table``; the local one in region ``q``)."""
    r_ok = (r >= 0) & (r < remote_count)
    q_ok = (q >= 0) & (q < local_count)
    r = tl.where(r_ok, r, 0).to(tl.int64) * 3
    q = tl.where(q_ok, q, 0).to(tl.int64) * 3
    delta = tl.load(remote_table + r)
    if REMOTE_SRC:
        ra = s
        la = d
    else:
        ra = d
        la = s
    inside = r_ok & q_ok & (ra >= tl.load(remote_table + r + 1)) & (ra <= tl.load(remote_table + r + 2) - n) \
        & (la >= tl.load(local_table + q + 1)) & (la <= tl.load(local_table + q + 2) - n)
    if REMOTE_SRC:
        s = s + delta
    else:
        d = d + delta
    n = tl.where(inside, n, start)     # outside: every mask below is empty
    so = s - anchor_addr
    do = d - anchor_addr
    if ((s | d) & 15) == 0:
        sw = tl.multiple_of(so >> 2, 4)
        dw = tl.multiple_of(do >> 2, 4)
        body = tl.multiple_of((n >> 4) << 2, 4)          # words of the 16-byte multiple part
        w0 = tl.multiple_of(start >> 2, 4)
        for off in tl.static_range(0, CHUNK // 4, BLOCK):
            idx = w0 + off + tl.arange(0, BLOCK)
            mask = idx < body
            tl.store(anchor32 + dw + idx, tl.load(anchor32 + sw + idx, mask=mask), mask=mask)
        if start + CHUNK >= n:                          # the last piece also copies the tail
            t = ((n >> 4) << 4) + tl.arange(0, 16)
            tmask = t < n
            tl.store(anchor8 + do + t, tl.load(anchor8 + so + t, mask=tmask), mask=tmask)
    else:
        for off in tl.static_range(0, CHUNK, BLOCK):
            b = start + off + tl.arange(0, BLOCK)
            bmask = b < n
            tl.store(anchor8 + do + b, tl.load(anchor8 + so + b, mask=bmask), mask=bmask)


@triton.jit(do_not_specialize=["runs_per_block", "remote_count", "local_count"])
def copy_block_runs(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions,
                    local_regions, remote_table, local_table, runs_per_block, remote_count, local_count,
                    anchor8, anchor32, anchor_addr,
                    REMOTE_SRC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (run, piece) of a block plan: run = block x ``runs_per_block`` + template run; its
    addresses are ``slot x step + offset`` on each side (``kvxfer.pagetable.BlockPlan``)."""
    run = tl.program_id(0)
    block = run // runs_per_block
    t = run - block * runs_per_block
    start = tl.program_id(1).to(tl.int64) * CHUNK
    n = tl.load(lengths + t).to(tl.int64)
    if start < n:
        s = tl.load(src_slots + block) * tl.load(src_step + t) + tl.load(src_offset + t)
        d = tl.load(dst_slots + block) * tl.load(dst_step + t) + tl.load(dst_offset + t)
        copy_piece(s, d, n, start, tl.load(regions + t), tl.load(local_regions + t), remote_table, local_table,
                   remote_count, local_count, anchor8, anchor32, anchor_addr, REMOTE_SRC, CHUNK, BLOCK)
