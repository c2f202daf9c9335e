"""Probe: stamps (monotonic clock, thread) at entry and exit of the serving path's functions, in every
Python process started with this directory on PYTHONPATH and ``KVX_TRACE=<dir>`` set (one file per
process: ``<dir>/stamps-<pid>.txt``). One host shares the monotonic clock, so merged files show where
a request's time went across the prefill and decode processes (``scripts/stage_trace/merge.py``)."""

import functools
import importlib
import os
import threading
import time

_DIR = os.environ.get("KVX_TRACE")
if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _out = open(os.path.join(_DIR, f"stamps-{os.getpid()}.txt"), "w", buffering=1)  # noqa: SIM115

    def _stamp(label: str) -> None:
        _out.write(f"{time.monotonic():.6f} {threading.current_thread().name[:24]:24s} {label}\n")

    def _wrap(owner: object, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def stamped(*a: object, **k: object) -> object:
            _stamp("> " + label)
            try:
                return fn(*a, **k)
            finally:
                _stamp("< " + label)
        setattr(owner, attr, stamped)

    _TARGETS = {
        "kvxfer.disagg.worker_prefill": ("PrefillWorker", ("_on_request", "_allocate", "_start_compute", "_computed",
                                                           "_send_kv", "_announce", "_finish", "_send")),
        "kvxfer.disagg.worker_decode": ("DecodeWorker", ("submit", "_begin", "_on_prefill", "_arrived", "_send")),
        "kvxfer.disagg.worker": ("Engine", ("_dispatch", "_post_internal")),
        "kvxfer.disagg.control": ("PeerConnection", ("send_urgent", "poll")),
        "kvxfer.transport.base": ("Transport", ("write", "_deliver")),
    }
    for _mod, (_cls, _names) in _TARGETS.items():
        _owner = getattr(importlib.import_module(_mod), _cls)
        for _name in _names:
            _wrap(_owner, _name, f"{_cls}.{_name}")
    _wrap(importlib.import_module("kvxfer.disagg.worker_prefill"), "plan_between", "plan_between")
    try:
        _ipc = importlib.import_module("kvxfer.transport.cuda_ipc")
        for _name in ("_launch", "_complete"):
            _wrap(_ipc.CudaIpcTransport, _name, f"CudaIpcTransport.{_name}")
    except Exception:   # no CUDA here: the other stamps still come
        pass
