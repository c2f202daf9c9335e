"""``kvxfer serve prefill|decode``, ``kvxfer generate`` and ``kvxfer status``: run a worker until stopped
(optionally with Prometheus metrics, ``/health`` and KV events: docs/operations.md, docs/events.md), ask a
decode worker for one completion, or read a worker's status. The shared secret comes from
``--secret-file``, ``$KVXFER_SECRET`` or ``$KVXFER_SECRET_FILE``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from typing import Any

import torch

from kvxfer.cache.event_publisher import KVEventPublisher
from kvxfer.cache.event_wire import EVENT_HASH_ALGOS, WIRE_FORMATS, WireContext
from kvxfer.cli.output import ms, print_json
from kvxfer.disagg.auth import SECRET_ENV, SECRET_FILE_ENV, AuthKey
from kvxfer.disagg.discovery import EtcdClient, PeerWatcher, Registration, follow_prefills, register_worker
from kvxfer.disagg.router import KVRouter
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import GenerateClient, query_status
from kvxfer.errors import BackendUnavailable, ConfigError, KvxferError, PeerUnreachable
from kvxfer.model import model_source
from kvxfer.ops.events import EventPump
from kvxfer.ops.http import OpsServer
from kvxfer.ops.metrics import WorkerMetrics
from kvxfer.transport import BACKENDS, check_backend
from kvxfer.transport import best_backend as best_backend  # re-exported: benchmarks and tests use it
from kvxfer.transport.integrity import ChecksumPolicy


def load_key(secret_file: str | None) -> AuthKey:
    """The shared secret of ``--secret-file`` or the environment; a ConfigError naming every way to give
    one when there is none."""
    if secret_file is None and not os.environ.get(SECRET_ENV) and not os.environ.get(SECRET_FILE_ENV):
        raise ConfigError(f"no shared secret: pass --secret-file FILE, or set ${SECRET_ENV} (the secret itself) "
                          f"or ${SECRET_FILE_ENV} (a file holding it)")
    return AuthKey.load(None, secret_file)


def check_device(device: str) -> None:
    """Refuse at once a device this machine cannot use (rather than a worker failing to start later)."""
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise ConfigError(f"--device {device!r}: expected cpu or cuda:N")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"--device {device!r}: CUDA is not available here (torch.cuda.is_available() is "
                                 f"False: no GPU, or a CPU-only torch build)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Options of a worker's model, cache and transport."""
    p.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    p.add_argument("--name", default=None, help="worker name (its transport name; default: role-pid)")
    p.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                   help="transport (auto: nixl, else ucx)")
    p.add_argument("--model", default="tiny", type=checked_model_name, metavar="NAME|hf:PRESET|hf:DIR",
                   help="reference preset (tiny, tiny-swa, small, medium), or a transformers model: hf:tiny, "
                        "hf:tiny-swa, hf:llama-3.2-1b, hf:llama-3-8b (seeded random weights) or hf:/path/to/dir "
                        "(a local checkpoint directory)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="the interpreter's GIL switch interval: how long the compute thread (the model, mostly "
                        "Python) may hold the GIL while the engine, control and transfer-completion threads wait "
                        "for it (Python's default is 5 ms; a notification then waits up to that long)")
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--blocks", type=int, default=512, help="blocks per layer group")
    p.add_argument("--head-order", choices=("HND", "NHD"), default="HND")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks held by this worker")
    p.add_argument("--lease", type=float, default=10.0, help="source-block lease in seconds")
    p.add_argument("--deadline", type=float, default=30.0, help="per-request KV deadline in seconds (decode)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size in tokens")
    p.add_argument("--no-prepare-writes", action="store_true",
                   help="prefill: write the push's plan at the compute's end instead of preparing it while the "
                        "model computes (Transport.prepare; for A/B measurements)")
    p.add_argument("--secret-file", default=None, help="file holding the shared secret")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus /metrics, /health and a read-only /status over HTTP on port N (0: any)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics server binds")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV events on this ZeroMQ PUB endpoint (e.g. tcp://*:5557), vLLM's wire format")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="also answer replay requests on this ZeroMQ ROUTER endpoint (e.g. tcp://*:5558)")
    p.add_argument("--kv-events-topic", default="kv-events")
    p.add_argument("--kv-events-wire", choices=WIRE_FORMATS, default=WIRE_FORMATS[0],
                   help="vllm (default): vLLM 0.34's, the latest release (array batch of tagged map events); "
                        "vllm-map: vLLM main's map batch; vllm-array: the positional form of vLLM 0.9-0.13; "
                        "reference: every event (Created, Updated diffs too) as the reference design's records")
    p.add_argument("--kv-events-hash", choices=EVENT_HASH_ALGOS, default=None,
                   help="hash option of the published block hashes (default: the cache's; an override may "
                        "only change the width: the *_64 and v1 options publish 64-bit ints, v2_blake3 / "
                        "v2_sha256 the full digest)")
    p.add_argument("--data-parallel-rank", type=int, default=0, help="the rank stamped on every event batch")
    p.add_argument("--etcd", default=None, metavar="URL",
                   help="register in etcd (e.g. http://127.0.0.1:2379) under a lease that expires with this worker; "
                        "a decode worker also follows the prefills registered there")
    p.add_argument("--cluster", default="default", help="etcd discovery: the cluster name (key prefix)")
    p.add_argument("--etcd-ttl", type=int, default=3, help="etcd discovery: lease TTL in seconds (>= 2)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: how long requests in flight may take to finish before they fail with "
                        "the shutdown error (a second signal cuts it short; docs/operations.md)")


