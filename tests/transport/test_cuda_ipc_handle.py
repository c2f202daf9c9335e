"""The cuda_ipc transfer handle's completion rules, with a stand-in for the CUDA event (runs anywhere):
a copy nobody watches is finished by whoever asks and never handed to the completion thread; one with a
callback (or a notification) is handed over exactly once; ``wait`` on a bounded copy synchronises itself."""

from __future__ import annotations

import threading

import pytest

from kvxfer.errors import TransferFailed, TransferTimeout
from kvxfer.transport import TransferStatus
from kvxfer.transport.cuda_ipc import CudaIpcTransport, _CopyHandle


class FakeEvent:
    def __init__(self) -> None:
        self.ready = False
        self.syncs = 0
        self.error: str | None = None

    def query(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self.ready

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError(self.error)
        self.syncs += 1
        self.ready = True


def make(bounded: bool = True) -> tuple[_CopyHandle, FakeEvent, list[str], list[_CopyHandle]]:
    event, completed = FakeEvent(), []
    handed: list[_CopyHandle] = []

    def complete(h: _CopyHandle) -> None:
        if h._finish(TransferStatus.DONE):
            completed.append("done")
    return _CopyHandle(1, "peer", 64, "write", event, bounded, complete, handed.append), event, completed, handed


def test_an_unwatched_copy_is_finished_by_whoever_asks_without_a_hand_off() -> None:
    handle, event, completed, handed = make()
    assert handle.status is TransferStatus.PENDING and not handle.done()
    event.ready = True
    assert handle.done() and handle.status is TransferStatus.DONE
    assert completed == ["done"] and handed == []


def test_a_callback_hands_the_copy_to_the_completion_thread_once() -> None:
    handle, event, completed, handed = make()
    seen: list[int] = []
    handle.add_done_callback(lambda h: seen.append(h.id))
    handle.add_done_callback(lambda h: seen.append(h.id))
    assert handed == [handle]
    assert handle.status is TransferStatus.PENDING   # watched: the thread finishes it, not a status query
    event.ready = True
    assert handle.status is TransferStatus.PENDING
    handed[0].complete(handed[0])                    # what the completion thread does after synchronising
    assert seen == [1, 1] and completed == ["done"]


def test_wait_on_a_bounded_copy_synchronises_in_the_callers_thread() -> None:
    handle, event, completed, handed = make(bounded=True)
    handle.wait(1.0)
    assert event.syncs == 1 and completed == ["done"] and handed == []


def test_wait_on_an_unbounded_copy_waits_for_the_completion_thread_within_its_timeout() -> None:
    handle, event, completed, handed = make(bounded=False)
    with pytest.raises(TransferTimeout):
        handle.wait(0.05)
    assert handed == [handle] and event.syncs == 0
    finisher = threading.Timer(0.05, lambda: handle.complete(handle))
    finisher.start()
    handle.wait(5.0)
    finisher.join()
    assert completed == ["done"] and handed == [handle]


def test_a_failed_copy_reports_the_cuda_error() -> None:
    handle, event, _, _ = make()
    event.error = "an illegal memory access was encountered"
    assert handle.status is TransferStatus.FAILED
    with pytest.raises(TransferFailed, match="illegal memory access"):
        handle.wait(1.0)


def test_a_settled_copy_with_a_notification_is_finished_by_the_posting_thread() -> None:
    """``write(..., settled=True)`` with a notification: the posting thread waits on the copy's event and
    finishes it (notification included) before returning; nothing is handed to the completion thread.
    (Mutation: watching it instead leaves it pending and handed over.)"""
    handle, event, completed, handed = make(bounded=True)
    assert CudaIpcTransport._notifying(handle, b"notice", True) is handle
    assert handle.status is TransferStatus.DONE and event.syncs == 1
    assert completed == ["done"] and handed == []


def test_a_copy_with_a_notification_not_settled_goes_to_the_completion_thread() -> None:
    handle, event, completed, handed = make(bounded=True)
    CudaIpcTransport._notifying(handle, b"notice", False)
    assert handed == [handle] and event.syncs == 0 and completed == []
    handle2, event2, _, handed2 = make(bounded=True)
    CudaIpcTransport._notifying(handle2, None, True)   # nobody to tell: whoever looks finishes it
    assert handed2 == [] and event2.syncs == 0 and handle2.status is TransferStatus.PENDING


def test_a_settled_copy_that_fails_in_the_posting_thread_names_the_cuda_error() -> None:
    handle, event, completed, _ = make(bounded=True)
    event.error = "an illegal memory access was encountered"
    CudaIpcTransport._notifying(handle, b"notice", True)
    assert handle.status is TransferStatus.FAILED and completed == []
    with pytest.raises(TransferFailed, match="CUDA copy failed: an illegal memory access"):
        handle.wait(1.0)


def test_a_copy_whose_notification_cannot_be_sent_fails_naming_it() -> None:
    """The data landed but the peer will never learn of it (its notification channel is gone): the copy
    fails with the reason instead of finishing as done, so the sender reports the request failed rather
    than waiting for a peer that waits for the notice. (Mutation: ignoring the send's failure.)"""
    import threading as _threading

    from kvxfer.errors import PeerUnreachable

    class GoneOutbox:
        def send(self, payload: bytes) -> None:
            raise PeerUnreachable("notification endpoint tcp://127.0.0.1:1: send failed: broken pipe")

    transport = object.__new__(CudaIpcTransport)   # the completion rule alone: no CUDA needed
    transport.name = "prefill"
    transport._push_lock = _threading.Lock()
    for outbox, reason in ((GoneOutbox(), "send failed: broken pipe"), (None, "'decode' was disconnected")):
        transport._push = {} if outbox is None else {"decode": outbox}
        handle, _, _, _ = make()
        transport._complete(handle, "decode", b"notice")
        assert handle.status is TransferStatus.FAILED
        with pytest.raises(TransferFailed, match=f"copy done, its notification to 'decode' not sent: .*{reason}"):
            handle.wait(1.0)
    transport._push = {}
    handle, _, _, _ = make()
    transport._complete(handle, "decode", None)   # nothing to tell: done
    assert handle.status is TransferStatus.DONE
