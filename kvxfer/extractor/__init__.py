"""Extractor: published layouts + block ids -> PageTables, and two layouts -> a paired TransferPlan."""

from kvxfer.extractor.block_ids import BlockIds, HasBlockIdMap
from kvxfer.extractor.extract import COORDS, extract
from kvxfer.extractor.pairing import plan_transfer
from kvxfer.extractor.regions import Placement, layout_regions, layout_roles, placements, region_indices

__all__ = [
    "COORDS",
    "BlockIds",
    "HasBlockIdMap",
    "Placement",
    "extract",
    "layout_regions",
    "layout_roles",
    "placements",
    "plan_transfer",
    "region_indices",
]
