"""kvxfer: move KV-cache pages between prefill and decode workers (see DESIGN.md)."""

__version__ = "0.1.0"
