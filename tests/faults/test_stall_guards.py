"""What keeps a prefill that was slow, frozen or cut off from writing into decode blocks decode gave away,
and what keeps a prefill that is merely busy from losing its lease:

- lease renewals take effect when they arrive, not when the busy engine gets to them;
- a prefill whose process stalled past decode's loss timeout refuses its pending writes (StallWatch);
- a decode that loses its prefill quarantines the push destinations until the lease could have run out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvxfer.disagg.worker import StallWatch, WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ConfigError, PeerUnreachable, TransferFailed
from tests.e2e.test_loopback import KV, NEW, SECRET, assert_matches_reference, name, prompts
from tests.faults.conftest import assert_settled

MARGIN = 3.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_stall_watch_reports_gaps_after_a_start_and_a_stall_in_progress() -> None:
    clock = FakeClock()
    watch = StallWatch(1.0, period=0.05, clock=clock)
    for _ in range(5):
        clock.t += 0.05
        watch.tick()
    assert watch.stalled_since(0.0) == 0.0
    started = clock.t
    clock.t += 0.9                     # under the threshold: not a stall
    watch.tick()
    assert watch.stalled_since(started) == 0.0
    clock.t += 2.5                     # in progress: the ticker has not run yet
    assert watch.stalled_since(started) == pytest.approx(2.5)
    watch.tick()                       # now recorded, ended at clock.t
    assert watch.stalled_since(started) == pytest.approx(2.5)
    assert watch.stalled_since(clock.t) == 0.0      # work begun after the stall is not affected
    clock.t += 0.05
    watch.tick()
    assert watch.stalled_since(clock.t - 0.01) == 0.0
    for bad in ((1.0, 1.0), (1.0, 0.0), (0.5, 2.0)):
        with pytest.raises(ConfigError, match="StallWatch"):
            StallWatch(bad[0], period=bad[1])


def slow_prefill(prefill: PrefillWorker, before: Callable[[], None]) -> None:
    """Run ``before`` on prefill's engine thread each time it starts computing a prompt."""
    real = prefill.model.prefill

    def wrapped(*args: Any, **kw: Any) -> Any:
        before()
        return real(*args, **kw)
    prefill.model.prefill = wrapped  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_renewals_keep_the_lease_while_prefill_computes_longer_than_it(mode: str) -> None:
    """Prefill's engine is busy 3 leases long before it can post the write (or offer the pull): decode's
    renewals arrive meanwhile and must count, or a long prompt fails for no fault of anyone."""
    lease = 0.4
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), lease_s=lease), SECRET, prefill=prefill.address,
                         mode=mode) as decode:
        slow_prefill(prefill, lambda: time.sleep(3 * lease))
        tokens = prompts(40)[0]
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert list(prefill.stats.reasons) == []
        assert_settled(prefill, decode)


def test_prefill_that_stalled_while_serving_refuses_to_write() -> None:
    """The stall watch's ticker does not run for longer than decode's loss timeout while a request is
    being computed (as in a SIGSTOP): prefill must not post the write, since decode may have declared it
    lost and reused the blocks; the request fails with that reason and the next one is served."""
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=prefill.address) as decode:
        threshold = prefill.stall_watch.threshold
        stalled = [True]

        def stall() -> None:
            if stalled:
                stalled.pop()
                prefill.stall_watch.stop()       # the ticker stops as it would with the whole process
                time.sleep(threshold + 0.3)
        slow_prefill(prefill, stall)
        tokens = prompts(41)[0]
        with pytest.raises(TransferFailed, match=r"this process stalled \d+\.\d s .*may have declared it lost"):
            decode.generate(tokens, NEW, timeout=30)
        prefill.stall_watch = StallWatch(threshold).start()
        assert_matches_reference(decode.generate(tokens, NEW, timeout=30, return_kv=KV), tokens, NEW)
        assert_settled(prefill, decode)
        prefill.stall_watch.stop()


def test_decode_quarantines_push_blocks_of_a_lost_prefill_until_the_lease_ran_out() -> None:
    """The control connection is cut while prefill computes a push request: decode fails the request at
    once but keeps its destination blocks until prefill's lease could have run out (the lease plus one
    more period), then frees them; prefill, resuming, refuses to write into them."""
    lease = 0.6
    with PrefillWorker(WorkerConfig(name("prefill")), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), lease_s=lease), SECRET, prefill=prefill.address) as decode:

        has_blocks = threading.Event()
        on_destinations = prefill._on_destinations

        def note_destinations(*args: Any) -> None:
            on_destinations(*args)
            has_blocks.set()
        prefill._on_destinations = note_destinations  # type: ignore[method-assign]

        def cut() -> None:   # once prefill knows decode's blocks (kv_blocks follows the prompt)
            assert has_blocks.wait(5.0), "decode's kv_blocks did not come"
            prefill.server.close("cut by the test")
            time.sleep(0.3)
        slow_prefill(prefill, cut)
        tokens = prompts(42)[0]
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match=r"^prefill '.*' closed the connection: cut by the test$"):
            decode.generate(tokens, NEW, timeout=30)
        status = decode.status()
        assert status["zombies"] == 1 and int(status["held_slots"]) > 0, status
        while decode.status()["zombies"] and time.monotonic() - t0 < 2 * lease + MARGIN:
            time.sleep(0.02)
        held_for = time.monotonic() - t0
        assert decode.status()["zombies"] == 0
        assert held_for >= lease, f"quarantine ended after {held_for:.2f} s, before one lease ({lease} s)"
        assert_settled(decode)
        deadline = time.monotonic() + 5.0
        while not prefill.stats.reasons and time.monotonic() < deadline:
            time.sleep(0.02)
        # Prefill's engine learns of the loss while its compute thread still runs (the request ends then),
        # or at the write after the compute (refused there): either way nothing is written.
        assert any(("not writing into the blocks of decode" in r and "connection ended" in r)
                   or r.startswith("decode peer lost") for r in prefill.stats.reasons), list(prefill.stats.reasons)
        assert_settled(prefill)
