"""benchmarks/pool_bench_gpu.py: one comparison of two bench_gpu columns over runs of fresh process pairs,
by the ratio of pooled medians and the median of paired (same run, same iteration) ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
from module_loader import load_module

ROOT = Path(__file__).resolve().parents[1]

pool_bench_gpu = load_module("kvxfer_pool_bench_gpu", ROOT / "benchmarks" / "pool_bench_gpu.py")


def result(col: list[float], base: list[float], case: str = "identical") -> dict:
    return {"cases": [{"tokens": 4096, "case": case, "mode": "push", "prep_times_ms": col, "raw_times_ms": base}]}


def test_runs_pool_by_position_and_pair_by_iteration() -> None:
    # run 1: the machine was slow for both columns (the column 2x faster than the baseline, iteration by
    # iteration); run 2: fast for both, the column 4x slower. Per run 2.0 and 0.25.
    slow = result([6.0, 5.0, 4.0], [12.0, 10.0, 8.0])
    fast = result([2.0, 2.0, 2.0], [0.5, 0.5, 0.5])
    (case,) = pool_bench_gpu.pool([slow, fast], "prep", "raw")
    assert (case.tokens, case.case, case.mode, case.iterations) == (4096, "identical", "push", 6)
    assert case.runs == (2.0, 0.25)
    # pooled medians: column (2,2,2,4,5,6) -> 3.0, baseline (.5,.5,.5,8,10,12) -> 4.25; paired: three 2, three .25
    assert case.pooled == pytest.approx(4.25 / 3.0)
    assert case.paired == pytest.approx(1.125)


def test_a_case_missing_from_a_run_or_uneven_iterations_is_refused() -> None:
    both = {"cases": result([1.0], [1.0])["cases"] + result([1.0], [1.0], "tp1->2")["cases"]}
    with pytest.raises(ValueError, match=r"\(4096, 'tp1->2', 'push'\) is in 1 of 2 results"):
        pool_bench_gpu.pool([both, result([1.0], [1.0])], "prep", "raw")
    with pytest.raises(ValueError, match="2 'prep' times against 3 'raw'"):
        pool_bench_gpu.pool([result([1.0, 1.0], [1.0, 1.0, 1.0])], "prep", "raw")
    with pytest.raises(ValueError, match="no 'other' or 'raw' times"):
        pool_bench_gpu.pool([result([1.0], [1.0])], "other", "raw")


def test_run_66_figures_come_from_its_raw_output(capsys: pytest.CaptureFixture[str]) -> None:
    """BENCHMARKS.md's run 66 pooled figures (nixl_prep against raw NIXL, the final wait, 3 runs on an H100)."""
    runs = [ROOT / "docs/bench/device-run-66/bench_gpu_nixl_new.json",
            ROOT / "docs/bench/device-run-66b/r2_new.json", ROOT / "docs/bench/device-run-66b/r4_new.json"]
    assert pool_bench_gpu.main([str(p) for p in runs]) == 0
    lines = {tuple(line.split()[:3]): line.split()[3:6] for line in capsys.readouterr().out.splitlines()[2:]}
    assert lines[("4096", "identical", "push")] == ["75", "0.98", "1.00"]
    assert lines[("4096", "identical", "pull")] == ["75", "0.91", "0.95"]
    assert lines[("4096", "tp1->2", "push")] == ["75", "1.01", "1.01"]
