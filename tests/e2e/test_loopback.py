"""End to end in one process over loopback: prefill and decode workers, token for token against
single-process generation and decode's committed prompt KV by (layer, role, token, head) against a
single-process prefill (the KV oracle); refused handshakes; leases, deadlines and cancels that free every
block."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.cache.manager import KVCacheManager
from kvxfer.cli import main as cli_main
from kvxfer.disagg import PROTOCOL_VERSION, LocalIdentity, PeerConnection, connect
from kvxfer.disagg import worker as worker_module
from kvxfer.disagg.messages import KvBlocks, KvFailed, KvPull, KvRanks, KvRequest
from kvxfer.disagg.oracle import DEFAULT_POSITIONS, KVOracle
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import ClientResult
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.disagg.worker_protocol import encode_block_ids, encode_layouts, encode_tokens
from kvxfer.errors import AuthenticationError, HandshakeRefused, LayoutMismatch, TransferTimeout
from kvxfer.model import ByteTokenizer, ModelConfig, ReferenceModel, preset
from kvxfer.transport import LoopbackFaults, Transport, create

SECRET = "e2e-test-secret-0123456789"
_names = itertools.count()
WORKER_THREADS = ("kvxfer-control-", "kvxfer-engine-", "kvxfer-reader-", "kvxfer-accept-")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread; and no worker, reader or control thread outlives its test."""
    torch.set_num_threads(1)
    yield
    deadline = time.monotonic() + 5
    while (left := [t.name for t in threading.enumerate() if t.name.startswith(WORKER_THREADS)]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads left behind: {left}"


def name(role: str) -> str:
    return f"e2e-{role}-{next(_names)}"


NEW = 8
"""New tokens of every request whose tokens are checked: the first comes from prefill, so fewer would
check little of decode (KV is checked by the oracle in any case)."""
KV = DEFAULT_POSITIONS
"""``return_kv`` of every checked request: its committed prompt KV comes back for the oracle."""
_oracles: dict[ModelConfig, KVOracle] = {}


def reference(tokens: np.ndarray, n: int, model: ModelConfig | None = None) -> list[int]:
    """Greedy tokens of one process doing prefill and decode."""
    cfg = model or preset("tiny")
    manager = KVCacheManager(cfg.cache_config(16, 128, enable_prefix_reuse=False))
    return ReferenceModel(cfg).generate(manager, tokens, n)


def kv_oracle(model: ModelConfig | None = None) -> KVOracle:
    """The KV oracle of ``model`` (default ``tiny``), built once per test process."""
    cfg = model or preset("tiny")
    if cfg not in _oracles:
        _oracles[cfg] = KVOracle(cfg)
    return _oracles[cfg]


def assert_matches_reference(res: GenerationResult | ClientResult, tokens: np.ndarray, n: int,
                             model: ModelConfig | None = None) -> None:
    """``res`` (asked with ``return_kv``) holds the reference's tokens and prompt KV, position by position."""
    kv = res.prompt_kv if isinstance(res, GenerationResult) else res.kv
    check = kv_oracle(model).check_request(tokens, n, res.tokens, kv)
    assert check.ok, check.describe()


def prompts(seed: int, prefix: int = 50, count: int = 3) -> list[np.ndarray]:
    """``count`` prompts sharing a ``prefix``-token prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 512, prefix)
    return [np.concatenate([shared, rng.integers(0, 512, int(rng.integers(3, 30)))]) for _ in range(count)]


@pytest.fixture
def prefill() -> Iterator[PrefillWorker]:
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256), SECRET) as worker:
        yield worker


def assert_idle(*workers: PrefillWorker | DecodeWorker) -> None:
    """No request holds a slot or an open cache (tree-only blocks are fine)."""
    for w in workers:
        assert w.held_slots() == 0
        assert w.num_open_caches() == 0


@pytest.mark.parametrize(("mode", "layerwise", "per_send"), [("push", False, 1), ("pull", False, 1),
                                                              ("push", True, 1), ("push", True, 3)])
def test_tokens_match_single_process(prefill: PrefillWorker, mode: str, layerwise: bool, per_send: int) -> None:
    with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET, prefill=prefill.address, mode=mode,
                      layerwise=layerwise, layers_per_send=per_send) as decode:
        for tokens in prompts(1):
            res = decode.generate(tokens, 10, timeout=60, return_kv=KV)
            assert_matches_reference(res, tokens, 10)
            assert res.mode == mode and res.layerwise == layerwise
        assert_idle(prefill, decode)


def test_prefix_hit_on_decode_moves_only_missing_tokens(prefill: PrefillWorker) -> None:
    cfg = WorkerConfig(name("decode"), num_blocks=256)
    bytes_per_token = 4 * 2 * 2 * 32 * 4     # layers x roles x kv heads x head_dim x float32
    with DecodeWorker(cfg, SECRET, prefill=prefill.address) as decode:
        first, second = prompts(2, prefix=64, count=2)
        a = decode.generate(first, NEW, timeout=60)
        assert a.reused_tokens_decode == 0 and a.bytes_moved == first.size * bytes_per_token
        b = decode.generate(second, NEW, timeout=60, return_kv=KV)
        assert_matches_reference(b, second, NEW)   # the reused prefix too
        assert b.reused_tokens_decode == 64          # the shared prefix (4 full blocks) stayed on decode
        assert b.reused_tokens_prefill == 64
        assert b.bytes_moved == (second.size - 64) * bytes_per_token
        assert_idle(prefill, decode)


@pytest.mark.parametrize("phased", [False, True])
@pytest.mark.parametrize(("mode", "layerwise"), [("push", True), ("push", False), ("pull", False)])
def test_heterogeneous_tp_block_size_and_head_order(mode: str, layerwise: bool, phased: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill rank (16 tokens/block, HND) feeds two decode ranks (8 tokens/block, NHD, one KV head each):
    the side that plans (prefill pushing, decode pulling) plans from the run templates it keeps for that
    peer: the first request makes them, the next reuse them (making only those of their own prompt-tail
    segment shapes). ``phased``: every plan posted as its phases (checked for read-only pages on its
    templates when pulled), as the workers post plans of many runs."""
    if phased:
        monkeypatch.setattr(worker_module, "PHASED_MIN_RUNS", 0)
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), tokens_per_block=8, head_order="NHD", tp_size=2), SECRET,
                         prefill=prefill.address, mode=mode, layerwise=layerwise) as decode:
        caches = list(prefill._peer_templates.values()) if mode == "push" else \
            [p.templates for p in decode.peers]
        kept = []
        for tokens in prompts(3):
            assert_matches_reference(decode.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW)
            kept.append(sum(len(c) for c in caches))
        assert kept[0] > 0 and all(0 <= b - a < kept[0] for a, b in itertools.pairwise(kept)), kept
        assert_idle(prefill, decode)


