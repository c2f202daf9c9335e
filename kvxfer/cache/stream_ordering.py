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


class StreamOrdering(ManagerState):
    """Streams of requests and the readiness of the slots they release."""

    def _check_stream(self, stream: Any, what: str) -> Any:
        """``stream`` validated for this manager's primary device (None is always accepted): a
        torch.cuda.Stream, or a raw ``cudaStream_t`` handle as the reference design passes it (an int,
        wrapped in a torch.cuda.ExternalStream)."""
        if stream is None:
            return None
        if self.device.type != "cuda":
            raise ConfigError(f"{what}: a CUDA stream needs a CUDA primary tier; this manager's primary tier is "
                              f"{self.device} (pass None)")
        if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
            stream = torch.cuda.ExternalStream(stream, device=self.device)  # type: ignore[no-untyped-call]
        if not isinstance(stream, torch.cuda.Stream):
            raise ConfigError(f"{what}: expected a torch.cuda.Stream or a cudaStream_t handle (int >= 0), "
                              f"got {stream!r:.80}")
        if stream.device != self.device:
            raise ConfigError(f"{what}: the stream is on {stream.device}, the primary tier on {self.device}")
        return stream

    def _stream_of(self, stream: Any) -> Any:
        """The stream work of a request with ``stream`` runs on (the device's current one for None)."""
        if self._readiness is None:
            return None
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def _stamp(self, layer_group: int, ids: IntArray, tiers: TierArray | None, stream: Any) -> None:
        """Remember that the primary pages ``ids`` (tier 0 where ``tiers`` says so) were last used on
        ``stream`` (a request's), so a request on another stream waits before touching them."""
        if self._readiness is None:
            return
        live = ids >= 0 if tiers is None else (ids >= 0) & (tiers == 0)
        self._readiness.stamp(self._lg_pool_group[layer_group], ids[live], self._stream_of(stream))

    def _wait_ready(self, cache: KVCache, stream: Any) -> None:
        """Make ``stream`` wait until every primary page and scratch slot of the cache is released by
        the streams that used it last (at resume: reused and onboarded pages)."""
        if self._readiness is None:
            return
        target = self._stream_of(stream)
        for g in range(len(cache._blocks)):
            blocks, tiers = cache._blocks[g], cache._tiers[g]
            self._readiness.wait_for(self._lg_pool_group[g], blocks[(blocks >= 0) & (tiers == 0)], target)
            if cache._scratch[g].size:
                self._readiness.wait_for(self._lg_pool_group[g], cache._scratch[g], target)

    def _wait_slots(self, layer_group: int, ids: IntArray, stream: Any) -> None:
        """Make ``stream`` wait until the slots ``ids`` (>= 0; just taken by a request) are released by
        the streams that used them last."""
        if self._readiness is not None:
            self._readiness.wait_for(self._lg_pool_group[layer_group], ids[ids >= 0], self._stream_of(stream))
