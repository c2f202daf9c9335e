"""The vLLM connector's transfer engine without vLLM: vLLM-shaped paged CPU tensors on two engines
(prefill, decode), pull and push over loopback and NIXL on 127.0.0.1, prefix tokens not moved,
heterogeneous block sizes and tensor-parallel splits, and failures reported instead of hanging."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

from kvxfer.integrations.vllm.layouts import describe_kv_caches, infer_axes, layer_ids
from kvxfer.integrations.vllm.transfer import RemoteKV, TransferEngine, readers_of
from kvxfer.transport import TransferHandle, TransferStatus, available_backends

SECRET = "vllm-connector-test-secret-0123456789"
LAYERS, HEADS, DIM = 2, 4, 8
_names = itertools.count()


def caches(num_blocks: int, block_size: int, heads: int = HEADS, fill: bool = False, head_start: int = 0
           ) -> dict[str, torch.Tensor]:
    """vLLM CPU/FlashAttention-shaped caches ``[2, blocks, block_size, heads, dim]``; filled with a value
    encoding (layer, K/V, global token slot, global head, dim) when ``fill``."""
    out = {}
    for layer in range(LAYERS):
        t = torch.zeros(2, num_blocks, block_size, heads, DIM, dtype=torch.float32)
        if fill:
            kv = torch.arange(2).view(2, 1, 1, 1, 1)
            slot = torch.arange(num_blocks * block_size).view(1, num_blocks, block_size, 1, 1)
            head = (torch.arange(heads) + head_start).view(1, 1, 1, heads, 1)
            dim = torch.arange(DIM).view(1, 1, 1, 1, DIM)
            t += layer * 1e6 + kv * 1e5 + slot * 100 + head * 10 + dim * 0.01
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def token_values(c: dict[str, torch.Tensor], blocks: list[int], block_size: int, tokens: range) -> list[torch.Tensor]:
    """Each layer's K/V rows of ``tokens`` (a request's token positions through its block table)."""
    out = []
    for t in c.values():
        rows = [t[:, blocks[p // block_size], p % block_size] for p in tokens]
        out.append(torch.stack(rows, dim=1))
    return out


def engine(c: dict[str, torch.Tensor], block_size: int, backend: str, heads: int = HEADS, tp_rank: int = 0,
           tp_size: int = 1, **kw: object) -> TransferEngine:
    kv, _ = describe_kv_caches(c, block_size=block_size, kv_heads=heads, head_dim=DIM, tp_rank=tp_rank,
                               tp_size=tp_size)
    return TransferEngine(f"vllm-test-{next(_names)}", kv, backend=backend, secret=SECRET, **kw)  # type: ignore[arg-type]


def wait_received(eng: TransferEngine, rid: str, timeout: float = 20.0) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = eng.finished_receiving()
        if rid in done:
            return True, ""
        if rid in failed:
            return False, failed[rid]
        time.sleep(0.01)
    raise AssertionError(f"{rid}: neither received nor failed within {timeout} s")


def wait_sent(eng: TransferEngine, rid: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rid in eng.finished_sending():
            return
        time.sleep(0.01)
    raise AssertionError(f"{rid}: blocks not released within {timeout} s")


BACKENDS = ["loopback"] + (["nixl"] if available_backends().get("nixl") is None else [])


def test_axes_and_layer_ids_are_read_off_the_tensors() -> None:
    assert infer_axes((2, 10, 16, 4, 64), 10, 16, 4, 64) == "KNBHD"
    assert infer_axes((2, 10, 4, 16, 64), 10, 16, 4, 64) == "KNHBD"
    assert infer_axes((10, 2, 16, 4, 64), 10, 16, 4, 64) == "NKBHD"
    assert layer_ids(["model.layers.3.attn", "model.layers.1.attn"]) == {"model.layers.3.attn": 3,
                                                                          "model.layers.1.attn": 1}
    assert layer_ids(["a", "b"]) == {"a": 0, "b": 1}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pull_and_push_move_exactly_the_tokens_the_decode_lacks(backend: str, mode: str) -> None:
    """The decode holds the first 2 blocks (a prefix hit): only tokens 32.. move, into its own blocks,
    bit for bit; the prefill frees the request once the decode is done."""
    bs, n_tokens, skip = 16, 70, 32
    src_c, dst_c = caches(12, bs, fill=True), caches(12, bs)
    src_blocks, dst_blocks = [7, 2, 9, 4, 11], [1, 3, 5, 0, 8]
    prefill, decode = engine(src_c, bs, backend), engine(dst_c, bs, backend)
    try:
        prefill.hold("p-1")
        remote = RemoteKV("p-1", (prefill.address,), tuple(src_blocks), n_tokens)
        if mode == "pull":
            decode.start_read("d-1", remote, dst_blocks, skip)
        else:
            prefill.computed("p-1", src_blocks)
            decode.start_push("d-1", remote, dst_blocks, skip)
        assert wait_received(decode, "d-1") == (True, "")
        wait_sent(prefill, "p-1")
        want = token_values(src_c, src_blocks, bs, range(skip, n_tokens))
        got = token_values(dst_c, dst_blocks, bs, range(skip, n_tokens))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        untouched = token_values(dst_c, dst_blocks, bs, range(0, skip))
        assert all(bool((u == 0).all()) for u in untouched)   # the prefix the decode held: not moved
        per_token = LAYERS * 2 * HEADS * DIM * 4
        moved = decode.stats.bytes_read if mode == "pull" else prefill.stats.bytes_written
        assert moved == (n_tokens - skip) * per_token
        assert decode.stats.tokens_skipped == skip
    finally:
        decode.close()
        prefill.close()


def test_block_sizes_and_tensor_parallel_splits_pair() -> None:
    """Two prefill ranks (2 heads each, block size 16) feed one decode rank (4 heads, block size 32)."""
    n_tokens = 40
    p_caches = [caches(8, 16, heads=2, fill=True, head_start=2 * r) for r in range(2)]
    prefills = [engine(p_caches[r], 16, "loopback", heads=2, tp_rank=r, tp_size=2) for r in range(2)]
    d_cache = caches(6, 32)
    decode = engine(d_cache, 32, "loopback")
    try:
        assert [readers_of(p.layout, decode.layout) for p in prefills] == [1, 1]
        for p in prefills:
            p.hold("p-2")
        remote = RemoteKV("p-2", tuple(p.address for p in prefills), (5, 1, 6), n_tokens)
        decode.start_read("d-2", remote, [4, 2], 0)
        assert wait_received(decode, "d-2") == (True, "")
        for p in prefills:
            wait_sent(p, "p-2")
        for layer, t in enumerate(d_cache.values()):
            for pos in range(n_tokens):
                row = t[:, [4, 2][pos // 32], pos % 32]
                for r, pc in enumerate(p_caches):
                    src = list(pc.values())[layer][:, [5, 1, 6][pos // 16], pos % 16]
                    assert torch.equal(row[:, 2 * r:2 * r + 2], src)
    finally:
        decode.close()
        for p in prefills:
            p.close()


def test_a_prefill_that_is_gone_is_reported_not_waited_for() -> None:
    prefill = engine(caches(4, 16, fill=True), 16, "loopback")
    address = prefill.address
    prefill.close()
    decode = engine(caches(4, 16), 16, "loopback", timeout=3.0)
    try:
        decode.start_read("d-3", RemoteKV("p-3", (address,), (0, 1), 20), [2, 3], 0)
        ok, reason = wait_received(decode, "d-3")
        assert not ok and reason and decode.stats.failures == 1
    finally:
        decode.close()


def test_a_wrong_secret_is_a_failure_too() -> None:
    prefill = engine(caches(4, 16, fill=True), 16, "loopback")
    kv, _ = describe_kv_caches(caches(4, 16), block_size=16, kv_heads=HEADS, head_dim=DIM)
    decode = TransferEngine("vllm-test-wrong-secret", kv, backend="loopback", secret="another-secret-0123456789",
                            timeout=3.0)
    try:
        decode.start_read("d-4", RemoteKV("p-4", (prefill.address,), (0, 1), 20), [2, 3], 0)
        ok, reason = wait_received(decode, "d-4")
        assert not ok and "auth" in reason.lower()
    finally:
        decode.close()
        prefill.close()


def test_held_blocks_are_freed_at_the_hold_timeout() -> None:
    prefill = engine(caches(4, 16, fill=True), 16, "loopback", hold_timeout=0.2)
    try:
        prefill.hold("p-5")
        assert "p-5" not in prefill.finished_sending()
        wait_sent(prefill, "p-5", timeout=5.0)
    finally:
        prefill.close()


def test_a_read_reported_before_the_hold_still_frees_the_blocks() -> None:
    """The decode may finish before the prefill's scheduler handed the hold to its worker."""
    prefill = engine(caches(4, 16, fill=True), 16, "loopback")
    decode = engine(caches(4, 16), 16, "loopback")
    try:
        decode.start_read("d-6", RemoteKV("p-6", (prefill.address,), (0, 1), 20), [2, 3], 0)
        assert wait_received(decode, "d-6") == (True, "")
        time.sleep(0.2)
        assert "p-6" not in prefill.finished_sending()
        prefill.hold("p-6")
        wait_sent(prefill, "p-6", timeout=5.0)
    finally:
        decode.close()
        prefill.close()


