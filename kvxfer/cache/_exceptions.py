"""The reference design's ``_exceptions`` module name, for code written against it: the cache errors
of ``kvxfer.errors`` under the reference's names."""

from kvxfer.errors import CorruptedError, CuError, LogicError, OutOfMemoryError, OutOfPagesError

__all__ = ["CorruptedError", "CuError", "LogicError", "OutOfMemoryError", "OutOfPagesError"]
