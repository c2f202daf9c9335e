"""GenerateClient: the tiny client of a decode worker (``kvxfer generate`` and ``kvxfer demo`` use it)."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.disagg.control import PeerConnection, Secret, connect
from kvxfer.disagg.handshake import LocalIdentity
from kvxfer.disagg.messages import (
    Generate,
    GenerateCancel,
    Generated,
    GenerateFailed,
    WorkerStatus,
    WorkerStatusReply,
)
from kvxfer.disagg.oracle import PromptKV
from kvxfer.disagg.worker_protocol import decode_stats
from kvxfer.errors import DecodeError, KvxferError, ProtocolError, TransferFailed


@dataclass(frozen=True)
class ClientResult:
    """A decode worker's answer: the tokens and the request's figures, or why it failed."""

    request_id: str
    tokens: list[int]
    stats: dict[str, int | float | str]
    error: str = ""
    kv: PromptKV | None = None
    """The committed prompt KV by logical position, when the request asked for it (``return_kv``)."""

    @property
    def ok(self) -> bool:
        """True when the request succeeded."""
        return not self.error


class GenerateClient:
    """An authenticated ``client`` connection to a decode worker, named ``name`` (default: unique in and
    across processes; decode keys a client's requests by it)."""

    def __init__(self, address: str, secret: Secret = None, *, name: str | None = None, timeout: float = 10.0) -> None:
        self.name = name or f"client-{os.getpid()}-{next(_client_ids)}-{secrets.token_hex(4)}"
        ident = LocalIdentity("client", self.name)
        self.conn: PeerConnection = connect(address, ident, secret, timeout=timeout, expect_role="decode")
        self._ids = itertools.count(1)

    def submit(self, tokens: npt.ArrayLike, max_new_tokens: int, *, mode: str = "", layerwise: bool = False,
               return_kv: int = 0) -> str:
        """Send one request; returns its id (answers come back through ``recv``). ``return_kv``: the answer
        carries decode's committed KV of up to that many prompt positions (``ClientResult.kv``)."""
        rid = f"r{next(self._ids)}"
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1).tolist()
        self.conn.send(Generate(request_id=rid, tokens=ids, max_new_tokens=max_new_tokens,
                                mode=mode,  # type: ignore[arg-type]
                                layerwise=layerwise, return_kv=int(return_kv)))
        return rid

    def recv(self, timeout: float) -> ClientResult:
        """The next answer (ControlTimeout after ``timeout`` s, PeerUnreachable if decode went away)."""
        msg = self.conn.recv(timeout)
        match msg:
            case Generated():
                try:
                    kv = PromptKV.from_bytes(msg.kv) if msg.kv else None
                except DecodeError as exc:
                    raise ProtocolError(f"generated.kv: {exc}") from exc
                return ClientResult(msg.request_id, list(msg.tokens), decode_stats(msg.stats), kv=kv)
            case GenerateFailed():
                return ClientResult(msg.request_id, [], {}, f"{msg.error}: {msg.reason}")
        raise ProtocolError(f"decode worker sent {msg.kind!r} to a client")

    def generate(self, tokens: npt.ArrayLike, max_new_tokens: int, timeout: float = 120.0,
                 **kw: str | bool | int) -> ClientResult:
        """Submit one request and wait for its answer; TransferFailed if it failed."""
        rid = self.submit(tokens, max_new_tokens, **kw)  # type: ignore[arg-type]
        while True:
            res = self.recv(timeout)
            if res.request_id != rid:
                continue
            if not res.ok:
                raise TransferFailed(f"request {rid} failed: {res.error}")
            return res

    def cancel(self, request_id: str, reason: str = "cancelled by the client") -> None:
        """Cancel one of this client's requests; decode answers it with ``generate_failed`` (RequestCancelled)."""
        self.conn.send(GenerateCancel(request_id=request_id, reason=reason[:1024]))

    def status(self, timeout: float = 10.0) -> dict[str, int | float | str]:
        """The decode worker's slot accounting and counters."""
        return _ask_status(self.conn, timeout)

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(KvxferError):
            self.conn.close("client done")


def _ask_status(conn: PeerConnection, timeout: float) -> dict[str, int | float | str]:
    conn.send(WorkerStatus())
    deadline = time.monotonic() + timeout
    while True:
        msg = conn.recv(max(0.001, deadline - time.monotonic()))
        if isinstance(msg, WorkerStatusReply):
            return decode_stats(msg.stats)


def query_status(address: str, secret: Secret = None, timeout: float = 10.0) -> dict[str, int | float | str]:
    """The slot accounting and counters of the worker (prefill or decode) at ``address``, over a
    short-lived authenticated ``client`` connection: for operators and for fault checks across processes."""
    ident = LocalIdentity("client", f"status-{os.getpid()}-{next(_status_ids)}")
    conn = connect(address, ident, secret, timeout=timeout)
    try:
        return _ask_status(conn, timeout)
    finally:
        with contextlib.suppress(KvxferError):
            conn.close("status read")


_status_ids = itertools.count(1)
#: Default client names: pid, a per-process counter and random bits, so two clients never share a name.
_client_ids = itertools.count(1)