def worker_config(a: argparse.Namespace, role: str) -> WorkerConfig:
    """The WorkerConfig the options describe (refused at once when the device or transport cannot run)."""
    check_device(a.device)
    backend = best_backend() if a.backend == "auto" else a.backend
    check_backend(backend, device=a.device)
    return WorkerConfig(a.name or f"{role}-{os.getpid()}", model_source(a.model), a.tokens_per_block, a.blocks,
                        a.head_order, a.tp_size, a.device, backend, a.lease, a.deadline, chunk_size=a.chunk_size,
                        checksum=getattr(a, "checksum", None), prepare_writes=not a.no_prepare_writes)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``serve prefill|decode`` options."""
    sub = p.add_subparsers(dest="role", required=True)
    pre = sub.add_parser("prefill", help="compute KV and send it to decode workers")
    add_worker_arguments(pre)
    dec = sub.add_parser("decode", help="serve clients, get KV from a prefill worker, generate")
    add_worker_arguments(dec)
    dec.add_argument("--prefill", default=None, type=parse_prefills, metavar="ADDR[,ADDR...]",
                     help="control address of the prefill worker, or a comma-separated list of them (xPyD: "
                          "each request goes to the least loaded connected one); required without --etcd")
    dec.add_argument("--kv-route", action="store_true",
                     help="with --etcd: route by KV, following the events endpoints the prefills registered")
    dec.add_argument("--prefill-events", default=None, type=parse_prefills, metavar="ENDPOINT[,ENDPOINT...]",
                     help="route by KV: the prefills' --kv-events endpoints, in --prefill's order; each request "
                          "goes to the prefill holding the longest cached prefix of its prompt")
    dec.add_argument("--mode", choices=("push", "pull"), default="push")
    dec.add_argument("--layerwise", action="store_true", help="send each group of layers as soon as computed")
    dec.add_argument("--layers-per-send", type=int, default=1)
    dec.add_argument("--checksum", type=parse_checksum, default=None, metavar="off|full|every:K|sample:F",
                     help="verify each request's pages against a blake3 digest from prefill (default off)")


def parse_prefills(text: str) -> str | list[str]:
    """``--prefill``: one address, or a comma-separated list (a list of one is the single-prefill case)."""
    addresses = [part.strip() for part in text.split(",")]
    if not all(addresses):
        raise argparse.ArgumentTypeError(f"--prefill: empty address in {text!r}")
    if len(set(addresses)) != len(addresses):
        raise argparse.ArgumentTypeError(f"--prefill: duplicate address in {text!r}")
    return addresses[0] if len(addresses) == 1 else addresses


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
#: Default ``--drain-timeout``: below the 30 s a Kubernetes pod (``terminationGracePeriodSeconds``) gets
#: between SIGTERM and SIGKILL, leaving 10 s to release transfers, registrations and the etcd lease, and
#: above what a request of the default 30 s deadline still needs once its KV is moving.
DRAIN_TIMEOUT_S = 20.0


class StopSignals:
    """SIGTERM/SIGINT handlers of ``serve``: the first signal asks for a drain (``first``), any later one
    cuts it short (``again``). The handlers only set events: the main thread does the work."""

    def __init__(self) -> None:
        self.first = threading.Event()
        self.again = threading.Event()
        self.name = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.first.is_set():
            self.again.set()
        else:
            self.name = signal.Signals(signum).name
            self.first.set()


def _wait_for_signal(worker: Any, signals: StopSignals) -> str | None:
    """Wait for SIGTERM/SIGINT (None) or for the worker to turn unhealthy (the reason)."""
    while not signals.first.wait(0.2):
        if not worker.health.ok:
            return str(worker.health.reason)
    return None


def _drain(worker: Any, who: str, signals: StopSignals, timeout: float) -> None:
    """Stop taking requests and let those in flight finish within ``timeout`` s (a second signal cuts it
    short); the worker's ``close`` then fails what is left with the shutdown error."""
    print(f"{who}: {signals.name}: draining (up to {timeout:g} s; a second signal stops at once)", file=sys.stderr,
          flush=True)
    started = time.monotonic()
    done = worker.drain(timeout, cancel=signals.again)
    took = time.monotonic() - started
    if done:
        print(f"{who}: drained in {took:.1f} s", file=sys.stderr, flush=True)
    else:
        why = "a second signal" if signals.again.is_set() else f"the {timeout:g} s drain timeout"
        print(f"{who}: {why} ended the drain after {took:.1f} s: requests still in flight fail with the shutdown "
              f"error", file=sys.stderr, flush=True)


