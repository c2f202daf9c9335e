"""Merge the stamp files of ``sitecustomize.py`` and print the last request's after-prefill path: every
stamp from prefill's ``_computed`` (the compute's result reaching its engine) on, in ms from the compute
thread's hand-off. Usage: python merge.py DIR [LINES]"""

import glob
import os
import pathlib
import sys

rows = sorted(line.split(None, 2) for f in glob.glob(os.path.join(sys.argv[1], "stamps-*.txt"))
              for line in pathlib.Path(f).read_text().splitlines())
rows = [r for r in rows if len(r) == 3]
start = max(i for i, r in enumerate(rows) if "PrefillWorker._computed" in r[2] and r[2].startswith(">"))
while start > 0 and "Engine._post_internal" not in rows[start][2]:   # the compute thread's hand-off
    start -= 1
t0 = float(rows[start][0])
for t, thread, label in rows[start:start + int(sys.argv[2]) if len(sys.argv) > 2 else None]:
    print(f"{(float(t) - t0) * 1e3:9.3f}  {thread:24s} {label.strip()}")
