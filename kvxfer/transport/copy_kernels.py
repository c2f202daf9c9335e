"""The Triton kernels of ``cuda_copy``: run lists (``copy_runs``) and block plans (``copy_block_runs``; short
runs packed several per program, ``copy_block_runs_packed``/``_tiled``, or as affine groups, ``copy_block_groups``).

Both give every program one ``CHUNK``-byte piece of one run (``copy_piece``): addresses become int64
offsets from ``anchor`` (any device buffer) so loads use typed pointers whose 16-byte alignment the
compiler is told about (it then emits 16-byte vector loads and stores), and a run not inside its
registered regions on both sides (tables of (delta, start, end) per region) is not copied, so the host may
check a plan while the kernel runs (``RegionTable``).

Program order (``RUN_MAJOR``): the GPU starts programs in index order, so with a 1-D grid of
``runs x pieces`` the programs running at once copy the contiguous bytes of a few runs; with the 2-D grid
(run, piece) they copy the same piece of many runs at once, which spreads them over many more DRAM pages
and TLB entries (on an H200 the 2-D order copied 4 MiB runs slower than 32 KiB runs).
Importing this module needs Triton (``cuda_copy`` imports it only when present).

Triton resolves annotations as kernel globals: only constexpr parameters are annotated.
"""

# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def translate_inside(s, d, s_len, d_len, r, q, remote_table, local_table, remote_count, local_count,
                     REMOTE_SRC: tl.constexpr):
    """``s`` and ``d`` with the remote one translated (region ``r`` of ``remote_table``, the local one in region
    ``q``), and whether ``s_len`` bytes from ``s`` and ``d_len`` bytes from ``d`` lie inside those regions;
    scalars or tiles alike."""
    r_ok = (r >= 0) & (r < remote_count)
    q_ok = (q >= 0) & (q < local_count)
    r = tl.where(r_ok, r, 0).to(tl.int64) * 3
    q = tl.where(q_ok, q, 0).to(tl.int64) * 3
    delta = tl.load(remote_table + r)
    if REMOTE_SRC:
        ra = s
        rn = s_len
        la = d
        ln = d_len
    else:
        ra = d
        rn = d_len
        la = s
        ln = s_len
    inside = r_ok & q_ok & (ra >= tl.load(remote_table + r + 1)) & (ra <= tl.load(remote_table + r + 2) - rn) \
        & (la >= tl.load(local_table + q + 1)) & (la <= tl.load(local_table + q + 2) - ln)
    if REMOTE_SRC:
        s = s + delta
    else:
        d = d + delta
    return s, d, inside


