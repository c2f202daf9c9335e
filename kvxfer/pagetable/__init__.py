"""Page tables: the compact, validated, serialisable description of what bytes move where."""

from kvxfer.pagetable.table import PageTable, TransferPlan

__all__ = ["PageTable", "TransferPlan"]