def kv_router(a: argparse.Namespace, cfg: WorkerConfig) -> KVRouter | None:
    """The KV-aware router ``--prefill-events`` asks for (None without it)."""
    if a.prefill_events is None:
        return KVRouter({}, tokens_per_block=cfg.tokens_per_block) if a.etcd and a.kv_route else None
    if a.prefill is None:
        raise ConfigError("--prefill-events needs --prefill (the addresses its endpoints belong to)")
    prefills = [a.prefill] if isinstance(a.prefill, str) else a.prefill
    events = [a.prefill_events] if isinstance(a.prefill_events, str) else a.prefill_events
    if len(events) != len(prefills):
        raise ConfigError(f"--prefill-events: {len(events)} endpoint(s) for {len(prefills)} prefill address(es); "
                          f"give one per --prefill address, in the same order")
    return KVRouter(dict(zip(prefills, events, strict=True)), tokens_per_block=cfg.tokens_per_block)


def serve(a: argparse.Namespace) -> int:
    """Run one worker until SIGTERM/SIGINT (exit 0) or until it turns unhealthy (exit ``EXIT_UNHEALTHY``);
    prints ``listening on ADDRESS`` once ready, then where its metrics and KV events are served."""
    torch.set_num_threads(1)
    if not 0 < a.switch_interval_ms <= 100:
        raise ConfigError(f"--switch-interval-ms must be in (0, 100], got {a.switch_interval_ms}")
    sys.setswitchinterval(a.switch_interval_ms / 1e3)
    if not a.drain_timeout >= 0:
        raise ConfigError(f"--drain-timeout must be >= 0 s, got {a.drain_timeout}")
    signals = StopSignals()   # from here on a signal stops the worker in order (after it has started)
    from kvxfer.disagg.worker_decode import DecodeWorker
    from kvxfer.disagg.worker_prefill import PrefillWorker
    key = load_key(a.secret_file)
    if a.role == "decode" and a.prefill is None and a.etcd is None:
        raise ConfigError("serve decode: give --prefill ADDR[,ADDR...] or --etcd URL (to follow registered prefills)")
    cfg = worker_config(a, a.role)
    worker: Any
    if a.role == "prefill":
        worker = PrefillWorker(cfg, key, bind=a.listen)
    else:
        worker = DecodeWorker(cfg, key, prefill=a.prefill, bind=a.listen, mode=a.mode, layerwise=a.layerwise,
                              layers_per_send=a.layers_per_send, router=kv_router(a, cfg))
    ops: OpsServer | None = None
    pump: EventPump | None = None
    registration: Registration | None = None
    watcher: PeerWatcher | None = None
    try:
        if a.metrics_port is not None:
            metrics = WorkerMetrics(worker, worker.engine)
            if a.role == "decode":
                worker.result_observers.append(metrics.observer())
            ops = OpsServer(worker, metrics, worker.engine, a.metrics_port, a.metrics_host)
        if a.kv_events is not None:
            manager = worker.managers[0]      # every rank's prefix tree sees the same requests: rank 0 speaks
            ctx = WireContext.for_manager(manager, hash_name=a.kv_events_hash, wire=a.kv_events_wire,
                                          data_parallel_rank=a.data_parallel_rank)
            publisher = KVEventPublisher(a.kv_events, context=ctx, topic=a.kv_events_topic,
                                         replay_endpoint=a.kv_events_replay)
            pump = EventPump(publisher, manager, worker.engine)
        print(f"kvxfer {a.role} {cfg.name}: listening on {worker.address} (transport {cfg.backend}, model warmed up "
              f"in {worker.warm_up_s * 1e3:.0f} ms)", flush=True)
        if ops is not None:
            print(f"kvxfer {a.role} {cfg.name}: metrics on http://{ops.host}:{ops.port}/metrics", flush=True)
        if pump is not None:
            replay = pump.publisher.replay_endpoint
            print(f"kvxfer {a.role} {cfg.name}: KV events on {pump.publisher.endpoint}"
                  + (f", replay on {replay}" if replay else ""), flush=True)
        if a.etcd is not None:
            etcd = EtcdClient(a.etcd)
            if a.role == "decode":
                watcher = follow_prefills(worker, etcd, a.cluster, router=worker.router)
            registration = register_worker(worker, etcd, a.cluster, ttl_s=a.etcd_ttl,
                                           events=pump.publisher.endpoint if pump is not None else "",
                                           replay=(pump.publisher.replay_endpoint or "") if pump is not None else "")
            print(f"kvxfer {a.role} {cfg.name}: registered in etcd {a.etcd} as {registration.key}", flush=True)
        unhealthy = _wait_for_signal(worker, signals)
        if registration is not None:   # first: nobody should pick a worker that is going away
            registration.close()
            registration = None
        if unhealthy is None:
            _drain(worker, f"kvxfer {a.role} {cfg.name}", signals, a.drain_timeout)
    finally:
        if registration is not None:
            registration.close()
        if watcher is not None:
            watcher.close()
        if pump is not None:
            pump.close()
        if ops is not None:
            ops.close()
        worker.close()
    if unhealthy is not None:   # its requests already failed with the cause; a restart gives a sound worker
        print(f"kvxfer {a.role} {cfg.name}: unhealthy, exiting for a restart: {unhealthy}", file=sys.stderr, flush=True)
        return EXIT_UNHEALTHY
    print(f"kvxfer {a.role} {cfg.name}: stopped", file=sys.stderr, flush=True)
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


