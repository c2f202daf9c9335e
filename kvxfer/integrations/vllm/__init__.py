"""kvxfer as a vLLM KV connector (``KVConnectorBase_V1``) for prefill/decode disaggregation.

``KvxferConnector`` (``kvxfer.integrations.vllm.connector``) is what vLLM loads with
``--kv-transfer-config '{"kv_connector": "KvxferConnector", "kv_connector_module_path":
"kvxfer.integrations.vllm.connector", ...}'`` (docs/vllm.md). It needs vLLM; the parts below it do not:
``layouts`` (vLLM's paged KV tensors as kvxfer layouts), ``transfer`` (the per-worker engine: control
plane, transport, plans) and ``proxy`` (a small P/D proxy).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvxferConnector":   # vLLM is imported only when the connector itself is asked for
        from kvxfer.integrations.vllm.connector import KvxferConnector
        return KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
