"""Mutation tests of the checks themselves: each class of pairing bug (``tests/support/faulty_planner.py``: block
swap, token shift by one, head ranges swapped between TP ranks, a block from another request, one layer
left unwritten) is injected into the real workers' plans (their ``WorkerConfig.planner``) over loopback, in push, pull and layer-wise, on
identical layouts and on a TP 1 -> 2 pair with other block size and head order. The KV oracle must see
every one (tokens alone cannot: K is stored after RoPE and attention is order-blind), ``--checksum full``
must refuse every one with IntegrityError, and the unmutated request must pass both."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.disagg.worker import WorkerConfig, plan_between
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ConfigError, IntegrityError
from kvxfer.extractor import multirank
from kvxfer.transport.integrity import ChecksumPolicy
from tests.e2e.test_loopback import KV, NEW, SECRET, kv_oracle, name
from tests.support.faulty_planner import MUTATIONS, PER_REQUEST, FaultyPlanner

LAYOUTS: dict[str, dict[str, Any]] = {"same": {}, "tp1to2": {"tokens_per_block": 8, "head_order": "NHD", "tp_size": 2}}
MODES = [("push", False), ("pull", False), ("layerwise", True)]
_ids = itertools.count()


def _cases() -> list[Any]:
    out: list[Any] = []
    for layout, checksum, (mode, _), mutation in itertools.product(LAYOUTS, ("off", "full"), MODES, (None, *MUTATIONS)):
        if mutation == "head_swap" and layout == "same":
            continue   # one rank on each side: no head range to swap
        out.append(pytest.param(layout, checksum, mode, mutation,
                                id=f"{layout}-checksum_{checksum}-{mode}-{mutation or 'none'}"))
    return out


@pytest.fixture(scope="module")
def pairs() -> Iterator[dict[tuple[str, str], tuple[PrefillWorker, DecodeWorker]]]:
    """Worker pairs by (layout, checksum), started on first use; the mutation is chosen per request."""
    torch.set_num_threads(1)
    made: dict[tuple[str, str], tuple[PrefillWorker, DecodeWorker]] = {}
    try:
        yield made
    finally:
        for prefill, decode in made.values():
            decode.close()
            prefill.close()


def pair(pairs: dict[tuple[str, str], tuple[PrefillWorker, DecodeWorker]], layout: str,
         checksum: str) -> DecodeWorker:
    if (layout, checksum) not in pairs:
        planner = FaultyPlanner(PER_REQUEST)   # both sides plan: prefill for push, decode for pull
        prefill = PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256, planner=planner), SECRET)
        policy = ChecksumPolicy() if checksum == "full" else None
        decode = DecodeWorker(WorkerConfig(name("decode"), num_blocks=256, checksum=policy, planner=planner,
                                           **LAYOUTS[layout]), SECRET, prefill=prefill.address)
        pairs[(layout, checksum)] = (prefill, decode)
    return pairs[(layout, checksum)][1]


_first_tokens = itertools.count(1)


def fresh_prompt(case: str) -> np.ndarray:
    """A prompt sharing no token prefix with any earlier one of this process (a distinct first token), so
    the whole prompt travels (>= 2 blocks to swap) and no request reuses blocks a mutated request committed
    (decode's prefix tree keeps those: partial-block reuse would carry their corruption into the next)."""
    tokens = np.random.default_rng(zlib.crc32(case.encode())).integers(0, 512, 70)
    tokens[0] = next(_first_tokens) % 512
    return tokens


@pytest.mark.parametrize(("layout", "checksum", "mode", "mutation"), _cases())
def test_every_mutation_is_caught_over_loopback(pairs: dict[tuple[str, str], tuple[PrefillWorker, DecodeWorker]],
                                                layout: str, checksum: str, mode: str, mutation: str | None) -> None:
    decode = pair(pairs, layout, checksum)
    run_mutation_case(decode, f"m{next(_ids)}", f"{layout}-{checksum}-{mode}-{mutation}", checksum, mode, mutation)


def run_mutation_case(decode: DecodeWorker, rid: str, case: str, checksum: str, mode: str,
                      mutation: str | None) -> None:
    """One request through ``decode`` with ``mutation`` applied by the workers' faulty planner
    (``-mutate=NAME`` in its id): with a full checksum a mutated request must fail IntegrityError; otherwise the KV oracle must pass
    a healthy request and name a mutated one far outside its tolerance."""
    tokens = fresh_prompt(case)
    rid += f"-mutate={mutation}" if mutation else ""
    kw: dict[str, Any] = {"mode": "push" if mode == "layerwise" else mode, "layerwise": mode == "layerwise",
                          "request_id": rid, "return_kv": KV}
    if checksum == "full" and mutation is not None:
        with pytest.raises(IntegrityError):
            decode.generate(tokens, NEW, timeout=60, **kw)
        return
    res = decode.generate(tokens, NEW, timeout=60, **kw)
    check = kv_oracle().check_request(tokens, NEW, res.tokens, res.prompt_kv)
    if mutation is None:
        assert check.ok, check.describe()
        return
    assert not check.kv.ok, f"the KV oracle missed {mutation} ({case}): {check.describe()}"
    assert check.kv.max_error > 100 * check.kv.tolerance
    if mutation == "zero_layer":
        assert check.kv.worst[0] == 1, check.describe()   # the report names the layer left unwritten


def test_unknown_mutation_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"faulty planner 'swap_everything' is not a test mutation"):
        FaultyPlanner("swap_everything")
    with pytest.raises(ConfigError, match=r"faulty planner 'block_swapped' is not a test mutation"):
        FaultyPlanner(PER_REQUEST).mutation_for("r1-mutate=block_swapped")


