"""The cuda_ipc copy kernel's driver launch, with a stand-in for the driver library (runs anywhere):
it takes a compiled kernel only when the driver's parameter list is the expected one, and a launch
puts every argument in its own parameter, Triton's hidden scratch pointers as NULL."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace
from typing import Any

import pytest

cuda_copy = pytest.importorskip("kvxfer.transport.cuda_copy", reason="needs cuda-python (the ucx or cuda extra)")

from kvxfer.errors import TransferFailed  # noqa: E402

EXPECTED = [8] * 7 + [4, 4] + [8, 8, 8]
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


ARGS = (0x1000, 0x2010, 0x3020, 0x4030, 0x4040, 0x5050, 0x6060, 3, 70_000, 0x7070, 0x7070, (1 << 47) + 16)


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
    ([*EXPECTED[:7], 4, *EXPECTED[9:], 8, 8], {}),     # a count compiled in (specialised away)
    ([*EXPECTED[:7], 8, 8, *EXPECTED[9:], 8, 8], {}),  # counts passed as 64-bit
    ([*EXPECTED, 8, 4], {}),                              # a hidden parameter that is not a pointer
    ([*EXPECTED, 8, 8], {"global_scratch_size": 256}),    # scratch memory Triton would allocate
    ([*EXPECTED, 8, 8], {"num_ctas": 2}),
])
def test_other_parameter_lists_are_refused(sizes: list[int], meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        cuda_copy._DriverLaunch(compiled(**meta), FakeDriver(sizes))


def test_a_failed_launch_raises_with_the_driver_result() -> None:
    launch = cuda_copy._DriverLaunch(compiled(), FakeDriver([*EXPECTED, 8, 8], launch_result=701))
    with pytest.raises(TransferFailed, match="CUresult 701"):
        launch(2, 3, 0, ARGS)
