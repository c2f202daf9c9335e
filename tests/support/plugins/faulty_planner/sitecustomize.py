"""Test plugin: put this folder first on PYTHONPATH and set ``TEST_FAULTY_PLANNER`` to a mutation of
``tests/support/faulty_planner.py`` (or ``per_request``), and every worker that process configures plans with
that faulty planner. Tests use it for worker processes they start but cannot pass a config to (``kvxfer
serve``, the worker processes of ``kvxfer demo``). Python imports ``sitecustomize`` at start-up."""

import os
import sys
from pathlib import Path

_setting = os.environ.get("TEST_FAULTY_PLANNER", "")
if _setting:
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))   # the repository root: `tests` importable
    from tests.support.faulty_planner import install

    install(_setting)
