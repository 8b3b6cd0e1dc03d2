"""The torch backend against the float64 reference, on shuffled physical blocks."""

from __future__ import annotations

import dataclasses

import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec, UnsupportedError
from pagedkv.conformance import Scenario, run_scenario

BACKEND = pagedkv.get_backend("torch")

MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
SCENARIOS = [
    Scenario("mixed-fp16", **MIXED, num_padding_tokens=3),
    Scenario("mixed-fp32-gqa5", **MIXED, num_heads=10, num_kv_heads=2, dtype=torch.float32),
    Scenario("mqa-bf16", **MIXED, num_heads=8, num_kv_heads=1, dtype=torch.bfloat16, head_size=128),
    Scenario("prefill-block5", seq_lens=(23, 9), query_lens=(23, 9), block_size=5),
    Scenario("window-smaller-than-block", **MIXED, sliding_window=5),
    Scenario("softcap", **MIXED, logits_soft_cap=5.0),
    Scenario("alibi", **MIXED, alibi=True),
    Scenario("sinks", **MIXED, use_sinks=True),
    Scenario(
        "non-causal-window", seq_lens=(30, 12), query_lens=(30, 12), causal=False, sliding_window=9
    ),
    Scenario("fp8-e4m3", **MIXED, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario("fp8-e5m2", **MIXED, kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=1.5),
    Scenario(
        "everything",
        **MIXED,
        sliding_window=20,
        logits_soft_cap=30.0,
        alibi=True,
        use_sinks=True,
        dtype=torch.float32,
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_reference(scenario):
    result = run_scenario(BACKEND, scenario, "cpu", backend_label="torch")
    assert result.passed, result.report()


def test_write_skips_negative_slots():
    spec = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=8, dtype=torch.float32, block_size=4
    )
    cache = BACKEND.allocate_kv_cache(3, spec, "cpu")
    md = pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[2]], 4, num_tokens=5)
    impl = BACKEND.make_impl(spec)
    key, value = torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    impl.write_kv(key, value, cache, BACKEND.make_builder(spec, "cpu").build(md))
    assert torch.equal(cache[0, 2, :3], key[:3]) and torch.equal(cache[1, 2, :3], value[:3])
    assert cache[:, :2].abs().sum() == 0 and cache[:, 2, 3].abs().sum() == 0


def test_copy_blocks_copies_exactly_the_named_blocks():
    spec = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=8, dtype=torch.float16, block_size=4
    )
    cache = torch.randn(BACKEND.get_kv_cache_shape(6, 4, 1, 8)).half()
    before = cache.clone()
    BACKEND.copy_blocks(cache, torch.tensor([1, 4]), torch.tensor([4, 5]))
    assert torch.equal(cache[:, 4], before[:, 1]) and torch.equal(cache[:, 5], before[:, 4])
    assert torch.equal(cache[:, :4], before[:, :4])
    k, _v = BACKEND.kv_cache_to_logical(cache, spec)
    assert k.data_ptr() == cache.data_ptr() and k.shape == (6, 4, 1, 8)


def test_rejections_carry_reasons():
    mla = AttentionSpec(
        num_heads=4,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.float16,
        block_size=16,
        scale=0.07,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    )
    assert BACKEND.validate(mla) == ["MLA layers (kv_lora_rank set) are not supported by torch"]
    odd_v = AttentionSpec(
        num_heads=4,
        num_kv_heads=1,
        head_size=64,
        head_size_v=32,
        dtype=torch.float16,
        block_size=16,
    )
    assert "head_size_v 32 != head_size 64" in BACKEND.validate(odd_v)[0]
    assert BACKEND.validate(odd_v.replace(head_size_v=64), device="mps") == [
        "device mps not supported by torch (supports cpu, cuda)"
    ]
    with pytest.raises(UnsupportedError, match="cannot run this layer"):
        BACKEND.make_impl(mla)


def test_forward_argument_errors_name_the_argument():
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float16, block_size=4
    )
    md = BACKEND.make_builder(spec, "cpu").build(
        pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[1]], 4)
    )
    cache = BACKEND.allocate_kv_cache(2, spec, "cpu")
    impl = BACKEND.make_impl(spec)
    q = torch.randn(3, 4, 16).half()
    kv = torch.randn(3, 2, 16).half()
    with pytest.raises(
        UnsupportedError, match=r"query: expected shape \[3, 4, 16\], got \[3, 2, 16\]"
    ):
        impl.forward(kv, kv, kv, cache, md)
    with pytest.raises(
        UnsupportedError, match="key: expected dtype torch.float16, got torch.float32"
    ):
        impl.forward(q, kv.float(), kv, cache, md)
    with pytest.raises(UnsupportedError, match="key and value must be given together"):
        impl.forward(q, kv, None, cache, md)
    # compiled kernels take bare addresses: a tensor elsewhere is refused by name
    elsewhere = torch.empty(3, 4, 16, dtype=torch.float16, device="meta")
    with pytest.raises(UnsupportedError, match="output: expected a tensor on cpu .* got meta"):
        impl.forward(q, None, None, cache, md, elsewhere)
    with pytest.raises(UnsupportedError, match="value: expected a tensor on cpu .* got meta"):
        impl.forward(q, kv, kv.to("meta"), cache, md)
    meta_md = dataclasses.replace(
        md, common=pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[1]], 4, "meta")
    )
    with pytest.raises(UnsupportedError, match="metadata: built for meta, but the query is on cpu"):
        impl.forward(q, None, None, cache, meta_md)
    with pytest.raises(UnsupportedError, match="sinks were given but spec.use_sinks is False"):
        BACKEND.make_impl(spec, sinks=torch.zeros(4))
    with pytest.raises(UnsupportedError, match="spec.use_sinks is set"):
        BACKEND.make_impl(spec.replace(use_sinks=True))
