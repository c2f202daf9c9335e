"""``kvxfer serve prefill|decode`` and ``kvxfer generate``: run a worker until stopped, or ask a decode
worker for one completion. The shared secret comes from ``--secret-file``, ``$KVXFER_SECRET`` or
``$KVXFER_SECRET_FILE``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

import torch

from kvxfer.disagg.auth import AuthKey
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import GenerateClient, query_status
from kvxfer.errors import BackendUnavailable, ConfigError, KvxferError
from kvxfer.model import model_source
from kvxfer.transport import available_backends
from kvxfer.transport.integrity import ChecksumPolicy

UCX_BACKENDS = ("nixl", "ucx")


def best_backend() -> str:
    """The best installed transport that crosses processes: nixl, then ucx (BackendUnavailable otherwise:
    loopback only works between workers of one process)."""
    reasons = available_backends()
    for name in UCX_BACKENDS:
        if reasons.get(name) is None:
            return name
    raise BackendUnavailable("no UCX transport is installed (" + "; ".join(f"{n}: {reasons.get(n)}" for n in UCX_BACKENDS)
                             + "); loopback cannot cross processes, so two worker processes cannot talk")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Options of a worker's model, cache and transport."""
    p.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    p.add_argument("--name", default=None, help="worker name (its transport name; default: role-pid)")
    p.add_argument("--backend", default="auto", choices=("auto", "nixl", "ucx", "loopback", "cuda_ipc"),
                   help="transport (auto: nixl, else ucx)")
    p.add_argument("--model", default="tiny", type=checked_model_name, metavar="NAME|hf:PRESET|hf:DIR",
                   help="reference preset (tiny, tiny-swa, small, medium), or a transformers model: hf:tiny, "
                        "hf:tiny-swa, hf:llama-3.2-1b, hf:llama-3-8b (seeded random weights) or hf:/path/to/dir "
                        "(a local checkpoint directory)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--blocks", type=int, default=512, help="blocks per layer group")
    p.add_argument("--head-order", choices=("HND", "NHD"), default="HND")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks held by this worker")
    p.add_argument("--lease", type=float, default=10.0, help="source-block lease in seconds")
    p.add_argument("--deadline", type=float, default=30.0, help="per-request KV deadline in seconds (decode)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size in tokens")
    p.add_argument("--secret-file", default=None, help="file holding the shared secret")


def worker_config(a: argparse.Namespace, role: str) -> WorkerConfig:
    """The WorkerConfig the options describe."""
    import os
    backend = best_backend() if a.backend == "auto" else a.backend
    return WorkerConfig(a.name or f"{role}-{os.getpid()}", model_source(a.model), a.tokens_per_block, a.blocks,
                        a.head_order, a.tp_size, a.device, backend, a.lease, a.deadline, chunk_size=a.chunk_size,
                        checksum=getattr(a, "checksum", None))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``serve prefill|decode`` options."""
    sub = p.add_subparsers(dest="role", required=True)
    pre = sub.add_parser("prefill", help="compute KV and send it to decode workers")
    add_worker_arguments(pre)
    dec = sub.add_parser("decode", help="serve clients, get KV from a prefill worker, generate")
    add_worker_arguments(dec)
    dec.add_argument("--prefill", required=True, help="control address of the prefill worker")
    dec.add_argument("--mode", choices=("push", "pull"), default="push")
    dec.add_argument("--layerwise", action="store_true", help="send each group of layers as soon as computed")
    dec.add_argument("--layers-per-send", type=int, default=1)
    dec.add_argument("--checksum", type=parse_checksum, default=None, metavar="off|full|every:K|sample:F",
                     help="verify each request's pages against a blake3 digest from prefill (default off)")


def checked_model_name(text: str) -> str:
    """``--model`` as given, once it names a model (read without loading weights)."""
    try:
        model_source(text)
    except KvxferError as exc:
        raise argparse.ArgumentTypeError(f"--model {text!r}: {exc}") from exc
    return text


def parse_checksum(text: str) -> ChecksumPolicy | None:
    """``off``, ``full``, ``every:K`` (every K-th plan entry) or ``sample:F`` (a seeded fraction F)."""
    kind, _, arg = text.partition(":")
    try:
        if kind == "off" and not arg:
            return None
        if kind == "full" and not arg:
            return ChecksumPolicy()
        if kind == "every":
            return ChecksumPolicy.every(int(arg))
        if kind == "sample":
            return ChecksumPolicy.sample(float(arg), seed=0)
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(f"--checksum {text!r}: {exc}") from exc
    raise argparse.ArgumentTypeError(f"--checksum {text!r}: expected off, full, every:K or sample:F")


#: Exit status of ``serve`` when its worker became unhealthy (a supervisor restarts it).
EXIT_UNHEALTHY = 3


def _wait_for_signal(worker: Any) -> str | None:
    """Wait for SIGTERM/SIGINT (None) or for the worker to turn unhealthy (the reason)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2):
        if not worker.health.ok:
            return str(worker.health.reason)
    return None


