"""pagedkv.toolkit.launch: keyword-only planned launches, and where a second kernel may
be launched as a programmatic dependent of the first (compiled Triton on sm_90+)."""

from __future__ import annotations

import pytest
import torch
from pagedkv.toolkit import launch as launch_module
from pagedkv.toolkit.launch import KernelLaunch, programmatic_launch


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
