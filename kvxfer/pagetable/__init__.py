"""Page tables: the compact, validated, serialisable description of what bytes move where."""

from kvxfer.pagetable.blocks import BlockPlan
from kvxfer.pagetable.phased import PhasedPlan
from kvxfer.pagetable.plan import PLAN_MAGIC, TransferPlan
from kvxfer.pagetable.table import TABLE_MAGIC, PageTable
from kvxfer.pagetable.wire import WIRE_VERSION

__all__ = ["PLAN_MAGIC", "TABLE_MAGIC", "WIRE_VERSION", "BlockPlan", "PageTable", "PhasedPlan", "TransferPlan"]