@triton.jit
def copy_piece(s, d, n, start, r, q, remote_table, local_table, remote_count, local_count, anchor8, anchor32,
               anchor_addr, REMOTE_SRC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Bytes [start, start + CHUNK) of the ``n``-byte run from ``s`` to ``d`` (the remote side's address
    advertised: translated through region ``r`` of ``remote_table``; the local one in region ``q``). Its
    bounds check is ``translate_inside``'s, written out: the run kernels have no fallback (a compile
    failure leaves cuda_ipc without its kernel), so they change only with a GPU at hand to compile them."""
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


@triton.jit
def run_and_start(pieces, CHUNK: tl.constexpr, RUN_MAJOR: tl.constexpr):
    """This program's run and the first byte of its piece: program = run x ``pieces`` + piece in a 1-D grid
    (``RUN_MAJOR``), else program (run, piece) of a 2-D grid."""
    if RUN_MAJOR:
        pid = tl.program_id(0)
        run = pid // pieces
        start = (pid - run * pieces).to(tl.int64) * CHUNK
    else:
        run = tl.program_id(0)
        start = tl.program_id(1).to(tl.int64) * CHUNK
    return run, start


# Counts are not specialised: a count of 1 would be compiled in, and the launcher reuses the compiled
# kernel for every count.
@triton.jit(do_not_specialize=["remote_count", "local_count", "pieces"])
def copy_runs(src_addr, dst_addr, lengths, regions, local_regions, remote_table, local_table,
              remote_count, local_count, pieces, anchor8, anchor32, anchor_addr,
              REMOTE_SRC: tl.constexpr, PER_RUN_LENGTH: tl.constexpr, PER_RUN_REGION: tl.constexpr,
              PER_RUN_LOCAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, RUN_MAJOR: tl.constexpr):
    """A piece of a run list: run ``run`` copies ``lengths[run]`` bytes (one shared length, region or local
    region when its ``PER_RUN_*`` is 0) from ``src_addr[run]`` to ``dst_addr[run]``."""
    run, start = run_and_start(pieces, CHUNK, RUN_MAJOR)
    n = tl.load(lengths + run * PER_RUN_LENGTH).to(tl.int64)
    if start < n:
        copy_piece(tl.load(src_addr + run), tl.load(dst_addr + run), n, start,
                   tl.load(regions + run * PER_RUN_REGION), tl.load(local_regions + run * PER_RUN_LOCAL),
                   remote_table, local_table, remote_count, local_count, anchor8, anchor32, anchor_addr,
                   REMOTE_SRC, CHUNK, BLOCK)


@triton.jit(do_not_specialize=["runs_per_block", "remote_count", "local_count", "pieces"])
def copy_block_runs(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions,
                    local_regions, remote_table, local_table, runs_per_block, remote_count, local_count, pieces,
                    anchor8, anchor32, anchor_addr,
                    REMOTE_SRC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, RUN_MAJOR: tl.constexpr):
    """A piece of a block plan: run = block x ``runs_per_block`` + template run; its addresses are
    ``slot x step + offset`` on each side (``kvxfer.pagetable.BlockPlan``)."""
    run, start = run_and_start(pieces, CHUNK, RUN_MAJOR)
    block = run // runs_per_block
    t = run - block * runs_per_block
    n = tl.load(lengths + t).to(tl.int64)
    if start < n:
        s = tl.load(src_slots + block) * tl.load(src_step + t) + tl.load(src_offset + t)
        d = tl.load(dst_slots + block) * tl.load(dst_step + t) + tl.load(dst_offset + t)
        copy_piece(s, d, n, start, tl.load(regions + t), tl.load(local_regions + t), remote_table, local_table,
                   remote_count, local_count, anchor8, anchor32, anchor_addr, REMOTE_SRC, CHUNK, BLOCK)


@triton.jit
def copy_rows(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions, local_regions,
              remote_table, local_table, remote_count, local_count, anchor32, anchor_addr, block, t, live,
              REMOTE_SRC: tl.constexpr, WORDS: tl.constexpr):
    """Runs ``(block[i], t[i])`` of a block plan where ``live[i]``, one per row of a ``len(t) x WORDS`` tile of
    4-byte words (each run at most ``WORDS`` words, 16-byte aligned); runs outside their regions are not
    copied, as in ``copy_piece``."""
    n = tl.load(lengths + t).to(tl.int64)
    s = tl.load(src_slots + block) * tl.load(src_step + t) + tl.load(src_offset + t)
    d = tl.load(dst_slots + block) * tl.load(dst_step + t) + tl.load(dst_offset + t)
    s, d, inside = translate_inside(s, d, n, n, tl.load(regions + t), tl.load(local_regions + t), remote_table,
                                    local_table, remote_count, local_count, REMOTE_SRC)
    inside = live & inside
    words = tl.multiple_of(tl.where(inside, (n >> 4) << 2, 0), 4)
    sw = tl.multiple_of((s - anchor_addr) >> 2, 4)
    dw = tl.multiple_of((d - anchor_addr) >> 2, 4)
    w = tl.arange(0, WORDS)
    mask = w[None, :] < words[:, None]
    tl.store(anchor32 + dw[:, None] + w[None, :], tl.load(anchor32 + sw[:, None] + w[None, :], mask=mask), mask=mask)


@triton.jit(do_not_specialize=["runs_per_block", "remote_count", "local_count", "total_runs"])
def copy_block_runs_packed(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions,
                           local_regions, remote_table, local_table, runs_per_block, remote_count, local_count,
                           total_runs, anchor8, anchor32, anchor_addr,
                           REMOTE_SRC: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``ROWS`` consecutive runs of a block plan whose runs are short (at most ``WORDS`` 4-byte words) and
    16-byte aligned, one run per row of a ``ROWS x WORDS`` tile: a program moves as many bytes as one piece
    of ``copy_block_runs`` however short the runs (a re-layout's 256-byte head rows, 4 KiB token slices),
    where one run per program would leave most of its lanes idle."""
    run = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = run < total_runs
    run = tl.where(live, run, 0)
    block = run // runs_per_block
    copy_rows(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions, local_regions,
              remote_table, local_table, remote_count, local_count, anchor32, anchor_addr, block,
              run - block * runs_per_block, live, REMOTE_SRC, WORDS)


