"""The benchmark scripts: each runs as `python benchmarks/NAME.py`; a package so tests import them (`from benchmarks import soak`)."""
