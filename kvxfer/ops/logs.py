"""Logging configured once per process: timestamps and levels on stderr (rich's handler on a terminal),
a level for kvxfer's loggers, and native libraries' chatter kept off stdout."""

from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error", "critical")
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_configured = False


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler writing to whatever ``sys.stderr`` is when a record is emitted (a redirected
    or captured stderr keeps working)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(level: str = "warning") -> None:
    """Send the ``kvxfer`` loggers at ``level`` and above to stderr (later calls only change the level)."""
    global _configured
    name = level.lower()
    if name not in LEVELS:
        from kvxfer.errors import ConfigError
        raise ConfigError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    root = logging.getLogger("kvxfer")
    root.setLevel(getattr(logging, name.upper()))
    if _configured:
        return
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler
        handler = RichHandler(console=Console(stderr=True), show_path=False, log_time_format="%Y-%m-%d %H:%M:%S")
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    _configured = True
