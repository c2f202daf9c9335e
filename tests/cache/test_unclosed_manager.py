"""A manager dropped without ``shutdown()`` while caches are open (a test that timed out, an engine that
crashed): collecting it stops its copy engine's worker and removes its disk tier's pool files, and one
still alive when the interpreter exits removes them too; the process exits cleanly either way. Runs in a
child process so the threads and files it counts are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import gc, json, os, sys, threading
sys.path.insert(0, os.getcwd())
from pathlib import Path
import numpy as np
from tests.support.reuse_support import TPB, make_manager, write_kv

def workers():
    return sum(t.name == "kvxfer-copy-engine" and t.is_alive() for t in threading.enumerate())

def busy_manager(path):
    mgr = make_manager(8, host_blocks=2, disk_blocks=16, disk_path=str(path))
    tokens = np.arange(100, 100 + 5 * TPB, dtype=np.int64)
    a = mgr.create_kv_cache_for_prompt(tokens)
    assert a.resume() and a.resize(tokens.size)
    write_kv(mgr, a, tokens, 0, tokens.size)
    a.commit(tokens)
    a.suspend()                            # its pages go to the host and disk tiers under pressure
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8 * TPB)
    assert 2 in a.page_tiers(0).tolist()   # something is on disk
    return mgr, a, b

root = Path(sys.argv[1])
(root / "collected").mkdir()
(root / "at_exit").mkdir()
before = workers()
mgr, a, b = busy_manager(root / "collected")
files_open = len(os.listdir(root / "collected"))
running = workers() - before
del mgr, a, b                              # no close, no shutdown
gc.collect()
for t in threading.enumerate():
    if t.name == "kvxfer-copy-engine":
        t.join(timeout=10)
report = {"files_open": files_open, "running": running,
          "files_after_gc": os.listdir(root / "collected"), "workers_after_gc": workers() - before}
kept = busy_manager(root / "at_exit")      # alive until the interpreter exits
gc.disable()
print(json.dumps(report), flush=True)
"""


def test_an_unclosed_manager_releases_its_files_and_worker(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["files_open"] >= 1 and report["running"] == 1
    assert report["files_after_gc"] == []      # collected: the pool files are gone
    assert report["workers_after_gc"] == 0     # and the copy engine's worker ended
    assert os.listdir(tmp_path / "at_exit") == []   # alive at exit: removed by the finalizer
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
