"""Publish a running worker's KV events: a thread drains a cache manager every ``interval`` seconds and
sends what it had through a ``KVEventPublisher`` (vLLM's wire format; docs/events.md)."""

from __future__ import annotations

import logging
import threading

from kvxfer.cache.event_publisher import EventSource, KVEventPublisher
from kvxfer.disagg.health import HealthSource
from kvxfer.errors import ConfigError

log = logging.getLogger(__name__)


class EventPump:
    """Drains ``source`` into ``publisher`` from a thread of its own until ``close``. A failure stops the
    pump, is logged and marks ``health`` unhealthy (a router would otherwise go stale silently)."""

    def __init__(self, publisher: KVEventPublisher, source: EventSource, health: HealthSource,
                 interval: float = 0.05) -> None:
        if not interval > 0:
            raise ConfigError(f"EventPump interval must be > 0 s, got {interval!r}")
        self.publisher = publisher
        self.source = source
        self.health = health
        self.interval = interval
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.publisher.publish_from(self.source)
            self.publisher.publish_from(self.source)   # what happened before close
        except BaseException as exc:
            self.error = exc
            log.error("KV event publishing stopped: %s", exc)
            self.health.set_unhealthy(f"KV event publishing stopped: {exc}")

    def close(self) -> None:
        """Publish what is left, stop the thread, close the publisher."""
        self._stop.set()
        self._thread.join(5.0 + self.interval)
        self.publisher.close()
