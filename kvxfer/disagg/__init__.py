"""Disaggregated serving: control plane (handshake, auth, messages, heartbeats) and per-request sessions."""
