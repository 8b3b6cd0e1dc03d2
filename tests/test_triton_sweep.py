"""benchmarks/triton_sweep.py: the occupancy it records for each compiled variant (the
sweep itself needs a GPU; --plan-overhead runs on a CPU)."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    return runpy.run_path(str(SCRIPT), run_name="triton_sweep")


@pytest.mark.parametrize(
    ("registers", "shared", "warps", "expected"),
    [
        (124, 38912, 4, 4),  # D 128 m16-n64, split (ptxas for sm_90): 128 x 128 registers each
        (164, 38912, 4, 3),  # the same tile unsplit: 168 registers allocated
        (200, 73728, 4, 2),  # m16-n128: registers and shared memory both allow 2
        (64, 6656, 4, 8),  # D 64 m16-n16: 8 by registers
        (32, 4096, 4, 16),  # 2048 threads per SM are the limit
        (168, 160 * 1024, 4, 1),  # shared memory is the limit
    ],
)
def test_occupancy_of_a_compiled_kernel(sweep, registers, shared, warps, expected):
    compiled = SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(shared=shared))
    assert sweep["occupancy"](compiled, warps) == (registers, expected)


def test_occupancy_unknown_without_a_compiled_kernel(sweep):
    assert sweep["occupancy"](None, 4) == (None, None)
