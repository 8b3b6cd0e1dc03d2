"""The MLA backend on a GPU: DeepSeek dims, 128 heads, bf16, long contexts, 64-bit
offsets, and every kernel variant the benchmark sweep may choose.

    python -m pytest -q tests/test_mla_gpu.py
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pagedkv.conformance import Scenario, reproduce

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs test_mla_backend.py)"
)

DEEPSEEK = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, block_size=64
)
BF16 = dict(DEEPSEEK, dtype=torch.bfloat16, num_heads=128)

SCENARIOS = [
    (
        "mla",
        Scenario("decode-128h", seq_lens=(1, 63, 64, 65, 4100, 700), query_lens=(1,) * 6, **BF16),
    ),
    (
        "mla",
        Scenario(
            "mixed-128h",
            seq_lens=(900, 77, 300, 130),
            query_lens=(1, 77, 40, 3),
            num_padding_tokens=5,
            **BF16,
        ),
    ),
    ("mla", Scenario("long-decode-split", seq_lens=(16384 + 7, 33), query_lens=(1, 1), **BF16)),
    (
        "mla(num_splits=7)",
        Scenario("forced-split-prefill", seq_lens=(1000, 260), query_lens=(300, 1), **BF16),
    ),
    (
        "mla",
        Scenario(
            "heads-16",
            seq_lens=(2000, 5, 640),
            query_lens=(1, 5, 2),
            **DEEPSEEK,
            num_heads=16,
            dtype=torch.bfloat16,
        ),
    ),
    (
        "mla",
        Scenario(
            "fp8-e4m3",
            seq_lens=(900, 77),
            query_lens=(1, 9),
            kv_cache_dtype="fp8_e4m3",
            k_scale=0.5,
            **BF16,
        ),
    ),
    (
        "mla",
        Scenario(
            "fp8-e5m2",
            seq_lens=(900, 77),
            query_lens=(1, 9),
            kv_cache_dtype="fp8_e5m2",
            k_scale=0.25,
            **BF16,
        ),
    ),
    (
        "mla",
        Scenario(
            "float16", seq_lens=(900, 77), query_lens=(1, 9), **dict(BF16, dtype=torch.float16)
        ),
    ),
    (
        "mla",
        Scenario(
            "float32", seq_lens=(300, 77), query_lens=(1, 9), **dict(BF16, dtype=torch.float32)
        ),
    ),
    (
        "mla",
        Scenario("block-16", seq_lens=(900, 77), query_lens=(1, 9), **dict(BF16, block_size=16)),
    ),
    ("mla", Scenario("non-causal", seq_lens=(200, 77), query_lens=(200, 77), causal=False, **BF16)),
    # the Triton kernel where the Gluon one would run (sm_90), and the Gluon kernel's
    # other shapes: 128-token blocks (two tiles per block), a 256-wide latent
    (
        "mla(use_gluon=false)",
        Scenario("triton-decode-128h", seq_lens=(1, 65, 4100, 700), query_lens=(1,) * 4, **BF16),
    ),
    (
        "mla(use_gluon=false)",
        Scenario("triton-mixed", seq_lens=(900, 77, 300), query_lens=(1, 77, 40), **BF16),
    ),
    (
        "mla",
        Scenario(
            "block-128", seq_lens=(900, 77, 129), query_lens=(1, 9, 1), **dict(BF16, block_size=128)
        ),
    ),
    (
        "mla",
        Scenario(
            "latent-256",
            seq_lens=(900, 77, 3000),
            query_lens=(1, 9, 1),
            **dict(BF16, kv_lora_rank=256),
        ),
    ),
    (
        "mla(num_splits=5)",
        Scenario("split-causal-mixed", seq_lens=(700, 130), query_lens=(70, 1), **BF16),
    ),
    # a ragged batch of 200 requests split three ways: 1200 programs for 132 SMs, short
    # requests' later splits without keys among them
    (
        "mla(num_splits=3)",
        Scenario(
            "many-programs-ragged-split",
            seq_lens=tuple(1 + (97 * i * i + 13 * i) % 2500 for i in range(200)),
            query_lens=(1,) * 200,
            **BF16,
        ),
    ),
    # the makespan rule's key ranges: the long requests cut (one of 20000 keys into 10
    # ranges, those past 2048 into 2), the others written directly
    (
        "mla",
        Scenario(
            "ragged-ranges",
            seq_lens=(*(1 + (37 * i * i) % 3000 for i in range(100)), 20000),
            query_lens=(1,) * 101,
            **BF16,
        ),
    ),
    # a chunk of 40 tokens beside decodes, the long ones cut into 1024-key ranges
    (
        "mla",
        Scenario(
            "mixed-ranges",
            seq_lens=(*(1 + (37 * i * i) % 3000 for i in range(60)), 9000, 1800),
            query_lens=(*(1,) * 61, 40),
            **BF16,
        ),
    ),
    # > 2**31 cache elements: block offsets need 64 bits
    (
        "mla",
        Scenario(
            "many-blocks",
            seq_lens=(4096 + 3, 700, 1),
            query_lens=(1, 64, 1),
            min_num_blocks=58400,
            **BF16,
        ),
    ),
]


@pytest.mark.parametrize(("config", "scenario"), SCENARIOS, ids=[s.name for _, s in SCENARIOS])
def test_matches_unabsorbed_reference_on_gpu(config, scenario):
    result = reproduce(config, scenario, "cuda")
    assert result.passed, result.report()


SWEEP = [
    f"mla(block_n={n}, num_stages={st}, lazy_rescale={lazy}, use_tma={tma}, num_splits={sp})"
    for n, st, lazy, tma, sp in itertools.product(
        (32, 64), (1, 2, 3), (True, False), (True, False), (1, 3)
    )
    if not (n == 64 and st == 3)  # does not fit shared memory
]


@pytest.mark.parametrize("config", SWEEP)
def test_every_sweep_variant_is_correct(config):
    scenario = Scenario("sweep", seq_lens=(1500, 64, 200), query_lens=(1, 1, 30), **BF16)
    result = reproduce(config, scenario, "cuda")
    assert result.passed, result.report()


def test_the_gluon_kernel_runs_on_sm90_where_it_applies():
    import pagedkv

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm_90 only")
    from pagedkv.conformance.problem import build_problem

    problem = build_problem(Scenario("x", (100,), (1,), **BF16), "cuda")
    backend = pagedkv.select_backend("mla", problem.spec)
    cache = backend.allocate_kv_cache(problem.num_blocks, problem.spec, "cuda")
    metadata = backend.make_builder(problem.spec, "cuda").build(problem.common)
    assert metadata.plan.kind == "gluon"
    q = problem.query
    (launch,) = backend.make_impl(problem.spec).plan_attention(
        q[..., :512], q[..., 512:], cache, metadata, q[..., :512].clone()
    )
    assert launch.kernel.fn.__name__ == "_mla_attention_sm90"


def test_a_query_tma_cannot_read_gives_the_same_output():
    """The Gluon kernel's query comes through TMA: a query part at an address or with
    row strides TMA cannot read is copied first, and the output is the same."""
    import pagedkv
    from pagedkv.conformance.problem import build_problem

    problem = build_problem(Scenario("x", (700, 90), (1, 3), **BF16), "cuda")
    backend = pagedkv.select_backend("mla", problem.spec)
    cache = backend.allocate_kv_cache(problem.num_blocks, problem.spec, "cuda")
    metadata = backend.make_builder(problem.spec, "cuda").build(problem.common)
    impl = backend.make_impl(problem.spec)
    q = problem.query
    torch.manual_seed(0)
    cache.normal_()
    expected = impl.forward_mla(q[..., :512], q[..., 512:], None, None, cache, metadata)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    shifted.copy_(q)  # 2 bytes past a 16-byte boundary
    wide = torch.zeros(*q.shape[:2], 580, dtype=q.dtype, device=q.device)[..., :576]
    wide.copy_(q)  # rows of 1160 bytes
    for query in (shifted, wide):
        out = impl.forward_mla(query[..., :512], query[..., 512:], None, None, cache, metadata)
        assert torch.equal(out, expected)
