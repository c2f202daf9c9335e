"""The nixl handle's wait: it asks NIXL back to back, only asking for ``WAIT_SPIN_S``, then yielding the
CPU between asks and sleeping (which costs Linux's timer slack, 55-75 us) only once per
``WAIT_SLEEP_EVERY_S``, so a transfer's completion is seen within about one ask of happening while the
process's other threads still get the GIL."""

from __future__ import annotations

import pytest

from kvxfer.errors import TransferTimeout
from kvxfer.transport import nixl as nixl_backend
from kvxfer.transport.handle import TransferHandle, TransferStatus

TICK_S = 10e-6   # what each reading of the fake clock advances it by


class FakeClock:
    """time.monotonic and time.sleep for the module: each reading advances 10 us; sleeps and yields counted."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.yields = 0

    def monotonic(self) -> float:
        self.now += TICK_S
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1

    def sched_yield(self) -> None:
        self.yields += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(nixl_backend.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(nixl_backend.time, "sleep", fake.sleep)
    monkeypatch.setattr(nixl_backend, "_yield_cpu", fake.sched_yield)
    return fake


def handle_done_after(asks: int) -> tuple[TransferHandle, list[int]]:
    """A nixl handle whose transfer NIXL reports done at the ``asks``-th ask; and the count of asks."""
    count = [0]

    def poll(handle: TransferHandle) -> None:
        count[0] += 1
        if count[0] >= asks:
            handle._finish(TransferStatus.DONE)

    return nixl_backend._PollingHandle(1, "peer", 4096, "write", poll=poll, abort=lambda h: True), count


def test_wait_yields_between_asks_and_sleeps_once_per_interval(clock: FakeClock) -> None:
    handle, asks = handle_done_after(400)   # 400 asks, one clock reading each: 4 ms of fake time
    handle.wait(1.0)
    assert handle.status is TransferStatus.DONE and asks[0] == 400
    spin = round(nixl_backend.WAIT_SPIN_S / TICK_S)   # asks made back to back before the first yield
    per_interval = nixl_backend.WAIT_SLEEP_EVERY_S / TICK_S
    expected_sleeps = (399 - spin) / per_interval   # one reading per ask after the first
    assert expected_sleeps - 1 <= clock.sleeps <= expected_sleeps + 1, clock.sleeps
    assert spin - 1 <= 399 - clock.sleeps - clock.yields <= spin + 1


def test_a_transfer_done_within_the_spin_is_seen_without_giving_the_core_away(clock: FakeClock) -> None:
    handle, asks = handle_done_after(5)
    handle.wait(1.0)
    assert handle.status is TransferStatus.DONE and asks[0] == 5
    assert clock.yields == 0 and clock.sleeps == 0


def test_wait_times_out_with_the_transfer_named(clock: FakeClock) -> None:
    handle, asks = handle_done_after(10**9)
    with pytest.raises(TransferTimeout, match=r"transfer 1 .*peer 'peer'"):
        handle.wait(0.002)
    assert 190 <= asks[0] <= 202   # 2 ms of 10 us readings: it kept asking until the deadline, no longer
    assert handle.status is TransferStatus.PENDING
