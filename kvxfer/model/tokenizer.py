"""A trivial built-in tokenizer for the CLI: UTF-8 bytes as token ids (modulo the vocabulary)."""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.errors import ConfigError


class ByteTokenizer:
    """Text <-> token ids: each UTF-8 byte is one id (``byte % vocab_size``); lossless for vocab >= 256."""

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ConfigError(f"ByteTokenizer.vocab_size must be an int > 0, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``: ids >= 256 wrap to a byte; invalid UTF-8 shows as U+FFFD."""
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
