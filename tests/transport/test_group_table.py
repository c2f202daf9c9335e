"""The group kernel's host side (``cuda_copy._GroupTable``, ``_GroupCache``) on any machine: which plans it
takes, the numbers it gives each group (extents included), and a cache that never hands one template's
groups to another. The kernel itself: ``test_copy_kernels.py`` (interpreter) and ``test_gpu.py`` (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.pagetable import BlockPlan

cuda_copy = pytest.importorskip("kvxfer.transport.cuda_copy", reason="needs cuda-python (the ucx or cuda extra)")


def transpose_plan(heads: int = 8, tokens: int = 16, layers: int = 4, row: int = 256, blocks: int = 3,
                   nbytes: np.ndarray | None = None, dst_offset: np.ndarray | None = None) -> BlockPlan:
    h, t = np.meshgrid(np.arange(heads), np.arange(tokens), indexing="ij")
    tile = heads * tokens * row
    base = np.repeat(np.arange(layers) * tile, heads * tokens)
    s = np.tile(((h * tokens + t) * row).ravel(), layers) + base
    d = np.tile(((t * heads + h) * row).ravel(), layers) + base if dst_offset is None else dst_offset
    n = s.size
    step = layers * tile * 2
    zeros = np.zeros(n, np.uint32)
    return BlockPlan(np.arange(blocks, dtype=np.uint64), np.arange(blocks, dtype=np.uint64)[::-1].copy(),
                     np.full(n, step, np.uint64), s.astype(np.uint64), np.full(n, step, np.uint64), d.astype(np.uint64),
                     (np.full(n, row) if nbytes is None else nbytes).astype(np.uint64), zeros, zeros + 1)


def test_a_transposing_template_is_one_group_per_tile_with_its_extent() -> None:
    plan = transpose_plan()
    table = cuda_copy._GroupTable.of(plan, False, True, 64)
    assert table is not None
    groups = table.columns[2].reshape(-1, cuda_copy.GROUP_FIELDS)
    assert groups.shape[0] == 4 and table.rows == 128 and table.programs == 4 and table.blocks == 3
    tile = 8 * 16 * 256
    # extents: the last row's offset + its length, on each side: the whole tile
    assert groups[:, 13].tolist() == [tile] * 4 and groups[:, 14].tolist() == [tile] * 4
    assert groups[:, 11].tolist() == [1] * 4 and groups[:, 12].tolist() == [0] * 4   # remote = dst, local = src
    read = cuda_copy._GroupTable.of(plan, True, True, 64)
    assert read is not None
    regions = read.columns[2].reshape(-1, cuda_copy.GROUP_FIELDS)[:, 11:13]
    assert regions.tolist() == [[0, 1]] * 4                                          # remote = src, local = dst


def test_groups_larger_than_a_program_take_several_programs() -> None:
    plan = transpose_plan(heads=32, tokens=64, layers=1, row=64)
    table = cuda_copy._GroupTable.of(plan, False, False, 16)
    assert table is not None and table.rows == 512
    programs = table.columns[3].reshape(-1, 2)
    assert programs.tolist() == [[0, 0], [0, 512], [0, 1024], [0, 1536]]


def test_templates_without_large_groups_stay_with_the_packed_kernels() -> None:
    rng = np.random.default_rng(3)
    plan = transpose_plan(dst_offset=rng.permutation(512) * 256)
    assert cuda_copy._GroupTable.of(plan, False, False, 64) is None
    assert cuda_copy._GroupTable.of(plan, False, False, 64, min_runs=1) is not None


def test_the_cache_never_returns_another_templates_groups() -> None:
    cache = cuda_copy._GroupCache(size=4)
    plan = transpose_plan()
    first = cache.get(plan)
    assert cache.get(transpose_plan()) is first          # an equal template (another copy): the kept groups
    nbytes = np.full(512, 256)
    nbytes[37] = 128                                      # same length and sampled runs, one run shorter
    other = transpose_plan(nbytes=nbytes)
    groups = cache.get(other)
    assert groups is not first and len(groups) > len(first)
    groups.check(other)
    assert cache.get(plan) is first and cache.get(other) is groups
    for k in range(6):                                    # more templates than it keeps: the oldest go
        cache.get(transpose_plan(layers=5 + k))
    assert cache._count <= 4