def stats_with_units(stats: dict[str, Any]) -> dict[str, Any]:
    """A request's figures for JSON: every ``..._s`` duration as ``..._ms``."""
    return {(k[:-2] + "_ms" if k.endswith("_s") else k): (ms(v) if k.endswith("_s") else v) for k, v in stats.items()}


def generate(a: argparse.Namespace) -> int:
    """Send one prompt to a decode worker and print the completion (``--timeout`` bounds everything:
    connecting, waiting, receiving)."""
    if not a.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 s, got {a.timeout}")
    deadline = time.monotonic() + a.timeout
    tok = model_source(a.model).tokenizer()
    client = GenerateClient(a.decode, load_key(a.secret_file), timeout=a.timeout)
    try:
        res = client.generate(tok.encode(a.prompt), a.max_new_tokens, max(0.001, deadline - time.monotonic()),
                              mode=a.mode)
    finally:
        client.close()
    if a.json:
        print_json("generate", {"tokens": res.tokens, "text": tok.decode(res.tokens), **stats_with_units(res.stats)})
    else:
        print(f"tokens: {res.tokens}")
        print(f"text:   {tok.decode(res.tokens)!r}")
        print(f"ttft {ms(float(res.stats['ttft_s'])):.1f} ms, {res.stats['bytes_moved']} bytes moved, "
              f"{res.stats['reused_tokens_decode']} prompt tokens reused on decode")
    return 0


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    """``status`` options."""
    p.add_argument("address", help="control address of a worker (tcp://..., needs the shared secret), or its "
                                   "metrics server (http://HOST:PORT, read-only, no secret)")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--secret-file", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def read_public_status(url: str, timeout: float) -> dict[str, Any]:
    """``GET {url}/status`` of a worker's metrics server (no secret needed: counters only)."""
    target = url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:
            body: dict[str, Any] = json.loads(resp.read())
            return body
    except (OSError, ValueError) as exc:
        raise PeerUnreachable(f"cannot read {target}: {exc}") from exc


def status(a: argparse.Namespace) -> int:
    """Print a worker's status: slot accounting and counters over the authenticated control plane, or the
    read-only subset its metrics server shows to anyone (docs/operations.md)."""
    if a.address.startswith(("http://", "https://")):
        result = read_public_status(a.address, a.timeout)
        source = "metrics server (read-only)"
    else:
        result = dict(query_status(a.address, load_key(a.secret_file), a.timeout))
        source = "control plane"
    if a.json:
        print_json("status", {"address": a.address, "source": source, "status": result})
    else:
        print(f"{a.address} ({source})")
        for k in sorted(result):
            print(f"  {k:20} {result[k]}")
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
