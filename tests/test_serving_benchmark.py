"""benchmarks/serving_throughput.py stays runnable (its --tiny CPU smoke run)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_throughput.py"


def test_tiny_run_prints_both_tables(capsys):
    main = runpy.run_path(str(SCRIPT), run_name="serving_throughput")["main"]
    threads = torch.get_num_threads()
    try:
        assert main(["--tiny", "--requests", "3", "--scheduling", "sync", "async"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    summary = out.split("\n\n")[-2:]
    lines = summary[0].splitlines()
    assert lines[0].startswith("requests  scheduling  output tok/s")
    assert lines[2].split()[:2] == ["3", "sync"] and lines[3].split()[:2] == ["3", "async"]
    assert "static generate tok/s" in summary[1]
    assert "failed" not in out
