"""The decode worker's request table (``JobTable``): each live request sits in the collection of its
state, ``move`` alone changes it, and what the worker asks of the table (cancellable, live ids, in
flight, a prefill's load) follows the states."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvxfer.disagg.decode_jobs import DecodeJob, JobState, JobTable
from kvxfer.disagg.session import Session
from kvxfer.errors import SessionError


def job(request_id: str, conn: Any = None) -> DecodeJob:
    return DecodeJob(request_id=request_id, tokens=np.arange(4, dtype=np.int64), max_new_tokens=1, mode="push",
                     layerwise=False, future=Future(), session=Session(request_id), submitted=0.0, deadline=1.0,
                     conn=conn)


def collections(table: JobTable) -> dict[str, list[str]]:
    return {"waiting": [j.request_id for j in table.waiting], "parked": [j.request_id for j in table.parked],
            "requested": sorted(table.requested), "generating": sorted(table.generating),
            "quarantined": sorted(table.quarantined)}


def test_a_request_is_in_the_collection_of_its_state_and_leaves_at_a_terminal_one() -> None:
    table, a = JobTable(), job("a")
    table.move(a, JobState.WAITING)
    assert collections(table)["waiting"] == ["a"] and a.state is JobState.WAITING
    table.move(a, JobState.REQUESTED)
    assert collections(table) == {"waiting": [], "parked": [], "requested": ["a"], "generating": [],
                                  "quarantined": []}
    table.move(a, JobState.GENERATING)
    assert collections(table)["generating"] == ["a"] and not table.requested
    table.move(a, JobState.DONE)
    assert collections(table) == {"waiting": [], "parked": [], "requested": [], "generating": [], "quarantined": []}


def test_an_illegal_move_is_refused_and_changes_nothing() -> None:
    table, a = JobTable(), job("a")
    table.move(a, JobState.REQUESTED)
    with pytest.raises(SessionError, match=r"decode request 'a': illegal move requested -> parked"):
        table.move(a, JobState.PARKED)
    assert a.state is JobState.REQUESTED and collections(table)["requested"] == ["a"]


def test_a_stale_copy_under_the_same_id_does_not_take_the_live_attempt_out() -> None:
    """A retried attempt's stale copy carries its own id; moving a record that is not the one held under an
    id (an earlier attempt) leaves the held one in place."""
    table, live, old = JobTable(), job("a"), job("a")
    table.move(live, JobState.REQUESTED)
    old.state = JobState.REQUESTED   # an earlier attempt, no longer the table's
    table.move(old, JobState.FREED)
    assert table.requested["a"] is live


def test_what_the_worker_asks_of_the_table_follows_the_states() -> None:
    table = JobTable()
    conn_a, conn_b = object(), object()
    w, p, r1, r2, g, q = job("w"), job("p"), job("r1", conn_a), job("r2", conn_a), job("g", conn_b), job("q", conn_b)
    table.move(w, JobState.WAITING)
    table.move(p, JobState.PARKED)
    for j in (r1, r2, g, q):
        table.move(j, JobState.REQUESTED)
    table.move(g, JobState.GENERATING)
    table.move(q, JobState.QUARANTINED)
    assert [table.cancellable(i) for i in ("w", "p", "r1")] == [w, p, r1]
    assert table.cancellable("g") is None and table.cancellable("q") is None and table.cancellable("x") is None
    assert all(table.holds(i) for i in ("w", "p", "r1", "r2", "g", "q")) and not table.holds("x")
    assert table.in_flight() == 5   # a quarantined request was answered: only its pages are held
    assert (table.load(conn_a), table.load(conn_b), table.load(None)) == (2, 0, 0)