def test_a_worker_config_takes_a_callable_planner_only() -> None:
    with pytest.raises(ConfigError, match=r"WorkerConfig.planner must be None or a callable Planner, got 'x'"):
        WorkerConfig("refused", planner="x")  # type: ignore[arg-type]
    assert WorkerConfig("default").planner is None
    assert WorkerConfig("faulty", planner=FaultyPlanner("block_swap")).planner is not None


def test_the_workers_plan_is_the_planners_and_by_default_the_extractors() -> None:
    """The seam itself: without a planner the workers' plan is ``multirank.plan_between``'s; with one, the
    planner's, given the request id (so a per-request planner sees it)."""
    prefill = WorkerConfig("p", num_blocks=16).managers()
    decode = WorkerConfig("d", num_blocks=16).managers()
    tokens = np.arange(48)
    src, dst = [m.create_kv_cache_for_prompt(tokens) for m in prefill], [m.create_kv_cache() for m in decode]
    for c in (*src, *dst):
        c.resume()
        c.resize(len(tokens))
    src_layouts, dst_layouts = [m.layout for m in prefill], [m.layout for m in decode]
    want = multirank.plan_between(src_layouts, src, dst_layouts, dst, token_range=(0, 48))
    got = plan_between(src_layouts, src, dst_layouts, dst, token_range=(0, 48), request_id="r")
    assert np.array_equal(got.src.addr, want.src.addr) and np.array_equal(got.dst.addr, want.dst.addr)
    per_request = FaultyPlanner(PER_REQUEST)
    healthy = plan_between(src_layouts, src, dst_layouts, dst, token_range=(0, 48), request_id="r",
                           planner=per_request)
    assert np.array_equal(healthy.dst.addr, want.dst.addr)
    swapped = plan_between(src_layouts, src, dst_layouts, dst, token_range=(0, 48), request_id="r-mutate=block_swap",
                           planner=per_request)
    assert swapped.total_bytes == want.total_bytes and not np.array_equal(swapped.dst.addr, want.dst.addr)
    for c in (*src, *dst):
        c.close()
