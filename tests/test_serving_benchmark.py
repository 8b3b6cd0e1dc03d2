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


def test_kernel_profile_prints_the_step_by_kind(capsys):
    bench = runpy.run_path(str(SCRIPT), run_name="serving_throughput")
    threads = torch.get_num_threads()
    try:
        args = ["--tiny", "--requests", "3", "--no-compare", "--kernel-profile", "2"]
        assert bench["main"]([*args, "--kernel-profile-top", "5"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    by_kind = out.split("CPU operators (self time) per decode step, by kind\n")[1]
    kinds = {line.split()[0] for line in by_kind.split("\n\n")[0].splitlines()[2:]}
    assert kinds == {"matmul", "other"}  # the torch backend's attention is aten ops
    top = out.split("\ntop 5\n")[1].split("\n\n")[0].splitlines()[2:]
    assert len(top) == 5 and float(top[0].split()[-1].rstrip("%")) > 0
    # GPU kernel names as the H200 profile shows them
    kind = bench["kernel_kind"]
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "matmul"
    assert kind("nvjet_hsh_64x8_64x16_2x1_v_bz_coopA_TNT") == "matmul"
    assert kind("unified_attention_kernel") == "attention"
    assert kind("write_kv_kernel") == "attention"
    assert kind("triton_poi_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"
