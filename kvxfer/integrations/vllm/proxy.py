"""A small P/D proxy for vLLM with kvxfer's connector: each completion goes to a prefill instance first
(``max_tokens`` 1, ``kv_transfer_params={"do_remote_decode": true}``), then to a decode instance with
the ``kv_transfer_params`` the prefill returned; the decode's answer (streamed or not) goes back to the
client as it comes. Prefill and decode instances are taken round-robin. When the prefill fails the
request goes to the decode alone, which then computes the prompt itself.

    python -m kvxfer.integrations.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Layer-wise push (``"mode": "push", "layerwise": true`` on both instances) turns the order round: the
proxy names each request's transfer with an id of its own and sends it to the decode first
(``do_remote_prefill`` with that id and the prefill's control addresses, ``--prefill-kv``), then to the
prefill (``do_remote_decode`` with the same id): the decode's blocks are allocated and asked for while
the prefill computes, so the prefill writes each layer as its forward pass computes it.

    python -m kvxfer.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \
        --prefill-kv tcp://10.0.0.1:15600,tcp://10.0.0.1:15601 --decode http://127.0.0.1:8200 --layerwise

Standard library only (no vLLM): it can run on any host that reaches the instances.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvxfer.errors import ConfigError

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_CHUNK = 1 << 14
#: Layer-wise push: how long after sending a request to the decode the proxy sends it to the prefill.
LAYERWISE_PREFILL_DELAY_S = 0.05


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill's copy of a completion request: one token, not streamed, asking to hold its KV."""
    out = dict(body)
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def layerwise_params(transfer_id: str, addresses: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Layer-wise push: the prefill's and the decode's ``kv_transfer_params`` for one transfer."""
    return ({"do_remote_decode": True, "kvxfer_transfer_id": transfer_id},
            {"do_remote_prefill": True, "remote_request_id": transfer_id, "kvxfer_addresses": list(addresses)})


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode's copy: the client's request with the prefill's ``kv_transfer_params`` (none: the
    decode computes the prompt itself)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params:
        out["kv_transfer_params"] = params
    return out


class Proxy:
    """Round-robin over ``prefills`` and ``decodes`` (base URLs such as ``http://127.0.0.1:8100``)."""

    def __init__(self, prefills: Sequence[str], decodes: Sequence[str], *, timeout: float = 600.0,
                 prefill_kv: Sequence[Sequence[str]] | None = None, layerwise: bool = False) -> None:
        """``prefill_kv``: each prefill's control addresses (one per rank), needed by ``layerwise``."""
        if not prefills or not decodes:
            raise ConfigError(f"vLLM proxy: at least one prefill and one decode URL needed, got {list(prefills)}, "
                              f"{list(decodes)}")
        if layerwise and (prefill_kv is None or len(prefill_kv) != len(prefills) or not all(prefill_kv)):
            raise ConfigError(f"vLLM proxy: layer-wise push needs each prefill's control addresses (--prefill-kv, "
                              f"one per --prefill), got {prefill_kv!r} for {len(prefills)} prefills")
        self.layerwise = layerwise
        self.prefill_kv = {u.rstrip("/"): list(a) for u, a in zip(prefills, prefill_kv or [[]] * len(prefills),
                                                                    strict=True)}
        self.prefills = [u.rstrip("/") for u in prefills]
        self.decodes = [u.rstrip("/") for u in decodes]
        self.timeout = timeout
        self._p = itertools.cycle(self.prefills)
        self._d = itertools.cycle(self.decodes)
        self._lock = threading.Lock()
        self.prefill_failures = 0

    def next_pair(self) -> tuple[str, str]:
        with self._lock:
            return next(self._p), next(self._d)

    def prefill(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str],
                params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Run the prefill (``params``: its ``kv_transfer_params`` instead of ``do_remote_decode`` alone); its
        answer's ``kv_transfer_params``, or None (logged) when it failed."""
        out = prefill_body(body)
        if params is not None:
            out["kv_transfer_params"] = params
        req = urllib.request.Request(url + path, data=json.dumps(out).encode(), method="POST",
                                     headers={**headers, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                params = json.loads(resp.read()).get("kv_transfer_params")
        except (OSError, ValueError) as exc:
            with self._lock:
                self.prefill_failures += 1
            log.warning("vLLM proxy: prefill %s failed (%s); the decode computes the prompt", url, exc)
            return None
        return params if isinstance(params, dict) else None

    def decode(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
               ) -> tuple[int, list[tuple[str, str]], Iterator[bytes]]:
        """Send to the decode; its status, headers and body chunks (streamed as they arrive)."""
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            resp = err

        def chunks() -> Iterator[bytes]:
            with resp:
                while chunk := resp.read1(_CHUNK) if hasattr(resp, "read1") else resp.read(_CHUNK):
                    yield chunk

        return resp.status or 502, list(resp.headers.items()), chunks()


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("vLLM proxy: " + fmt, *args)

        def _auth(self) -> dict[str, str]:
            value = self.headers.get("Authorization")
            return {"Authorization": value} if value else {}

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in COMPLETION_PATHS:
                self.send_error(404, f"the proxy serves {', '.join(COMPLETION_PATHS)}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if not isinstance(body, dict):
                    raise ValueError("the request body is not a JSON object")
            except ValueError as exc:
                self.send_error(400, f"bad request body: {exc}")
                return
            p_url, d_url = proxy.next_pair()
            params: dict[str, Any] | None
            if proxy.layerwise:   # decode first; the prefill starts as soon as the decode's request went out
                p_params, params = layerwise_params(uuid.uuid4().hex, proxy.prefill_kv[p_url])
                threading.Thread(target=self._prefill_after, args=(p_url, body, p_params), daemon=True).start()
            else:
                params = proxy.prefill(p_url, self.path, body, self._auth())
            try:
                status, headers, chunks = proxy.decode(d_url, self.path, decode_body(body, params), self._auth())
            except OSError as exc:
                self.send_error(502, f"decode {d_url} unreachable: {exc}")
                return
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _prefill_after(self, url: str, body: dict[str, Any], params: dict[str, Any]) -> None:
            """Layer-wise: the prefill, a moment after the decode's request (whichever reaches its
            instance first, the KV arrives: a prefill asked late writes the finished request whole)."""
            time.sleep(LAYERWISE_PREFILL_DELAY_S)
            proxy.prefill(url, self.path, body, self._auth(), params)

        def do_GET(self) -> None:
            _, d_url = proxy.next_pair()
            try:
                with urllib.request.urlopen(d_url + self.path, timeout=proxy.timeout) as resp:
                    data, status = resp.read(), resp.status
            except urllib.error.HTTPError as err:
                data, status = err.read(), err.code
            except OSError as exc:
                self.send_error(502, f"decode {d_url} unreachable: {exc}")
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def serve(proxy: Proxy, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for ``proxy`` bound to ``host:port`` (call ``serve_forever``)."""
    server = ThreadingHTTPServer((host, port), _handler(proxy))
    server.daemon_threads = True
    return server


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.integrations.vllm.proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode instance's base URL (repeatable)")
    ap.add_argument("--prefill-kv", action="append", default=None,
                    help="layer-wise: a prefill's control addresses, comma-separated ranks (one per --prefill, in order)")
    ap.add_argument("--layerwise", action="store_true",
                    help="layer-wise push: decode first, the prefill writes each layer during its forward pass")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    kv = [[x for x in v.split(",") if x] for v in a.prefill_kv] if a.prefill_kv else None
    try:
        proxy = Proxy(a.prefill, a.decode, timeout=a.timeout, prefill_kv=kv, layerwise=a.layerwise)
    except ConfigError as exc:
        ap.error(str(exc))
    server = serve(proxy, a.host, a.port)
    log.info("vLLM P/D proxy on http://%s:%d: prefill %s, decode %s", a.host, server.server_port, a.prefill,
             a.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
