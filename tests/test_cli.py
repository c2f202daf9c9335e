"""The `kvxfer` command line."""

from __future__ import annotations

import json

import pytest

from kvxfer.cache import CacheLayoutDesc
from kvxfer.cli import main


def test_inspect_json_is_a_decodable_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--layers", "6", "--window", "1024", "--scale-role", "--json"]) == 0
    out = capsys.readouterr().out
    layout = CacheLayoutDesc.from_json(out)
    assert [lg.window for lg in layout.layer_groups] == [1024, None]
    assert set(json.loads(out)) == {"version", "tokens_per_block", "layer_groups", "pool_groups", "formats",
                                    "fingerprint"}


def test_inspect_table_shows_llama3_8b_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "Layer groups" in out and "Pools" in out
    assert "65536" in out  # 8 heads x 32 tokens x 128 dims x 2 bytes per buffer
    assert "total pool memory: 4.000 GiB" in out  # 1024 blocks x 32 layers x 2 roles x 64 KiB


def test_inspect_reports_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--kv-heads", "3", "--tp-size", "2"]) == 2
    assert "num_kv_heads=3" in capsys.readouterr().err
