"""Capacity maths: the chapter's figures (§4.1, §4.3, §4.8), MLA, TP, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from pagedkv import AttentionSpec
from pagedkv.cli import main
from pagedkv.errors import KVCacheUsageError
from pagedkv.kv.capacity import (
    GiB,
    KiB,
    KVShape,
    MiB,
    estimate_capacity,
    kv_budget_bytes,
    kv_heads_per_rank,
)
from pagedkv.kv.presets import PRESETS


def preset_shape(name: str) -> KVShape:
    return KVShape.from_preset(PRESETS[name])


def test_llama2_13b_fp16_figures():
    est = estimate_capacity(preset_shape("llama-2-13b"), 2, block_size=16)
    assert est.bytes_per_token == 819_200  # 2 x 40 layers x 40 heads x 128 x 2 B
    assert est.bytes_per_block_per_layer == 320 * KiB
    assert est.bytes_per_block == 12.5 * MiB  # 40 layers x 320 KiB
    # §4.3.1: 50 GiB of KV holds 4096 complete blocks ("about 4000")
    assert estimate_capacity(preset_shape("llama-2-13b"), 2, kv_budget=50 * GiB).num_blocks == 4096


def test_llama3_70b_tp2_on_an_80gb_a100():
    budget = kv_budget_bytes(80 * GiB, 70 * GiB, 4 * GiB)
    assert budget == 6 * GiB
    est = estimate_capacity(
        preset_shape("llama-3-70b"), 2, tp=2, block_size=16, kv_budget=budget,
        request_len=800 + 256, concurrency=32,
    )  # fmt: skip
    assert est.bytes_per_token_per_layer == 2 * KiB  # 2 x 4 heads/rank x 128 x 2 B
    assert est.bytes_per_token == 160 * KiB
    assert est.num_tokens == 39_321  # 6 GiB / 160 KiB = 39,321.6: "about 39,000"
    assert est.num_blocks == 2_457  # "about 2,400" (the chapter divides 39,000 by 16)
    assert est.blocks_per_request == 66
    assert est.blocks_for_concurrency == 2_112  # 32 x 1056 tokens / 16
    assert est.fits and est.max_concurrency == 37


def test_mla_latent_is_not_split_by_tp():
    shape = preset_shape("deepseek-v3")
    assert shape.is_mla and shape.head_size == 576
    one = estimate_capacity(shape, 2, tp=1)
    eight = estimate_capacity(shape, 2, tp=8)
    assert one.bytes_per_token == eight.bytes_per_token == 61 * 576 * 2
    spec = AttentionSpec(
        num_heads=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, block_size=64,
        kv_lora_rank=512, qk_rope_head_dim=64, scale=0.1,
    )  # fmt: skip
    assert KVShape.from_spec(spec, 61) == shape


def test_gqa_heads_per_rank_and_fp8():
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(8, 16) == 1  # replicated
    with pytest.raises(KVCacheUsageError, match="num_kv_heads 8 is not divisible by tp_size 3"):
        kv_heads_per_rank(8, 3)
    with pytest.raises(KVCacheUsageError, match=">= 1"):
        kv_heads_per_rank(8, 0)
    fp16 = estimate_capacity(preset_shape("llama-3-8b"), 2)
    fp8 = estimate_capacity(preset_shape("llama-3-8b"), 1)
    assert fp16.bytes_per_token == 2 * fp8.bytes_per_token == 131_072


def test_budget_errors():
    with pytest.raises(KVCacheUsageError, match="no room for a KV cache"):
        kv_budget_bytes(80 * GiB, 78 * GiB, 4 * GiB)
    with pytest.raises(KVCacheUsageError, match="needs a request length"):
        estimate_capacity(preset_shape("llama-3-8b"), 2, concurrency=4)


def test_cli_reproduces_the_chapter(capsys):
    argv = ["capacity", "--model", "llama-3-70b", "--tp", "2", "--gpu-memory", "80"]
    argv += ["--weights", "70", "--overhead", "4", "--prompt-len", "800", "--output-len", "256"]
    assert main([*argv, "--concurrency", "32"]) == 0
    out = capsys.readouterr().out
    assert "163,840 B (160 KiB)" in out and "39,321" in out and "2,457" in out
    assert "2,112" in out and "fits" in out
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["num_blocks"] == 2457 and record["bytes_per_token"] == 163840


def test_cli_by_hand_and_errors(capsys):
    assert (
        main(["capacity", "--num-layers", "40", "--num-kv-heads", "40", "--head-size", "128"]) == 0
    )
    assert "819,200 B (800 KiB)" in capsys.readouterr().out
    assert main(["capacity", "--num-layers", "40"]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["capacity", "--model", "llama-3-8b", "--gpu-memory", "10"]) == 2
    assert "no room for a KV cache" in capsys.readouterr().err
