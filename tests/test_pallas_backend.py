"""The Pallas backend in interpret mode (CPU) against the float64 reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pagedkv
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedkv import AttentionSpec, ConfigError, Feature, UnsupportedError
from pagedkv.conformance import Scenario, run_scenario

pytest.importorskip("jax")

from pagedkv.backends.pallas import interop, kernel
from pagedkv.backends.pallas.backend import jax_gpu_unavailable
from pagedkv.backends.pallas.builder import PallasMetadataBuilder, num_tiles_bound
from pagedkv.reference import reference_attention

BACKEND = pagedkv.get_backend("pallas")
MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))

# The conformance suite covers the features one by one; these add what is
# specific to this kernel: tiling edges, padded heads and groups, split-KV (forced,
# with fewer splits than the launch has slots, and chosen by the CPU SM stand-in).
SCENARIOS = [
    (Scenario("mixed-fp16-padded", **MIXED, num_padding_tokens=3), {}),
    (
        Scenario(
            "gqa5-fp32-head80",
            **MIXED,
            num_heads=10,
            num_kv_heads=2,
            head_size=80,
            dtype=torch.float32,
        ),
        {},
    ),
    (
        Scenario(
            "mqa-bf16-block5",
            seq_lens=(23, 9, 70),
            query_lens=(23, 1, 6),
            num_heads=8,
            num_kv_heads=1,
            dtype=torch.bfloat16,
            block_size=5,
        ),
        {},
    ),
    (
        Scenario(
            "split4-everything",
            **MIXED,
            sliding_window=20,
            logits_soft_cap=30.0,
            alibi=True,
            use_sinks=True,
            dtype=torch.float32,
        ),
        {"num_splits": 4, "block_n": 16},
    ),
    (
        Scenario(
            "split4-fp8-window-decode",
            seq_lens=(90, 130, 7),
            query_lens=(1, 1, 1),
            kv_cache_dtype="fp8_e4m3",
            k_scale=0.5,
            v_scale=2.0,
            sliding_window=50,
        ),
        # 130 keys in steps of 64: 3 splits, in a launch of 4 split slots
        {"num_splits": 4},
    ),
    (
        Scenario(
            "gqa8-long-decode-auto-split",
            seq_lens=(1100, 40),
            query_lens=(1, 1),
            num_heads=16,
            num_kv_heads=2,
            dtype=torch.float32,
            use_sinks=True,
        ),
        {},
    ),
    (
        Scenario(
            "noncausal-window-bm64-bn16",
            seq_lens=(30, 12),
            query_lens=(30, 12),
            causal=False,
            sliding_window=9,
        ),
        {"block_m": 64, "block_n": 16},
    ),
]


@pytest.mark.parametrize(("scenario", "options"), SCENARIOS, ids=[s.name for s, _ in SCENARIOS])
def test_matches_reference(scenario, options):
    backend = pagedkv.get_backend("pallas", **options)
    result = run_scenario(backend, scenario, "cpu", backend_label=f"pallas{options or ''}")
    assert result.passed, result.report()


def _problem(rng, seq_lens, query_lens, spec, num_blocks, width, num_tokens):
    """A random cache written through the backend, plus dense K/V for the reference."""
    perm = rng.permutation(np.arange(1, num_blocks))
    block_ids, taken = [], 0
    for s in seq_lens:
        n = -(-s // spec.block_size)
        block_ids.append(perm[taken : taken + n].tolist())
        taken += n
    keys = [torch.randn(s, spec.num_kv_heads, spec.head_size) for s in seq_lens]
    values = [torch.randn(s, spec.num_kv_heads, spec.head_size) for s in seq_lens]
    cache = BACKEND.allocate_kv_cache(num_blocks, spec, "cpu")
    builder = BACKEND.make_builder(spec, "cpu")
    impl = BACKEND.make_impl(spec)
    full = pagedkv.CommonAttentionMetadata.from_requests(
        seq_lens, seq_lens, block_ids, spec.block_size, max_blocks_per_req=width
    )
    impl.write_kv(torch.cat(keys), torch.cat(values), cache, builder.build(full))
    common = pagedkv.CommonAttentionMetadata.from_requests(
        seq_lens,
        query_lens,
        block_ids,
        spec.block_size,
        num_tokens=num_tokens,
        max_blocks_per_req=width,
    )
    query = torch.randn(num_tokens, spec.num_heads, spec.head_size)
    return cache, builder, impl, common, query, keys, values


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=4).map(
        lambda reqs: [(s, min(q, s)) for s, q in reqs]
    ),
    window=st.sampled_from([None, 1, 7]),
)
def test_random_batches_at_fixed_shapes_match_the_reference(batch, window):
    """Any mix of decode, prefill and empty requests, padded to fixed shapes (so the
    examples share a few compiled variants)."""
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float32,
        block_size=4,
        sliding_window=window,
    )
    seq_lens = [s for s, _ in batch] + [1] * (4 - len(batch))
    query_lens = [q for _, q in batch] + [0] * (4 - len(batch))
    rng = np.random.default_rng(len(batch))
    cache, builder, impl, common, query, keys, values = _problem(
        rng, seq_lens, query_lens, spec, num_blocks=48, width=10, num_tokens=160
    )
    out = impl.forward(query, None, None, cache, builder.build(common))
    n = sum(query_lens)
    want = reference_attention(query[:n], keys, values, query_lens, spec)
    torch.testing.assert_close(out[:n].double(), want, atol=2e-5, rtol=2e-5)


def test_second_step_of_same_shape_does_not_recompile():
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float16, block_size=8
    )
    rng = np.random.default_rng(0)
    sizes = dict(num_blocks=20, width=6, num_tokens=24)
    cache, builder, impl, common, query, *_ = _problem(rng, [30, 9], [20, 1], spec, **sizes)
    impl.forward(query.half(), None, None, cache, builder.build(common))
    compiled = kernel.jitted("interpret")._cache_size()
    cache, builder, impl, common, query, *_ = _problem(rng, [41, 3], [12, 3], spec, **sizes)
    impl.forward(query.half(), None, None, cache, builder.build(common))
    assert kernel.jitted("interpret")._cache_size() == compiled


def test_tiles_cover_every_query_row_once():
    spec = AttentionSpec(
        num_heads=12, num_kv_heads=4, head_size=16, dtype=torch.float16, block_size=16
    )
    builder = PallasMetadataBuilder(spec, "cpu")
    common = pagedkv.CommonAttentionMetadata.from_requests(
        [5, 40, 3, 70],
        [5, 33, 0, 1],
        [[1], [2, 3, 4], [5], [6, 7, 8, 9, 10]],
        16,
        num_tokens=45,
    )
    md = builder.build(common)
    # group 3 pads to 4; the batch has prefill, so tiles are 64 rows = 16 tokens
    assert md.block_q == 16
    req, qstart = np.asarray(md.arrays.tile_req), np.asarray(md.arrays.tile_qstart)
    covered = []
    for r, q0 in zip(req[req >= 0], qstart[req >= 0], strict=True):
        q_len = [5, 33, 0, 1][r]
        covered += [(int(r), j) for j in range(q0, min(q0 + md.block_q, q_len))]
    assert sorted(covered) == [(r, j) for r, q in enumerate([5, 33, 0, 1]) for j in range(q)]
    assert len(req) == num_tiles_bound(45, 4, 16)


def test_declares_exactly_what_it_runs():
    caps = BACKEND.capabilities
    assert caps.features == {
        Feature.SLIDING_WINDOW,
        Feature.LOGITS_SOFT_CAP,
        Feature.ALIBI,
        Feature.SINKS,
        Feature.NON_CAUSAL,
        Feature.FP8_KV,
    }
    # `auto` tries torch first: interpret mode on a CPU is slower than plain torch
    assert BACKEND.priority < pagedkv.get_backend("torch").priority
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float16, block_size=16
    )
    assert pagedkv.select_backend("pallas,torch", spec, "cpu").name == "pallas"


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
    reasons = BACKEND.validate(mla)
    assert "MLA layers (kv_lora_rank set) are not supported by pallas" in reasons
    assert any("head_size 576 not supported by pallas" in r for r in reasons)
    big = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=512, dtype=torch.float16, block_size=16
    )
    assert BACKEND.validate(big) == [
        "head_size 512 not supported by pallas (supports multiple of 1 in [1, 256])"
    ]
    spec = big.replace(head_size=64)
    assert BACKEND.validate(spec, device="mps") == [
        "device mps not supported by pallas (supports cpu, cuda)"
    ]
    with pytest.raises(UnsupportedError, match="cannot run this layer"):
        BACKEND.make_impl(mla)


def test_cuda_without_a_jax_gpu_backend_is_refused_with_the_reason():
    if jax_gpu_unavailable() is None:
        pytest.skip("this JAX has a GPU backend")
    spec = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=64, dtype=torch.float16, block_size=16
    )
    (reason,) = BACKEND.validate(spec, device="cuda")
    assert reason.startswith("no JAX GPU backend for CUDA tensors")


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="block_n=48: expected a power of two >= 16"):
        pagedkv.get_backend("pallas", block_n=48)
    with pytest.raises(ConfigError, match="block_m=8: expected a power of two >= 16"):
        pagedkv.get_backend("pallas", block_m=8)
    with pytest.raises(ConfigError, match=r"num_splits=-1: expected 0 to 64"):
        pagedkv.get_backend("pallas", num_splits=-1)
    with pytest.raises(ConfigError, match="num_splits=65: expected 0"):
        pagedkv.get_backend("pallas", num_splits=65)
    with pytest.raises(ConfigError, match="unknown option"):
        pagedkv.get_backend("pallas", interpret=True)


def test_forward_names_the_bad_argument():
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float16, block_size=4
    )
    md = BACKEND.make_builder(spec, "cpu").build(
        pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[1]], 4)
    )
    impl = BACKEND.make_impl(spec)
    q = torch.randn(3, 4, 16).half()
    cache = BACKEND.allocate_kv_cache(2, spec, "cpu")
    with pytest.raises(
        UnsupportedError,
        match=r"kv_cache: expected the interleaved_heads layout \[num_blocks, 4, 4, 16\]",
    ):
        impl.forward(q, None, None, cache[:, :, :2], md)
    with pytest.raises(UnsupportedError, match="kv_cache: expected dtype torch.float16"):
        impl.forward(q, None, None, cache.float(), md)
    with pytest.raises(UnsupportedError, match=r"query: expected shape \[3, 4, 16\]"):
        impl.forward(q[:2], None, None, cache, md)
    with pytest.raises(UnsupportedError, match="kv_cache: expected a contiguous tensor"):
        impl.forward(q, None, None, torch.zeros(4, 4, 4, 16).half()[::2], md)


def test_output_argument_is_filled_in_the_callers_dtype():
    spec = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.bfloat16, block_size=4
    )
    md = BACKEND.make_builder(spec, "cpu").build(
        pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[1]], 4)
    )
    impl = BACKEND.make_impl(spec)
    cache = BACKEND.allocate_kv_cache(2, spec, "cpu")
    kv = torch.randn(3, 1, 16).bfloat16()
    output = torch.empty(3, 2, 16, dtype=torch.bfloat16)
    returned = impl.forward(torch.randn(3, 2, 16).bfloat16(), kv, kv, cache, md, output=output)
    assert returned is output and output.dtype == torch.bfloat16
    # the first token sees only itself: its output is its own value row
    torch.testing.assert_close(output[0], kv[0].expand(2, 16), atol=0, rtol=0)


def test_missing_jax_is_the_reason_it_is_unavailable(monkeypatch):
    import importlib.util

    from pagedkv.backends.pallas import backend as module

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a)
    )
    assert module.jax_missing.__wrapped__() == "jax is not installed (pip install 'pagedkv[jax]')"


@pytest.mark.parametrize(
    ("num_reqs", "context", "splits"), [(64, 4096, 1), (4, 32768, 16), (1, 32768, 64), (8, 300, 1)]
)
def test_kv_splits_fill_the_gpu_only_when_few_long_requests_decode(num_reqs, context, splits):
    spec = AttentionSpec(
        num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
    )
    builder = PallasMetadataBuilder(spec, "cpu")
    builder.num_sms = 132  # as on an H200, without one
    common = pagedkv.CommonAttentionMetadata.from_requests(
        [context] * num_reqs, [1] * num_reqs, [[0] * -(-context // 16)] * num_reqs, 16
    )
    md = builder.build(common)
    assert (md.num_splits, md.split_slots) == (splits, splits)
    assert np.asarray(md.arrays.split_steps).tolist() == [-(-context // 64 // splits)]


def test_short_tiles_take_fewer_key_ranges_than_the_longest():
    """A tile takes as many ranges as ranges of the step's length take: beside a long
    decode, a short one and a chunk's early tiles take fewer programs, whose slots past
    their ranges only mark their rows empty (log-sum-exp -inf: no partial written, none
    merged), and the merged result equals the unsplit one (interpret mode)."""
    import jax.numpy as jnp

    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16
    )
    backend = pagedkv.get_backend("pallas", num_splits=4, block_n=16)
    seq_lens, query_lens = [256, 20, 70], [1, 1, 40]
    ids = [list(range(1 + i * 16, 1 + i * 16 + -(-n // 16))) for i, n in enumerate(seq_lens)]
    common = pagedkv.CommonAttentionMetadata.from_requests(seq_lens, query_lens, ids, 16, "cpu")
    md = backend.make_builder(spec, "cpu").build(common)
    # 256 keys in 4 ranges of 4 steps (16 keys each)
    assert (md.num_splits, md.split_slots, md.split_steps) == (4, 4, 4)
    cache = backend.allocate_kv_cache(1 + 3 * 16, spec, "cpu")
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
    query = torch.randn(42, 4, 32, generator=torch.Generator().manual_seed(1))
    impl = backend.make_impl(spec)
    zeros = jnp.zeros(4, jnp.float32)
    _, lse = kernel.kernel_call(
        jnp.asarray(query.numpy()), jnp.asarray(cache.numpy()), md.arrays, zeros, zeros,
        cfg=impl._config(md),
    )  # fmt: skip
    finite = np.isfinite(np.asarray(lse)[:42]).all(axis=2)  # [tokens, slots]
    ranges = finite.sum(axis=1)
    # the long decode: 16 steps in 4 ranges; the short one: 2 steps, one range; the
    # chunk's rows see 30 + their position + 1 keys: 2 to 5 steps, one or two ranges
    assert ranges[0] == 4 and ranges[1] == 1
    assert set(ranges[2:].tolist()) == {1, 2}
    assert finite[:, 0].all() and not finite[1, 1:].any()
    out = impl.forward(query, None, None, cache, md)
    unsplit = pagedkv.get_backend("pallas", num_splits=1, block_n=16)
    alone = unsplit.make_impl(spec).forward(
        query, None, None, cache, unsplit.make_builder(spec, "cpu").build(common)
    )
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
    # ranges too short for the slots (a host count of steps short of the kernel's):
    # the last slot takes the rest, no key is dropped
    short = dataclasses.replace(md, arrays=md.arrays._replace(split_steps=jnp.ones(1, jnp.int32)))
    out = impl.forward(query, None, None, cache, short)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


def test_a_ragged_batch_splits_its_critical_path():
    """Many short decodes beside one long one: the grid is full, but the long request is
    its critical path; the makespan rule splits (the earlier rule, which counted programs
    only, did not: 945 us against 277 on the H200's GQA 8 row, docs/benchmarks.md)."""
    spec = AttentionSpec(
        num_heads=64, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
    )
    builder = PallasMetadataBuilder(spec, "cpu")
    builder.num_sms = 132
    seq_lens = [1000] * 63 + [32768]
    common = pagedkv.CommonAttentionMetadata.from_requests(
        seq_lens, [1] * 64, [[0] * -(-n // 16) for n in seq_lens], 16
    )
    md = builder.build(common)
    assert md.num_splits >= 8 and 32768 / md.num_splits <= 4096, md.num_splits


def test_split_count_is_chosen_on_cpu_and_launched_in_power_of_two_slots():
    """The CPU stand-in for the SM count splits few long decodes (so CI runs the split
    path); a forced count is kept whole when every split gets keys, and launched in
    the next power of two of programs."""
    spec = AttentionSpec(
        num_heads=16, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=16
    )
    builder = PallasMetadataBuilder(spec, "cpu")
    long_decode = pagedkv.CommonAttentionMetadata.from_requests(
        [1100, 40], [1, 1], [list(range(1, 70)), [70, 71, 72]], 16
    )
    md = builder.build(long_decode)
    # fixed ranges of 512 keys (the longest program 512 keys, where two even shares
    # take 576): three for the long request, launched in four slots
    assert (md.num_splits, md.split_slots, md.split_steps) == (3, 4, 8)
    md = builder.build(long_decode, num_splits=5)
    assert (md.num_splits, md.split_slots) == (5, 8)
    # ranges of 4 steps (64 keys each): 1100 keys in 5 ranges, 40 keys in one
    assert np.asarray(md.arrays.split_steps).tolist() == [4]
    # a prefill batch does not split unless forced
    prefill = pagedkv.CommonAttentionMetadata.from_requests(
        [1100], [1100], [list(range(1, 70))], 16
    )
    assert builder.build(prefill).num_splits == 1
    with pytest.raises(ConfigError, match=r"build\(num_splits\)=99: expected 0"):
        builder.build(long_decode, num_splits=99)
    with pytest.raises(ConfigError, match="unknown override"):
        builder.build(long_decode, tile=3)


def test_jax_is_told_not_to_preallocate_unless_the_user_chose(monkeypatch):
    """Set where the backend first uses JAX (not at import); it leaves the user's own
    choice alone."""
    import jax

    option = "jax_pjrt_client_create_options"
    before = getattr(jax.config, option)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    try:
        jax.config.update(option, "collective_memory_size:0")
        interop.configure_jax.__wrapped__()
        assert getattr(jax.config, option) == {"collective_memory_size": "0", "preallocate": False}
        jax.config.update(option, {"preallocate": True})
        interop.configure_jax.__wrapped__()
        assert getattr(jax.config, option) == {"preallocate": True}
        jax.config.update(option, None)
        monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
        interop.configure_jax.__wrapped__()
        assert getattr(jax.config, option) is None
    finally:
        jax.config.update(option, before)
