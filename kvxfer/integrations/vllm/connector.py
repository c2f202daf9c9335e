"""``KvxferConnector``: kvxfer as a vLLM KV connector (``KVConnectorBase_V1``) for P/D disaggregation.

Loaded by vLLM from ``--kv-transfer-config`` (docs/vllm.md has the recipe)::

    {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm.connector",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"backend": "nixl", "mode": "pull", "host": "127.0.0.1", "port": 15600}}

A request goes to the prefill with ``kv_transfer_params={"do_remote_decode": true}``; when it finishes
the prefill holds its blocks and returns ``kv_transfer_params`` naming them and its ranks' control
addresses; the proxy hands those to the decode, whose scheduler counts the prompt tokens it lacks as
external (asynchronously loaded) and whose workers move them with ``transfer.TransferEngine``
(pull: the decode reads; push: the prefill writes). Tokens the decode already holds in its prefix
cache are not moved. A failed receive is reported through ``get_finished`` with its blocks in
``get_block_ids_with_load_errors``, so vLLM recomputes them (``kv_load_failure_policy: "recompute"``;
with vLLM's default "fail" the request fails instead) rather than waiting.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.layouts import describe_kv_caches, layer_ids
from kvxfer.integrations.vllm.transfer import RemoteKV, TransferEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

MODES = ("pull", "push")
DEFAULT_PORT = 15600
#: The keys kvxfer adds to ``kv_transfer_params`` (besides vLLM's ``do_remote_prefill`` /
#: ``do_remote_decode`` / ``remote_block_ids`` / ``remote_engine_id`` / ``remote_request_id``).
PARAM_ADDRESSES = "kvxfer_addresses"
PARAM_NUM_TOKENS = "remote_num_tokens"
#: Layer-wise push (decode first): the id a proxy gives one request's transfer, in the prefill's
#: ``kv_transfer_params`` (and as ``remote_request_id`` in the decode's, which names no prefill blocks).
PARAM_TRANSFER_ID = "kvxfer_transfer_id"


@dataclass(frozen=True)
class Recv:
    """One request's receive, for the decode's workers: from ``remote`` into ``block_ids`` (the whole
    block table), tokens ``[start, remote.num_tokens)``."""

    request_id: str
    remote: RemoteKV
    block_ids: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class Save:
    """Layer-wise push: this step computes prompt tokens ``[start, stop)`` of the request the decode
    knows as ``transfer_id``, in ``block_ids``."""

    transfer_id: str
    block_ids: tuple[int, ...]
    start: int
    stop: int


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step: receives to start, finished requests whose
    blocks to hold for the decode, and (push) their block ids."""

    recv: list[Recv] = field(default_factory=list)
    hold: dict[str, tuple[int, ...]] = field(default_factory=dict)
    saves: list[Save] = field(default_factory=list)
    """Layer-wise push: requests whose prompt tokens this step computes, to write layer by layer."""
    transfer_ids: dict[str, str] = field(default_factory=dict)
    """Layer-wise push: a held request's transfer id (the decode's name for it)."""


def _config(vllm_config: VllmConfig) -> tuple[dict[str, Any], str, str, int]:
    """The extra config, mode, backend and base control port, checked (``layerwise`` needs push)."""
    kt = vllm_config.kv_transfer_config
    assert kt is not None
    extra = dict(kt.kv_connector_extra_config or {})
    mode = str(extra.get("mode", "pull"))
    if mode not in MODES:
        raise ConfigError(f"KvxferConnector: kv_connector_extra_config.mode must be one of {MODES}, got {mode!r}")
    backend = str(extra.get("backend", "nixl"))
    port = int(extra.get("port", DEFAULT_PORT))
    if extra.get("layerwise") and mode != "push":
        raise ConfigError(f"KvxferConnector: kv_connector_extra_config.layerwise needs mode 'push', got {mode!r}")
    if not 0 <= port < 65536:
        raise ConfigError(f"KvxferConnector: kv_connector_extra_config.port must be a TCP port, got {port!r}")
    return extra, mode, backend, port


