"""The manager's CUDA-stream ordering of slot reuse: checking a request's stream, stamping released
slots, making a request's stream wait for their previous users (see kvxfer.cache.streams)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager_state import ManagerState
from kvxfer.errors import ConfigError

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]


class StreamOrdering:
    """Streams of requests and the readiness of the slots they release."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    def check_stream(self, stream: Any, what: str) -> Any:
        """``stream`` validated for this manager's primary device (None is always accepted): a
        torch.cuda.Stream, or a raw ``cudaStream_t`` handle as the reference design passes it (an int,
        wrapped in a torch.cuda.ExternalStream)."""
        if stream is None:
            return None
        if self.state.device.type != "cuda":
            raise ConfigError(f"{what}: a CUDA stream needs a CUDA primary tier; this manager's primary tier is "
                              f"{self.state.device} (pass None)")
        if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
            stream = torch.cuda.ExternalStream(stream, device=self.state.device)  # type: ignore[no-untyped-call]
        if not isinstance(stream, torch.cuda.Stream):
            raise ConfigError(f"{what}: expected a torch.cuda.Stream or a cudaStream_t handle (int >= 0), "
                              f"got {stream!r:.80}")
        if stream.device != self.state.device:
            raise ConfigError(f"{what}: the stream is on {stream.device}, the primary tier on {self.state.device}")
        return stream

    def stream_of(self, stream: Any) -> Any:
        """The stream work of a request with ``stream`` runs on (the device's current one for None)."""
        if self.state.readiness is None:
            return None
        return stream if stream is not None else torch.cuda.current_stream(self.state.device)

    def stamp(self, layer_group: int, ids: IntArray, tiers: TierArray | None, stream: Any) -> None:
        """Remember that the primary pages ``ids`` (tier 0 where ``tiers`` says so) were last used on
        ``stream`` (a request's), so a request on another stream waits before touching them."""
        if self.state.readiness is None:
            return
        live = ids >= 0 if tiers is None else (ids >= 0) & (tiers == 0)
        self.state.readiness.stamp(self.state.lg_pool_group[layer_group], ids[live], self.stream_of(stream))

    def wait_ready(self, cache: KVCache, stream: Any) -> None:
        """Make ``stream`` wait until every primary page and scratch slot of the cache is released by
        the streams that used it last (at resume: reused and onboarded pages)."""
        if self.state.readiness is None:
            return
        target = self.stream_of(stream)
        for g in range(len(cache.record.blocks)):
            blocks, tiers = cache.record.blocks[g], cache.record.tiers[g]
            self.state.readiness.wait_for(self.state.lg_pool_group[g], blocks[(blocks >= 0) & (tiers == 0)], target)
            if cache.record.scratch[g].size:
                self.state.readiness.wait_for(self.state.lg_pool_group[g], cache.record.scratch[g], target)

    def wait_slots(self, layer_group: int, ids: IntArray, stream: Any) -> None:
        """Make ``stream`` wait until the slots ``ids`` (>= 0; just taken by a request) are released by
        the streams that used them last."""
        if self.state.readiness is not None:
            self.state.readiness.wait_for(self.state.lg_pool_group[layer_group], ids[ids >= 0], self.stream_of(stream))

    def hand_over(self, old: Any, new: Any) -> None:
        """Make ``new`` (a request's next stream) wait for the work queued so far on ``old`` (its
        previous one), so what the request wrote or was waiting for stays ordered before its next work."""
        if self.state.readiness is None:
            return
        src, dst = self.stream_of(old), self.stream_of(new)
        if src is not None and dst is not None and src != dst:
            dst.wait_stream(src)