def unified(num_blocks: int, block_size: int, *, token_major: bool, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer cache: logical ``[blocks, heads, block_size, K+V content]``, in memory
    head-major (LBHNC) or token-major (LBNHC, a permuted view)."""
    out = {}
    for layer in range(LAYERS):
        if token_major:
            t = torch.zeros(num_blocks, block_size, HEADS, 2 * DIM).permute(0, 2, 1, 3)
        else:
            t = torch.zeros(num_blocks, HEADS, block_size, 2 * DIM)
        if fill:
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + layer * 1e6)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def test_vllm_032_caches_pull_across_memory_orders_and_block_sizes() -> None:
    """K and V as one content axis: moved together, head-major 16-token blocks into token-major 32-token ones."""
    assert infer_axes((10, 4, 16, 128), 10, 16, 4, 64) == "NHBD"
    src_c, dst_c = unified(8, 16, token_major=False, fill=True), unified(4, 32, token_major=True, fill=False)
    prefill, decode = engine(src_c, 16, "loopback"), engine(dst_c, 32, "loopback")
    try:
        prefill.hold("p-7")
        decode.start_read("d-7", RemoteKV("p-7", (prefill.address,), (6, 0, 3), 45), [3, 1], 5)
        assert wait_received(decode, "d-7") == (True, "")
        for s, d in zip(src_c.values(), dst_c.values(), strict=True):
            for pos in range(45):
                row = d[[3, 1][pos // 32], :, pos % 32]
                if pos < 5:
                    assert bool((row == 0).all())
                else:
                    assert torch.equal(row, s[[6, 0, 3][pos // 16], :, pos % 16])
    finally:
        decode.close()
        prefill.close()


def test_vllm_is_imported_only_by_the_connector_module() -> None:
    """vLLM is optional: kvxfer and the connector's helpers import without it; only connector.py names it."""
    import ast
    import json
    import subprocess
    import sys
    from pathlib import Path

    import kvxfer

    code = ("import sys, json, kvxfer, kvxfer.cli, kvxfer.integrations.vllm, kvxfer.integrations.vllm.transfer, "
            "kvxfer.integrations.vllm.layouts, kvxfer.integrations.vllm.proxy; "
            "print(json.dumps([m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    package = Path(kvxfer.__file__).parent
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"integrations/vllm/connector.py"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_concurrent_first_reads_share_one_connection(backend: str, mode: str) -> None:
    """Several receives starting at once against a prefill not yet connected all land, bit for bit (push:
    the prefill's threads connect the unseen decode and write to it at once)."""
    bs = 16
    src_c, dst_c = caches(16, bs, fill=True), caches(16, bs)
    prefill, decode = engine(src_c, bs, backend), engine(dst_c, bs, backend)
    try:
        for i in range(6):
            prefill.hold(f"p-c{i}")
            remote = RemoteKV(f"p-c{i}", (prefill.address,), (2 * i, 2 * i + 1), 20)
            if mode == "pull":
                decode.start_read(f"d-c{i}", remote, [15 - 2 * i, 14 - 2 * i], 0)
            else:
                prefill.computed(f"p-c{i}", [2 * i, 2 * i + 1])
                decode.start_push(f"d-c{i}", remote, [15 - 2 * i, 14 - 2 * i], 0)
        done: set[str] = set()
        deadline = time.monotonic() + 20
        while len(done) < 6 and time.monotonic() < deadline:
            ok, failed = decode.finished_receiving()
            assert failed == {}
            done |= ok
            time.sleep(0.01)
        assert done == {f"d-c{i}" for i in range(6)}
        assert decode.stats.requests_read == 6 and decode.stats.failures == 0
        for i in range(6):
            want = token_values(src_c, [2 * i, 2 * i + 1], bs, range(20))
            got = token_values(dst_c, [15 - 2 * i, 14 - 2 * i], bs, range(20))
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    finally:
        decode.close()
        prefill.close()


class StalledDecode:
    """A decode engine whose loopback reads never complete (a stalled peer), with every transfer it posted
    and each one's state when the engine closed its transport."""

    def __init__(self, timeout: float) -> None:
        from kvxfer.transport.loopback import LoopbackFaults, LoopbackTransport

        name = f"vllm-test-stalled-{next(_names)}"
        transport = LoopbackTransport(name, LoopbackFaults(never_complete=True))
        self.handles: list[TransferHandle] = []
        self.at_close: list[TransferStatus] = []
        read, close = transport.read, transport.close

        def recorded_read(peer: str, plan: Any, notify: bytes | None = None) -> TransferHandle:
            handle = read(peer, plan, notify)
            self.handles.append(handle)
            return handle

        def recorded_close() -> None:
            self.at_close = [h.status for h in self.handles]
            close()

        transport.read = recorded_read  # type: ignore[method-assign]
        transport.close = recorded_close  # type: ignore[method-assign]
        kv, _ = describe_kv_caches(caches(4, 16), block_size=16, kv_heads=HEADS, head_dim=DIM)
        self.engine = TransferEngine(name, kv, backend="loopback", secret=SECRET, timeout=timeout,
                                     transport=transport)


def test_a_read_that_times_out_is_cancelled_not_left_in_flight() -> None:
    prefill = engine(caches(4, 16, fill=True), 16, "loopback")
    stalled = StalledDecode(timeout=0.5)
    try:
        prefill.hold("p-8")
        stalled.engine.start_read("d-8", RemoteKV("p-8", (prefill.address,), (0, 1), 20), [2, 3], 0)
        ok, reason = wait_received(stalled.engine, "d-8")
        assert not ok and "not complete" in reason
        assert [h.status for h in stalled.handles] == [TransferStatus.CANCELLED]
    finally:
        stalled.engine.close()
        prefill.close()


def test_close_cancels_the_transfers_in_flight_before_closing_the_transport() -> None:
    prefill = engine(caches(4, 16, fill=True), 16, "loopback")
    stalled = StalledDecode(timeout=30.0)
    try:
        for i in range(2):
            prefill.hold(f"p-9{i}")
            stalled.engine.start_read(f"d-9{i}", RemoteKV(f"p-9{i}", (prefill.address,), (2 * i, 2 * i + 1), 20),
                                      [3 - 2 * i, 2 - 2 * i], 0)
        deadline = time.monotonic() + 10
        while len(stalled.handles) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stalled.handles) == 2
        began = time.monotonic()
        stalled.engine.close()
        assert time.monotonic() - began < 5.0   # not the transfers' 30 s
        assert stalled.at_close == [TransferStatus.CANCELLED] * 2
        _, failed = stalled.engine.finished_receiving()
        assert set(failed) == {"d-90", "d-91"}
    finally:
        stalled.engine.close()
        prefill.close()


def wait_asked(prefill: TransferEngine, rid: str, timeout: float = 10.0) -> None:
    """Until the decode's push request for ``rid`` reached the prefill."""
    deadline = time.monotonic() + timeout
    while rid not in prefill._wants and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rid in prefill._wants, f"{rid}: the decode's push request did not arrive"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["every-layer", "one-layer", "asked-mid-prompt"])
