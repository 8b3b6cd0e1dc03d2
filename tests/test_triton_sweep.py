"""benchmarks/triton_sweep.py: the occupancy it records for each compiled variant (the
sweep itself needs a GPU; --plan-overhead runs on a CPU)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    return runpy.run_path(str(SCRIPT), run_name="triton_sweep")


def test_occupancy_unknown_without_a_compiled_kernel(sweep):
    assert sweep["occupancy"](None, 4) == (None, None)
