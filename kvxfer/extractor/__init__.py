"""Extractor: published layouts + block ids -> PageTables, and two layouts -> a paired TransferPlan."""

from kvxfer.extractor.block_ids import BlockIds, HasBlockIdMap
from kvxfer.extractor.blocks import (
    TemplateCache,
    block_template,
    plan_blocks,
    plan_templated,
    segment_template,
)
from kvxfer.extractor.extract import COORDS, extract
from kvxfer.extractor.multirank import all_regions, plan_between, plan_phased, region_offsets
from kvxfer.extractor.pairing import plan_transfer
from kvxfer.extractor.regions import Placement, layout_regions, layout_roles, placements, region_indices
from kvxfer.extractor.writable import (
    HasCommittedTokens,
    check_writable,
    check_writable_phased,
    committed_tokens,
    writable_block_ids,
)

__all__ = [
    "COORDS",
    "BlockIds",
    "HasBlockIdMap",
    "HasCommittedTokens",
    "Placement",
    "TemplateCache",
    "all_regions",
    "block_template",
    "check_writable",
    "check_writable_phased",
    "committed_tokens",
    "extract",
    "layout_regions",
    "layout_roles",
    "placements",
    "plan_between",
    "plan_blocks",
    "plan_phased",
    "plan_templated",
    "plan_transfer",
    "region_indices",
    "region_offsets",
    "segment_template",
    "writable_block_ids",
]
