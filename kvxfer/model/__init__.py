"""A small reference transformer whose KV lives in cache-manager pages (produces and consumes real KV)."""

from kvxfer.model.config import PRESETS, ModelConfig, preset
from kvxfer.model.paged import PagedKV
from kvxfer.model.tokenizer import ByteTokenizer
from kvxfer.model.transformer import ReferenceModel, attention, greedy

__all__ = ["PRESETS", "ByteTokenizer", "ModelConfig", "PagedKV", "ReferenceModel", "attention", "greedy", "preset"]
