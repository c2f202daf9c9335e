"""The KV oracle: a request's prompt KV by logical position (layer, role, token, head), read from a
worker's own pages, compared against an independent single-process reference run of the same model.

Tokens alone cannot see block order: K is stored after RoPE and attention is order-blind over (K, V)
pairs, so a swapped block still generates the right tokens. The oracle reads what decode committed,
position by position, through decode's own cache pages and block ids (never through a transfer plan),
and compares it with a reference prefill computed in the checking process in a cache of its own.

Batched and single-token compute round differently (prefill recomputes only what its prefix tree lacks,
so the same token's K/V may come from a 40-token or a 90-token batch), so the comparison allows a small
relative error per (layer, role, token, head) vector: ``err = max|got - ref| / max(max|ref|, 1e-6)``.
Measured on the ``tiny`` model in float32: healthy pairs stay below ~1e-6; a swapped, shifted, stale,
foreign or zeroed block gives err >= ~0.3 (usually ~1). See RELIABILITY.md.

Large prompts are checked on a bounded, seeded, stratified sample of token positions: one position in
each of ``count`` equal strata of the prompt, so any corruption covering a whole stratum (a block, when
strata are no wider than a block) is seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.descriptors import BufferId
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.errors import DecodeError, KVCacheError, LayoutMismatch
from kvxfer.model import KVSpec, ModelSource, greedy

ROLES = ("key", "value")
KV_FORMAT_VERSION = 1
MAX_KV_BYTES = 16 << 20
"""Largest prompt-KV payload a decode worker returns (positions are sampled to fit)."""
DEFAULT_POSITIONS = 512
"""Positions returned when a request asks for its KV without saying how many."""
TOLERANCE = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 3e-2, "float16": 5e-3}
"""Largest relative error per (layer, role, token, head) vector accepted as "same KV", per KV dtype:
about 100x the rounding seen between batched and single-token compute, far below a misplaced block."""

Shards = Sequence[tuple[KVCacheManager, KVCache]]


@dataclass(frozen=True)
class PromptKV:
    """K and V of some prompt positions: ``key``/``value`` are float32 ``[layers, positions, heads, dim]``;
    ``present[layer, i]`` is False where the layer holds no page for ``positions[i]`` (a sliding window
    released it)."""

    positions: npt.NDArray[np.int64]
    key: npt.NDArray[np.float32]
    value: npt.NDArray[np.float32]
    present: npt.NDArray[np.bool_]

    def __post_init__(self) -> None:
        layers, count = self.present.shape
        if self.positions.shape != (count,) or self.key.shape != self.value.shape or self.key.shape[:2] != (layers, count):
            raise KVCacheError(f"PromptKV: inconsistent shapes positions {self.positions.shape}, key {self.key.shape}, "
                               f"value {self.value.shape}, present {self.present.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V arrays."""
        return int(self.key.nbytes + self.value.nbytes)

    def role(self, role: str) -> npt.NDArray[np.float32]:
        """The ``[layers, positions, heads, dim]`` array of ``role``."""
        return self.key if role == "key" else self.value

    def to_bytes(self) -> bytes:
        """Compact msgpack encoding (what decode's ``generated.kv`` carries)."""
        layers, count, heads, dim = self.key.shape
        return bytes(msgpack.packb({"v": KV_FORMAT_VERSION, "shape": [layers, count, heads, dim],
                                    "positions": self.positions.astype("<i8").tobytes(),
                                    "present": np.packbits(self.present.ravel()).tobytes(),
                                    "key": self.key.astype("<f4").tobytes(), "value": self.value.astype("<f4").tobytes()},
                                   use_bin_type=True))

    @classmethod
    def from_bytes(cls, data: bytes) -> PromptKV:
        """Inverse of ``to_bytes``; DecodeError when malformed (sizes are checked before any array is built)."""
        try:
            obj = msgpack.unpackb(data, raw=False, max_bin_len=2 * MAX_KV_BYTES, max_str_len=64, max_array_len=8,
                                  max_map_len=8, max_ext_len=0)
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
            raise DecodeError(f"prompt KV: invalid msgpack ({type(exc).__name__})") from exc
        if not isinstance(obj, dict) or obj.get("v") != KV_FORMAT_VERSION:
            raise DecodeError(f"prompt KV: expected a version {KV_FORMAT_VERSION} map")
        shape = obj.get("shape")
        if not isinstance(shape, list) or len(shape) != 4 or not all(isinstance(x, int) and 0 <= x < 1 << 24
                                                                     for x in shape):
            raise DecodeError(f"prompt KV: bad shape {shape!r}")
        layers, count, heads, dim = shape
        values = layers * count * heads * dim
        expect = {"positions": 8 * count, "present": -(-layers * count // 8), "key": 4 * values, "value": 4 * values}
        for name, size in expect.items():
            raw = obj.get(name)
            if not isinstance(raw, bytes) or len(raw) != size:
                raise DecodeError(f"prompt KV: field {name!r} must hold {size} bytes")
        present = np.unpackbits(np.frombuffer(obj["present"], np.uint8))[:layers * count].astype(bool)
        return cls(np.frombuffer(obj["positions"], "<i8").astype(np.int64),
                   np.frombuffer(obj["key"], "<f4").reshape(layers, count, heads, dim).copy(),
                   np.frombuffer(obj["value"], "<f4").reshape(layers, count, heads, dim).copy(),
                   present.reshape(layers, count))


def sample_positions(num_tokens: int, count: int, seed: int = 0) -> npt.NDArray[np.int64]:
    """``count`` prompt positions: every position when ``count >= num_tokens``, else one seeded random
    position in each of ``count`` equal strata of ``[0, num_tokens)`` (ascending)."""
    if num_tokens <= 0 or count <= 0:
        return np.empty(0, dtype=np.int64)
    if count >= num_tokens:
        return np.arange(num_tokens, dtype=np.int64)
    edges = np.linspace(0, num_tokens, count + 1).astype(np.int64)
    width = np.maximum(edges[1:] - edges[:-1], 1)
    offsets = np.random.default_rng(seed).integers(0, 1 << 62, count) % width
    picked: npt.NDArray[np.int64] = np.minimum(edges[:-1] + offsets, num_tokens - 1).astype(np.int64)
    return picked


def positions_within(num_tokens: int, count: int, model: KVSpec, seed: int = 0) -> npt.NDArray[np.int64]:
    """``sample_positions`` with ``count`` capped so that K and V of the positions fit in MAX_KV_BYTES."""
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    return sample_positions(num_tokens, min(count, max(1, MAX_KV_BYTES // per_token)), seed)


def read_prompt_kv(shards: Shards, positions: npt.ArrayLike, num_layers: int, num_kv_heads: int,
                   head_dim: int) -> PromptKV:
    """K/V at ``positions`` read from the pages of ``shards`` (tensor-parallel ranks of one request) through
    each rank's block ids and buffer formats; each head is read from the first rank holding it."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    shape = (num_layers, pos.size, num_kv_heads, head_dim)
    out = {role: np.zeros(shape, dtype=np.float32) for role in ROLES}
    present = np.ones((num_layers, pos.size), dtype=bool)
    for layer in range(num_layers):
        filled = np.zeros(num_kv_heads, dtype=bool)
        for manager, cache in shards:
            layout = manager.layout
            tpb = layout.tokens_per_block
            fmt = layout.format_of(BufferId(layer, "key"))
            if fmt.total_heads != num_kv_heads or fmt.head_dim != head_dim:
                raise LayoutMismatch(f"read_prompt_kv: cache {cache.id} layer {layer} holds {fmt.total_heads} heads "
                                     f"of {fmt.head_dim}, expected {num_kv_heads} of {head_dim}")
            heads = np.arange(fmt.head_start, fmt.head_start + fmt.num_heads)
            take = ~filled[heads]
            if not take.any():
                continue
            blocks = cache.block_ids(layout.layer_group_of(layer).layer_group_id)
            block = pos // tpb
            slots = np.where(block < blocks.size, blocks[np.minimum(block, max(blocks.size - 1, 0))], -1) \
                if blocks.size else np.full(pos.size, -1, np.int64)
            present[layer] &= slots >= 0
            have = np.flatnonzero(slots >= 0)
            slot_t = torch.from_numpy(slots[have].astype(np.int64))
            off_t = torch.from_numpy((pos[have] % tpb).astype(np.int64))
            for role in ROLES:
                view = manager.buffer_view(layer, role)
                idx_s, idx_o = slot_t.to(view.device), off_t.to(view.device)
                rows = view[idx_s, :, idx_o, :] if fmt.order == "HND" else view[idx_s, idx_o]   # [n, heads, dim]
                got = rows.float().cpu().numpy()
                out[role][layer][np.ix_(have, heads[take])] = got[:, take]
            filled[heads] = True
        if not filled.all():
            raise LayoutMismatch(f"read_prompt_kv: layer {layer} heads {np.flatnonzero(~filled).tolist()} are held "
                                 f"by no rank")
    return PromptKV(pos, out["key"], out["value"], present)


class ReferenceKV:
    """Prompt KV from an independent single-process prefill of the same model, in a cache of its own."""

    def __init__(self, model: ModelSource, device: str = "cpu", tokens_per_block: int = 16) -> None:
        self.config = model.kv_spec
        self.model = model.load(device)
        self.device = device
        self.tokens_per_block = tokens_per_block
        self._manager: KVCacheManager | None = None
        self._blocks = 0

    def manager_for(self, num_tokens: int) -> KVCacheManager:
        """A manager (prefix reuse off) with room for one request of ``num_tokens``."""
        need = -(-num_tokens // self.tokens_per_block) + 2
        if self._manager is None or self._blocks < need:
            if self._manager is not None:
                self._manager.shutdown()
            self._blocks = max(need, 64)
            self._manager = KVCacheManager(self.config.cache_config(self.tokens_per_block, self._blocks, self.device,
                                                                    enable_prefix_reuse=False))
        return self._manager

    def run(self, tokens: npt.ArrayLike, max_new_tokens: int = 0,
            positions: npt.ArrayLike | None = None) -> tuple[list[int], PromptKV]:
        """One prefill of ``tokens`` (one forward over the whole prompt): the prompt K/V at ``positions``
        (default: all), then ``max_new_tokens`` greedy tokens (what ``ReferenceModel.generate`` gives)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos = np.arange(ids.size, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
        manager = self.manager_for(int(ids.size) + max_new_tokens)
        cache = manager.create_kv_cache()
        try:
            cache.resume()
            c = self.config
            with torch.inference_mode():
                kv = self.model.bind([(manager, cache)])
                logits = self.model.prefill(kv, ids)
                prompt = read_prompt_kv([(manager, cache)], pos, c.num_layers, c.num_kv_heads, c.head_dim)
                out = self.model.continue_greedy(kv, greedy(logits[-1]), max_new_tokens) if max_new_tokens else []
            return out, prompt
        finally:
            cache.close()

    def prompt_kv(self, tokens: npt.ArrayLike, positions: npt.ArrayLike | None = None) -> PromptKV:
        """K/V of ``tokens`` at ``positions`` (default: all)."""
        return self.run(tokens, 0, positions)[1]


@dataclass(frozen=True)
class KVReport:
    """The comparison of a request's prompt KV with the reference: ``ok`` when every compared
    (layer, role, token, head) vector is within ``tolerance``; ``worst`` names the largest error."""

    ok: bool
    max_error: float
    tolerance: float
    compared: int
    """(layer, role, token, head) vectors compared."""
    bad: int
    """Vectors outside the tolerance."""
    worst: tuple[int, str, int, int]
    """(layer, role, token position, head) of the largest error."""
    problem: str = ""
    """Why nothing could be compared (positions or pages missing), when that is the failure."""

    def describe(self) -> str:
        """One line for tables and assertion messages."""
        if self.problem:
            return f"KV not comparable: {self.problem}"
        layer, role, token, head = self.worst
        verdict = "match" if self.ok else f"MISMATCH in {self.bad}/{self.compared} vectors"
        return (f"KV {verdict}: max rel. error {self.max_error:.2e} (tolerance {self.tolerance:.0e}) at layer {layer} "
                f"{role} token {token} head {head}")


def compare_kv(got: PromptKV, ref: PromptKV, tolerance: float) -> KVReport:
    """Compare ``got`` (decode's pages) with ``ref`` (the reference) position by position."""
    none = (0, "key", -1, -1)
    if got.key.shape[0] != ref.key.shape[0] or got.key.shape[2:] != ref.key.shape[2:]:
        return KVReport(False, float("inf"), tolerance, 0, 0, none,
                        f"shape {got.key.shape} differs from the reference {ref.key.shape}")
    index = {int(p): i for i, p in enumerate(ref.positions)}
    missing = [int(p) for p in got.positions if int(p) not in index]
    if missing or not got.positions.size:
        return KVReport(False, float("inf"), tolerance, 0, 0, none,
                        f"positions {missing[:5]} not in the reference" if missing else "no positions returned")
    sel = np.array([index[int(p)] for p in got.positions], dtype=np.int64)
    ref_present = ref.present[:, sel]
    if (got.present & ~ref_present).any():
        return KVReport(False, float("inf"), tolerance, 0, 0, none, "decode holds pages the reference lacks")
    errors = []
    for role in ROLES:
        g, r = got.role(role), ref.role(role)[:, sel]
        scale = np.maximum(np.abs(r).max(axis=-1), 1e-6)
        err = np.abs(g - r).max(axis=-1) / scale                    # [layers, positions, heads]
        errors.append(np.where(got.present[:, :, None], err, 0.0))
    err_all = np.stack(errors, axis=1)                              # [layers, roles, positions, heads]
    compared = int(got.present.sum()) * len(ROLES) * got.key.shape[2]
    if not compared:
        return KVReport(False, float("inf"), tolerance, 0, 0, none, "no position has a page in any layer")
    flat = int(np.argmax(err_all))
    layer, role_index, i, head = (int(x) for x in np.unravel_index(flat, err_all.shape))
    worst = float(err_all.flat[flat])
    bad = int((err_all > tolerance).sum())
    return KVReport(bad == 0, worst, tolerance, compared, bad, (layer, ROLES[role_index], int(got.positions[i]), head))


@dataclass(frozen=True)
class RequestCheck:
    """One request checked two ways: its tokens against reference generation, its prompt KV by position."""

    tokens_match: bool
    kv: KVReport

    @property
    def ok(self) -> bool:
        """Both checks passed."""
        return self.tokens_match and self.kv.ok

    def describe(self) -> str:
        """One line naming what failed."""
        return f"tokens {'match' if self.tokens_match else 'MISMATCH'}; {self.kv.describe()}"


class KVOracle:
    """Checks requests served by decode against a reference of the same model run in this process (built
    once): tokens against single-process greedy generation, prompt KV against ``ReferenceKV``."""

    def __init__(self, model: ModelSource, device: str = "cpu", tolerance: float | None = None) -> None:
        self.reference = ReferenceKV(model, device)
        self.tolerance = TOLERANCE.get(model.kv_spec.dtype, 3e-2) if tolerance is None else tolerance

    def check(self, tokens: npt.ArrayLike, got: PromptKV | None) -> KVReport:
        """Compare decode's prompt KV for ``tokens`` with the reference (a missing KV is a failure)."""
        return self.check_request(tokens, 0, [], got).kv

    def check_request(self, tokens: npt.ArrayLike, max_new_tokens: int, got_tokens: Sequence[int],
                      got_kv: PromptKV | None) -> RequestCheck:
        """Both checks of one served request, from one reference prefill."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        none = (0, "key", -1, -1)
        if got_kv is None:
            expected, _ = self.reference.run(ids, max_new_tokens, np.empty(0, np.int64))
            return RequestCheck(list(got_tokens) == expected,
                                KVReport(False, float("inf"), self.tolerance, 0, 0, none, "decode returned no KV"))
        if got_kv.positions.size and (int(got_kv.positions.min()) < 0 or int(got_kv.positions.max()) >= ids.size):
            expected, _ = self.reference.run(ids, max_new_tokens, np.empty(0, np.int64))
            return RequestCheck(list(got_tokens) == expected,
                                KVReport(False, float("inf"), self.tolerance, 0, 0, none,
                                         f"positions outside the {ids.size}-token prompt"))
        expected, ref = self.reference.run(ids, max_new_tokens, np.unique(got_kv.positions))
        return RequestCheck(list(got_tokens) == expected, compare_kv(got_kv, ref, self.tolerance))
