"""Shared-secret authentication: secret loading, key derivation, nonces and transcript proofs.

The key is derived from the secret with blake3's key-derivation mode; a proof is keyed blake3 over
a label and the canonical msgpack encoding of the handshake transcript, so a proof made for one
direction, one session (nonces) or one set of negotiated values never verifies for another.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Any

import blake3
import msgpack

from kvxfer.disagg.messages import NONCE_BYTES
from kvxfer.errors import ConfigError

SECRET_ENV = "KVXFER_SECRET"
SECRET_FILE_ENV = "KVXFER_SECRET_FILE"
MIN_SECRET_BYTES = 16
_KDF_CONTEXT = "kvxfer control plane 2025 handshake authentication key v1"


def load_secret(secret: str | bytes | None = None, path: str | os.PathLike[str] | None = None) -> bytes:
    """The shared secret: ``secret`` if given, else the file ``path``, else ``$KVXFER_SECRET``, else the
    file ``$KVXFER_SECRET_FILE``. A file's trailing newline is dropped. At least 16 bytes."""
    source: str
    if secret is not None:
        raw, source = (secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)), "the secret argument"
    elif path is not None:
        raw, source = _read_secret_file(Path(path)), f"secret file {os.fspath(path)}"
    elif os.environ.get(SECRET_ENV):
        raw, source = os.environ[SECRET_ENV].encode("utf-8"), f"${SECRET_ENV}"
    elif os.environ.get(SECRET_FILE_ENV):
        raw, source = _read_secret_file(Path(os.environ[SECRET_FILE_ENV])), f"${SECRET_FILE_ENV}"
    else:
        raise ConfigError(f"no shared secret: pass one, or set ${SECRET_ENV} or ${SECRET_FILE_ENV}")
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"shared secret from {source} is {len(raw)} bytes; at least {MIN_SECRET_BYTES} needed")
    return raw


def _read_secret_file(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from exc
    return data.rstrip(b"\r\n")


def new_nonce() -> bytes:
    """A fresh random nonce from the OS's CSPRNG."""
    return secrets.token_bytes(NONCE_BYTES)


def digest(*parts: Any) -> bytes:
    """Unkeyed blake3 of the canonical encoding of ``parts`` (binds payloads into a transcript)."""
    return blake3.blake3(msgpack.packb(list(parts), use_bin_type=True)).digest()


class AuthKey:
    """The handshake key derived from the shared secret; makes and checks transcript proofs."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"AuthKey needs a secret of at least {MIN_SECRET_BYTES} bytes")
        self._key = blake3.blake3(secret, derive_key_context=_KDF_CONTEXT).digest()

    @classmethod
    def load(cls, secret: str | bytes | None = None, path: str | os.PathLike[str] | None = None) -> AuthKey:
        """Key from ``load_secret(secret, path)``."""
        return cls(load_secret(secret, path))

    def proof(self, label: str, *transcript: Any) -> bytes:
        """Keyed blake3 over ``label`` and the transcript values."""
        return blake3.blake3(msgpack.packb([label, *transcript], use_bin_type=True), key=self._key).digest()

    def verify(self, proof: bytes, label: str, *transcript: Any) -> bool:
        """Constant-time check that ``proof`` was made with this key over exactly this transcript."""
        return hmac.compare_digest(proof, self.proof(label, *transcript))

    def __repr__(self) -> str:
        return "AuthKey(<derived key hidden>)"
