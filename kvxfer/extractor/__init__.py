"""Extractor: published layouts + block ids -> PageTables, and two layouts -> a paired TransferPlan."""

from kvxfer.extractor.block_ids import BlockIds, HasBlockIdMap
from kvxfer.extractor.extract import COORDS, extract
from kvxfer.extractor.multirank import all_regions, plan_between, region_offsets
from kvxfer.extractor.pairing import plan_transfer
from kvxfer.extractor.regions import Placement, layout_regions, layout_roles, placements, region_indices

__all__ = [
    "COORDS",
    "BlockIds",
    "HasBlockIdMap",
    "Placement",
    "all_regions",
    "extract",
    "layout_regions",
    "layout_roles",
    "placements",
    "plan_between",
    "plan_transfer",
    "region_indices",
    "region_offsets",
]
