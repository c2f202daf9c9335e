"""Disaggregated serving: control plane (handshake, auth, messages, heartbeats), per-request sessions, and the
prefill/decode workers built on them."""

from kvxfer.disagg.auth import AuthKey, load_secret
from kvxfer.disagg.control import ControlServer, PeerConnection, connect
from kvxfer.disagg.handshake import LocalIdentity, PeerInfo, check_compatible
from kvxfer.disagg.messages import PROTOCOL_VERSION, ControlMessage
from kvxfer.disagg.session import Lease, LeaseTable, Session, SessionState
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import ClientResult, GenerateClient
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.disagg.worker_prefill import PrefillWorker

__all__ = [
    "PROTOCOL_VERSION",
    "AuthKey",
    "ClientResult",
    "ControlMessage",
    "ControlServer",
    "DecodeWorker",
    "GenerateClient",
    "GenerationResult",
    "Lease",
    "LeaseTable",
    "LocalIdentity",
    "PeerConnection",
    "PeerInfo",
    "PrefillWorker",
    "Session",
    "SessionState",
    "WorkerConfig",
    "check_compatible",
    "connect",
    "load_secret",
]
