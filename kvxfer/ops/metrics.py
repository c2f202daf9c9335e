"""Prometheus metrics of one worker: request counters, transfer size / latency histograms, slot usage per
tier, reuse, integrity failures, peer losses, health (docs/operations.md lists every name).

Counters and gauges are read from the worker at scrape time (``status()`` and each manager's slot
accounting); histograms are fed by ``observe`` with each finished request's figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvxfer.cache.config import DiskTier, HostTier, PrimaryTier
from kvxfer.cache.manager import KVCacheManager
from kvxfer.disagg.health import HealthSource
from kvxfer.errors import KvxferError

log = logging.getLogger(__name__)

#: Byte buckets: 64 KiB .. 4 GiB, x4.
BYTE_BUCKETS = tuple(float(1 << s) for s in range(16, 33, 2))
#: Latency buckets in seconds: 0.5 ms .. 60 s.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TIER_NAMES = {PrimaryTier: "primary", HostTier: "host", DiskTier: "disk"}
#: status() key -> (metric, outcome label) of the request counter.
_OUTCOMES = {"requests": "received", "completed": "completed", "failed": "failed", "cancelled": "cancelled"}


class ObservedWorker(Protocol):
    """What the metrics read from a prefill or decode worker."""

    managers: list[KVCacheManager]

    def status(self) -> dict[str, int | float | str]: ...


def slot_usage(managers: Sequence[KVCacheManager]) -> Iterator[tuple[dict[str, str], int]]:
    """(labels, slots) for every rank, tier, pool group and state (free, request_only, evictable, shared)."""
    for rank, m in enumerate(managers):
        for tier in range(m.num_tiers):
            tier_name = _TIER_NAMES.get(type(m.config.tiers[tier]), str(tier))
            for pg in range(len(m.layout.pool_groups)):
                acc = m.slot_accounting(pg, tier)
                for state in ("free", "request_only", "evictable", "shared"):
                    yield ({"rank": str(rank), "tier": tier_name, "pool_group": str(pg), "state": state},
                           int(getattr(acc, state)))


class _StatusCollector(Collector):
    """Reads the worker's status and slot accounting when scraped."""

    def __init__(self, worker: ObservedWorker, health: HealthSource) -> None:
        self.worker = worker
        self.health = health

    def collect(self) -> Iterator[Any]:
        state = self.health.state()
        healthy = GaugeMetricFamily("kvxfer_healthy", "1 when the worker reports itself healthy")
        healthy.add_metric([], 1.0 if state.healthy else 0.0)
        yield healthy
        up = GaugeMetricFamily("kvxfer_status_ok", "1 when the worker answered its status at this scrape")
        try:
            status = self.worker.status()
            usage = list(slot_usage(self.worker.managers))
        except KvxferError as exc:
            log.warning("metrics: the worker did not answer its status: %s", exc)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from status_metrics(status)
        slots = GaugeMetricFamily("kvxfer_slots", "Cache slots by rank, tier, pool group and state",
                                  labels=["rank", "tier", "pool_group", "state"])
        for labels, n in usage:
            slots.add_metric([labels["rank"], labels["tier"], labels["pool_group"], labels["state"]], n)
        yield slots


