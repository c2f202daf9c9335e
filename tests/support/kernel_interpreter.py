"""The cuda_ipc copy kernels run by Triton's interpreter on host memory (``TRITON_INTERPRET=1``, set by
``tests/transport/test_copy_kernels.py``, which runs this file in a process of its own): plans packed by
``cuda_copy``'s own packers and launched with its own grid, each result checked byte by byte against
the plan's runs copied by position with numpy. Prints one JSON line per case:
``{"case": ..., "wrong": bytes that differ from the oracle, "copied": bytes the oracle moved}``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/transport/test_copy_kernels.py"

from kvxfer.pagetable import BlockPlan  # noqa: E402
from kvxfer.transport import copy_kernels, cuda_copy  # noqa: E402

cuda_copy.CHUNK_BYTES = 1024   # pieces of 1 KiB, so short runs still span several programs
BLOCK = 64
SIZE = 1 << 16
#: The peer advertises its memory this far from where it is mapped here (the kernel adds the difference).
ADVERTISED_SHIFT = 0x4000_0000


class Memory:
    """A local buffer and a peer's (two regions), in host memory the interpreter reads and writes."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.local = torch.from_numpy(rng.integers(0, 256, SIZE, dtype=np.uint8))
        self.remote = torch.from_numpy(rng.integers(0, 256, SIZE, dtype=np.uint8))
        self.l0, self.r0 = self.local.data_ptr(), self.remote.data_ptr()
        half = SIZE // 2
        # Region rows (mapped - advertised, advertised start, advertised end): the peer's two halves, ours whole.
        delta = np.array([-ADVERTISED_SHIFT], np.int64)[0]
        self.remote_rows = torch.tensor([[int(delta), self.r0 + ADVERTISED_SHIFT, self.r0 + ADVERTISED_SHIFT + half],
                                         [int(delta), self.r0 + ADVERTISED_SHIFT + half,
                                          self.r0 + ADVERTISED_SHIFT + SIZE]], dtype=torch.int64).reshape(-1)
        self.local_rows = torch.tensor([0, self.l0, self.l0 + SIZE], dtype=torch.int64)
        self.anchor = torch.zeros(16, dtype=torch.int32)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.local.numpy().copy(), self.remote.numpy().copy()


