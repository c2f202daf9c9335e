"""Control-plane messages: a versioned msgpack envelope and strict, bounded, type-checked decoding.

Wire form of every message: a msgpack array ``[version, type, body]`` where ``version`` is the
protocol version (int), ``type`` names a registered MessageSpec and ``body`` is a map whose keys are
exactly the spec's fields. Anything else raises ProtocolError naming the offending field; nothing a
peer sends can make the decoder allocate more than ``max_bytes`` plus msgpack's own bounded objects.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import msgpack

from kvxfer.errors import ProtocolError

#: 2 adds ``kv_posted`` (push: decode learns the first token while the writes are in flight).
PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
MAX_MESSAGE_BYTES = 64 << 20
NONCE_BYTES = 32
PROOF_BYTES = 32
ROLES = ("prefill", "decode", "client")
REFUSAL_CODES = ("auth", "version", "role", "layout", "protocol", "busy", "timeout")
_I64 = (1 << 63) - 1

FieldKind = Literal["int", "float", "str", "bytes", "bool", "ints"]


@dataclass(frozen=True)
class Field:
    """One body field: its kind and bounds (value range for numbers, length range otherwise)."""

    name: str
    kind: FieldKind
    lo: float = 0
    hi: float = _I64
    max_len: int = 256
    min_len: int = 0
    choices: tuple[str, ...] | None = None

    def check(self, value: Any, where: str) -> Any:
        """``value`` if it fits this field, else ProtocolError naming ``where``."""
        name = f"{where}.{self.name}"
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
                raise ProtocolError(f"{name}: expected an int in [{self.lo}, {self.hi}], got {_show(value)}")
        elif self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or not self.lo <= value <= self.hi:
                raise ProtocolError(f"{name}: expected a number in [{self.lo}, {self.hi}], got {_show(value)}")
            value = float(value)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise ProtocolError(f"{name}: expected a bool, got {_show(value)}")
        elif self.kind in ("str", "bytes"):
            typ = str if self.kind == "str" else bytes
            if not isinstance(value, typ) or not self.min_len <= len(value) <= self.max_len:
                raise ProtocolError(f"{name}: expected {self.kind} of {self.min_len}..{self.max_len} "
                                    f"{'chars' if typ is str else 'bytes'}, got {_show(value)}")
            if self.choices is not None and value not in self.choices:
                raise ProtocolError(f"{name}: expected one of {list(self.choices)}, got {_show(value)}")
        else:   # ints
            if not isinstance(value, list | tuple) or len(value) > self.max_len or any(
                    isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi for v in value):
                raise ProtocolError(f"{name}: expected a list of <= {self.max_len} ints in [{self.lo}, {self.hi}], "
                                    f"got {_show(value)}")
            value = list(value)
        return value


@dataclass(frozen=True)
class MessageSpec:
    """A message type and its body fields."""

    type: str
    fields: tuple[Field, ...] = ()

    def check_body(self, body: Any, where: str) -> dict[str, Any]:
        """A validated copy of ``body``: exactly the spec's fields, each in bounds."""
        if not isinstance(body, Mapping):
            raise ProtocolError(f"{where}.body: expected a map, got {_show(body)}")
        known = {f.name for f in self.fields}
        for key in body:
            if key not in known:
                raise ProtocolError(f"{where}.body: unexpected field {_show(key)}")
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name not in body:
                raise ProtocolError(f"{where}.body: missing field {f.name!r}")
            out[f.name] = f.check(body[f.name], where)
        return out


@dataclass(frozen=True)
class Message:
    """A decoded (or to-be-encoded) control message; ``body`` holds exactly its spec's fields."""

    type: str
    body: Mapping[str, Any] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION

    def __getitem__(self, name: str) -> Any:
        return self.body[name]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_SPECS: dict[str, MessageSpec] = {}
_SPECS_LOCK = threading.Lock()
MESSAGE_SPECS: Mapping[str, MessageSpec] = MappingProxyType(_SPECS)
"""Every registered message type (read-only: ``register`` is the one way in)."""


