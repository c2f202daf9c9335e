"""kvxfer: move KV-cache pages between prefill and decode workers (docs/architecture.md)."""

__version__ = "0.1.0"
