"""Helpers for the transport conformance suite: seeded plans and a peer process."""