def register(spec: MessageSpec) -> MessageSpec:
    """Add a message type, explicitly, once (the handshake's below, the workers' in ``worker_protocol``).
    Registering the same spec again is a no-op; another spec under a registered type is refused, so a
    type can never change meaning while connections use it."""
    if not isinstance(spec, MessageSpec):
        raise ProtocolError(f"register: expected a MessageSpec, got {type(spec).__name__}")
    with _SPECS_LOCK:
        if spec.type in _SPECS and _SPECS[spec.type] != spec:
            raise ProtocolError(f"message type {spec.type!r} is already registered with other fields")
        _SPECS[spec.type] = spec
    return spec


_NAME = Field("name", "str", max_len=128)
_ROLE = Field("role", "str", max_len=16, choices=ROLES)
_NONCE = Field("nonce", "bytes", min_len=NONCE_BYTES, max_len=NONCE_BYTES)
_PROOF = Field("proof", "bytes", min_len=PROOF_BYTES, max_len=PROOF_BYTES)
_HEARTBEAT = Field("heartbeat_interval", "float", lo=0.001, hi=3600.0)
_PAYLOAD = (Field("layout", "bytes", max_len=MAX_MESSAGE_BYTES // 2), Field("backend", "str", max_len=64),
            Field("metadata", "bytes", max_len=MAX_MESSAGE_BYTES // 2))
_REASON = Field("reason", "str", max_len=1024)

# Handshake (see docs/control-plane.md): hello -> challenge -> auth -> accept, or refuse at any step.
HELLO = register(MessageSpec("hello", (Field("min_version", "int", hi=1 << 16), Field("max_version", "int", hi=1 << 16),
                                       _ROLE, _NAME, _NONCE)))
CHALLENGE = register(MessageSpec("challenge", (Field("version", "int", hi=1 << 16), _ROLE, _NAME, _NONCE,
                                               _HEARTBEAT, _PROOF)))
AUTH = register(MessageSpec("auth", (*_PAYLOAD, _HEARTBEAT, _PROOF)))
ACCEPT = register(MessageSpec("accept", (*_PAYLOAD, _PROOF)))
REFUSE = register(MessageSpec("refuse", (Field("code", "str", max_len=16, choices=REFUSAL_CODES), _REASON)))
# After the handshake.
HEARTBEAT = register(MessageSpec("heartbeat"))
BYE = register(MessageSpec("bye", (_REASON,)))
HANDSHAKE_TYPES = frozenset({"hello", "challenge", "auth", "accept"})


def encode(message: Message) -> bytes:
    """The wire bytes of ``message`` after checking its body against its spec (ProtocolError if bad)."""
    spec = MESSAGE_SPECS.get(message.type)
    if spec is None:
        raise ProtocolError(f"message.type: unknown type {_show(message.type)}")
    body = spec.check_body(message.body, f"message {message.type!r}")
    return bytes(msgpack.packb([message.version, message.type, body], use_bin_type=True))


def decode(data: bytes, versions: tuple[int, int] = SUPPORTED_VERSIONS,
           max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate one message from a peer; hostile bytes raise ProtocolError naming the field."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"message: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message: {len(data)} bytes exceed the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                              max_str_len=min(1 << 16, len(data)), max_bin_len=min(max_bytes, len(data)),
                              max_array_len=min(1 << 20, len(data)), max_map_len=64, max_ext_len=0)
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"message: invalid msgpack ({type(exc).__name__}: {_show(str(exc))})") from exc
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError(f"message: expected [version, type, body], got {_show(obj)}")
    version, mtype, body = obj
    if isinstance(version, bool) or not isinstance(version, int) or not versions[0] <= version <= versions[1]:
        raise ProtocolError(f"message.version: unsupported protocol version {_show(version)} "
                            f"(this side speaks {versions[0]}..{versions[1]})")
    if not isinstance(mtype, str) or mtype not in MESSAGE_SPECS:
        raise ProtocolError(f"message.type: unknown message type {_show(mtype)}")
    return Message(mtype, MESSAGE_SPECS[mtype].check_body(body, f"message {mtype!r}"), version)
