"""Wire format of page tables and transfer plans: a fixed prefix, a msgspec header, raw columns.

Layout of one message (integers little-endian)::

    prefix   magic(4s) version(u16) header_len(u16)                     8 bytes
    header   msgpack of ``WireHeader``: [count, [column names]]         header_len bytes
    columns  fixed columns of the message kind, then the named int64 columns, each ``count`` items

The header is a bounded ``msgspec.Struct`` (the codec family of the control plane and the published
descriptors); the bulk columns stay raw arrays, read in place. A decoder checks the prefix, decodes
the header under its bounds and checks that the payload length is exactly what ``count`` implies
*before* it allocates anything, so a hostile count is an error, never an allocation.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError

WIRE_VERSION = 2
PREFIX = struct.Struct("<4sHH")
MAX_NAMED_COLUMNS = 64
MAX_NAME_LEN = 32

Column = npt.NDArray[np.generic]
ColumnName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class WireHeader(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a page table's columns need: how many entries, and the names of its int64 coordinate columns."""

    count: Annotated[int, msgspec.Meta(ge=0)]   # msgpack ints end at 2**64 - 1
    names: Annotated[tuple[ColumnName, ...], msgspec.Meta(max_length=MAX_NAMED_COLUMNS)] = ()


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WireHeader)
_MAX_HEADER = 16 + MAX_NAMED_COLUMNS * (MAX_NAME_LEN + 2)


def encode_header(magic: bytes, header: WireHeader, version: int = WIRE_VERSION) -> bytes:
    """The prefix and header of one message (what precedes its columns)."""
    raw = _ENCODER.encode(header)
    return PREFIX.pack(magic, version, len(raw)) + raw


def encode(magic: bytes, fixed: Sequence[tuple[str, np.dtype[np.generic], Column]],
           named: Mapping[str, npt.NDArray[np.int64]]) -> bytes:
    """One message: the ``fixed`` columns (dtype given) then the ``named`` int64 columns."""
    parts = [encode_header(magic, WireHeader(int(fixed[0][2].size), tuple(named)))]
    for _, dtype, col in fixed:
        parts.append(np.ascontiguousarray(col, dtype=dtype.newbyteorder("<")).tobytes())
    for col in named.values():
        parts.append(np.ascontiguousarray(col, dtype="<i8").tobytes())
    return b"".join(parts)


def decode_header(buf: memoryview, magic: bytes, what: str) -> tuple[WireHeader, int]:
    """The header of a message and where its columns start; PageTableError on anything malformed."""
    if len(buf) < PREFIX.size:
        raise PageTableError(f"{what}.from_bytes: truncated header ({len(buf)} of {PREFIX.size} bytes)")
    got_magic, version, size = PREFIX.unpack_from(buf, 0)
    if got_magic != magic:
        raise PageTableError(f"{what}.from_bytes: bad magic {bytes(got_magic)!r}, expected {magic!r}")
    if version != WIRE_VERSION:
        raise PageTableError(f"{what}.from_bytes: unsupported version {version} (expected {WIRE_VERSION})")
    end = PREFIX.size + size
    if size > _MAX_HEADER or end > len(buf):
        raise PageTableError(f"{what}.from_bytes: truncated header ({size} header bytes, {len(buf) - PREFIX.size} "
                             f"present, at most {_MAX_HEADER})")
    try:
        header = _DECODER.decode(buf[PREFIX.size:end])
    except msgspec.ValidationError as exc:
        raise PageTableError(f"{what}.from_bytes: bad header: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise PageTableError(f"{what}.from_bytes: malformed header: {exc}") from exc
    if len(set(header.names)) != len(header.names):
        raise PageTableError(f"{what}.from_bytes: column names {list(header.names)} repeat a name")
    return header, end


def decode(data: bytes | bytearray | memoryview, magic: bytes, what: str,
           fixed: Sequence[tuple[str, np.dtype[np.generic]]]) -> tuple[dict[str, Column], dict[str, Column]]:
    """(fixed columns, named columns) of a message; raises PageTableError on anything malformed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PageTableError(f"{what}.from_bytes: expected bytes, got {type(data).__name__}")
    buf = memoryview(data).cast("B")
    header, pos = decode_header(buf, magic, what)
    count = header.count
    row_bytes = sum(dt.itemsize for _, dt in fixed) + 8 * len(header.names)
    if len(buf) - pos != count * row_bytes:
        raise PageTableError(f"{what}.from_bytes: header says {count} entries ({count * row_bytes} bytes), "
                             f"payload has {len(buf) - pos} bytes")
    out_fixed: dict[str, Column] = {}
    for name, dtype in fixed:
        out_fixed[name] = np.frombuffer(buf, dtype=dtype.newbyteorder("<"), count=count, offset=pos).astype(dtype)
        pos += count * dtype.itemsize
    out_named: dict[str, Column] = {}
    for name in header.names:
        out_named[name] = np.frombuffer(buf, dtype="<i8", count=count, offset=pos).astype(np.int64)
        pos += count * 8
    return out_fixed, out_named


def check_no_wrap(addr: npt.NDArray[np.uint64], nbytes: npt.NDArray[np.uint64], what: str) -> None:
    """Raise PageTableError naming the first entry whose end passes 2**64."""
    wraps = addr + nbytes < addr
    if wraps.any():
        i = int(np.argmax(wraps))
        raise PageTableError(f"{what}: entry {i} [{int(addr[i]):#x}, +{int(nbytes[i])}) overflows 64 bits")