def carve(rng: np.random.Generator, lengths: list[int], aligned: list[bool]) -> list[int]:
    """Non-overlapping offsets spread over [0, SIZE) for runs of ``lengths`` (16-byte aligned where asked),
    in a random order of the buffer."""
    order = rng.permutation(len(lengths))
    at, out = 0, [0] * len(lengths)
    slack = (SIZE - sum(lengths) - 16 * len(lengths)) // len(lengths)   # spread over the whole buffer
    for i in order:
        at += int(rng.integers(0, slack))
        if aligned[i]:
            at = -(-at // 16) * 16
        out[i] = at
        at += lengths[i]
    assert at <= SIZE, at
    return out


def oracle(mem: Memory, before: tuple[np.ndarray, np.ndarray], runs: list[tuple[int, int, int]],
           remote_src: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Local and remote bytes after copying ``runs`` (src offset, dst offset, length; the remote side's
    offsets into the peer buffer), by position."""
    local, remote = before[0].copy(), before[1].copy()
    src, dst = (before[1], local) if remote_src else (before[0], remote)
    copied = 0
    for s, d, n in runs:
        dst[d: d + n] = src[s: s + n]
        copied += n
    return local, remote, copied


def run_list_case(seed: int, remote_src: bool, run_major: bool) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mem = Memory(seed)
    count = 18
    lengths = [int(x) for x in rng.choice([16, 48, 1024, 3000, 3072, 2500, 1000, 7], count)]
    aligned = [n % 16 == 0 and bool(rng.integers(0, 4)) for n in lengths]
    src_off, dst_off = carve(rng, lengths, aligned), carve(rng, lengths, aligned)
    remote_off = src_off if remote_src else dst_off
    region = np.array([0 if o + n <= SIZE // 2 else (1 if o >= SIZE // 2 else 0) for o, n in zip(remote_off, lengths, strict=True)],
                      np.uint32)
    # Runs the kernel must refuse: region out of the table; labelled with the other half's region (below its
    # start, past its end); straddling both halves.
    region[0] = 7
    lower = [i for i in range(1, count) if remote_off[i] + lengths[i] <= SIZE // 2]
    upper = [i for i in range(1, count) if remote_off[i] >= SIZE // 2]
    region[lower[0]], region[upper[0]] = 1, 0
    straddles = [i for i, (o, n) in enumerate(zip(remote_off, lengths, strict=True)) if o < SIZE // 2 < o + n]
    refused = {0, lower[0], upper[0], *straddles}
    remote_base, local_base = mem.r0 + ADVERTISED_SHIFT, mem.l0
    src = np.array([(remote_base if remote_src else local_base) + o for o in src_off], np.uint64)
    dst = np.array([(local_base if remote_src else remote_base) + o for o in dst_off], np.uint64)
    before = mem.snapshot()
    launch_runs(mem, dst, src, np.array(lengths, np.uint64), region, remote_src, run_major)
    local, remote, copied = oracle(mem, before, [(s, d, n) for i, (s, d, n) in
                                                 enumerate(zip(src_off, dst_off, lengths, strict=True)) if i not in refused],
                                   remote_src)
    wrong = int((mem.local.numpy() != local).sum() + (mem.remote.numpy() != remote).sum())
    return {"case": f"runs {'read' if remote_src else 'write'} {'run-major' if run_major else '2-D'}",
            "wrong": wrong, "copied": copied}


def launch_runs(mem: Memory, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, region: np.ndarray,
                remote_src: bool, run_major: bool) -> None:
    """``BatchedCopier._launch_runs`` on host memory: the same cut, table and grid."""
    local_region = np.zeros(1, np.uint32)
    dst, src, nbytes, region, local_region, pieces = cuda_copy._cut_long_runs(dst, src, nbytes, region, local_region)
    packed = cuda_copy._RunTable.of(dst, src, nbytes, region, local_region, 2, 1)
    table = torch.zeros(packed.size + 16, dtype=torch.uint8)
    packed.write(table.numpy())

    def col(at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        width = 8 if dtype == torch.int64 else 4
        return table[at: at + width * count].view(dtype)
    per_len, per_reg, per_loc = packed.per_run
    grid = cuda_copy._grid(packed.n, pieces, run_major)
    copy_kernels.copy_runs[grid](
        col(0, packed.n, torch.int64), col(packed.at_dst, packed.n, torch.int64),
        col(packed.at_len, packed.nbytes.size, torch.int32), col(packed.at_reg, packed.region.size, torch.int32),
        col(packed.at_loc, packed.local_region.size, torch.int32), mem.remote_rows, mem.local_rows, 2, 1, pieces,
        mem.anchor.view(torch.uint8), mem.anchor, mem.anchor.data_ptr(),
        REMOTE_SRC=remote_src, PER_RUN_LENGTH=per_len, PER_RUN_REGION=per_reg, PER_RUN_LOCAL=per_loc,
        CHUNK=cuda_copy.CHUNK_BYTES, BLOCK=BLOCK, RUN_MAJOR=run_major)


def block_case(seed: int, remote_src: bool, run_major: bool) -> dict[str, Any]:
    """A block plan: 5 blocks of a 3-run template (one run unaligned), slots scattered on both sides."""
    rng = np.random.default_rng(seed)
    mem = Memory(seed)
    template = [(0, 2048), (2048, 48), (2096, 1001)]     # (offset in the block, length)
    step = 4096
    blocks = 5
    remote_slots = rng.permutation(8)[:blocks].astype(np.uint64)   # the peer's region 0 holds slots 0-7
    local_slots = rng.permutation(16)[:blocks].astype(np.uint64)
    src_slots, dst_slots = (remote_slots, local_slots) if remote_src else (local_slots, remote_slots)
    offs = np.array([o for o, _ in template], np.uint64)
    lengths = np.array([n for _, n in template], np.uint64)
    remote_base, local_base = mem.r0 + ADVERTISED_SHIFT, mem.l0
    src_base, dst_base = (remote_base, local_base) if remote_src else (local_base, remote_base)
    zeros = np.zeros(3, np.uint32)
    plan = BlockPlan(src_slots, dst_slots, np.full(3, step, np.uint64), offs + np.uint64(src_base),
                     np.full(3, step, np.uint64), offs + np.uint64(dst_base), lengths, zeros, zeros)
    before = mem.snapshot()
    packed = cuda_copy._BlockTable.of(plan, remote_src, local_regions=False)
    assert packed is not None
    table = torch.zeros(packed.size + 16, dtype=torch.uint8)
    packed.write(table.numpy())
    cols = [table[packed.at[k]: packed.at[k + 1]].view(torch.int64 if k < 6 else torch.int32) for k in range(9)]
    grid = cuda_copy._grid(packed.blocks * packed.runs, packed.pieces, run_major)
    copy_kernels.copy_block_runs[grid](
        *cols, mem.remote_rows, mem.local_rows, packed.runs, 2, 1, packed.pieces,
        mem.anchor.view(torch.uint8), mem.anchor, mem.anchor.data_ptr(),
        REMOTE_SRC=remote_src, CHUNK=cuda_copy.CHUNK_BYTES, BLOCK=BLOCK, RUN_MAJOR=run_major)
    runs = [(int(s) * step + o, int(d) * step + o, n) for s, d in zip(src_slots, dst_slots, strict=True)
            for o, n in template]
    local, remote, copied = oracle(mem, before, runs, remote_src)
    wrong = int((mem.local.numpy() != local).sum() + (mem.remote.numpy() != remote).sum())
    return {"case": f"blocks {'read' if remote_src else 'write'} {'run-major' if run_major else '2-D'}",
            "wrong": wrong, "copied": copied}


def packed_case(seed: int, remote_src: bool, kind: str = "packed") -> dict[str, Any]:
    """A re-layout as a block plan of short aligned runs (``kind``: ``copy_block_runs_packed``, its tiled order,
    or ``copy_block_groups``): each 4 KiB block is 4 heads x 8 tokens x 128 bytes, copied head-major to
    token-major; a template run in the peer's other region and one slot pair out of its region are refused."""
    rng = np.random.default_rng(seed)
    mem = Memory(seed)
    heads, tokens, row = 4, 8, 128
    step = heads * tokens * row
    src_offs = [(h * tokens + k) * row for h in range(heads) for k in range(tokens)]
    dst_offs = [(k * heads + h) * row for h in range(heads) for k in range(tokens)]
    runs = len(src_offs)
    blocks = 5
    remote_slots = rng.permutation(8)[:blocks].astype(np.uint64)    # slots 0-7 fill the peer's region 0
    remote_slots[-1] = 12                                             # in region 1, labelled region 0: refused
    local_slots = rng.permutation(16)[:blocks].astype(np.uint64)
    src_slots, dst_slots = (remote_slots, local_slots) if remote_src else (local_slots, remote_slots)
    remote_base, local_base = mem.r0 + ADVERTISED_SHIFT, mem.l0
    src_base, dst_base = (remote_base, local_base) if remote_src else (local_base, remote_base)
    lengths = np.full(runs, row, np.uint64)
    lengths[3] = 48                                                   # a shorter row, still 16-byte aligned
    region = np.zeros(runs, np.uint32)
    region[5] = 1      # labelled with the other half: refused, except in the last block, which lies there
    remote_region, zeros = region, np.zeros(runs, np.uint32)
    plan = BlockPlan(src_slots, dst_slots, np.full(runs, step, np.uint64), np.array(src_offs, np.uint64) + np.uint64(src_base),
                     np.full(runs, step, np.uint64), np.array(dst_offs, np.uint64) + np.uint64(dst_base), lengths,
                     remote_region if remote_src else zeros, zeros if remote_src else remote_region)
    before = mem.snapshot()
    packed = cuda_copy._BlockTable.of(plan, remote_src, local_regions=False, aligned=True)
    assert packed is not None and packed.words == row // 4, "a template of 128-byte rows must go packed"
    if kind == "grouped":
        launch_groups(mem, plan, remote_src, packed.words)
    else:
        table = torch.zeros(packed.size + 16, dtype=torch.uint8)
        packed.write(table.numpy())
        cols = [table[packed.at[k]: packed.at[k + 1]].view(torch.int64 if k < 6 else torch.int32) for k in range(9)]
        rows = 64 if kind == "tiled" else 8     # tiled: one program per block, half its rows past the template
        total = packed.blocks * packed.runs
        kernel, grid = (copy_kernels.copy_block_runs_tiled, (-(-packed.runs // rows), packed.blocks)) \
            if kind == "tiled" else (copy_kernels.copy_block_runs_packed, (-(-total // rows), 1))
        kernel[grid](*cols, mem.remote_rows, mem.local_rows, packed.runs, 2, 1, total,
                     mem.anchor.view(torch.uint8), mem.anchor, mem.anchor.data_ptr(),
                     REMOTE_SRC=remote_src, ROWS=rows, WORDS=packed.words)
    expected = [(int(s) * step + o, int(d) * step + p, int(n))
                for b, (s, d) in enumerate(zip(src_slots, dst_slots, strict=True))
                for t, (o, p, n) in enumerate(zip(src_offs, dst_offs, lengths, strict=True))
                if (b == blocks - 1) == (t == 5)]
    local, remote, copied = oracle(mem, before, expected, remote_src)
    wrong = int((mem.local.numpy() != local).sum() + (mem.remote.numpy() != remote).sum())
    return {"case": f"{kind} {'read' if remote_src else 'write'}", "wrong": wrong, "copied": copied}


def launch_groups(mem: Memory, plan: BlockPlan, remote_src: bool, words: int) -> None:
    """``BatchedCopier._launch_groups`` on host memory: the same grouping, table and grid."""
    grouped = cuda_copy._GroupTable.of(plan, remote_src, False, words, min_runs=1)
    assert grouped is not None, "the head-major to token-major template must cut into groups"
    assert len(cuda_copy._group_cache.get(plan)) < plan.runs_per_block // 4
    table = torch.zeros(grouped.size + 16, dtype=torch.uint8)
    grouped.write(table.numpy())
    cols = [table[grouped.at[k]: grouped.at[k + 1]].view(torch.int64) for k in range(4)]
    copy_kernels.copy_block_groups[(grouped.programs, grouped.blocks)](
        *cols, mem.remote_rows, mem.local_rows, 2, 1, mem.anchor, mem.anchor.data_ptr(),
        REMOTE_SRC=remote_src, ROWS=grouped.rows, WORDS=words)


def main() -> None:
    for seed, remote_src in ((1, False), (2, True)):
        for run_major in (True, False):
            print(json.dumps(run_list_case(seed, remote_src, run_major)), flush=True)
            print(json.dumps(block_case(seed, remote_src, run_major)), flush=True)
        for kind in ("packed", "tiled", "grouped"):
            print(json.dumps(packed_case(seed, remote_src, kind)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