def status_metrics(status: Mapping[str, int | float | str]) -> Iterator[Any]:
    """The metric families of one ``status()`` answer (prefill or decode)."""
    role = str(status.get("role", ""))
    requests = CounterMetricFamily("kvxfer_requests", "Requests by outcome", labels=["role", "outcome"])
    for key, outcome in _OUTCOMES.items():
        if key in status:
            requests.add_metric([role, outcome], float(status[key]))
    yield requests
    for key, name, doc in (("integrity_failures", "kvxfer_integrity_failures", "Requests whose pages failed the digest"),
                           ("bad_notices", "kvxfer_bad_notices",
                            "Transfer notifications ignored: forged, untagged or malformed (protocol 2)"),
                           ("peer_losses", "kvxfer_peer_losses", "Peer connections lost (not closed cleanly)"),
                           ("failovers", "kvxfer_failovers",
                            "Requests decode sent to another prefill after theirs was lost, removed or stopping"),
                           ("bytes_sent", "kvxfer_sent_bytes", "KV bytes sent by prefill"),
                           ("reused_tokens", "kvxfer_prefill_reused_tokens", "Prompt tokens prefill reused")):
        if key in status:
            fam = CounterMetricFamily(name, doc, labels=["role"])
            fam.add_metric([role], float(status[key]))
            yield fam
    for key, name, doc in (("held_slots", "kvxfer_held_slots", "Slots held by requests over every rank"),
                           ("open_caches", "kvxfer_open_caches", "KV caches open over every rank"),
                           ("jobs", "kvxfer_jobs", "Requests in flight"),
                           ("draining", "kvxfer_draining", "1 while the worker drains for a shutdown")):
        if key in status:
            gauge = GaugeMetricFamily(name, doc, labels=["role"])
            gauge.add_metric([role], float(status[key]))
            yield gauge


#: The stages of ``kvxfer_ttft_stage_seconds`` and the GenerationResult figures they come from: decode's
#: request (``kv_request`` sent), prefill's queue, compute and post (as prefill reported them), the
#: transfer, decode's digest check and the rest of the arrival time ("messages"), which add up to TTFT; and,
#: not in that sum, "commit" (decode entering the prompt into its prefix tree, after the first token) and
#: "allocate" (decode's destination allocation, overlapping prefill's queue and compute).
TTFT_STAGES = (("request", "request_s"), ("queued", "queued_s"), ("prefill", "prefill_s"), ("post", "post_s"),
               ("transfer", "transfer_s"), ("verify", "verify_s"), ("messages", "messages_s"), ("commit", "commit_s"),
               ("allocate", "allocate_s"))


class WorkerMetrics:
    """A Prometheus registry for one worker (``registry``), its histograms fed by ``observe``."""

    def __init__(self, worker: ObservedWorker, health: HealthSource) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatusCollector(worker, health))
        self.transfer_bytes = Histogram("kvxfer_transfer_size_bytes", "KV bytes moved per request",
                                        buckets=BYTE_BUCKETS, registry=self.registry)
        self.transfer_seconds = Histogram("kvxfer_transfer_seconds", "KV transfer time per request",
                                          buckets=SECONDS_BUCKETS, registry=self.registry)
        self.ttft_seconds = Histogram("kvxfer_ttft_seconds", "Submit to first token per request",
                                      buckets=SECONDS_BUCKETS, registry=self.registry)
        self.stage_seconds = Histogram("kvxfer_ttft_stage_seconds", "Where each request's time to first token went",
                                       labelnames=["stage"], buckets=SECONDS_BUCKETS, registry=self.registry)
        self.reused_tokens = Counter("kvxfer_decode_reused_tokens", "Prompt tokens decode reused from its tree",
                                     registry=self.registry)
        self.reuse_hits = Counter("kvxfer_reuse_hits", "Requests that reused at least one block on decode",
                                  registry=self.registry)

    def observe(self, stats: Mapping[str, Any]) -> None:
        """Record one finished request's figures (a decode GenerationResult's ``stats()``)."""
        self.transfer_bytes.observe(float(stats.get("bytes_moved", 0)))
        self.transfer_seconds.observe(float(stats.get("transfer_s", 0.0)))
        self.ttft_seconds.observe(float(stats.get("ttft_s", 0.0)))
        for stage, key in TTFT_STAGES:
            if key in stats:
                self.stage_seconds.labels(stage).observe(float(stats[key]))
        reused = int(stats.get("reused_tokens_decode", 0))
        self.reused_tokens.inc(reused)
        if reused > 0:
            self.reuse_hits.inc()

    def observer(self) -> Callable[[Any], None]:
        """A callback taking a result object with ``stats()`` (what a decode worker's observers get)."""
        return lambda result: self.observe(result.stats())