def serve(a: argparse.Namespace) -> int:
    """Run one worker until SIGTERM/SIGINT (exit 0) or until it turns unhealthy (exit ``EXIT_UNHEALTHY``);
    prints ``listening on ADDRESS`` once ready."""
    torch.set_num_threads(1)
    from kvxfer.disagg.worker_decode import DecodeWorker
    from kvxfer.disagg.worker_prefill import PrefillWorker
    key = AuthKey.load(None, a.secret_file)
    cfg = worker_config(a, a.role)
    worker: Any
    if a.role == "prefill":
        worker = PrefillWorker(cfg, key, bind=a.listen)
    else:
        worker = DecodeWorker(cfg, key, prefill=a.prefill, bind=a.listen, mode=a.mode, layerwise=a.layerwise,
                              layers_per_send=a.layers_per_send)
    try:
        print(f"kvxfer {a.role} {cfg.name}: listening on {worker.address} (transport {cfg.backend})", flush=True)
        unhealthy = _wait_for_signal(worker)
    finally:
        worker.close()
    if unhealthy is not None:   # its requests already failed with the cause; a restart gives a sound worker
        print(f"kvxfer {a.role} {cfg.name}: unhealthy, exiting for a restart: {unhealthy}", file=sys.stderr, flush=True)
        return EXIT_UNHEALTHY
    return 0


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """``generate`` options."""
    p.add_argument("prompt", help="prompt text (encoded with the model's tokenizer)")
    p.add_argument("--decode", required=True, help="control address of the decode worker")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--model", default="tiny", type=checked_model_name, metavar="NAME|hf:PRESET|hf:DIR",
                   help="the model the workers serve (its tokenizer encodes the prompt and decodes the answer)")
    p.add_argument("--mode", choices=("", "push", "pull"), default="", help="override the decode worker's mode")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--secret-file", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def generate(a: argparse.Namespace) -> int:
    """Send one prompt to a decode worker and print the completion."""
    tok = model_source(a.model).tokenizer()
    client = GenerateClient(a.decode, AuthKey.load(None, a.secret_file))
    try:
        res = client.generate(tok.encode(a.prompt), a.max_new_tokens, a.timeout, mode=a.mode)
    finally:
        client.close()
    if a.json:
        print(json.dumps({"tokens": res.tokens, "text": tok.decode(res.tokens), **res.stats}))
    else:
        print(f"tokens: {res.tokens}")
        print(f"text:   {tok.decode(res.tokens)!r}")
        print(f"ttft {float(res.stats['ttft_s']) * 1e3:.1f} ms, {res.stats['bytes_moved']} bytes moved, "
              f"{res.stats['reused_tokens_decode']} prompt tokens reused on decode")
    return 0


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    """``status`` options."""
    p.add_argument("address", help="control address of a prefill or decode worker")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--secret-file", default=None)


def status(a: argparse.Namespace) -> int:
    """Print a worker's slot accounting and counters as one JSON object."""
    print(json.dumps(query_status(a.address, AuthKey.load(None, a.secret_file), a.timeout), sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``serve``/``generate`` as a standalone entry point (the kvxfer CLI wires the same functions)."""
    ap = argparse.ArgumentParser(prog="kvxfer-worker")
    sub = ap.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve"))
    add_generate_arguments(sub.add_parser("generate"))
    a = ap.parse_args(argv)
    return serve(a) if a.command == "serve" else generate(a)


if __name__ == "__main__":
    sys.exit(main())
