"""kvxfer's vLLM connector driven through vLLM's own Scheduler with mock model-runner outputs: the
prefill holds a finished request's blocks and hands back kv_transfer_params; the decode counts the
prompt as external tokens, its worker side reads them (kvxfer's loopback transport between real
tensors), vLLM then computes only the last prompt token; a prefix the decode holds is not moved; a
prefill gone is reported as invalid blocks and vLLM recomputes; the prefill frees its blocks once
the decode is done. Needs vLLM (.venv-vllm: ``make vllm-venv``)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make vllm-venv`, then run these tests with "
                                   ".venv-vllm/bin/python -m pytest tests/integrations")

import torch

from tests.integrations.vllm_support import (
    request,
    runner_output,
    scheduler,
    tiny_llama,
    vllm_config,
    worker_connector,
)

BS = 16
NUM_BLOCKS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_caches(fill: bool) -> dict[str, torch.Tensor]:
    """The tiny Llama's caches as vLLM 0.32 shapes them: ``[blocks, heads, block_size, K+V content]``."""
    out = {}
    for layer in range(2):
        t = torch.zeros(NUM_BLOCKS, 4, BS, 128)
        if fill:
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + layer * 1e7)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def token_rows(caches: dict[str, torch.Tensor], blocks: list[int], tokens: range) -> list[torch.Tensor]:
    return [torch.stack([t[blocks[p // BS], :, p % BS] for p in tokens]) for t in caches.values()]


def pump(worker: Any, sched_out: Any) -> None:
    """The worker side of one step: bind the scheduler's metadata, start loads, clear."""
    worker.bind_connector_metadata(sched_out.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def wait_finished(worker: Any, timeout: float = 20.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sent, recv = worker.get_finished(set())
        if sent or recv:
            return sent or set(), recv or set()
        time.sleep(0.01)
    raise AssertionError("the connector reported nothing within the deadline")


class PD:
    """A prefill and a decode: vLLM schedulers with kvxfer's connector, and its worker sides over real tensors."""

    def __init__(self, tmp: Path, mode: str = "pull", **extra: Any) -> None:
        model = tiny_llama(tmp / "model")
        self.p_cfg = vllm_config(model, "kv_producer", block_size=BS, port=free_port(), mode=mode, **extra)
        self.d_cfg = vllm_config(model, "kv_consumer", block_size=BS, mode=mode, **extra)
        self.p_sched, self.d_sched = scheduler(self.p_cfg, NUM_BLOCKS), scheduler(self.d_cfg, NUM_BLOCKS)
        self.p_work, self.d_work = worker_connector(self.p_cfg), worker_connector(self.d_cfg)
        self.p_kv, self.d_kv = kv_caches(True), kv_caches(False)
        self.p_work.register_kv_caches(self.p_kv)
        self.d_work.register_kv_caches(self.d_kv)

    def prefill(self, prompt: list[int]) -> tuple[Any, dict[str, Any]]:
        """Run ``prompt`` on the prefill (one step, one token); its kv_transfer_params."""
        req = request(prompt, block_size=BS, max_tokens=1, params={"do_remote_decode": True})
        self.p_sched.add_request(req)
        out = self.p_sched.schedule()
        assert 0 < out.num_scheduled_tokens[req.request_id] <= len(prompt)   # less on its own prefix hit
        pump(self.p_work, out)
        outputs = self.p_sched.update_from_output(out, runner_output([req]))
        (eco,) = [o for group in outputs.values() for o in group.outputs if o.request_id == req.request_id]
        assert eco.finish_reason is not None and eco.kv_transfer_params is not None
        return req, eco.kv_transfer_params

    def release(self, req: Any) -> None:
        """The prefill's next steps: hand the hold to the worker, wait until the decode is done, free."""
        out = self.p_sched.schedule()
        pump(self.p_work, out)
        sent, _ = wait_finished(self.p_work)
        assert sent == {req.request_id}
        self.p_sched.update_from_output(out, runner_output(list(out.num_scheduled_tokens), finished_sending=sent))
        out = self.p_sched.schedule()
        self.p_sched.update_from_output(out, runner_output(list(out.num_scheduled_tokens)))

    def decode_until_loaded(self, prompt: list[int], params: dict[str, Any]) -> tuple[Any, Any, set[str], set[int]]:
        req = request(prompt, block_size=BS, max_tokens=3, params=params)
        self.d_sched.add_request(req)
        out = self.d_sched.schedule()
        assert req.request_id not in out.num_scheduled_tokens            # waiting for remote KV
        (recv,) = out.kv_connector_metadata.recv
        pump(self.d_work, out)
        _, recvd = wait_finished(self.d_work)
        invalid = self.d_work.get_block_ids_with_load_errors()
        self.d_sched.update_from_output(out, runner_output(list(out.num_scheduled_tokens), finished_recving=recvd,
                                                           invalid_block_ids=invalid))
        return req, recv, recvd, invalid

    def close(self) -> None:
        self.d_work.shutdown()
        self.p_work.shutdown()


@pytest.fixture
def pd(tmp_path: Path) -> Any:
    pair = PD(tmp_path)
    yield pair
    pair.close()


def free_blocks(sched: Any) -> int:
    return int(sched.kv_cache_manager.block_pool.free_block_queue.num_free_blocks)


def test_pull_through_vllms_schedulers(pd: PD) -> None:
    prompt = list(range(100, 150))                                   # 50 tokens: 4 blocks of 16
    p_req, params = pd.prefill(prompt)
    assert params["do_remote_prefill"] and params["remote_request_id"] == p_req.request_id
    assert params["kvxfer_addresses"] == [f"tcp://127.0.0.1:{pd.p_cfg.kv_transfer_config.kv_connector_extra_config['port']}"]
    assert len(params["remote_block_ids"][0]) == 4 and params["remote_num_tokens"] == 50
    held = free_blocks(pd.p_sched)
    d_req, recv, recvd, invalid = pd.decode_until_loaded(prompt, params)
    assert recvd == {d_req.request_id} and invalid == set() and recv.start == 0
    out = pd.d_sched.schedule()                                       # only the last prompt token is computed
    assert out.num_scheduled_tokens[d_req.request_id] == 1
    d_blocks = list(recv.block_ids)
    want = token_rows(pd.p_kv, list(params["remote_block_ids"][0]), range(50))
    got = token_rows(pd.d_kv, d_blocks, range(50))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert pd.d_work.engine.stats.bytes_read == 50 * 2 * 2 * 4 * 64 * 4   # tokens x layers x K/V x heads x dim x fp32
    pd.release(p_req)
    assert free_blocks(pd.p_sched) == held + 4                      # the held blocks went back
    pd.d_sched.update_from_output(out, runner_output([d_req]))


def test_a_prefix_the_decode_holds_is_not_moved(pd: PD) -> None:
    first = list(range(200, 250))
    p1, params1 = pd.prefill(first)
    d1, _, _, _ = pd.decode_until_loaded(first, params1)
    out = pd.d_sched.schedule()
    pd.d_sched.update_from_output(out, runner_output([d1]))           # d1 computes its last token: cached
    pd.release(p1)
    before = pd.d_work.engine.stats.bytes_read
    second = first[:40] + list(range(900, 920))                        # shares 2 full blocks (32 tokens)
    p2, params2 = pd.prefill(second)
    d2, recv, recvd, invalid = pd.decode_until_loaded(second, params2)
    assert recvd == {d2.request_id} and not invalid
    assert recv.start == 32                                            # the decode's own prefix hit
    assert pd.d_work.engine.stats.bytes_read - before == (60 - 32) * 2 * 2 * 4 * 64 * 4
    assert pd.d_work.engine.stats.tokens_skipped == 32
    got = token_rows(pd.d_kv, list(recv.block_ids), range(32, 60))
    want = token_rows(pd.p_kv, list(params2["remote_block_ids"][0]), range(32, 60))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    pd.release(p2)


def test_a_prefill_gone_is_recomputed_not_waited_for(pd: PD) -> None:
    prompt = list(range(300, 340))
    _, params = pd.prefill(prompt)
    pd.p_work.shutdown()                                               # the prefill dies holding the blocks
    pd.d_work.engine.timeout = 3.0
    d_req, recv, recvd, invalid = pd.decode_until_loaded(prompt, params)
    assert recvd == {d_req.request_id}
    assert invalid and invalid <= set(recv.block_ids)
    assert pd.d_work.engine.stats.failures == 1
    out = pd.d_sched.schedule()                                        # vLLM recomputes the prompt itself
    assert out.num_scheduled_tokens[d_req.request_id] == len(prompt)


def test_push_through_vllms_schedulers(tmp_path: Path) -> None:
    pair = PD(tmp_path, mode="push")
    try:
        prompt = list(range(400, 437))
        p_req, params = pair.prefill(prompt)
        out = pair.p_sched.schedule()                                  # the hold (and push source) reach the worker
        pump(pair.p_work, out)
        d_req, recv, recvd, invalid = pair.decode_until_loaded(prompt, params)
        assert recvd == {d_req.request_id} and not invalid
        got = token_rows(pair.d_kv, list(recv.block_ids), range(37))
        want = token_rows(pair.p_kv, list(params["remote_block_ids"][0]), range(37))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert pair.p_work.engine.stats.bytes_written == 37 * 2 * 2 * 4 * 64 * 4
        sent, _ = wait_finished(pair.p_work)
        assert sent == {p_req.request_id}
    finally:
        pair.close()


def forward(worker: Any, sched_out: Any, caches: dict[str, torch.Tensor]) -> None:
    """The worker side of one step with a forward pass: each attention layer saved as it is done."""
    worker.bind_connector_metadata(sched_out.kv_connector_metadata)
    worker.start_load_kv(None)
    for name, t in caches.items():
        worker.save_kv_layer(name, t, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_layerwise_push_through_vllms_schedulers(tmp_path: Path) -> None:
    """Decode first; the prefill's 300-token prompt runs in two chunks (256 batched tokens a step), each
    written layer by layer as its forward pass computes it; the finished request is not written again,
    and the decode's blocks hold the prompt's KV."""
    pair = PD(tmp_path, mode="push", layerwise=True)
    try:
        prompt = list(range(500, 800))
        port = pair.p_cfg.kv_transfer_config.kv_connector_extra_config["port"]
        d_req = request(prompt, block_size=BS, max_tokens=3, params={
            "do_remote_prefill": True, "remote_request_id": "lw-1", "kvxfer_addresses": [f"tcp://127.0.0.1:{port}"]})
        pair.d_sched.add_request(d_req)
        d_out = pair.d_sched.schedule()
        assert d_req.request_id not in d_out.num_scheduled_tokens     # waiting for remote KV
        (recv,) = d_out.kv_connector_metadata.recv
        pump(pair.d_work, d_out)                                       # asks the prefill for it
        deadline = time.monotonic() + 10
        while "lw-1" not in pair.p_work.engine._wants and time.monotonic() < deadline:
            time.sleep(0.01)
        p_req = request(prompt, block_size=BS, max_tokens=1,
                        params={"do_remote_decode": True, "kvxfer_transfer_id": "lw-1"})
        pair.p_sched.add_request(p_req)
        steps = []
        for chunk in range(2):
            out = pair.p_sched.schedule()
            steps.append([(s.transfer_id, s.start, s.stop) for s in out.kv_connector_metadata.saves])
            p_blocks = list(out.kv_connector_metadata.saves[0].block_ids)
            forward(pair.p_work, out, pair.p_kv)
            ro = runner_output([p_req])
            if chunk == 0:
                ro.sampled_token_ids = [[]]                            # a partial prefill samples nothing
            pair.p_sched.update_from_output(out, ro)
        assert steps == [[("lw-1", 0, 256)], [("lw-1", 256, 300)]]
        token = 2 * 2 * 4 * 64 * 4
        assert pair.p_work.engine.stats.bytes_written_layerwise == 300 * token
        out = pair.p_sched.schedule()                                  # the hold reaches the worker
        pump(pair.p_work, out)
        _, recvd = wait_finished(pair.d_work)
        assert recvd == {d_req.request_id} and not pair.d_work.get_block_ids_with_load_errors()
        got = token_rows(pair.d_kv, list(recv.block_ids), range(300))
        want = token_rows(pair.p_kv, p_blocks, range(300))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert pair.p_work.engine.stats.bytes_written == 300 * token    # nothing written again
        assert pair.d_work.engine.stats.bytes_read == 300 * token
        sent, _ = wait_finished(pair.p_work)
        assert sent == {p_req.request_id}                              # reported under vLLM's own id
    finally:
        pair.close()
