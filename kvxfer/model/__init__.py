"""The model seam (``Model``, ``ModelSource``, ``KVSpec``), the reference transformer whose KV lives in
cache-manager pages, and ``model_source`` to pick a model by name (``tiny``, ``hf:tiny``, ``hf:/dir``).
The transformers adapter is ``kvxfer.model.hf`` (optional extra ``hf``)."""

from kvxfer.model.base import KVSpec, Model, ModelSource, Tokenizer, greedy, token_ids
from kvxfer.model.config import PRESETS, ModelConfig, preset
from kvxfer.model.paged import PagedKV
from kvxfer.model.source import model_source
from kvxfer.model.tokenizer import ByteTokenizer
from kvxfer.model.transformer import ReferenceModel, attention

__all__ = ["PRESETS", "ByteTokenizer", "KVSpec", "Model", "ModelConfig", "ModelSource", "PagedKV",
           "ReferenceModel", "Tokenizer", "attention", "greedy", "model_source", "preset", "token_ids"]
