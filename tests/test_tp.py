"""Tensor parallelism: head sharding rules, and conformance run sharded over 2 gloo ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pagedkv import AttentionSpec, SpecError
from pagedkv.distributed import agree_num_blocks, shard_problems, shard_spec
from pagedkv.spec import alibi_slopes

SPEC = AttentionSpec(
    num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
)


def test_heads_split_evenly_and_kv_heads_follow_their_query_heads():
    shards = [shard_spec(SPEC, 4, r) for r in range(4)]
    assert [s.query_heads for s in shards] == [range(8 * r, 8 * r + 8) for r in range(4)]
    assert [s.kv_heads for s in shards] == [range(2 * r, 2 * r + 2) for r in range(4)]
    assert all(s.spec.num_heads == 8 and s.spec.num_kv_heads == 2 for s in shards)
    assert shards[0].spec.scale == SPEC.scale  # the scale is the full layer's


def test_kv_heads_are_replicated_past_their_count():
    # Llama-3-70B at TP 16: 64 query heads over 8 KV heads: each KV head on 2 ranks
    spec = SPEC.replace(num_heads=64)
    shards = [shard_spec(spec, 16, r) for r in range(16)]
    assert [s.kv_heads.start for s in shards] == [r // 2 for r in range(16)]
    assert all(len(s.kv_heads) == 1 and s.spec.num_heads == 4 for s in shards)
    # query heads 4r..4r+3 belong to KV head (4r) // 8 == r // 2
    assert all(s.query_heads.start // spec.num_queries_per_kv == s.kv_heads.start for s in shards)


def test_mla_keeps_its_latent_and_alibi_slopes_follow_the_heads():
    mla = AttentionSpec(num_heads=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                        block_size=64, scale=0.07, kv_lora_rank=512, qk_rope_head_dim=64)  # fmt: skip
    shard = shard_spec(mla, 4, 3)
    assert shard.spec.num_heads == 4 and shard.spec.num_kv_heads == 1 and shard.spec.is_mla
    alibi = SPEC.replace(alibi_slopes=alibi_slopes(32))
    assert shard_spec(alibi, 2, 1).spec.alibi_slopes == alibi.alibi_slopes[16:]


@pytest.mark.parametrize(
    "spec, tp, message",
    [
        (SPEC, 3, "num_heads 32 is not divisible by tp_size 3"),
        (SPEC.replace(num_heads=48, num_kv_heads=12), 8, "num_kv_heads 12 is not divisible"),
        (SPEC.replace(num_heads=48, num_kv_heads=3), 6, None),  # 3 KV heads on 6 ranks: fine
        (
            SPEC.replace(num_heads=40, num_kv_heads=4),
            10,
            "tp_size 10 is not a multiple of num_kv_heads 4",
        ),
        (SPEC, 0, "tp_size must be a positive int"),
    ],
)
def test_impossible_splits_are_refused_with_the_reason(spec, tp, message):
    if message is None:
        assert shard_problems(spec, tp) == []
        return
    assert any(message in p for p in shard_problems(spec, tp))
    with pytest.raises(SpecError, match=message):
        shard_spec(spec, tp, 0)


def test_num_blocks_without_a_process_group_is_the_local_figure():
    assert agree_num_blocks(1234) == 1234


def _launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.conformance.tp", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def test_conformance_sharded_over_two_gloo_ranks_matches_the_unsharded_reference():
    run = _launch("--backend", "torch", "--tp", "2", "--device", "cpu",
                  "--scenarios", "decode,mixed-*,mqa,gqa-5,sinks,alibi,fp8-e4m3")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "8 passed, 0 failed, 0 not applicable" in run.stdout


def test_unsplittable_layers_are_not_applicable_and_a_wrong_shard_fails():
    run = _launch(
        "--backend", "torch", "--tp", "4", "--device", "cpu", "--scenarios", "decode,gqa-5"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "n/a   gqa-5: num_heads 10 is not divisible by tp_size 4" in run.stdout