def test_prefill_ranks_holding_different_prefixes_reuse_the_one_they_share() -> None:
    """Rank 0 of a two-rank prefill loses its cached prefix (another cache takes every slot, evicting it)
    while rank 1 keeps it: the next request with that prefix reuses what both ranks hold (nothing), not
    each rank's own longest match (which failed the request: "ranks reused different prefixes")."""
    model = preset("tiny-swa")
    with PrefillWorker(WorkerConfig(name("prefill"), model=model, tp_size=2, chunk_size=32), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), model=model, tokens_per_block=8), SECRET,
                         prefill=prefill.address) as decode:
        first, second = prompts(4, prefix=70, count=2)
        assert_matches_reference(decode.generate(first, NEW, timeout=60, return_kv=KV), first, NEW, model)
        rank0, rank1 = prefill.managers
        hog = rank0.create_kv_cache(id="hog")
        assert hog.resume()
        tpb, tokens = rank0.layout.tokens_per_block, 0
        while hog.resize(tokens + tpb):
            tokens += tpb
        hog.close()
        held = [m.create_kv_cache_for_prompt(second, id=f"probe{i}") for i, m in enumerate((rank0, rank1))]
        assert [c.num_reused_tokens for c in held] == [0, 70]
        for c in held:
            c.close()
        res = decode.generate(second, NEW, timeout=60, return_kv=KV)
        assert_matches_reference(res, second, NEW, model)
        assert res.reused_tokens_prefill == 0
        assert_idle(prefill, decode)


def test_two_prefill_ranks_feed_one_decode_rank_with_sliding_windows() -> None:
    model = preset("tiny-swa")
    with PrefillWorker(WorkerConfig(name("prefill"), model=model, tp_size=2, chunk_size=32), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), model=model, tokens_per_block=8), SECRET,
                         prefill=prefill.address) as decode:
        for tokens in prompts(4, prefix=70):
            assert_matches_reference(decode.generate(tokens, NEW, timeout=60, return_kv=KV), tokens, NEW, model)
        assert_idle(prefill, decode)
    with PrefillWorker(WorkerConfig(name("prefill"), model=model), SECRET) as prefill, \
            pytest.raises(LayoutMismatch, match="multiple of decode's"):
        DecodeWorker(WorkerConfig(name("decode"), model=model, tokens_per_block=32), SECRET, prefill=prefill.address)


def test_refused_handshakes_fail_fast_with_the_reason(prefill: PrefillWorker) -> None:
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match=r"failed authentication \(wrong secret"):
        DecodeWorker(WorkerConfig(name("decode")), "a-wrong-secret-0123456789", prefill=prefill.address)
    other = ModelConfig(head_dim=16)
    with pytest.raises(HandshakeRefused, match=r"incompatible layout.*head_dim"):
        DecodeWorker(WorkerConfig(name("decode"), model=other), SECRET, prefill=prefill.address)
    with pytest.raises(HandshakeRefused, match="version"):
        DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address,
                     versions=(PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 1))
    assert time.monotonic() - t0 < 10
    assert_idle(prefill)


