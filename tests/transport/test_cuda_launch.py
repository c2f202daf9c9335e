"""The cuda_ipc copy kernel's driver launch, with a stand-in for the driver library (runs anywhere):
it takes a compiled kernel only when the driver's parameter list is the expected one, and a launch
puts every argument in its own parameter, Triton's hidden scratch pointers as NULL."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

cuda_copy = pytest.importorskip("kvxfer.transport.cuda_copy", reason="needs cuda-python (the ucx or cuda extra)")

from kvxfer.errors import TransferFailed  # noqa: E402

EXPECTED = [8] * 7 + [4, 4, 4] + [8, 8, 8]
_CUDA_ERROR_INVALID_VALUE = 1


class FakeDriver:
    """``cuFuncGetParamInfo`` answers from ``sizes``; ``cuLaunchKernel`` reads every parameter back
    through the pointer it was given."""

    def __init__(self, sizes: list[int], launch_result: int = 0) -> None:
        self.sizes = sizes
        self.launch_result = launch_result
        self.launches: list[tuple[tuple[Any, ...], list[bytes]]] = []

    def cuFuncGetParamInfo(self, fn: Any, index: int, offset: Any, size: Any) -> int:
        if index >= len(self.sizes):
            return _CUDA_ERROR_INVALID_VALUE
        offset._obj.value = 8 * index
        size._obj.value = self.sizes[index]
        return 0

    def cuLaunchKernel(self, fn: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: int, params: Any, extra: Any) -> int:
        values = [ctypes.string_at(params[i], n) for i, n in enumerate(self.sizes)]
        self.launches.append(((fn.value, gx, gy, gz, bx, by, bz, shared, stream, extra), values))
        return self.launch_result


def compiled(**meta: Any) -> SimpleNamespace:
    fields = {"global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1, "num_warps": 4, "shared": 0}
    fields.update(meta)
    return SimpleNamespace(metadata=SimpleNamespace(**fields), function=0x7F00)


ARGS = (0x1000, 0x2010, 0x3020, 0x4030, 0x4040, 0x5050, 0x6060, 3, 70_000, 128, 0x7070, 0x7070, (1 << 47) + 16)


def test_a_launch_puts_every_argument_in_its_own_parameter() -> None:
    driver = FakeDriver([*EXPECTED, 8, 8])    # Triton's global and profile scratch pointers
    launch = cuda_copy._DriverLaunch(compiled(), driver)
    launch(5, 128, 0xABC, ARGS)
    launch(1, 1, 0xABC, tuple(a + 16 if i < 7 else a for i, a in enumerate(ARGS)))
    (shape, values), (_, again) = driver.launches
    assert shape == (0x7F00, 5, 128, 1, 128, 1, 1, 0, 0xABC, None)
    decoded = [struct.unpack("<i" if len(v) == 4 else "<Q", v)[0] for v in values]
    assert decoded == [*ARGS, 0, 0]
    assert [struct.unpack("<Q", v)[0] for v in again[:7]] == [a + 16 for a in ARGS[:7]]


@pytest.mark.parametrize(("sizes", "meta"), [
    ([*EXPECTED[:7], 4, 4, *EXPECTED[10:], 8, 8], {}),     # a count compiled in (specialised away)
    ([*EXPECTED[:7], 8, 8, 8, *EXPECTED[10:], 8, 8], {}),  # counts passed as 64-bit
    ([*EXPECTED, 8, 4], {}),                              # a hidden parameter that is not a pointer
    ([*EXPECTED, 8, 8], {"global_scratch_size": 256}),    # scratch memory Triton would allocate
    ([*EXPECTED, 8, 8], {"num_ctas": 2}),
])
def test_other_parameter_lists_are_refused(sizes: list[int], meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        cuda_copy._DriverLaunch(compiled(**meta), FakeDriver(sizes))


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, ctypes._SimpleCData) else value


def test_a_bound_launch_keeps_its_own_arguments() -> None:
    """A prepared copy's launch (``bind``): its arguments packed once into a buffer of its own, so launches of
    the same variant with other arguments in between do not change what it launches."""
    driver = FakeDriver([*EXPECTED, 8, 8])
    launch = cuda_copy._DriverLaunch(compiled(), driver)
    bound = launch.bind(16384, 1, 0xABC, ARGS)
    launch(1, 1, 0xDEF, tuple(a + 16 for a in ARGS))
    bound()
    (_, other), (shape, values) = driver.launches
    assert tuple(_plain(v) for v in shape) == (0x7F00, 16384, 1, 1, 128, 1, 1, 0, 0xABC, None)
    assert [struct.unpack("<i" if len(v) == 4 else "<Q", v)[0] for v in values] == [*ARGS, 0, 0]
    assert [struct.unpack("<Q", v)[0] for v in other[:7]] == [a + 16 for a in ARGS[:7]]


def test_a_failed_bound_launch_raises_with_the_driver_result() -> None:
    bound = cuda_copy._DriverLaunch(compiled(), FakeDriver([*EXPECTED, 8, 8], launch_result=719)).bind(2, 1, 0, ARGS)
    with pytest.raises(TransferFailed, match=r"prepared copy \(2 x 1 programs\).*CUresult 719"):
        bound()


def test_a_failed_launch_raises_with_the_driver_result() -> None:
    launch = cuda_copy._DriverLaunch(compiled(), FakeDriver([*EXPECTED, 8, 8], launch_result=701))
    with pytest.raises(TransferFailed, match="CUresult 701"):
        launch(2, 3, 0, ARGS)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 129, 4096])
def test_a_run_table_packs_every_column_at_its_16_byte_aligned_offset(n: int) -> None:
    """The run table the kernel reads: each column starts 16-byte aligned where ``layout`` says, holds the
    plan's values there, and the sections do not overlap (read back from the packed bytes). Per-run and
    shared (one value) columns both; the device table's room for a whole plan is this same layout."""
    import numpy as np

    rng = np.random.default_rng(n)
    src = rng.integers(0, 1 << 40, n, dtype=np.uint64)
    dst = rng.integers(0, 1 << 40, n, dtype=np.uint64)
    for shared in (False, True):
        lengths = np.full(1, 4096, dtype=np.uint64) if shared else rng.integers(1, 1 << 20, n, dtype=np.uint64)
        region = rng.integers(0, 5, 1 if shared else n, dtype=np.uint32)
        local = rng.integers(0, 3, 1 if shared else n, dtype=np.uint32)
        table = cuda_copy._RunTable(dst, src, lengths, region, local, n)
        at = (table.at_dst, table.at_len, table.at_reg, table.at_loc)
        assert all(x % 16 == 0 for x in at)
        assert table.at_dst >= 8 * n and table.at_len - table.at_dst >= 8 * n
        assert table.at_reg - table.at_len >= 4 * lengths.size and table.at_loc - table.at_reg >= 4 * region.size
        assert table.size == table.at_loc + 4 * local.size
        out = np.full(table.size + 32, 0xAB, dtype=np.uint8)
        table.write(out)
        assert np.array_equal(out[: 8 * n].view(np.uint64), src)
        assert np.array_equal(out[table.at_dst: table.at_dst + 8 * n].view(np.uint64), dst)
        assert np.array_equal(out[table.at_len: table.at_len + 4 * lengths.size].view(np.uint32), lengths)
        assert np.array_equal(out[table.at_reg: table.at_reg + 4 * region.size].view(np.uint32), region)
        assert np.array_equal(out[table.at_loc: table.size].view(np.uint32), local)
        assert np.all(out[table.size:] == 0xAB)
        whole = cuda_copy._RunTable.layout(n, n, n, n)[4]
        assert whole >= table.size


