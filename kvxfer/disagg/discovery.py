"""Discovery of xPyD workers in etcd: workers register their endpoint, role, layout fingerprint and load
under a lease that expires with them, and decode workers watch for prefill peers.

Keys: ``/kvxfer/<cluster>/<role>/<name>`` -> a JSON record (``WorkerRecord``), attached to a lease of
``ttl_s`` seconds kept alive every ``ttl_s / 3`` by the registering worker; a worker that dies stops
renewing, so etcd deletes its key within ``ttl_s``. The client talks to etcd's v3 JSON gateway
(``POST /v3/kv/put`` etc., etcd >= 3.4) with the standard library: no client package to install.
Watching is a poll of the prefix every ``interval_s`` (0.25 s by default), not a watch stream: simpler
to keep correct across etcd restarts, and fast enough for "a new prefill is used within a second".
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvxfer.errors import ConfigError, PeerUnreachable, ProtocolError

log = logging.getLogger("kvxfer.disagg.discovery")

PREFIX = "/kvxfer"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _range_end(prefix: str) -> str:
    """The key just past every key starting with ``prefix`` (etcd's prefix range)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class EtcdClient:
    """The few etcd v3 calls discovery needs, over the JSON gateway at ``url`` (e.g. http://127.0.0.1:2379)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"etcd URL must start with http:// or https://, got {url!r}")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>``; the decoded answer (PeerUnreachable when etcd cannot be reached)."""
        req = urllib.request.Request(f"{self.url}/v3/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                answer = json.loads(resp.read())
        except (urllib.error.URLError, OSError) as exc:
            raise PeerUnreachable(f"etcd at {self.url}: {path}: {exc}") from exc
        except ValueError as exc:
            raise ProtocolError(f"etcd at {self.url}: {path}: answer is not JSON: {exc}") from exc
        if not isinstance(answer, dict):
            raise ProtocolError(f"etcd at {self.url}: {path}: expected a JSON object, got {answer!r:.200}")
        return answer

    def grant(self, ttl_s: int) -> str:
        """A new lease of ``ttl_s`` seconds; its id."""
        return str(self.call("lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: str) -> int:
        """Renew a lease; its remaining TTL (0 or less: it has expired)."""
        result = self.call("lease/keepalive", {"ID": lease}).get("result", {})
        return int(result.get("TTL", 0))

    def revoke(self, lease: str) -> None:
        """End a lease now (its keys go at once)."""
        self.call("lease/revoke", {"ID": lease})

    def put(self, key: str, value: str, lease: str | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        self.call("kv/put", body)

    def get_prefix(self, prefix: str) -> dict[str, str]:
        """Every key under ``prefix`` and its value."""
        answer = self.call("kv/range", {"key": _b64(prefix), "range_end": _range_end(prefix)})
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
                for kv in answer.get("kvs", [])}


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker registers: how to reach it and whether it fits (layout fingerprint), and its load."""

    role: str
    name: str
    address: str
    fingerprint: str
    """Hex blake3 fingerprint of rank 0's cache layout (``CacheLayoutDesc.fingerprint``)."""
    load: int = 0
    events: str = ""
    """Its KV events endpoint ("" when it publishes none)."""
    replay: str = ""
    """Its KV events replay endpoint ("" when it answers none)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerRecord:
        try:
            d = json.loads(text)
            return cls(str(d["role"]), str(d["name"]), str(d["address"]), str(d["fingerprint"]), int(d.get("load", 0)),
                       str(d.get("events", "")), str(d.get("replay", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"discovery record is not a worker record: {exc}: {text!r:.200}") from exc


def key_of(cluster: str, role: str, name: str) -> str:
    return f"{PREFIX}/{cluster}/{role}/{name}"


class Registration:
    """Keeps one worker's record in etcd under a lease until ``close`` (which revokes it). The record's
    ``load`` is refreshed from ``load()`` at every renewal. A renewal that finds the lease expired (etcd
    restarted, or the worker stalled past the TTL) registers again under a new lease."""

    def __init__(self, client: EtcdClient, cluster: str, record: WorkerRecord, *, ttl_s: int = 3,
                 load: Callable[[], int] | None = None) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 2:
            raise ConfigError(f"Registration.ttl_s must be an int >= 2 (etcd's minimum lease), got {ttl_s!r}")
        self.client, self.record, self.ttl_s, self._load = client, record, ttl_s, load
        self.key = key_of(cluster, record.role, record.name)
        self._stop = threading.Event()
        self.error = ""
        """Why the last renewal failed ("" when it succeeded)."""
        self.lease = self._register()
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-etcd-{record.name}", daemon=True)
        self._thread.start()

    def _register(self) -> str:
        lease = self.client.grant(self.ttl_s)
        self._put(lease)
        return lease

    def _put(self, lease: str) -> None:
        record = self.record
        if self._load is not None:
            record = replace(record, load=self._load())
        self.client.put(self.key, record.to_json(), lease)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.client.keepalive(self.lease) <= 0:
                    self.lease = self._register()
                else:
                    self._put(self.lease)
                self.error = ""
            except Exception as exc:   # etcd away: keep trying; the key expires if it stays away
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("%s: renewing its etcd registration failed: %s", self.record.name, self.error)

    def close(self) -> None:
        """Stop renewing and delete the record now."""
        self._stop.set()
        self._thread.join(self.client.timeout_s * 3 + 1.0)
        try:
            self.client.revoke(self.lease)
        except Exception as exc:   # the lease expires by itself
            log.warning("%s: revoking its etcd lease failed: %s", self.record.name, exc)


class PeerWatcher:
    """Polls etcd for the workers of one role and reports those that appear and disappear:
    ``on_added(record)`` / ``on_removed(record)`` run on the watcher's thread; an exception there is
    logged and the record is offered again at the next poll (a prefill not ready yet is retried)."""

    def __init__(self, client: EtcdClient, cluster: str, role: str, on_added: Callable[[WorkerRecord], None],
                 on_removed: Callable[[WorkerRecord], None], *, interval_s: float = 0.25,
                 accept: Callable[[WorkerRecord], bool] | None = None) -> None:
        self.client, self.prefix = client, f"{PREFIX}/{cluster}/{role}/"
        self._on_added, self._on_removed, self._accept = on_added, on_removed, accept
        self.interval_s = interval_s
        self.known: dict[str, WorkerRecord] = {}
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-etcd-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
                self.error = ""
            except Exception as exc:   # etcd away: nothing changes until it answers again
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("etcd watch of %s failed: %s", self.prefix, self.error)
            self._stop.wait(self.interval_s)

    def poll(self) -> None:
        """One look at etcd: report additions, changed addresses and removals."""
        seen: dict[str, WorkerRecord] = {}
        for key, value in self.client.get_prefix(self.prefix).items():
            try:
                record = WorkerRecord.from_json(value)
            except ProtocolError as exc:
                log.warning("etcd key %s: %s", key, exc)
                continue
            if self._accept is None or self._accept(record):
                seen[key] = record
        for key, old in list(self.known.items()):
            new = seen.get(key)
            if new is None or new.address != old.address:
                del self.known[key]
                self._call(self._on_removed, old)
        for key, record in seen.items():
            if key not in self.known and self._call(self._on_added, record):
                self.known[key] = record

    def _call(self, fn: Callable[[WorkerRecord], None], record: WorkerRecord) -> bool:
        try:
            fn(record)
            return True
        except Exception as exc:
            log.warning("etcd watch: handling %s %s failed: %s", record.name, record.address, exc)
            return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.client.timeout_s * 3 + 1.0)


def register_worker(worker: Any, client: EtcdClient, cluster: str, *, events: str = "", replay: str = "",
                    ttl_s: int = 3) -> Registration:
    """Register a running prefill or decode worker (its ``address``, role, rank-0 layout fingerprint, and
    its requests in flight as load)."""
    status = worker.status()

    def load() -> int:
        return int(worker.status()["jobs"])

    record = WorkerRecord(str(status["role"]), worker.config.name, str(worker.address),
                          worker.layouts[0].fingerprint.hex(), int(status["jobs"]), events, replay)
    return Registration(client, cluster, record, ttl_s=ttl_s, load=load)


def follow_prefills(decode: Any, client: EtcdClient, cluster: str, *, router: Any = None,
                    interval_s: float = 0.25) -> PeerWatcher:
    """Keep a decode worker's prefill peers equal to the prefills registered in etcd: one that appears is
    added (``add_prefill``; and to ``router`` with its events endpoint, when it publishes one), one whose
    key goes (its lease expired or was revoked) is removed."""

    def added(record: WorkerRecord) -> None:
        if record.address not in decode.prefills:
            decode.add_prefill(record.address)
        if router is not None and record.events and record.address not in router.workers:
            router.add_worker(record.address, record.events, record.replay or None)
        log.info("%s: prefill %s at %s joined (etcd)", decode.config.name, record.name, record.address)

    def removed(record: WorkerRecord) -> None:
        decode.remove_prefill(record.address)
        if router is not None:
            router.remove_worker(record.address)
        log.info("%s: prefill %s at %s left (etcd)", decode.config.name, record.name, record.address)

    return PeerWatcher(client, cluster, "prefill", added, removed, interval_s=interval_s)
