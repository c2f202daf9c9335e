"""End to end on CPU: a prefill vLLM engine and a decode vLLM engine (the tiny random Llama, vLLM's CPU
build) with kvxfer's connector between them over NIXL on 127.0.0.1. Every request's greedy output
equals one vLLM instance's (the prefill's blocks hold 32 tokens, the decode's 64); the KV bytes moved
are counted; a prompt sharing a prefix the decode
already computed moves only the rest; a prefill killed while holding a request's KV is reported as a
failed load and vLLM recomputes the request, with the same output. Needs .venv-vllm (``make
vllm-venv``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make vllm-venv`, then run these tests with "
                                   ".venv-vllm/bin/python -m pytest tests/integrations")
if not any(__import__("importlib").util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl")):
    pytest.skip("NIXL is not installed in this environment", allow_module_level=True)

from tests.integrations.vllm_support import SECRET, tiny_llama

ENGINE = Path(__file__).with_name("vllm_engine.py")
#: bytes of one token's KV in the tiny Llama: layers x K/V x kv heads x head_dim x fp32
TOKEN_BYTES = 2 * 2 * 4 * 64 * 4
START_S = 300


class Engine:
    """One ``vllm_engine.py`` process: send a step (JSON line), read its result line."""

    def __init__(self, role: str, model: Path, port: int, log: Path, mode: str) -> None:
        # PYTHONPATH: the engines import this checkout's kvxfer, whichever one the environment installed
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, KVXFER_SECRET=SECRET, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=path)
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), role, str(model), str(port), mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.role = role

    def result(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        for line in out:
            if line.startswith("{"):
                return dict(json.loads(line))
        raise AssertionError(f"{self.role} engine ended (rc {self.proc.wait()}); see {self.log.name}")

    def start(self, prompts: list[list[int]], params: list[Any] | None = None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "params": params}) + "\n")
        self.proc.stdin.flush()

    def run(self, prompts: list[list[int]], params: list[Any] | None = None) -> dict[str, Any]:
        self.start(prompts, params)
        return self.result()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 1000 + 3 for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_and_decode_engines_match_one_engine(tmp_path: Path, mode: str) -> None:
    model = tiny_llama(tmp_path / "model")
    port = 15600 + os.getpid() % 2000 * 2 + (mode == "push")
    shared = prompt(1, 128)                                  # 2 decode blocks the decode will already hold
    wave1 = [prompt(1, 128) + prompt(2, 21), prompt(3, 70), prompt(4, 33), prompt(5, 150)]
    wave2 = [shared + prompt(6, 40)]                          # shares 128 tokens with wave1[0]
    lost = [prompt(7, 64)]                                    # its prefill dies before the decode reads it
    engines = [Engine(r, model, port, tmp_path / f"{r}.log", mode) for r in ("baseline", "prefill", "decode")]
    baseline, prefill, decode = engines
    try:
        for e in engines:
            assert e.result() == {"ready": True}
        want = baseline.run(wave1 + wave2 + lost)["tokens"]

        p1 = prefill.run(wave1)["params"]
        assert all(p["do_remote_prefill"] and p["kvxfer_addresses"] for p in p1)
        d1 = decode.run(wave1, p1)
        assert d1["tokens"] == want[:4]
        n1 = sum(len(p) for p in wave1)
        assert d1["stats"]["bytes_read"] == n1 * TOKEN_BYTES and d1["stats"]["requests_read"] == 4

        p2 = prefill.run(wave2)["params"]
        d2 = decode.run(wave2, p2)
        assert d2["tokens"] == want[4:5]
        moved = d2["stats"]["bytes_read"] - d1["stats"]["bytes_read"]
        assert moved == (len(wave2[0]) - 128) * TOKEN_BYTES       # the shared 128 tokens were not re-sent
        assert d2["stats"]["tokens_skipped"] - d1["stats"]["tokens_skipped"] == 128

        p3 = prefill.run(lost)["params"]
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(30)
        d3 = decode.run(lost, p3)
        assert d3["tokens"] == want[5:]                            # recomputed by the decode itself
        assert d3["stats"]["failures"] == 1 and d3["stats"]["bytes_read"] == d2["stats"]["bytes_read"]
        print(json.dumps({"kv_bytes_moved": d2["stats"]["bytes_read"], "requests": 5, "recomputed": 1}))
    finally:
        for e in engines:
            e.close()


@pytest.mark.slow
def test_layerwise_push_writes_the_kv_during_the_prefill_forward_pass(tmp_path: Path) -> None:
    """Decode first: the decode's requests name the prefill and a transfer id each, and wait for their KV;
    the prefill, given the same ids, writes each layer as its forward pass computes it. Greedy outputs equal
    one engine's, and every byte the decode needed was written layer by layer (none again at the end)."""
    model = tiny_llama(tmp_path / "model")
    port = 15600 + os.getpid() % 2000 * 2 + 4000
    prompts = [prompt(11, 45), prompt(12, 100), prompt(13, 70)]
    engines = [Engine(r, model, port, tmp_path / f"{r}.log", "layerwise") for r in ("baseline", "prefill", "decode")]
    baseline, prefill, decode = engines
    try:
        for e in engines:
            assert e.result() == {"ready": True}
        want = baseline.run(prompts)["tokens"]
        ids = [f"layerwise-{i}" for i in range(len(prompts))]
        decode.start(prompts, [{"do_remote_prefill": True, "remote_request_id": t, "remote_num_tokens": len(p),
                                "kvxfer_addresses": [f"tcp://127.0.0.1:{port}"]} for t, p in zip(ids, prompts,
                                                                                                 strict=True)])
        time.sleep(5)   # the decode's requests wait for their KV; their push requests reach the prefill
        p = prefill.run(prompts, [{"kvxfer_transfer_id": t} for t in ids])
        d = decode.result()
        assert d["tokens"] == want
        n = sum(len(x) for x in prompts)
        assert d["stats"]["bytes_read"] == n * TOKEN_BYTES and d["stats"]["requests_read"] == 3
        assert p["stats"]["bytes_written_layerwise"] == n * TOKEN_BYTES
        assert p["stats"]["bytes_written"] == n * TOKEN_BYTES      # nothing written again at the end
        print(json.dumps({"kv_bytes_written_layerwise": p["stats"]["bytes_written_layerwise"], "requests": 3}))
    finally:
        for e in engines:
            e.close()
