"""benchmarks/pool_bench_gpu.py: one comparison of two bench_gpu columns over runs of fresh process pairs,
by the ratio of pooled medians and the median of paired (same run, same iteration) ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import pool_bench_gpu


def result(col: list[float], base: list[float], case: str = "identical") -> dict:
    return {"cases": [{"tokens": 4096, "case": case, "mode": "push", "prep_times_ms": col, "raw_times_ms": base}]}


def test_runs_pool_by_position_and_pair_by_iteration() -> None:
    # pass 1: the machine was slow for both columns (the column 2x faster than the baseline, iteration by
    # iteration); pass 2: fast for both, the column 4x slower. Per pass 2.0 and 0.25.
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


def test_main_prints_and_writes_the_pooled_cases_of_result_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line over bench_gpu JSON files: one line per case, in first-seen order, and the JSON."""
    def write(name: str, prep: list[float], raw: list[float], tp_prep: list[float], tp_raw: list[float]) -> str:
        cases = [{"tokens": 4096, "case": "identical", "mode": "push", "nixl_prep_times_ms": prep,
                  "raw_nixl_times_ms": raw},
                 {"tokens": 4096, "case": "tp1->2", "mode": "pull", "nixl_prep_times_ms": tp_prep,
                  "raw_nixl_times_ms": tp_raw}]
        path = tmp_path / name
        path.write_text(json.dumps({"cases": cases}))
        return str(path)

    # identical: pass 1 the column is 2x faster, pass 2 2x slower; tp: equal, then the column 1.25x faster
    files = [write("a.json", [1.0, 1.0], [2.0, 2.0], [4.0, 4.0], [4.0, 4.0]),
             write("b.json", [4.0, 4.0], [2.0, 2.0], [4.0, 4.0], [5.0, 5.0])]
    out = tmp_path / "pooled.json"
    assert pool_bench_gpu.main([*files, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "nixl_prep against raw_nixl over 2 runs (> 1: nixl_prep faster)"
    rows = [line.split() for line in lines[2:]]
    assert rows == [["4096", "identical", "push", "4", "0.80", "1.25", "2.00", "0.50"],
                    ["4096", "tp1->2", "pull", "4", "1.12", "1.12", "1.00", "1.25"]]
    saved = json.loads(out.read_text())
    assert (saved["column"], saved["baseline"], saved["results"]) == ("nixl_prep", "raw_nixl", files)
    assert [c["case"] for c in saved["cases"]] == ["identical", "tp1->2"]
    assert saved["cases"][0]["runs"] == [2.0, 0.5]
