"""Machine-readable output of every ``--json`` command: one JSON object on stdout with a ``schema``
field (``kvxfer.<command>/<version>``), named fields and explicit units; anything else (native
libraries writing to file descriptor 1, child processes) goes to stderr while the command runs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

#: Version of every command's JSON layout; bumped when a field changes meaning or is removed.
SCHEMA_VERSION = 1


def schema(command: str) -> str:
    """The ``schema`` value of ``command``'s JSON (e.g. ``kvxfer.demo/1``)."""
    return f"kvxfer.{command}/{SCHEMA_VERSION}"


def print_json(command: str, payload: Mapping[str, Any]) -> None:
    """Print ``payload`` as one JSON object, ``schema`` first."""
    print(json.dumps({"schema": schema(command), **payload}), flush=True)


def ms(seconds: float) -> float:
    """Seconds as milliseconds (every duration in JSON output is ``..._ms``)."""
    return float(seconds) * 1e3


@contextlib.contextmanager
def stdout_for_json_only() -> Iterator[None]:
    """While the block runs, file descriptor 1 (what native code and child processes write to) points at
    stderr and ``sys.stdout`` at the real stdout, so only what Python prints reaches stdout. A no-op when
    ``sys.stdout`` is not the process's own (e.g. captured by a test)."""
    process_stdout = sys.__stdout__
    if process_stdout is None or sys.stdout is not process_stdout:
        yield
        return
    process_stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = io.TextIOWrapper(os.fdopen(saved, "wb", closefd=False), write_through=True)
    original = sys.stdout
    sys.stdout = real
    try:
        yield
    finally:
        real.flush()
        sys.stdout = original
        os.dup2(saved, 1)
        os.close(saved)
