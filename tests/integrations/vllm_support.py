"""Helpers for the tests against real vLLM (run with .venv-vllm, ``make vllm-venv``): a tiny Llama
config on disk, vLLM configs and a scheduler with kvxfer's connector, requests and mock model-runner
outputs."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import torch

CONNECTOR = "KvxferConnector"
MODULE = "kvxfer.integrations.vllm.connector"
SECRET = "vllm-connector-test-secret-0123456789"
EOS = 2
#: The tiny random-init Llama of the end-to-end tests (head_dim 64: vLLM's CPU attention refuses 16).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
              "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": EOS,
              "tie_word_embeddings": False}
_ids = itertools.count(1)


def tiny_llama(path: Path) -> Path:
    """A model directory with only the tiny Llama's config (weights: vLLM's ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def vllm_config(model: Path, role: str, *, block_size: int = 16, port: int = 0, mode: str = "pull",
                policy: str = "recompute", **extra: Any) -> Any:
    """A VllmConfig of the tiny Llama with kvxfer's connector as ``role`` (kv_producer / kv_consumer)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=1024)
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                                       enable_chunked_prefill=True, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=MODULE, kv_role=role,
                          kv_load_failure_policy=policy,
                          kv_connector_extra_config={"backend": "loopback", "port": port, "mode": mode,
                                                     "secret": SECRET, **extra})
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def scheduler(config: Any, num_blocks: int = 64) -> Any:
    """vLLM's own Scheduler over ``num_blocks`` blocks of one full-attention group."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs = config.cache_config.block_size
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                         FullAttentionSpec(block_size=bs, num_kv_heads=4, head_size=64, dtype=torch.float32))])
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config), block_size=bs)


def worker_connector(config: Any) -> Any:
    """kvxfer's connector in the worker role of ``config``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer.integrations.vllm.connector import KvxferConnector
    return KvxferConnector(config, KVConnectorRole.WORKER, None)


def request(prompt: list[int], *, block_size: int, max_tokens: int = 4, params: dict[str, Any] | None = None) -> Any:
    """A vLLM Request of ``prompt`` with prefix-cache block hashes and ``kv_transfer_params``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    def sha(x: Any) -> bytes:
        return hashlib.sha256(repr(x).encode()).digest()

    init_none_hash(sha)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(prompt), sampling_params=sp,
                  pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha))
    req.kv_transfer_params = params
    return req


def runner_output(reqs: list[Any], *, token: int = 7, finished_sending: set[str] | None = None,
                  finished_recving: set[str] | None = None, invalid_block_ids: set[int] | None = None) -> Any:
    """A mock ModelRunnerOutput: one sampled ``token`` per request (a Request or its id) and the
    connector's report."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = [r if isinstance(r, str) else r.request_id for r in reqs]
    kv = None
    if finished_sending or finished_recving or invalid_block_ids:
        kv = KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving,
                               invalid_block_ids=invalid_block_ids or set())
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                             pooler_output=[], kv_connector_output=kv)
