"""Disaggregated serving: control plane (handshake, auth, messages, heartbeats) and per-request sessions."""

from kvxfer.disagg.auth import AuthKey, load_secret
from kvxfer.disagg.control import ControlServer, PeerConnection, connect
from kvxfer.disagg.handshake import LocalIdentity, PeerInfo, check_compatible
from kvxfer.disagg.messages import PROTOCOL_VERSION, Field, Message, MessageSpec, register
from kvxfer.disagg.session import Lease, LeaseTable, Session, SessionState

__all__ = [
    "PROTOCOL_VERSION",
    "AuthKey",
    "ControlServer",
    "Field",
    "Lease",
    "LeaseTable",
    "LocalIdentity",
    "Message",
    "MessageSpec",
    "PeerConnection",
    "PeerInfo",
    "Session",
    "SessionState",
    "check_compatible",
    "connect",
    "load_secret",
    "register",
]
