"""The MLA backend against the un-absorbed float64 reference, on shuffled blocks.

On a CPU the Triton kernels run under the interpreter (float16/float32 only); on a
GPU the same tests run compiled, bf16 included.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pagedkv
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import AttentionSpec, UnsupportedError
from pagedkv.backends.mla import MLABackend, absorb_query, mla_attention, up_project
from pagedkv.backends.mla.configs import SPLIT_POLICY, choose_config
from pagedkv.backends.mla.plan import tile_table
from pagedkv.backends.mla.work import choose_ranges, tile_keys, work_list
from pagedkv.conformance import TOLERANCES, Scenario, run_scenario
from pagedkv.conformance.problem import build_problem, poison_cache, reference_output

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    # Triton decorates its own helpers (tl.zeros, ...) and our kernels when first
    # imported: the interpreter must be on before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    if not CUDA:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            pytest.skip(
                "triton was imported before TRITON_INTERPRET=1 was set: run these tests "
                "with TRITON_INTERPRET=1 in the environment"
            )


SMALL = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))

# (config string, scenario): every kernel path the CPU can run
CASES = [
    ("mla", Scenario("mixed-padded", **MIXED, **SMALL, num_padding_tokens=3)),
    ("mla", Scenario("mixed-fp32", **MIXED, **SMALL, dtype=torch.float32)),
    ("mla(num_splits=3)", Scenario("split-kv-reduce", **MIXED, **SMALL)),
    ("mla(use_tma=false)", Scenario("pointer-loads", **MIXED, **SMALL, num_padding_tokens=2)),
    ("mla(lazy_rescale=true)", Scenario("lazy-rescale", **MIXED, **SMALL)),
    # a 32-row tile spans two 16-slot blocks: per-row block-table gather
    ("mla(block_n=32)", Scenario("tile-spans-blocks", **MIXED, **SMALL, block_size=16)),
    ("mla", Scenario("block-48", **MIXED, **SMALL, block_size=48)),
    # 32 heads: one token's heads span two 16-row tiles
    (
        "mla(num_splits=2)",
        Scenario("heads-32", seq_lens=(50, 3), query_lens=(1, 3), num_heads=32, **SMALL),
    ),
    (
        "mla",
        Scenario(
            "non-pow2-dims",
            **MIXED,
            kv_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=24,
        ),
    ),
    (
        "mla",
        Scenario(
            "no-rope",
            seq_lens=(20, 9),
            query_lens=(4, 9),
            kv_lora_rank=32,
            qk_rope_head_dim=0,
            qk_nope_head_dim=16,
            v_head_dim=16,
        ),
    ),
    ("mla", Scenario("non-causal", seq_lens=(30, 12), query_lens=(30, 12), causal=False, **SMALL)),
    ("mla", Scenario("fp8-e4m3", **MIXED, **SMALL, kv_cache_dtype="fp8_e4m3", k_scale=0.5)),
    ("mla", Scenario("fp8-e5m2", **MIXED, **SMALL, kv_cache_dtype="fp8_e5m2", k_scale=0.25)),
    (
        "mla(num_splits=2)",
        Scenario(
            "fp8-split",
            seq_lens=(70, 9),
            query_lens=(1, 2),
            **SMALL,
            kv_cache_dtype="fp8_e4m3",
            k_scale=2.0,
        ),
    ),
    # the makespan rule cuts the long request into key ranges, the others write directly
    (
        "mla",
        Scenario(
            "ragged-ranges",
            seq_lens=(1500, 9, 20, 12, 7),
            query_lens=(1, 1, 2, 1, 3),
            **SMALL,
            num_padding_tokens=2,
        ),
    ),
    # a causal chunk after a long context: every token's partials for each range
    ("mla", Scenario("chunk-ranges", seq_lens=(1200, 5, 30), query_lens=(6, 1, 2), **SMALL)),
    (
        "mla",
        Scenario(
            "deepseek-dims",
            seq_lens=(70, 9),
            query_lens=(1, 3),
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            num_heads=16,
            block_size=64,
        ),
    ),
]
if CUDA:
    CASES += [
        ("mla", s.replace(name=s.name + "-bf16", dtype=torch.bfloat16))
        for _, s in CASES
        if s.dtype == torch.float16
    ]


@pytest.mark.parametrize(("config", "scenario"), CASES, ids=[s.name for _, s in CASES])
def test_matches_unabsorbed_reference(config, scenario):
    result = pagedkv.conformance.reproduce(config, scenario, DEVICE)
    assert result.passed, result.report()


# -- the harness catches scale and absorption bugs ---------------------------------------


class _WrongScale(MLABackend):
    """Scales scores by the latent width, the classic MLA bug."""

    def make_impl(self, spec, *, sinks=None):
        return super().make_impl(spec.replace(scale=spec.head_size**-0.5), sinks=sinks)


def test_a_scale_from_the_latent_width_fails():
    scenario = Scenario("wrong-scale", **MIXED, **SMALL)
    assert run_scenario(MLABackend(), scenario, DEVICE).passed
    result = run_scenario(_WrongScale(), scenario, DEVICE)
    assert not result.passed
    assert "differs from the float64 reference" in str(result.failures[0])


def _model_level(dtype, w_uk_transform=lambda w: w):
    """A model's layer through absorb_query / forward_mla / up_project against the
    un-absorbed reference. Returns (max error, allowed error) on the scheduled rows."""
    scenario = Scenario(
        "model-level", seq_lens=(40, 9, 23), query_lens=(1, 9, 6), dtype=dtype, **SMALL
    )
    backend = MLABackend()
    problem = build_problem(scenario, DEVICE)
    spec, w = problem.spec, problem.mla_weights
    lora = spec.kv_lora_rank
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, DEVICE)
    poison_cache(backend, cache, problem)
    builder, impl = backend.make_builder(spec, DEVICE), backend.make_impl(spec)
    context = torch.cat(
        [k[: s - q] for k, s, q in zip(problem.keys, scenario.seq_lens, scenario.query_lens)]
    ).to(DEVICE)
    impl.write_kv(context, None, cache, builder.build(problem.context))
    new = problem.new_key[:, 0]
    out = mla_attention(
        impl,
        w["q_nope"].to(DEVICE),
        w["q_pe"].to(DEVICE),
        new[:, :lora],
        new[:, lora:],
        w_uk_transform(w["w_uk"]).to(DEVICE),
        w["w_uv"].to(DEVICE),
        cache,
        builder.build(problem.common),
    )
    expected = reference_output(problem)
    n = problem.common.num_actual_tokens
    err = (out[:n].double().cpu() - expected).abs()
    tol = TOLERANCES[dtype]
    return float((err - tol.rtol * expected.abs()).max()), tol.atol


def test_model_level_helpers_match_the_unabsorbed_reference():
    excess, atol = _model_level(torch.float32)
    assert excess <= atol


def test_a_wrong_absorption_fails():
    # heads' W_UK swapped: every shape still fits, only the maths is wrong
    excess, atol = _model_level(torch.float32, lambda w: w.roll(1, dims=1))
    assert excess > 10 * atol


def test_absorb_and_up_project_are_the_per_head_matmuls():
    g = torch.Generator().manual_seed(0)
    q_nope = torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
    w_uk = torch.randn(16, 3, 8, generator=g, dtype=torch.float64)
    w_uv = torch.randn(16, 3, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        absorb_query(q_nope, w_uk), torch.einsum("thp,lhp->thl", q_nope, w_uk)
    )
    o = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(up_project(o, w_uv), torch.einsum("thl,lhv->thv", o, w_uv))
    with pytest.raises(UnsupportedError, match="w_uk: expected"):
        absorb_query(q_nope, w_uk.transpose(0, 1))
    with pytest.raises(UnsupportedError, match="w_uv: expected"):
        up_project(o, w_uv[:8])


# -- parts, writes and arguments ---------------------------------------------------------


def _spec(dtype=torch.float16, **changes):
    fields = dict(
        num_heads=4,
        num_kv_heads=1,
        head_size=80,
        dtype=dtype,
        block_size=16,
        scale=0.2,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
    )
    fields.update(changes)
    return AttentionSpec(**fields)


def _step(
    spec, seq_lens=(20, 7), query_lens=(3, 7), blocks=((2, 4), (1,)), num_tokens=None, **options
):
    common = pagedkv.CommonAttentionMetadata.from_requests(
        seq_lens, query_lens, blocks, spec.block_size, DEVICE, num_tokens=num_tokens
    )
    backend = MLABackend(**options)
    return backend, backend.make_builder(spec, DEVICE).build(common), backend.make_impl(spec)


def test_forward_mla_parts_equal_forward_concat_and_fill_output():
    spec = _spec()
    backend, md, impl = _step(spec, num_tokens=12)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 4, 80, generator=g).half().to(DEVICE)
    latent = torch.randn(12, 1, 80, generator=g).half().to(DEVICE)
    cache_a = backend.allocate_kv_cache(6, spec, DEVICE)
    cache_b = backend.allocate_kv_cache(6, spec, DEVICE)
    ctx = torch.randn(12, 1, 80, generator=g).half().to(DEVICE)
    ctx_md = backend.make_builder(spec, DEVICE).build(
        pagedkv.CommonAttentionMetadata.from_requests(
            [17], [17], [(2, 4)], 16, DEVICE, num_tokens=17
        )
    )
    for cache in (cache_a, cache_b):
        impl.write_kv(torch.cat([ctx, ctx[:5]]), None, cache, ctx_md)
    a = impl.forward(q, latent, None, cache_a, md)
    out = torch.full((12, 4, 64), 5.0, dtype=torch.float16, device=DEVICE)
    b = impl.forward_mla(
        q[..., :64], q[..., 64:], latent[:, 0, :64], latent[:, :, 64:], cache_b, md, out
    )
    assert b is out
    assert torch.equal(a[:10], b[:10]) and torch.equal(cache_a, cache_b)
    assert bool((b[10:] == 0).all())  # padded rows: zero, not stale
    assert torch.isfinite(a[:10]).all()


def test_write_skips_negative_slots_and_keeps_other_slots():
    spec = _spec()
    backend, md, impl = _step(spec, seq_lens=(3,), query_lens=(3,), blocks=((2,),), num_tokens=5)
    cache = backend.allocate_kv_cache(3, spec, DEVICE)
    kv_c = torch.randn(5, 64).half().to(DEVICE)
    k_pe = torch.randn(5, 16).half().to(DEVICE)
    impl.write_latent(kv_c, k_pe, cache, md)
    assert torch.equal(cache[2, :3], torch.cat([kv_c, k_pe], 1)[:3])
    assert cache[:2].abs().sum() == 0 and cache[2, 3:].abs().sum() == 0


@pytest.mark.parametrize("use_triton", [None, True], ids=["default", "triton"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "auto"])
def test_write_matches_the_portable_quantisation(kv_cache_dtype, use_triton):
    """The latent write in one launch of the shared writer (kv_c and k_pe into the two
    parts of the row, one scale) stores what quantize_for_cache gives the whole row."""
    from pagedkv.toolkit.kv_write import quantize_for_cache

    spec = _spec(kv_cache_dtype=kv_cache_dtype, k_scale=0.37)
    backend, md, impl = _step(spec, seq_lens=(40,), query_lens=(40,), blocks=((1, 3, 2),))
    g = torch.Generator().manual_seed(2)
    latent = (torch.randn(40, 80, generator=g) * torch.logspace(-4, 2, 80)).half().to(DEVICE)
    cache = backend.allocate_kv_cache(4, spec, DEVICE)
    impl.write_latent(latent[:, :64], latent[:, 64:], cache, md, use_triton=use_triton)
    got = cache[[1, 3, 2]].flatten(0, 1)[:40]
    want = quantize_for_cache(latent, spec.cache_dtype, 0.37)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # the same bits
    assert cache[0].float().abs().sum() == 0 and cache[2, 8:].float().abs().sum() == 0


@pytest.mark.parametrize("use_triton", [None, True], ids=["default", "triton"])
def test_write_without_rope_part(use_triton):
    spec = _spec(head_size=64, qk_rope_head_dim=0)
    backend, md, impl = _step(spec, seq_lens=(3,), query_lens=(3,), blocks=((1,),))
    cache = backend.allocate_kv_cache(2, spec, DEVICE)
    kv_c = torch.randn(3, 64).half().to(DEVICE)
    impl.write_latent(kv_c, kv_c[:, :0], cache, md, use_triton=use_triton)
    assert torch.equal(cache[1, :3], kv_c) and cache[1, 3:].abs().sum() == 0


def test_a_misaligned_cache_falls_back_to_pointer_loads():
    spec = _spec()
    # TMA tiles within a block of 16 rows (the interpreter runs TMA loads too; a GPU's
    # table row may take wider tiles, through pointers)
    _, md, impl = _step(spec, use_tma=True, block_n=16)
    assert md.plan.kind == "tma"
    g = torch.Generator().manual_seed(3)
    aligned = torch.randn(6, 16, 80, generator=g).half().to(DEVICE)
    storage = torch.empty(aligned.numel() + 1, dtype=torch.float16, device=DEVICE)
    misaligned = storage[1:].view(6, 16, 80)  # 2 bytes past a 16-byte boundary
    misaligned.copy_(aligned)
    q = torch.randn(10, 4, 80, generator=g).half().to(DEVICE)
    out = impl.forward_mla(q[..., :64], q[..., 64:], None, None, misaligned, md)
    (launch,) = impl.plan_attention(q[..., :64], q[..., 64:], misaligned, md, out)
    assert not launch.kwargs["USE_TMA"] and launch.kwargs["Cache"] is misaligned
    expected = impl.forward_mla(q[..., :64], q[..., 64:], None, None, aligned, md)
    assert torch.equal(out, expected)


def test_argument_errors_name_the_argument():
    spec = _spec()
    backend, md, impl = _step(spec)
    cache = backend.allocate_kv_cache(6, spec, DEVICE)
    q = torch.zeros(10, 4, 80, dtype=torch.float16, device=DEVICE)
    with pytest.raises(UnsupportedError, match=r"query: expected shape \[10, 4, 80\]"):
        impl.forward(q[:, :, :64], None, None, cache, md)
    with pytest.raises(UnsupportedError, match="value must be None"):
        impl.forward(q, q[:, :1], q[:, :1], cache, md)
    with pytest.raises(UnsupportedError, match="q_nope: expected dtype"):
        impl.forward_mla(q[..., :64].float(), q[..., 64:], None, None, cache, md)
    with pytest.raises(UnsupportedError, match="kv_c and k_pe must be given together"):
        impl.forward_mla(q[..., :64], q[..., 64:], q[:, 0, :64], None, cache, md)
    with pytest.raises(UnsupportedError, match=r"kv_c: expected shape \[10, 64\]"):
        impl.forward_mla(q[..., :64], q[..., 64:], q[:, 0, :32], q[:, 0, 64:], cache, md)
    with pytest.raises(UnsupportedError, match=r"k_pe: expected shape \[10, 16\]"):
        impl.write_latent(q[:, 0, :64], q[:, 0, :8], cache, md)
    with pytest.raises(
        UnsupportedError, match=r"kv_cache: expected the latent layout \[num_blocks, 16, 80\]"
    ):
        impl.forward(q, None, None, cache.view(6, 8, 160), md)
    with pytest.raises(UnsupportedError, match="kv_cache: expected dtype"):
        impl.forward(q, None, None, cache.float(), md)


def test_rejections_carry_reasons():
    backend = MLABackend()
    assert backend.validate(_spec()) == []
    standard = AttentionSpec(
        num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float16, block_size=16
    )
    assert backend.validate(standard) == [
        "mla runs MLA layers only (kv_lora_rank and qk_rope_head_dim unset)"
    ]
    big = _spec(head_size=1024 + 64, kv_lora_rank=1024, qk_rope_head_dim=64)
    assert any("kv_lora_rank 1024 not supported by mla" in r for r in backend.validate(big))
    assert any("block_size 8" in r for r in backend.validate(_spec(block_size=8)))
    bf16 = _spec(dtype=torch.bfloat16)
    assert backend.validate(bf16) == []
    assert "bfloat16 is not supported by mla on a CPU" in backend.validate(bf16, "cpu")[0]
    with pytest.raises(pagedkv.ConfigError, match="block_m"):
        MLABackend(block_m=24)


@pytest.mark.skipif(CUDA, reason="the interpreter's bf16 limitation is CPU-only")
def test_bf16_under_the_interpreter_is_refused():
    from pagedkv.backends.mla.builder import MLAMetadataBuilder

    spec = _spec(dtype=torch.bfloat16)
    backend = MLABackend()
    with pytest.raises(UnsupportedError, match="bfloat16 is not supported by mla on a CPU"):
        backend.make_builder(spec, "cpu")
    # make_impl does not know the device: forward refuses too
    common = pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[1]], 16)
    md = MLAMetadataBuilder(spec, "cpu").build(common)
    impl = backend.make_impl(spec)
    cache = backend.allocate_kv_cache(2, spec, "cpu")
    q = torch.zeros(3, 4, 80, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="bfloat16 is not supported under the Triton"):
        impl.forward(q, None, None, cache, md)


def test_layout_views_share_the_cache():
    spec = _spec()
    backend = MLABackend()
    cache = backend.allocate_kv_cache(5, spec, "cpu")
    assert cache.shape == (5, 16, 80) and backend.get_kv_cache_shape(5, 16, 1, 80) == (5, 16, 80)
    k, v = backend.kv_cache_to_logical(cache, spec)
    assert k.shape == (5, 16, 1, 80) and v.shape == (5, 16, 1, 64)
    k[1, 2, 0, 70] = 3.0
    v[4, 0, 0, 5] = 2.0
    assert cache[1, 2, 70] == 3.0 and cache[4, 0, 5] == 2.0
    backend.copy_blocks(cache, torch.tensor([1, 4]), torch.tensor([4, 1]))
    assert cache[4, 2, 70] == 3.0 and cache[1, 0, 5] == 2.0


def test_registered_and_selected_for_mla_layers():
    assert isinstance(pagedkv.get_backend("mla"), MLABackend)
    assert pagedkv.select_backend("mla,torch", _spec(), DEVICE).name == "mla"


# -- planning ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forced", "max_kv_len"), [(3, 4096), (64, 32768), (5, 1), (7, 700), (64, 50), (2, 200)]
)
def test_forced_splits_cover_the_longest_tile_without_empty_splits(forced, max_kv_len):
    # the num_splits option (the rule's own ranges: choose_ranges, below)
    choice = SPLIT_POLICY.choose(4, 1, max_kv_len, 132, forced=forced, granule=64)
    splits, per_split = choice.num_splits, choice.keys_per_split
    assert per_split % 64 == 0 and splits <= forced
    assert splits * per_split >= max_kv_len > (splits - 1) * per_split


def _h200_ranges(seq_lens, heads=128):
    seq = np.asarray(seq_lens)
    q = np.ones_like(seq)
    tiles = tile_table(q, heads, 64)
    keys = tile_keys(tiles, q, seq, heads, 64, causal=False)
    choice = choose_ranges(keys, 132, 64, len(seq) * heads * 513 * 4, 576 * 2)
    return choice, work_list(tiles, q, seq, choice.keys_per_split, len(seq))


@pytest.mark.parametrize(
    ("batch", "context", "keys", "items"),
    [(64, 4096, 4096, 128), (256, 1024, 1024, 512), (4, 32768, 2048, 128), (1, 32768, 512, 128)],
)
def test_uniform_decodes_on_an_h200_fill_one_wave_or_stay_whole(batch, context, keys, items):
    # 128 heads: two 64-row tiles a request; one program per SM
    choice, work = _h200_ranges([context] * batch)
    assert choice.keys_per_split == keys and work.items.shape[1] == items


def test_a_ragged_batch_cuts_only_its_long_requests():
    seq = [1000] * 200 + [9000, 600]
    choice, work = _h200_ranges(seq)
    keys = choice.keys_per_split
    assert 1000 <= keys < 9000 and work.num_splits == -(-9000 // keys)
    ranges = work.token_ranges[0]
    assert (ranges[:200] == 1).all() and ranges[200] == work.num_splits
    assert work.num_partials == work.num_splits  # one token's slots
    assert work.merges.tolist() == [200]  # the reduction's list: that token alone
    # every tile's ranges once, the full ranges first (longest first)
    tiles = tile_table(np.ones(len(seq), dtype=np.int64), 128, 64)
    assert (work.items[3] == keys).all()  # each item's range length
    listed = sorted(zip(*work.items[:3].tolist()))
    expected = sorted((r, row, s) for r, row in zip(*tiles.tolist()) for s in
                      range(-(-seq[r] // keys) if seq[r] > keys else 1))  # fmt: skip
    assert listed == expected
    assert work.items[0, :2].tolist() == [200, 200] and work.items[2, :2].tolist() == [0, 0]


@pytest.mark.parametrize(
    ("entries", "splits", "grid", "shape"),
    [
        (1, 64, 1024, (64, 64, 8)),  # 1 x 32k: a token's 128 heads, 8 column blocks
        (4, 16, 1024, (16, 256, 2)),  # 4 x 32k
        (61, 7, 2112, (8, 512, 1)),  # ragged 256: whole rows, one grid of 16 an SM
        (0, 64, 1, (64, 64, 8)),  # nothing to merge: one program, which exits
    ],
)
def test_the_reduction_cuts_columns_only_to_fill_the_gpu(entries, splits, grid, shape):
    from pagedkv.backends.mla.plan import reduce_shape

    got_grid, got = reduce_shape(entries, 128, 512, splits, 132)
    assert got_grid == (grid,)
    assert (got["SPLITS_CHUNK"], got["BLOCK_L"], got["COL_BLOCKS"]) == shape


def test_token_slots_follow_each_other_for_a_multi_token_request():
    tiles = tile_table(np.array([3, 1]), 16, 64)
    work = work_list(tiles, np.array([3, 1]), np.array([1000, 50]), 256, num_tokens=6)
    ranges, first = work.token_ranges
    assert ranges.tolist() == [4, 4, 4, 1, 1, 1]  # the padding tokens: nothing to merge
    assert first.tolist()[:3] == [0, 4, 8] and work.num_partials == 12


def test_a_forced_split_count_stops_where_its_partials_would_not_fit():
    from pagedkv.backends.mla.builder import MLAMetadataBuilder
    from pagedkv.backends.mla.configs import MAX_FORCED_PARTIAL_BYTES

    spec = Scenario("x", (1,), (1,), kv_lora_rank=512, qk_rope_head_dim=64, num_heads=128,
                    block_size=64, dtype=torch.bfloat16).spec()  # fmt: skip
    builder = MLAMetadataBuilder(spec, "cpu", num_splits=3)
    per_token = 128 * 3 * (512 + 1) * 4  # the partials of one token row at 3 splits

    def step(query_lens):
        seq_lens = [q + 100 for q in query_lens]
        blocks = [list(range(1 + 64 * i, 1 + 64 * i + -(-n // 64))) for i, n in enumerate(seq_lens)]
        common = pagedkv.CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 64)
        return builder.build(common)

    decode = step([1] * 200)  # 150 MiB of partials: split as asked
    assert decode.num_splits == 3 and decode.mid_o.shape == (200 * 3, 128, 512)
    tokens = MAX_FORCED_PARTIAL_BYTES // per_token + 1  # just past the budget: two splits
    assert step([tokens]).num_splits == 2
    prefill = step([2000] * 120)  # 240k token rows (173 GiB at 3 splits): not split
    assert prefill.num_splits == 1 and prefill.mid_o is None


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "sm120"])
@pytest.mark.parametrize(
    ("itemsize", "l_pad", "r_pad"), [(2, 512, 64), (4, 512, 64), (2, 128, 32), (4, 64, 16)]
)
def test_configs_fit_registers_and_shared_memory(arch, itemsize, l_pad, r_pad):
    cfg = choose_config(arch, itemsize, l_pad, r_pad)
    threads = 32 * cfg.num_warps
    assert cfg.block_m * l_pad // threads <= 128  # fp32 accumulator registers per thread
    smem = (cfg.block_m + cfg.num_stages * cfg.block_n) * (l_pad + r_pad) * itemsize
    assert smem <= 227 * 1024
    assert math.log2(cfg.block_m).is_integer() and math.log2(cfg.block_n).is_integer()


@settings(max_examples=200, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3000)), min_size=1, max_size=8),
    heads=st.sampled_from([1, 16, 20, 64, 128]),
    block_m=st.sampled_from([16, 64]),
    keys=st.sampled_from([64, 256, 1024]),
    padding=st.integers(0, 3),
)
def test_every_tile_range_is_one_item_and_partial_slots_do_not_overlap(
    reqs, heads, block_m, keys, padding
):
    query_lens = np.array([q for q, _ in reqs])
    seq_lens = np.maximum(np.array([s for _, s in reqs]), query_lens)
    tiles = tile_table(query_lens, heads, block_m)
    tokens = int(query_lens.sum()) + padding
    work = work_list(tiles, query_lens, seq_lens, keys, tokens)
    ranges = np.maximum(1, -(-seq_lens // keys))
    # each tile's ranges, once each, and nothing else
    assert (work.items[3] == keys).all()  # each item's range length
    listed = sorted(zip(*work.items[:3].tolist()))
    expected = sorted((r, row, s) for r, row in zip(*tiles.tolist()) for s in range(int(ranges[r])))
    assert listed == expected
    # the longest ranges first
    item_keys = np.minimum(keys, seq_lens[work.items[0]] - work.items[2] * keys)
    assert (np.diff(item_keys) <= 0).all()
    # a token's slots: its request's ranges, none shared, all within num_partials
    token_req = np.repeat(np.arange(len(reqs)), query_lens)
    count, first = work.token_ranges
    assert (count[: len(token_req)] == ranges[token_req]).all() and (
        count[len(token_req) :] == 1
    ).all()
    used = np.zeros(max(1, work.num_partials), dtype=int)
    for n, f in zip(count, first):
        if n > 1:
            used[f : f + n] += 1
    assert (used <= 1).all() and used.sum() == work.num_partials
    assert work.num_splits == int(ranges.max())
    # the reduction's list: the tokens of cut requests, every one of them
    assert work.merges.tolist() == np.flatnonzero(count > 1).tolist()
