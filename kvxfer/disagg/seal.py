"""Sealed control-plane frames: every message after the handshake is encrypted and authenticated.

ChaCha20-Poly1305 (an AEAD) with one key per direction, derived from the shared-secret key and the
whole handshake transcript (both nonces, both payload hashes), so each connection has fresh keys that
only holders of the secret can compute. The nonce of a frame is its per-direction counter (0, 1, 2,
...): a frame is ``counter (8 bytes, little-endian) || ciphertext || 16-byte tag``. The receiver
accepts exactly the next counter, so a replayed, reordered or dropped frame is refused, and a frame
whose tag does not verify (altered or forged) is refused; either ends the connection with the reason.

The same keys also tag data-plane notices (``sign``/``verify``: a keyed BLAKE2b MAC under a key derived
per direction): a transfer's completion notice travels on the transport, not on this channel, and
the receiver must know it came from the peer before it takes the data as landed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from kvxfer.errors import AuthenticationError

COUNTER_BYTES = 8
TAG_BYTES = 16
#: What sealing adds to every frame.
OVERHEAD_BYTES = COUNTER_BYTES + TAG_BYTES
_COUNTER = struct.Struct("<Q")
_NONCE_PAD = b"\0\0\0\0"
_LIMIT = (1 << 64) - 1
#: Bytes of a notice tag (``SealedChannel.sign``).
NOTICE_TAG_BYTES = 16
_NOTICE_LABEL = b"kvxfer data-plane notice v1"


class SealError(AuthenticationError):
    """A sealed frame was refused: ``reason`` is "tampered", "replayed" or "reordered"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason} message refused: {detail}")
        self.reason = reason


class SealedChannel:
    """One connection's two directions: ``seal`` what this side sends, ``open`` what it receives.

    Not thread-safe: the control plane's I/O thread is the only caller (frames leave and arrive in
    the order it handles them, which is what the counters check)."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        if len(send_key) != 32 or len(recv_key) != 32 or send_key == recv_key:
            raise AuthenticationError("SealedChannel needs two different 32-byte keys")
        self._send = ChaCha20Poly1305(send_key)
        self._recv = ChaCha20Poly1305(recv_key)
        self._notice_send = hashlib.blake2b(_NOTICE_LABEL, key=send_key, digest_size=32).digest()
        self._notice_recv = hashlib.blake2b(_NOTICE_LABEL, key=recv_key, digest_size=32).digest()
        self._sent = 0
        self._expected = 0

    @property
    def sent(self) -> int:
        """Frames sealed so far (the next frame's counter)."""
        return self._sent

    @property
    def received(self) -> int:
        """Frames opened so far (the counter the next frame must carry)."""
        return self._expected

    def seal(self, frame: bytes) -> bytes:
        """``frame`` encrypted and tagged under the next send counter."""
        if self._sent >= _LIMIT:
            raise AuthenticationError("sealed channel: send counter exhausted; reconnect for fresh keys")
        header = _COUNTER.pack(self._sent)
        self._sent += 1
        return header + self._send.encrypt(_NONCE_PAD + header, frame, header)

    def open(self, data: bytes) -> bytes:
        """The plaintext of the next frame from the peer; SealError naming why it is refused."""
        if len(data) < OVERHEAD_BYTES:
            raise SealError("tampered", f"frame of {len(data)} bytes is shorter than the {OVERHEAD_BYTES}-byte seal")
        header = bytes(data[:COUNTER_BYTES])
        (counter,) = _COUNTER.unpack(header)
        try:
            plain = self._recv.decrypt(_NONCE_PAD + header, bytes(data[COUNTER_BYTES:]), header)
        except InvalidTag:
            raise SealError("tampered", f"frame {counter} does not authenticate (altered, forged or "
                                        f"sealed with another key)") from None
        if counter != self._expected:
            reason = "replayed" if counter < self._expected else "reordered"
            raise SealError(reason, f"frame counter {counter}, expected {self._expected}")
        self._expected += 1
        return plain

    def sign(self, data: bytes) -> bytes:
        """The tag of a notice this side sends (any thread: no counter is involved; a notice names its
        request and part, so a replay can only repeat what the peer already said)."""
        return hashlib.blake2b(data, key=self._notice_send, digest_size=NOTICE_TAG_BYTES).digest()

    def verify(self, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the peer's tag of ``data`` (constant-time compare)."""
        want = hashlib.blake2b(data, key=self._notice_recv, digest_size=NOTICE_TAG_BYTES).digest()
        return hmac.compare_digest(want, tag)