def test_stalled_push_fails_at_the_deadline_and_frees_both_sides() -> None:
    stall = LoopbackFaults(never_complete=True)
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET, transport_options={"faults": stall}) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), deadline_s=1.0), SECRET, prefill=prefill.address) as decode:
        tokens = prompts(5)[0]
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"did not arrive within 1\.0 s"):
            decode.generate(tokens, 4, timeout=30)
        assert time.monotonic() - t0 < 5
        deadline = time.monotonic() + 5    # decode frees its blocks once prefill confirms the cancel
        while (decode.held_slots() or prefill.held_slots()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_idle(prefill, decode)
        assert any("cancelled by decode" in r for r in prefill.stats.reasons)
        stall.never_complete = False     # the same pair then serves the next request
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert_idle(prefill, decode)


class HandDecode:
    """A decode peer driven by hand over the real control plane and a loopback transport."""

    def __init__(self, prefill: PrefillWorker) -> None:
        self.cfg = WorkerConfig(name("hand-decode"))
        self.managers = self.cfg.managers()
        self.transport: Transport = create("loopback", self.cfg.name)
        self.transport.register(self.managers[0].memory_regions())
        ident = LocalIdentity("decode", self.cfg.name, self.managers[0].layout, "loopback",
                              self.transport.metadata(), 0.2)
        self.conn: PeerConnection = connect(prefill.address, ident, SECRET, expect_role="prefill")
        self.conn.send(KvRanks(layouts=encode_layouts([m.layout for m in self.managers])))
        assert isinstance(self.conn.recv(5), KvRanks)

    def request(self, rid: str, tokens: np.ndarray, mode: str = "pull", lease_s: float = 30.0) -> None:
        self.conn.send(KvRequest(request_id=rid, tokens=encode_tokens(tokens), mode=mode,  # type: ignore[arg-type]
                                 layerwise=False, layers_per_send=1, lease_s=lease_s, checksum=b""))

    def blocks(self, rid: str, tokens: np.ndarray, skip: int = 0) -> Any:
        cache = self.managers[0].create_kv_cache_for_prompt(tokens)
        assert cache.resume() and cache.resize(int(tokens.size))
        self.conn.send(KvBlocks(request_id=rid, skip=skip, blocks=encode_block_ids([cache.block_id_map()])))
        return cache

    def close(self) -> None:
        self.conn.close()
        self.transport.close()


def test_pull_lease_expires_when_decode_stops_renewing(prefill: PrefillWorker) -> None:
    """A decode peer that asks for a pull and then goes quiet: prefill frees the blocks at lease expiry."""
    hand = HandDecode(prefill)
    try:
        tokens = prompts(6)[0]
        hand.request("q1", tokens, lease_s=0.5)
        cache = hand.blocks("q1", tokens)
        pull = hand.conn.recv(10)
        assert isinstance(pull, KvPull) and pull.request_id == "q1"
        assert prefill.held_slots() > 0
        failed = hand.conn.recv(5)
        assert isinstance(failed, KvFailed) and "lease expired" in failed.reason
        assert_idle(prefill)
        cache.close()
    finally:
        hand.close()


def test_demo_refuses_loopback_across_processes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:        # not even offered: --backend lists what crosses processes
        cli_main(["demo", "--backend", "loopback"])
    assert exc.value.code == 2
    assert "invalid choice: 'loopback'" in capsys.readouterr().err


def test_stalled_pull_fails_at_the_deadline_and_prefill_frees_at_once() -> None:
    stall = LoopbackFaults(never_complete=True)
    with PrefillWorker(WorkerConfig(name("prefill"), lease_s=30.0), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), deadline_s=1.0), SECRET, prefill=prefill.address, mode="pull",
                         transport_options={"faults": stall}) as decode:
        tokens = prompts(10)[0]
        with pytest.raises(TransferTimeout):
            decode.generate(tokens, 4, timeout=30)
        deadline = time.monotonic() + 5     # long before prefill's 30 s lease: decode's cancel frees it
        while prefill.held_slots() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_idle(prefill, decode)
        stall.never_complete = False
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)


def test_generate_client_through_a_serving_decode_worker(prefill: PrefillWorker, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVXFER_SECRET", SECRET)
    with DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address,
                      bind="tcp://127.0.0.1:0") as decode:
        assert decode.address is not None
        assert cli_main(["generate", "--decode", decode.address, "--max-new-tokens", str(NEW), "--json",
                         "hello, disaggregated world"]) == 0
        out = json.loads(capsys.readouterr().out)
        ids = ByteTokenizer(512).encode("hello, disaggregated world")
        assert out["tokens"] == reference(np.array(ids), NEW)
        assert out["prompt_tokens"] == len(ids) and out["bytes_moved"] > 0
        assert_idle(prefill, decode)