def test_the_warm_up_covers_every_variant_a_run_table_can_ask_for() -> None:
    """The variants a copier compiles before its first transfer are exactly those ``_RunTable.of`` can form:
    each column (lengths, peer regions, local regions) shared or per run, in both directions. A variant
    missing from the list would be compiled inside some request's transfer (tens of milliseconds, once)."""
    n = 6
    addr = np.arange(n, dtype=np.uint64) * np.uint64(4096)
    formed = set()
    for per_len in (False, True):
        for per_reg in (False, True):
            for per_loc in (False, True):
                lengths = np.arange(1, n + 1, dtype=np.uint64) if per_len else np.full(n, 64, np.uint64)
                region = (np.arange(n) % 2 if per_reg else np.zeros(n)).astype(np.uint32)
                local = (np.arange(n) % 3 if per_loc else np.ones(n)).astype(np.uint32)
                table = cuda_copy._RunTable.of(addr, addr, lengths, region, local, 2, 3)
                assert table.per_run == (int(per_len), int(per_reg), int(per_loc))
                for remote_src in (False, True):
                    formed.add(cuda_copy.run_variant_key(remote_src, table.per_run))
    keys = cuda_copy.run_variant_keys()
    assert len(keys) == len(set(keys)) == 16
    assert formed == set(keys)


class ProcAddressDriver:
    """``cuGetProcAddress`` as cuda.bindings has it: the symbol must be bytes (a str raises TypeError)."""

    CUdriverProcAddress_flags = SimpleNamespace(CU_GET_PROC_ADDRESS_DEFAULT=0)

    def __init__(self, pointer: int) -> None:
        self.pointer = pointer
        self.asked: list[tuple[bytes, int]] = []

    def cuGetProcAddress(self, symbol: bytes, version: int, flags: int) -> tuple[int, int, int]:
        if not isinstance(symbol, bytes):
            raise TypeError(f"expected bytes, {type(symbol).__name__} found")
        self.asked.append((symbol, version))
        return 0, self.pointer if symbol == b"cuMemcpyBatchAsync" else 0, 0


def test_the_batch_copy_function_is_found_through_a_bytes_symbol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver offers cuMemcpyBatchAsync: the copier's batch method gets it (CUDA 13 ABI), not None."""
    driver = ProcAddressDriver(0x1234)
    monkeypatch.setattr(cuda_copy, "cu", driver)
    assert cuda_copy._batch_fn() is not None
    assert driver.asked == [(b"cuMemcpyBatchAsync", 13000)]


def test_no_batch_copy_function_is_none_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cuda_copy, "cu", ProcAddressDriver(0))
    with caplog.at_level("INFO", logger=cuda_copy.__name__):
        assert cuda_copy._batch_fn() is None
    assert "no cuMemcpyBatchAsync" in caplog.text and "pointer 0x0" in caplog.text
