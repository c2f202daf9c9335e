"""The P/D proxy against fake prefill and decode instances (HTTP servers recording what they got): the
prefill gets one token and ``do_remote_decode``, the decode the prefill's kv_transfer_params, the client
the decode's answer; a failed prefill leaves the decode to compute the prompt."""

from __future__ import annotations

import itertools
import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvxfer.integrations.vllm.proxy import Proxy, serve

_arrivals = itertools.count()
PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "kvxfer_addresses": ["tcp://127.0.0.1:1"]}


class Fake:
    """A fake vLLM instance answering completions with ``answer`` (or HTTP 500)."""

    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.got: list[dict[str, Any]] = []
        self.arrived: list[int] = []   # when each request came, in the order of every fake's requests
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                fake.got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                fake.arrived.append(next(_arrivals))
                if answer is None:
                    self.send_error(500, "down")
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


@pytest.fixture
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[Fake, Fake, str, Proxy]]:
    prefill = Fake({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS} if request.param else None)
    decode = Fake({"choices": [{"text": "the answer"}]})
    proxy = Proxy([prefill.url], [decode.url], timeout=10)
    server = serve(proxy, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield prefill, decode, f"http://127.0.0.1:{server.server_port}", proxy
    server.shutdown()
    server.server_close()
    prefill.close()
    decode.close()


@pytest.mark.parametrize("setup", [True], indirect=True)
def test_prefill_then_decode_with_the_prefills_params(setup: tuple[Fake, Fake, str, Proxy]) -> None:
    prefill, decode, url, _ = setup
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "stream": False}
    assert post(url + "/v1/completions", body) == {"choices": [{"text": "the answer"}]}
    (p,) = prefill.got
    assert p["max_tokens"] == 1 and p["stream"] is False and p["kv_transfer_params"] == {"do_remote_decode": True}
    (d,) = decode.got
    assert d == {**body, "kv_transfer_params": PARAMS}


@pytest.mark.parametrize("setup", [False], indirect=True)
def test_a_failed_prefill_leaves_the_prompt_to_the_decode(setup: tuple[Fake, Fake, str, Proxy]) -> None:
    prefill, decode, url, proxy = setup
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
    assert post(url + "/v1/chat/completions", body) == {"choices": [{"text": "the answer"}]}
    assert prefill.got[0]["max_completion_tokens"] == 1
    assert decode.got == [body] and proxy.prefill_failures == 1


def test_layerwise_sends_the_decode_first_and_both_the_same_transfer_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer-wise push: the decode gets the prefill's control addresses and a transfer id before the
    prefill gets the request, the prefill the same id (and one token); the client the decode's answer."""
    import time

    import kvxfer.integrations.vllm.proxy as proxy_module

    monkeypatch.setattr(proxy_module, "LAYERWISE_PREFILL_DELAY_S", 0.5)   # a margin for a loaded host
    prefill = Fake({"choices": [{"text": "x"}]})
    decode = Fake({"choices": [{"text": "the answer"}]})
    proxy = Proxy([prefill.url], [decode.url], timeout=10, layerwise=True,
                  prefill_kv=[["tcp://10.0.0.1:15600", "tcp://10.0.0.1:15601"]])
    server = serve(proxy, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20}
        assert post(f"http://127.0.0.1:{server.server_port}/v1/completions", body) == {
            "choices": [{"text": "the answer"}]}
        deadline = time.monotonic() + 10
        while not prefill.got and time.monotonic() < deadline:
            time.sleep(0.01)
        (d,), (p,) = decode.got, prefill.got
        tid = d["kv_transfer_params"]["remote_request_id"]
        assert d == {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": tid,
                                                    "kvxfer_addresses": ["tcp://10.0.0.1:15600",
                                                                         "tcp://10.0.0.1:15601"]}}
        assert p["max_tokens"] == 1 and p["kv_transfer_params"] == {"do_remote_decode": True,
                                                                    "kvxfer_transfer_id": tid}
        assert tid and decode.arrived[0] < prefill.arrived[0]
    finally:
        server.shutdown()
        server.server_close()
        prefill.close()
        decode.close()


def test_layerwise_needs_each_prefills_control_addresses() -> None:
    from kvxfer.errors import ConfigError

    with pytest.raises(ConfigError, match="prefill-kv"):
        Proxy(["http://a"], ["http://b"], layerwise=True)
    with pytest.raises(ConfigError, match="prefill-kv"):
        Proxy(["http://a", "http://c"], ["http://b"], layerwise=True, prefill_kv=[["tcp://x:1"]])
