"""Binary wire format of page tables and transfer plans: versioned, little-endian, bounded decode.

Layout of one message (all integers little-endian)::

    header   magic(4s) version(u16) num_named(u16) count(u64)          16 bytes
    names    num_named x [len(u8) ascii-identifier(len bytes)]         the named int64 columns
    columns  fixed columns of the message kind, then the named columns, each ``count`` items

A decoder checks magic, version, names and that the payload length is exactly what ``count``
implies *before* it allocates anything, so a hostile count is an error, never an allocation.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PageTableError

WIRE_VERSION = 1
HEADER = struct.Struct("<4sHHQ")
MAX_NAMED_COLUMNS = 64
MAX_NAME_LEN = 32

Column = npt.NDArray[np.generic]


def encode(magic: bytes, fixed: Sequence[tuple[str, np.dtype[np.generic], Column]],
           named: Mapping[str, npt.NDArray[np.int64]]) -> bytes:
    """One message: the ``fixed`` columns (dtype given) then the ``named`` int64 columns."""
    count = int(fixed[0][2].size)
    parts = [HEADER.pack(magic, WIRE_VERSION, len(named), count)]
    for name in named:
        raw = name.encode("ascii")
        parts.append(struct.pack("<B", len(raw)) + raw)
    for _, dtype, col in fixed:
        parts.append(np.ascontiguousarray(col, dtype=dtype.newbyteorder("<")).tobytes())
    for col in named.values():
        parts.append(np.ascontiguousarray(col, dtype="<i8").tobytes())
    return b"".join(parts)


def decode(data: bytes | bytearray | memoryview, magic: bytes, what: str,
           fixed: Sequence[tuple[str, np.dtype[np.generic]]]) -> tuple[dict[str, Column], dict[str, Column]]:
    """(fixed columns, named columns) of a message; raises PageTableError on anything malformed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PageTableError(f"{what}.from_bytes: expected bytes, got {type(data).__name__}")
    buf = memoryview(data).cast("B")
    if len(buf) < HEADER.size:
        raise PageTableError(f"{what}.from_bytes: truncated header ({len(buf)} of {HEADER.size} bytes)")
    got_magic, version, num_named, count = HEADER.unpack_from(buf, 0)
    if got_magic != magic:
        raise PageTableError(f"{what}.from_bytes: bad magic {bytes(got_magic)!r}, expected {magic!r}")
    if version != WIRE_VERSION:
        raise PageTableError(f"{what}.from_bytes: unsupported version {version} (expected {WIRE_VERSION})")
    if num_named > MAX_NAMED_COLUMNS:
        raise PageTableError(f"{what}.from_bytes: {num_named} named columns (at most {MAX_NAMED_COLUMNS})")
    pos = HEADER.size
    names: list[str] = []
    for i in range(num_named):
        if pos >= len(buf):
            raise PageTableError(f"{what}.from_bytes: truncated in column name {i}")
        n = buf[pos]
        raw = bytes(buf[pos + 1:pos + 1 + n])
        if not 0 < n <= MAX_NAME_LEN or len(raw) != n:
            raise PageTableError(f"{what}.from_bytes: column name {i} has bad length {n} "
                                 f"({len(raw)} bytes present, at most {MAX_NAME_LEN})")
        try:
            name = raw.decode("ascii")
        except UnicodeDecodeError as exc:
            raise PageTableError(f"{what}.from_bytes: column name {i} is not ASCII: {raw!r}") from exc
        if not name.isidentifier() or name in names:
            raise PageTableError(f"{what}.from_bytes: column name {i} {name!r} is not a new identifier")
        names.append(name)
        pos += 1 + n
    row_bytes = sum(dt.itemsize for _, dt in fixed) + 8 * num_named
    if len(buf) - pos != count * row_bytes:
        raise PageTableError(f"{what}.from_bytes: header says {count} entries ({count * row_bytes} bytes), "
                             f"payload has {len(buf) - pos} bytes")
    out_fixed: dict[str, Column] = {}
    for name, dtype in fixed:
        out_fixed[name] = np.frombuffer(buf, dtype=dtype.newbyteorder("<"), count=count, offset=pos).astype(dtype)
        pos += count * dtype.itemsize
    out_named: dict[str, Column] = {}
    for name in names:
        out_named[name] = np.frombuffer(buf, dtype="<i8", count=count, offset=pos).astype(np.int64)
        pos += count * 8
    return out_fixed, out_named


def check_no_wrap(addr: npt.NDArray[np.uint64], nbytes: npt.NDArray[np.uint64], what: str) -> None:
    """Raise PageTableError naming the first entry whose end passes 2**64."""
    wraps = addr + nbytes < addr
    if wraps.any():
        i = int(np.argmax(wraps))
        raise PageTableError(f"{what}: entry {i} [{int(addr[i]):#x}, +{int(nbytes[i])}) overflows 64 bits")
