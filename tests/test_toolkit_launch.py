"""pagedkv.toolkit.launch: keyword-only planned launches, and where a second kernel may
be launched as a programmatic dependent of the first (compiled Triton on sm_90+)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pagedkv.toolkit import launch as launch_module
from pagedkv.toolkit.launch import (
    KernelLaunch,
    compiled_fit,
    kernel_fit,
    programmatic_capability,
    programmatic_launch,
)


def test_a_launch_passes_keywords_only():
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def run(**kwargs):
                seen.update(grid=grid, **kwargs)
                return "handle"

            return run

    assert KernelLaunch(Kernel(), (2, 3), {"X": 1})() == "handle"
    assert seen == {"grid": (2, 3), "X": 1}


def test_no_programmatic_launch_on_a_cpu():
    assert not programmatic_launch("cpu")
    assert not programmatic_launch(torch.device("cpu"))


def test_programmatic_launches_from_sm90():
    assert not programmatic_capability(None)
    assert not programmatic_capability((8, 0))
    assert programmatic_capability((9, 0)) and programmatic_capability((10, 0))


@pytest.mark.parametrize(
    ("capability", "expected"), [((8, 0), False), ((9, 0), True), ((10, 0), True)]
)
def test_programmatic_launch_needs_sm90(monkeypatch, capability, expected):
    # a compiled (not interpreted) kernel on a GPU of this capability
    monkeypatch.setattr(launch_module, "_capability", lambda index: capability)
    monkeypatch.setattr("pagedkv.toolkit.interpreter.interpreting", lambda: False)
    assert programmatic_launch("cuda:0") is expected


def test_no_programmatic_launch_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch_module, "_capability", lambda index: (9, 0))
    monkeypatch.setattr("pagedkv.toolkit.interpreter.interpreting", lambda: True)
    assert not programmatic_launch("cuda:0")


# an H200's limits, as torch reports them
H200 = SimpleNamespace(
    regs_per_multiprocessor=65536,
    shared_memory_per_multiprocessor=228 * 1024,
    max_threads_per_multi_processor=2048,
)


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
def test_how_a_compiled_kernel_fits(registers, shared, warps, expected):
    compiled = SimpleNamespace(
        n_regs=registers, n_spills=3, metadata=SimpleNamespace(shared=shared)
    )
    fit = kernel_fit(compiled, warps, H200)
    assert (fit.registers, fit.programs_per_sm) == (registers, expected)
    assert fit.spill_bytes == 12 and fit.shared_bytes == shared


def test_nothing_compiles_on_a_cpu():
    launch = KernelLaunch(lambda: None, (1,), {})
    assert compiled_fit(launch, "cpu") is None