class KvxferConnector(KVConnectorBase_V1):
    """vLLM KV connector moving KV between a prefill and a decode instance with kvxfer."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)   # type: ignore[arg-type]
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        self.extra, self.mode, self.backend, self.base_port = _config(vllm_config)
        self.host = str(self.extra.get("host", "127.0.0.1"))
        self.engine_id = str(kt.engine_id)
        self.is_producer = bool(kt.is_kv_producer)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.addresses = tuple(f"tcp://{self.host}:{self.base_port + r}" for r in range(self.tp_size))
        # scheduler side
        self._recv: list[Recv] = []
        self._hold: dict[str, tuple[int, ...]] = {}
        self._local_hits: dict[str, int] = {}
        self.layerwise = bool(self.extra.get("layerwise", False))
        self._saving: dict[str, str] = {}              # prefill request id -> transfer id (layer-wise)
        self._saving_blocks: dict[str, list[int]] = {}
        self._transfer_ids: dict[str, str] = {}
        # worker side
        self.engine: TransferEngine | None = None
        self._load_errors: set[int] = set()
        self._recv_blocks: dict[str, tuple[int, ...]] = {}
        self._layer_ids: dict[str, int] = {}
        self._sending: dict[str, str] = {}             # transfer id -> prefill request id (layer-wise)

    # --- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens the prefill computed beyond what the decode holds, loaded asynchronously."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if params.get("remote_block_ids") is None and not (self.mode == "push" and self.layerwise):
            return 0, False
        num_tokens = int(params.get(PARAM_NUM_TOKENS) or len(request.prompt_token_ids or ()))
        count = num_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the receive of a request whose blocks were just allocated for external tokens."""
        params = request.kv_transfer_params
        if (params and params.get("do_remote_decode") and self.layerwise and params.get(PARAM_TRANSFER_ID)
                and request.request_id not in self._saving):
            self._saving[request.request_id] = str(params[PARAM_TRANSFER_ID])
            return
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False   # once: a second call (after the load) must not load again
        start = self._local_hits.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        addresses = params.get(PARAM_ADDRESSES)
        remote_ids = params.get("remote_block_ids")
        if remote_ids is None and self.layerwise:
            remote_ids = []   # decode first: the prefill writes from blocks it has not allocated yet
        if not addresses or remote_ids is None:
            log.warning("KvxferConnector: request %s has kv_transfer_params without %s/remote_block_ids: %s",
                        request.request_id, PARAM_ADDRESSES, params)
            return
        if remote_ids and isinstance(remote_ids[0], list | tuple):   # per KV cache group
            remote_ids = remote_ids[0]
        remote = RemoteKV(str(params.get("remote_request_id")), tuple(str(a) for a in addresses),
                          tuple(int(b) for b in remote_ids), start + num_external_tokens)
        block_ids = tuple(int(b) for b in blocks.get_block_ids()[0])
        self._recv.append(Recv(request.request_id, remote, block_ids, start))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's receives and holds, handed to the workers (and forgotten here)."""
        meta = KvxferConnectorMetadata(self._recv, self._hold, transfer_ids=self._transfer_ids)
        self._recv, self._hold, self._transfer_ids = [], {}, {}
        if self._saving:
            self._add_saves(meta, scheduler_output)
        return meta

    def _add_saves(self, meta: KvxferConnectorMetadata, out: SchedulerOutput) -> None:
        """Layer-wise push: the prompt tokens each saving request computes in this step."""
        steps: list[tuple[str, int]] = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self._saving:
                self._saving_blocks[new.req_id] = list(new.block_ids[0])
                steps.append((new.req_id, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._saving:
                added = cached.new_block_ids[i]
                if added is not None:
                    self._saving_blocks[rid].extend(added[0])
                steps.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in steps:
            stop = computed + out.num_scheduled_tokens.get(rid, 0)
            meta.saves.append(Save(self._saving[rid], tuple(self._saving_blocks[rid]), computed, stop))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """On the prefill: hold a request asked for by a decode and return the parameters the decode
        needs. Elsewhere: nothing to do."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._local_hits.pop(request.request_id, None)
        transfer_id = self._saving.pop(request.request_id, None)
        self._saving_blocks.pop(request.request_id, None)
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None   # aborted: no decode will read it
        ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], list | tuple) else list(block_ids)
        if not ids:
            return False, None
        self._hold[request.request_id] = tuple(int(b) for b in ids)
        if transfer_id is not None:
            self._transfer_ids[request.request_id] = transfer_id
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [ids],   # per KV cache group, as vLLM's BlockIds
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            PARAM_ADDRESSES: list(self.addresses),
            PARAM_NUM_TOKENS: len(request.prompt_token_ids or ()),
        }

    # --- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's KV tensors as a kvxfer layout, register them with the transport and serve
        the control plane (a producer's rank ``r`` on ``port + r``)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        model = self._vllm_config.model_config
        parallel = self._vllm_config.parallel_config
        tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        kv, _ = describe_kv_caches(kv_caches, block_size=self.block_size,
                                   kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                                   tp_rank=tp_rank, tp_size=self.tp_size, axes=self.extra.get("kv_axes"))
        self._layer_ids = layer_ids(list(kv_caches))
        port = self.base_port + tp_rank if self.is_producer else 0
        self.engine = TransferEngine(f"{self.engine_id}-tp{tp_rank}"[:128], kv, backend=self.backend,
                                     secret=self.extra.get("secret") or os.environ.get("KVXFER_SECRET"),
                                     host=self.host, port=port,
                                     hold_timeout=float(self.extra.get("hold_timeout", 120.0)),
                                     timeout=float(self.extra.get("timeout", 30.0)))
        log.info("KvxferConnector %s: %d layers registered (%s), control plane at %s", self.engine.name,
                 len(kv_caches), self.backend, self.engine.address)

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise ConfigError("KvxferConnector: register_kv_caches was not called before a transfer")
        return self.engine

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's receives (asynchronous: they finish between steps) and take the holds."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        eng = self._engine()
        for rid, blocks in meta.hold.items():
            key = meta.transfer_ids.get(rid, rid)   # layer-wise: the decode asked under the transfer id
            self._sending[key] = rid
            eng.hold(key)
            if self.mode == "push":
                eng.computed(key, blocks)
        for r in meta.recv:
            first = r.start // self.block_size
            last = -(-r.remote.num_tokens // self.block_size)
            self._recv_blocks[r.request_id] = r.block_ids[first:last]
            if self.mode == "push":
                eng.start_push(r.request_id, r.remote, r.block_ids, r.start)
            else:
                eng.start_read(r.request_id, r.remote, r.block_ids, r.start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request's KV is loaded whole before the request is scheduled again."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Layer-wise push: write this layer of the prompt tokens computed in this step to the decode ranks
        that asked for them. Otherwise nothing: the decode reads (or the prefill writes) the finished
        request's blocks in place."""
        if not self.layerwise or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        layer = self._layer_ids.get(layer_name)
        if layer is None or not meta.saves:
            return
        eng = self._engine()
        for s in meta.saves:
            eng.save_layer(s.transfer_id, layer, s.block_ids, s.start, s.stop)

    def wait_for_save(self) -> None:
        """Layer-wise push: wait for this forward pass's layer writes. Otherwise nothing to wait for."""
        if self.layerwise and self.engine is not None:
            self.engine.wait_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Held requests the decode is done with, and receives that ended (a failed one too: its blocks
        are reported by ``get_block_ids_with_load_errors`` in the same step)."""
        eng = self._engine()
        sent = eng.finished_sending()
        if self.mode == "push":
            for rid in sent:
                eng.release(rid)
        sent = {self._sending.pop(key, key) for key in sent}
        done, failed = eng.finished_receiving()
        for rid in failed:
            self._load_errors.update(self._recv_blocks.get(rid, ()))
        for rid in done | set(failed):
            self._recv_blocks.pop(rid, None)
        return sent or None, (done | set(failed)) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed receives since the last call: vLLM recomputes them."""
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Close the transfer engine (control plane and transport)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


__all__ = ["KvxferConnector", "KvxferConnectorMetadata", "Recv", "Save"]
