"""atheris (libFuzzer) harnesses for every decoder that reads bytes from a peer.

    python fuzz/fuzz_decoders.py DECODER --seed-corpus DIR     write valid encodings into DIR
    python fuzz/fuzz_decoders.py DECODER [libFuzzer flags] DIR  fuzz, e.g. -max_total_time=60

DECODER is one of: layout, page_table, transfer_plan, metadata, message, digest. A decoder may
raise only its documented error (kvxfer.errors); anything else, or a decoded value that does not
re-encode to an equal one, is a crash that libFuzzer reports and saves. ``make fuzz`` runs each
decoder for a bounded time. The hypothesis twin of these harnesses is tests/test_hostile_input.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["kvxfer"]):
    import msgspec
    import msgspec.inspect
    import numpy as np

    from kvxfer.cache.config import CacheConfig, LayerSpec, PrimaryTier, RoleSpec
    from kvxfer.cache.descriptors import CacheLayoutDesc
    from kvxfer.cache.layout import plan_layout
    from kvxfer.cache.memory import MemoryRegion
    from kvxfer.disagg import messages
    from kvxfer.disagg.messages import MESSAGE_TYPES
    from kvxfer.errors import DecodeError, PageTableError, ProtocolError
    from kvxfer.pagetable import PageTable, TransferPlan
    from kvxfer.transport.integrity import ChecksumPolicy, DigestBuffer, KVDigest
    from kvxfer.transport.metadata import TransportMetadata


def _layout_seeds() -> list[bytes]:
    scale = RoleSpec("key_scale", head_dim=1, dtype="float32")
    configs = [CacheConfig.for_model(4, 8, 64, 16, "bfloat16", 10, windows=[128, None], roles=("key", "value", scale)),
               CacheConfig.for_model(2, 4, 32, 8, "float16", 6, coalesce=False, head_order="NHD"),
               CacheConfig((LayerSpec(0, 2, 64, window=64), LayerSpec(1, 2, 64, window=64), LayerSpec(2, 2, 128)),
                           16, "float16", (PrimaryTier(1 << 20),))]
    return [plan_layout(c).to_msgpack() for c in configs]


def _table_seeds() -> list[bytes]:
    addr = np.array([4096, 1 << 33, 77], np.uint64)
    return [PageTable(addr, np.array([4096, 1, 64], np.uint64), np.array([0, 1, 0], np.uint32),
                      {"layer": np.arange(3), "block": np.array([5, 9, 2])}).to_bytes(), PageTable.empty().to_bytes()]


def _plan_seeds() -> list[bytes]:
    src = PageTable(np.array([4096, 8192], np.uint64), np.array([100, 4096], np.uint64), np.zeros(2, np.uint32))
    dst = PageTable(np.array([1 << 33, 12288], np.uint64), np.array([100, 4096], np.uint64), np.array([1, 0], np.uint32))
    return [TransferPlan(src, dst).to_bytes(), TransferPlan.empty().to_bytes()]


def _metadata_seeds() -> list[bytes]:
    regions = (MemoryRegion(4096, 8192, "cpu", 0), MemoryRegion(1 << 40, 1 << 20, "cuda", 3))
    return [TransportMetadata("nixl", "prefill-0", regions, b"agent-blob").encode()]


def _sample(t: msgspec.inspect.Type) -> Any:
    """A value of the message field type ``t`` within its bounds."""
    if isinstance(t, msgspec.inspect.LiteralType):
        return t.values[-1]
    if isinstance(t, msgspec.inspect.StrType | msgspec.inspect.BytesType):
        return ("x" if isinstance(t, msgspec.inspect.StrType) else b"\x01") * max(t.min_length or 0, 1)
    if isinstance(t, msgspec.inspect.BoolType):
        return True
    if isinstance(t, msgspec.inspect.IntType):
        return max(t.ge or 0, min(7, 7 if t.le is None else t.le))
    if isinstance(t, msgspec.inspect.FloatType):
        return max(t.ge or 0.0, 0.5)
    if isinstance(t, msgspec.inspect.ListType):
        return [1, 2, 3]
    raise TypeError(f"no seed value for a message field of type {t}")


def _message_seeds() -> list[bytes]:
    """A valid frame of every control message type."""
    out = []
    for cls in MESSAGE_TYPES:
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        out.append(messages.encode(cls(**{f.name: _sample(f.type) for f in info.fields})))
    return out


def _digest_seeds() -> list[bytes]:
    policy = ChecksumPolicy.every(3, seed=2)
    buffers = (DigestBuffer(0, "key", "float16", 32, 4, ((0, 40),)),
               DigestBuffer(1, "value", "float16", 32, 4, ((8, 16), (24, 40))))
    cells = KVDigest("req-1", policy, 16, (0, 40), buffers, bytes(32), b"").num_cells
    tags = bytes(range(policy.tag_bytes)) * policy.count(cells)
    return [KVDigest("req-1", policy, 16, (0, 40), buffers, bytes(32), tags).to_bytes()]


def _consistent(decode: Callable[[bytes], Any], encode: Callable[[Any], bytes]) -> Callable[[Any], bool]:
    return lambda value: decode(encode(value)) == value


def _same_table(a: PageTable, b: PageTable) -> bool:
    return bool(np.array_equal(a.addr, b.addr) and np.array_equal(a.nbytes, b.nbytes)
                and np.array_equal(a.region, b.region) and not (a.addr + a.nbytes < a.addr).any())


# name -> (decoder, the one error it documents, seed builder, consistency check of a decoded value)
DECODERS: dict[str, tuple[Callable[[bytes], Any], type[Exception], Callable[[], list[bytes]], Callable[[Any], bool]]] = {
    "layout": (CacheLayoutDesc.from_msgpack, DecodeError, _layout_seeds,
               _consistent(CacheLayoutDesc.from_msgpack, lambda v: v.to_msgpack())),
    "page_table": (PageTable.from_bytes, PageTableError, _table_seeds,
                   lambda v: _same_table(PageTable.from_bytes(v.to_bytes()), v)),
    "transfer_plan": (TransferPlan.from_bytes, PageTableError, _plan_seeds,
                      lambda v: _same_table(TransferPlan.from_bytes(v.to_bytes()).src, v.src)
                      and _same_table(TransferPlan.from_bytes(v.to_bytes()).dst, v.dst)),
    "metadata": (TransportMetadata.decode, DecodeError, _metadata_seeds,
                 _consistent(TransportMetadata.decode, lambda v: v.encode())),
    "message": (messages.decode, ProtocolError, _message_seeds, _consistent(messages.decode, messages.encode_frame)),
    "digest": (KVDigest.from_bytes, DecodeError, _digest_seeds,
               _consistent(KVDigest.from_bytes, lambda v: v.to_bytes())),
}


def one_input(name: str) -> Callable[[bytes], None]:
    """libFuzzer's TestOneInput for decoder ``name``."""
    decode, error, _, consistent = DECODERS[name]

    def test_one_input(data: bytes) -> None:
        try:
            value = decode(data)
        except error:
            return
        if not consistent(value):
            raise AssertionError(f"{name}: {data[:64]!r} decoded into an inconsistent value {value!r:.200}")

    return test_one_input


def main(argv: list[str]) -> int:
    """Write a seed corpus, or fuzz one decoder with the remaining (libFuzzer) arguments."""
    if len(argv) < 2 or argv[1] not in DECODERS:
        print(f"usage: {argv[0]} {{{','.join(DECODERS)}}} [--seed-corpus DIR | libFuzzer flags and corpus dirs]",
              file=sys.stderr)
        return 2
    name = argv[1]
    if len(argv) == 4 and argv[2] == "--seed-corpus":
        out = Path(argv[3])
        out.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(DECODERS[name][2]()):
            one_input(name)(seed)
            (out / f"seed-{i}").write_bytes(seed)
        return 0
    atheris.Setup([argv[0], *argv[2:]], one_input(name))
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
