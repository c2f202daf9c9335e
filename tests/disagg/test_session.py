"""Session state machine (every legal and illegal transition) and leases on an injected clock."""

from __future__ import annotations

import itertools

import pytest

from kvxfer.disagg.session import LEGAL_TRANSITIONS, Lease, LeaseTable, Session, SessionState
from kvxfer.errors import ConfigError, SessionError

S = SessionState


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


PATHS = {  # how to reach each state from INIT through legal steps
    S.INIT: [], S.READY: [S.READY], S.TRANSFERRING: [S.READY, S.TRANSFERRING],
    S.DONE: [S.READY, S.TRANSFERRING, S.DONE], S.FAILED: [S.FAILED], S.CANCELLED: [S.CANCELLED],
}
EXPECTED_LEGAL = {
    (S.INIT, S.READY), (S.INIT, S.FAILED), (S.INIT, S.CANCELLED),
    (S.READY, S.TRANSFERRING), (S.READY, S.DONE), (S.READY, S.FAILED), (S.READY, S.CANCELLED),
    (S.TRANSFERRING, S.DONE), (S.TRANSFERRING, S.FAILED), (S.TRANSFERRING, S.CANCELLED),
}


def session_in(state: SessionState, clock: FakeClock | None = None) -> Session:
    s = Session("req-1", clock=clock or FakeClock())
    for step in PATHS[state]:
        s.transition(step, "setup")
    assert s.state is state
    return s


def test_legal_table_is_exactly_the_state_machine() -> None:
    table = {(a, b) for a, bs in LEGAL_TRANSITIONS.items() for b in bs}
    assert table == EXPECTED_LEGAL
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.CANCELLED}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(S, S)))
def test_every_transition(src: SessionState, dst: SessionState) -> None:
    s = session_in(src)
    before = list(s.history)
    if (src, dst) in EXPECTED_LEGAL:
        s.transition(dst, "because")
        assert s.state is dst and s.reason == "because"
        assert s.terminal == dst.terminal
    else:
        with pytest.raises(SessionError, match=f"session req-1: illegal transition {src.name} -> {dst.name}"):
            s.transition(dst, "because")
        assert s.history == before


def test_failure_needs_a_reason_and_keeps_it() -> None:
    clock = FakeClock()
    s = session_in(S.TRANSFERRING, clock)
    with pytest.raises(SessionError, match="FAILED needs a reason"):
        s.transition(S.FAILED)
    clock.now = 107.5
    s.fail("peer prefill-0 lost: 3 heartbeats missed")
    assert s.state is S.FAILED and s.reason == "peer prefill-0 lost: 3 heartbeats missed"
    assert [t.state for t in s.history] == [S.INIT, S.READY, S.TRANSFERRING, S.FAILED]
    assert s.history[-1].at == 107.5
    with pytest.raises(SessionError, match=r"illegal transition FAILED -> CANCELLED.*current reason: peer"):
        s.cancel()


def test_done_callbacks_run_once_on_terminal_state() -> None:
    calls: list[tuple[str, SessionState]] = []
    s = session_in(S.READY)
    s.add_done_callback(lambda x: calls.append(("early", x.state)))
    assert not s.wait(0)
    s.start_transfer()
    assert calls == []
    s.cancel("client went away")
    s.add_done_callback(lambda x: calls.append(("late", x.state)))
    assert calls == [("early", S.CANCELLED), ("late", S.CANCELLED)]
    assert s.wait(0)


def test_lease_expiry_renewal_and_release() -> None:
    clock = FakeClock()
    lease = Lease(5.0, clock)
    assert lease.deadline == 105.0 and not lease.expired and lease.remaining() == 5.0
    clock.now = 104.0
    assert lease.renew() == 109.0
    assert lease.renew(1.0) == 109.0        # renewal never shortens
    clock.now = 108.999
    assert not lease.expired
    clock.now = 109.0
    assert lease.expired and lease.remaining() == 0.0
    with pytest.raises(SessionError, match=r"lease expired at 109\.000 \(now 109\.000\); it cannot be renewed"):
        lease.renew()
    other = Lease(1.0, clock)
    other.release()
    assert other.expired
    with pytest.raises(SessionError, match="released"):
        other.renew()
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ConfigError, match=r"Lease\.duration"):
            Lease(bad, clock)  # type: ignore[arg-type]


def test_session_fails_when_its_lease_expires_and_releases_it_when_done() -> None:
    clock = FakeClock()
    s = Session("req-2", clock=clock, lease=Lease(2.0, clock))
    s.ready()
    s.start_transfer()
    clock.now = 101.0
    assert not s.fail_if_lease_expired()
    clock.now = 102.0
    assert s.fail_if_lease_expired()
    assert s.state is S.FAILED and s.reason == "lease expired at 102.000"
    assert not s.fail_if_lease_expired()          # already terminal
    done = Session("req-3", clock=clock, lease=Lease(2.0, clock))
    done.ready()
    done.done("all blocks were prefix hits")
    assert done.lease is not None and done.lease.expired     # released with the session
    assert not done.fail_if_lease_expired() and done.state is S.DONE


def test_lease_table_collects_only_expired_leases() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    table.grant("a", 1.0)
    table.grant("b", 3.0)
    table.grant("c", 2.0)
    with pytest.raises(SessionError, match="lease for 'a' already granted"):
        table.grant("a", 1.0)
    assert table.next_deadline() == 101.0
    clock.now = 100.5
    table.renew("a")                        # a -> 101.5
    clock.now = 101.5
    assert table.pop_expired() == ["a"]
    assert "a" not in table and len(table) == 2
    with pytest.raises(SessionError, match="no lease for 'a'"):
        table.renew("a")
    assert table.release("c") and not table.release("c")
    assert table.next_deadline() == 103.0
    clock.now = 103.0
    assert table.pop_expired() == ["b"] and len(table) == 0 and table.next_deadline() is None


def test_request_id_must_be_a_string() -> None:
    with pytest.raises(SessionError, match="request_id must be a non-empty string"):
        Session("")