@triton.jit(do_not_specialize=["runs_per_block", "remote_count", "local_count", "total_runs"])
def copy_block_runs_tiled(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions,
                          local_regions, remote_table, local_table, runs_per_block, remote_count, local_count,
                          total_runs, anchor8, anchor32, anchor_addr,
                          REMOTE_SRC: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``copy_block_runs_packed`` on a 2-D grid: program (i, b) copies template runs ``[i x ROWS, (i + 1) x
    ROWS)`` of block ``b``, so a program's template entries are consecutive and its slots one each side (no
    division per run, no gathered slot loads); ``total_runs`` is not used."""
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = t < runs_per_block
    block = tl.zeros([ROWS], tl.int64) + tl.program_id(1)
    copy_rows(src_slots, dst_slots, src_step, src_offset, dst_step, dst_offset, lengths, regions, local_regions,
              remote_table, local_table, remote_count, local_count, anchor32, anchor_addr, block,
              tl.where(live, t, 0), live, REMOTE_SRC, WORDS)


@triton.jit(do_not_specialize=["remote_count", "local_count"])
def copy_block_groups(src_slots, dst_slots, groups, programs, remote_table, local_table, remote_count, local_count,
                      anchor32, anchor_addr, REMOTE_SRC: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """A block plan whose template is cut into affine groups (``kvxfer.pagetable.affine``): program (p, b)
    copies rows ``[first, first + ROWS)`` of group ``g`` (``programs[p] = (g, first)``) of block ``b``, one
    run of at most ``WORDS`` 4-byte words per row of the tile, 16-byte aligned. A group is one row of
    ``GROUP_FIELDS`` int64 in ``groups``: source and destination offset and step, inner and outer strides of
    each side, run length, runs, runs per inner row, both regions, both extents. Its addresses come from
    those numbers and its bounds are checked once, on its extent, where the packed kernels load a dozen
    table entries per run."""
    p = tl.program_id(0).to(tl.int64) * 2
    g = tl.load(programs + p) * 16
    first = tl.load(programs + p + 1)
    b = tl.program_id(1)
    s = tl.load(src_slots + b) * tl.load(groups + g + 2) + tl.load(groups + g)
    d = tl.load(dst_slots + b) * tl.load(groups + g + 3) + tl.load(groups + g + 1)
    s, d, inside = translate_inside(s, d, tl.load(groups + g + 13), tl.load(groups + g + 14), tl.load(groups + g + 11),
                                    tl.load(groups + g + 12), remote_table, local_table, remote_count, local_count,
                                    REMOTE_SRC)
    n = tl.load(groups + g + 8)
    rows = tl.load(groups + g + 9).to(tl.int32)
    inner = tl.maximum(tl.load(groups + g + 10).to(tl.int32), 1)
    k = first.to(tl.int32) + tl.arange(0, ROWS)
    i = k // inner
    j = k - i * inner
    i = i.to(tl.int64)
    j = j.to(tl.int64)
    rs = s + i * tl.load(groups + g + 6) + j * tl.load(groups + g + 4)
    rd = d + i * tl.load(groups + g + 7) + j * tl.load(groups + g + 5)
    words = tl.multiple_of(tl.where(inside & (k < rows), (n >> 4) << 2, 0), 4)
    sw = tl.multiple_of((rs - anchor_addr) >> 2, 4)
    dw = tl.multiple_of((rd - anchor_addr) >> 2, 4)
    w = tl.arange(0, WORDS)
    mask = w[None, :] < words[:, None]
    tl.store(anchor32 + dw[:, None] + w[None, :], tl.load(anchor32 + sw[:, None] + w[None, :], mask=mask), mask=mask)