def test_layerwise_saves_during_the_forward_pass_are_the_push(backend: str, case: str) -> None:
    """The decode asks first; the prefill writes each layer as its forward pass computes it (the prompt in
    two chunks). With every layer of every token saved the finished request is not written again; with a
    layer missing, or the decode's ask arriving after the first chunk (a gap: no later chunk is written
    layer by layer then), the whole request is written when the prefill finishes. Either way the decode's blocks hold exactly the tokens it lacks."""
    bs, n_tokens, skip, cut = 16, 50, 16, 30
    src_c, dst_c = caches(8, bs, fill=True), caches(8, bs)
    src_blocks, dst_blocks = [5, 1, 6, 2], [3, 0, 7, 4]
    prefill, decode = engine(src_c, bs, backend), engine(dst_c, bs, backend)
    layers = 1 if case == "one-layer" else LAYERS
    try:
        if case == "asked-mid-prompt":   # the first chunk is computed before anyone asked
            for layer in range(layers):
                prefill.save_layer("p-lw", layer, src_blocks, 0, cut)
            prefill.wait_saves()
        decode.start_push("d-lw", RemoteKV("p-lw", (prefill.address,), (), n_tokens), dst_blocks, skip)
        wait_asked(prefill, "p-lw")
        if case != "asked-mid-prompt":
            for layer in range(layers):
                prefill.save_layer("p-lw", layer, src_blocks, 0, cut)
            prefill.wait_saves()
        for layer in range(layers):
            prefill.save_layer("p-lw", layer, src_blocks, cut, n_tokens)
        prefill.wait_saves()
        prefill.hold("p-lw")
        prefill.computed("p-lw", src_blocks)
        assert wait_received(decode, "d-lw") == (True, "")
        wait_sent(prefill, "p-lw")
        want = token_values(src_c, src_blocks, bs, range(skip, n_tokens))
        got = token_values(dst_c, dst_blocks, bs, range(skip, n_tokens))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert all(bool((u == 0).all()) for u in token_values(dst_c, dst_blocks, bs, range(0, skip)))
        per_token_layer = 2 * HEADS * DIM * 4
        # after a gap nothing more is written layer by layer: the whole request follows anyway
        early = 0 if case == "asked-mid-prompt" else layers * (n_tokens - skip) * per_token_layer
        whole = 0 if case == "every-layer" else LAYERS * (n_tokens - skip) * per_token_layer
        assert prefill.stats.bytes_written_layerwise == early
        assert prefill.stats.bytes_written == early + whole
        assert decode.stats.bytes_read == (whole or early)
    finally:
        decode.close()
        prefill.close()
