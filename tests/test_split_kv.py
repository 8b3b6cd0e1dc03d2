"""The split-KV combinator (pagedkv.toolkit.split_kv) on the CPU, with the torch backend:
slice planning, the log-sum-exp merge (torch path, and the Triton kernel under the
interpreter and compiled for sm_90), attend_with_lse, and split vs unsplit outputs on
ragged batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import AttentionSpec, CommonAttentionMetadata, MetadataError, UnsupportedError
from pagedkv.backends.torch import TorchBackend
from pagedkv.conformance import TOLERANCES, Scenario
from pagedkv.conformance.problem import build_problem, reference_output
from pagedkv.graph import GraphBounds
from pagedkv.toolkit.kv_write import write_kv_by_slot
from pagedkv.toolkit.split_kv import (
    RANGE_TIE,
    SliceCapacity,
    SplitKVCombinator,
    SplitPolicy,
    merge_by_lse,
    plan_decode_slices,
    split_problem,
    tile_keys,
)

# -- planning ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    seq_len=st.integers(1, 300),
    data=st.data(),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 64)),
    key_step=st.sampled_from([1, 16, 64]),
)
def test_tile_keys_bound_the_keys_a_tile_sees(seq_len, data, causal, window, key_step):
    """The keys the makespan rule weighs for a tile (every backend's planner uses the
    toolkit's ``tile_keys``): exactly the keys some row of the tile sees without a
    window; with one, never fewer, and at most the window's span beside the rows and a
    key step."""
    q_len = data.draw(st.integers(1, seq_len))
    first = data.draw(st.integers(0, q_len - 1))
    end = data.draw(st.integers(first + 1, q_len))
    pos = np.arange(seq_len - q_len + first, seq_len - q_len + end)[:, None]  # rows
    keys = np.arange(seq_len)[None, :]
    seen = keys <= pos if causal else np.ones_like(keys <= pos)
    if window is not None:
        seen &= pos - keys < window
        if not causal:
            seen &= keys - pos < window
    exact = int(seen.any(axis=0).sum())
    one = lambda v: np.array([v])  # noqa: E731
    est = tile_keys(one(seq_len), one(q_len), one(first), one(end), causal=causal,
                    window=window, key_step=key_step)  # fmt: skip
    assert est.shape == (1,)
    if window is None:
        assert est[0] == exact
    else:
        assert exact <= est[0] <= (window if causal else 2 * window) + (end - first) + key_step


def _step():
    # request 0: a decode over 40 keys; 1: a 7-token prefill; 2: a decode over 33 keys;
    # one padding row
    tables = [list(range(100, 110)), [7, 8], list(range(200, 209))]
    return CommonAttentionMetadata.from_requests(
        [40, 7, 33], [1, 7, 1], tables, 4, num_tokens=10, max_blocks_per_req=12
    )


def test_slices_of_long_decodes_only():
    slices = plan_decode_slices(_step(), 16)
    common = slices.common
    assert slices.num_cut == 2 and slices.keys_per_split == 16
    assert common.seq_lens_cpu.tolist() == [16, 16, 8, 7, 16, 16, 1]
    assert common.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert common.query_start_loc.tolist() == common.query_start_loc_cpu.tolist()
    assert common.seq_lens.tolist() == common.seq_lens_cpu.tolist()
    # each slice copies its request's row; the prefill keeps its rows
    assert slices.query_rows.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8]
    # original row t merges expanded rows [t]:[t + 1]; the padding row merges none
    assert slices.merge_indptr.tolist() == [0, 3, 4, 5, 6, 7, 8, 9, 10, 13, 13]
    assert slices.merge_indptr.dtype == torch.int32
    # slices start on their first page; unused columns hold the null block
    assert common.block_table.tolist() == [
        [100, 101, 102, 103],
        [104, 105, 106, 107],
        [108, 109, 0, 0],
        [7, 8, 0, 0],
        [200, 201, 202, 203],
        [204, 205, 206, 207],
        [208, 0, 0, 0],
    ]
    assert common.slot_mapping.tolist() == [-1] * 13  # attending it writes nothing
    assert common.num_actual_tokens == common.num_tokens == 13
    # a valid step for every backend's build()
    TorchBackend().make_builder(_spec(block_size=4), "cpu").build(common)


def test_nothing_to_cut():
    slices = plan_decode_slices(_step(), 40)  # 40 keys fit one slice
    assert slices.num_cut == 0
    assert slices.common.seq_lens_cpu.tolist() == [40, 7, 33]
    assert slices.merge_indptr.tolist() == [*range(10), 9]


def test_slices_into_fixed_buffers():
    buffers: dict[str, torch.Tensor] = {}

    def buffer(name, shape, dtype):
        buffers.setdefault(name, torch.empty(shape, dtype=dtype))
        return buffers[name]

    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=10, max_blocks_per_req=12, max_query_len=7)
    capacity = SliceCapacity.for_bounds(bounds, num_splits=3)
    assert capacity == SliceCapacity(num_requests=12, num_rows=18, table_width=12)
    first = plan_decode_slices(_step(), 16, capacity=capacity, buffer=buffer)
    common = first.common
    assert common.query_start_loc is buffers["split_kv.query_start_loc"]
    assert common.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 10, 11, 12, 13] + [13] * 5
    assert common.seq_lens_cpu.tolist() == [16, 16, 8, 7, 16, 16, 1] + [0] * 5
    assert common.block_table.shape == (12, 12) and common.slot_mapping.shape == (18,)
    assert first.query_rows.shape == (18,) and first.merge_indptr.shape == (11,)
    assert common.num_actual_tokens == 13 and common.num_tokens == 18
    # a second step lands in the same buffers
    other = CommonAttentionMetadata.from_requests([9], [1], [[1, 2, 3]], 4, num_tokens=10)
    second = plan_decode_slices(other, 8, capacity=capacity, buffer=buffer)
    assert second.common.block_table is first.common.block_table
    assert second.common.seq_lens_cpu.tolist() == [8, 1] + [0] * 10
    assert second.common.block_table[:2, :3].tolist() == [[1, 2, 0], [3, 0, 0]]
    too_many = CommonAttentionMetadata.from_requests([40], [1], [list(range(10))], 4)
    with pytest.raises(MetadataError, match="5 requests exceed the reserved 4"):
        plan_decode_slices(too_many, 8, capacity=SliceCapacity(4, 18, 12), buffer=buffer)


def test_keys_per_split_must_start_slices_on_pages():
    with pytest.raises(ValueError, match="multiple of the block size 4"):
        plan_decode_slices(_step(), 10)


# -- the merge ------------------------------------------------------------------------------


def _naive_merge(parts, lse, indptr, sinks, rows):
    out = torch.zeros(rows, *parts.shape[1:], dtype=torch.float64)
    for t in range(rows):
        k0, k1 = indptr[t], indptr[t + 1]
        for h in range(parts.shape[1]):
            logits = lse[k0:k1, h].double()
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            if k1 == k0 or torch.isneginf(logits).all():
                continue
            w = torch.softmax(logits, 0)[: k1 - k0]
            kept = ~torch.isneginf(lse[k0:k1, h])  # a slice without keys adds nothing
            out[t, h] = (w[kept, None] * parts[k0:k1, h][kept].double()).sum(0)
    return out


def _merge_case(with_sinks):
    gen = torch.Generator().manual_seed(3)
    # 3 slices, 1, none, 5, 1, 37 (more than the kernel's chunk of 16)
    indptr = [0, 3, 4, 4, 9, 10, 47]
    parts = torch.randn(48, 3, 20, generator=gen)  # one trailing padding row
    lse = torch.randn(48, 3, generator=gen) * 4
    lse[3, 1] = -math.inf  # a slice without keys: its partial may be unwritten
    lse[9, :] = -math.inf  # a row without keys at all
    parts[3, 1] = parts[9] = math.nan
    sinks = torch.randn(3, generator=gen) if with_sinks else None
    return parts, lse, torch.tensor(indptr, dtype=torch.int32), sinks


@pytest.mark.parametrize(
    ("with_sinks", "heads_major"),
    [(False, False), (True, False), (True, True)],
    ids=["plain", "sinks", "sinks-heads-major-lse"],
)
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_merge_matches_a_naive_softmax(use_triton, with_sinks, heads_major):
    # the kernel runs compiled on a GPU, in Triton's interpreter on a CPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts, lse, indptr, sinks = _merge_case(with_sinks)
    out = torch.full((6, 3, 20), math.nan, device=device)
    # FA4 returns its LSE as [heads, rows]: the merge takes any strides
    given = lse.t().contiguous().t() if heads_major else lse
    merge_by_lse(
        parts.to(device),
        given.to(device),
        indptr.to(device),
        out,
        None if sinks is None else sinks.to(device),
        use_triton=use_triton,
    )
    expected = _naive_merge(parts, lse, indptr.tolist(), sinks, 6)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-6)
    assert not out[2].any()  # no partial rows: zeros


def test_merge_rejects_bad_shapes():
    parts, lse, indptr, _ = _merge_case(False)
    out = torch.empty(6, 3, 20)
    with pytest.raises(ValueError, match=r"partial_lse: expected float32 \[48, 3\]"):
        merge_by_lse(parts, lse.half(), indptr, out)
    with pytest.raises(ValueError, match=r"merge_indptr: expected int32 \[7\]"):
        merge_by_lse(parts, lse, indptr.long(), out)
    with pytest.raises(ValueError, match=r"partial_out: expected \[R, 3, 20\]"):
        merge_by_lse(parts[:, :2], lse, indptr, out)
    with pytest.raises(ValueError, match=r"sinks: expected float32 \[3\]"):
        merge_by_lse(parts, lse, indptr, out, torch.zeros(2))


def test_merge_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    from pagedkv.toolkit.triton_lse_merge import plan_merge_by_lse
    from triton_compile import compile_launches

    # the largest head (256) with sinks (the most registers any variant holds), and the
    # branch without sinks
    launches, labels = [], []
    for head_size_v, dtype, sinks in (
        (256, torch.bfloat16, torch.empty(8)),
        (128, torch.float16, None),
    ):
        out = torch.empty(5, 8, head_size_v, dtype=dtype)
        parts = torch.empty(9, 8, head_size_v, dtype=dtype)
        indptr = torch.zeros(6, dtype=torch.int32)
        launches.append(plan_merge_by_lse(parts, torch.empty(9, 8), indptr, out, sinks))
        labels.append(f"merge-d{head_size_v}-{'sinks' if sinks is not None else 'plain'}")
    results = compile_launches(launches, labels=labels)
    assert all(r.ok and not r.spill_bytes for r in results), [str(r) for r in results]


# -- end to end with the torch backend ---------------------------------------------------


def _spec(**kw):
    base = dict(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=16)
    return AttentionSpec(**{**base, **kw})


# mixed decode and prefill rows, long and short decodes, an empty request, padding rows
RAGGED = dict(seq_lens=(300, 17, 520, 40, 1, 96, 200), query_lens=(1, 17, 1, 8, 1, 0, 3))
CASES = [
    Scenario("ragged", **RAGGED, num_padding_tokens=2),
    Scenario("sinks", **RAGGED, use_sinks=True),
    Scenario("softcap-gqa4", **RAGGED, num_heads=8, num_kv_heads=2, logits_soft_cap=3.0),
    Scenario("fp8-e4m3", **RAGGED, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario("non-causal-mqa-block5", seq_lens=(260, 33, 101), query_lens=(1, 33, 1),
             causal=False, num_heads=3, num_kv_heads=1, block_size=5),
    Scenario("sinks-softcap-fp8-e5m2", **RAGGED, use_sinks=True, logits_soft_cap=4.0,
             kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=1.5),
]  # fmt: skip


def _torch_setup(scenario):
    problem = build_problem(scenario.replace(dtype=torch.float32, head_size=16), "cpu")
    backend = TorchBackend()
    spec = problem.spec
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    everything = CommonAttentionMetadata.from_requests(
        problem.scenario.seq_lens, problem.scenario.seq_lens, problem.block_ids, spec.block_size
    )
    k_view, v_view = backend.kv_cache_to_logical(cache, spec)
    write_kv_by_slot(
        torch.cat(problem.keys),
        torch.cat(problem.values),
        k_view,
        v_view,
        everything.slot_mapping,
        spec.k_scale,
        spec.v_scale,
    )
    builder = backend.make_builder(spec, "cpu")
    impl = backend.make_impl(spec, sinks=problem.sinks)
    return problem, cache, builder, impl


@pytest.mark.parametrize("num_splits", [3, 8])
@pytest.mark.parametrize("scenario", CASES, ids=lambda s: s.name)
def test_split_equals_unsplit(scenario, num_splits):
    problem, cache, builder, impl = _torch_setup(scenario)
    unsplit = impl.forward(problem.query, None, None, cache, builder.build(problem.common))
    combinator = SplitKVCombinator(builder, impl, SplitPolicy(), num_splits=num_splits)
    step = combinator.build(problem.common)
    assert step.slices is not None and step.slices.num_cut >= 2
    split = combinator.attend(problem.query, cache, step)
    n = problem.common.num_actual_tokens
    torch.testing.assert_close(split[:n], unsplit[:n], rtol=1e-5, atol=1e-5)
    assert not split[n:].any()
    expected = reference_output(problem)
    tol = TOLERANCES[torch.float32]
    err = (split[:n].double() - expected).abs()
    assert bool((err <= tol.atol + tol.rtol * expected.abs()).all()), float(err.max())


def test_the_policy_decides_the_slices():
    problem, cache, builder, impl = _torch_setup(CASES[0])
    # 7 requests x 2 KV heads = 14 programs: at least 2 per SM of the 4-SM CPU stand-in
    assert SplitKVCombinator(builder, impl, SplitPolicy()).build(problem.common).slices is None
    # the default gate also keeps steps with a 17-token query whole
    eager = SplitPolicy(max_query_len=None, split_below_programs_per_sm=8.0,
                        target_programs_per_sm=16.0, min_keys_per_split=64)  # fmt: skip
    step = SplitKVCombinator(builder, impl, eager).build(problem.common)
    # by occupancy 16 * 4 // 14 = 4 splits of 520 keys: 144 keys (a multiple of 16) each
    assert step.slices is not None and step.slices.keys_per_split == 144
    # the decodes over 300 and 520 keys; the 200-key request has 3 query rows
    assert step.slices.num_cut == 2
    n = problem.common.num_actual_tokens
    torch.testing.assert_close(
        SplitKVCombinator(builder, impl, eager).attend(problem.query, cache, step)[:n],
        impl.forward(problem.query, None, None, cache, builder.build(problem.common))[:n],
        rtol=1e-5,
        atol=1e-5,
    )


def test_attend_with_lse_returns_the_log_sum_exp():
    problem, cache, builder, impl = _torch_setup(CASES[1])  # with sinks: left out here
    md = builder.build(problem.common)
    n, rows = problem.common.num_actual_tokens, problem.common.num_tokens
    spec = problem.spec
    group = spec.num_queries_per_kv
    out = torch.empty(rows, spec.num_heads, 16)
    lse = torch.empty(rows, spec.num_heads)
    got_out, got_lse = impl.attend_with_lse(problem.query, cache, md, out, lse)
    assert got_out is out and got_lse is lse
    qsl = problem.common.query_start_loc_cpu.tolist()
    for i, (k, v) in enumerate(zip(problem.keys, problem.values, strict=True)):
        q = problem.query[qsl[i] : qsl[i + 1]].double()
        seq, q_len = k.shape[0], q.shape[0]
        kk = k.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * spec.scale
        pos = torch.arange(seq - q_len, seq)[:, None]
        scores = scores.masked_fill(torch.arange(seq)[None, :] > pos, -math.inf)
        want_lse = torch.logsumexp(scores, -1).t()
        vv = v.double().repeat_interleave(group, 1)
        want_out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)
        torch.testing.assert_close(
            lse[qsl[i] : qsl[i + 1]].double(), want_lse, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            out[qsl[i] : qsl[i + 1]].double(), want_out, rtol=1e-5, atol=1e-5
        )
    assert torch.isneginf(lse[n:]).all()


def test_layers_it_cannot_split_are_refused():
    backend = TorchBackend()
    for spec, why in (
        (_spec(sliding_window=64), "sliding window: each slice is attended as a request"),
        (_spec(alibi_slopes=(0.5, 0.25, 0.125, 0.0625)), "ALiBi: the bias slope"),
    ):
        assert split_problem(spec).startswith(why.split(":")[0])
        with pytest.raises(UnsupportedError, match=f"cannot split this layer: {why}"):
            SplitKVCombinator(
                backend.make_builder(spec, "cpu"), backend.make_impl(spec), SplitPolicy()
            )
    assert split_problem(_spec(logits_soft_cap=5.0, use_sinks=True)) is None

    class NoLSE:
        spec = _spec()

    with pytest.raises(UnsupportedError, match="NoLSE has no attend_with_lse"):
        SplitKVCombinator(backend.make_builder(_spec(), "cpu"), NoLSE(), SplitPolicy())  # type: ignore[arg-type]


def test_graph_reservations_are_refused():
    spec = _spec()

    class Reserved:
        graph_bounds = GraphBounds(max_num_reqs=2, max_num_tokens=2, max_blocks_per_req=2)

    backend = TorchBackend()
    combinator = SplitKVCombinator(Reserved(), backend.make_impl(spec), SplitPolicy())  # type: ignore[arg-type]
    step = CommonAttentionMetadata.from_requests([5], [1], [[1]], 16)
    with pytest.raises(UnsupportedError, match="eager steps only"):
        combinator.build(step)
    assert np.array_equal(step.seq_lens_cpu.numpy(), [5])


# -- the makespan rule ---------------------------------------------------------------------


def test_makespan_rule_evens_the_waves_and_cuts_the_critical_path():
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64)

    def splits(keys, slots, copies=1):
        return policy.choose_by_makespan(
            np.asarray(keys), slots, granule=64, overhead_keys=64, copies=copies
        ).num_splits

    # a grid that fills its slots 1.3 times: split until the waves are even
    assert splits([4096] * 64, 396, copies=8) > 1
    # a grid of many waves does not split (it would only add programs)
    assert splits([1024] * 256, 396, copies=8) == 1
    # one long request among short ones is cut; alone, it is cut to the limit
    assert splits([32768] + [1024] * 127, 396, copies=8) > 1
    assert splits([32768], 396) == 64
    # never below min_keys_per_split keys per split
    assert splits([700], 396) == 1
    # the reduction's cost keeps a marginal split away
    base = dict(granule=64, overhead_keys=64, copies=8)
    free = policy.choose_by_makespan(np.asarray([4096] * 64), 396, **base).num_splits
    dear = policy.choose_by_makespan(
        np.asarray([4096] * 64), 396, merge_keys_per_split=1e4, **base
    ).num_splits
    assert dear < free


def test_makespan_rule_keeps_within_the_grid():
    """``max_programs``: a grid sized once (a CUDA graph's) bounds the choice, for even
    shares and for fixed key ranges alike; one program per entry always fits."""
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64)
    base = dict(granule=64, overhead_keys=64, copies=8)

    def choose(keys, max_programs=None, **more):
        return policy.choose_by_makespan(
            np.asarray(keys), 528, max_programs=max_programs, **base, **more
        )

    assert choose([32768] * 4).num_splits == 16  # 64 programs per copy
    assert choose([32768] * 4, max_programs=40).num_splits <= 10
    assert choose([32768] * 4, max_programs=3).num_splits == 1  # fewer than the entries
    # a ragged batch's fixed ranges count the ranges that hold keys
    ragged = [65536] + [1024] * 30
    free = choose(ragged, key_ranges=True, listed=True)
    assert free.fixed_ranges
    programs = sum(-(-k // free.keys_per_split) for k in ragged)
    capped = choose(ragged, max_programs=programs - 1, key_ranges=True, listed=True)
    if capped.fixed_ranges:
        assert sum(-(-k // capped.keys_per_split) for k in ragged) < programs
    else:
        assert capped.num_splits * len(ragged) < programs


def test_makespan_rule_fills_one_wave_and_counts_split_slots():
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64)
    base = dict(granule=64, overhead_keys=64, copies=8)

    def splits(keys, slots, split_slots=None):
        return policy.choose_by_makespan(
            np.asarray(keys), slots, split_slots=split_slots, **base
        ).num_splits

    # 4 requests x 8 heads: 16 splits are 512 programs, one wave of 528 slots (no tail);
    # in 396 slots they would spill into a second wave
    assert splits([32768] * 4, 528) == 16
    assert splits([32768] * 4, 396) != 16
    # a split launch that holds more programs per SM than the unsplit one
    assert splits([1024] * 256, 396) == 1
    assert splits([1024] * 256, 396, split_slots=528) == 2


def test_key_ranges_between_powers_of_two():
    """``range_multiples``: fixed key ranges of 1.25x, 1.5x, 1.75x a power of two of the
    granule are compared too (whole granules, at least the policy's minimum), and win
    where they fill the waves better; the default compares powers of two alone."""
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64)
    # the decodes of pagedkv bench's mixed-16d+1chunk: one 31.6k context among 1-4k ones
    keys = np.asarray([1237, 1659, 592, 3675, 2235, 1093, 3881, 855, 31622, 3561, 2074,
                       1949, 2302, 10561, 2099, 2760], dtype=np.float64)  # fmt: skip
    base = dict(granule=64, overhead_keys=64, copies=8, key_ranges=True, listed=True)
    powers = policy.choose_by_makespan(keys, 528, **base)
    finer = policy.choose_by_makespan(keys, 528, range_multiples=(1.0, 1.25, 1.5, 1.75), **base)
    assert powers.fixed_ranges and powers.keys_per_split == 512
    assert finer.fixed_ranges and finer.keys_per_split == 1280  # 20 granules: 1.25 x 16
    # every candidate the rule may return: whole granules, >= the minimum, < the longest
    for multiples in ((1.0, 1.5), (1.0, 1.25, 1.5, 1.75), (1.75,)):
        for slots in (64, 132, 528, 2048):
            choice = policy.choose_by_makespan(keys, slots, range_multiples=multiples, **base)
            if choice.fixed_ranges:
                steps = choice.keys_per_split // 64
                assert choice.keys_per_split % 64 == 0 and choice.keys_per_split >= 512
                assert choice.keys_per_split < keys.max()
                assert any(steps == m * (1 << k) for m in multiples for k in range(12)), (
                    multiples,
                    slots,
                    choice,
                )


def test_a_grid_that_leaves_sms_idle_may_split_shorter():
    """``key_floor``: a grid of fewer unsplit programs than SMs splits down to
    ``sparse_grid_min_keys_per_split`` keys, one that fills them keeps
    ``min_keys_per_split``; ``choose_by_makespan`` takes the floor it is given."""
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64, sparse_grid_min_keys_per_split=128)
    assert policy.key_floor(8, 132) == 128
    assert policy.key_floor(131, 132) == 128
    assert policy.key_floor(132, 132) == 512
    assert policy.key_floor(8, None) == 512  # no SM count: the policy's floor
    assert SplitPolicy(min_keys_per_split=512).key_floor(8, 132) == 512
    base = dict(granule=64, overhead_keys=64, copies=8)
    one = np.asarray([1024.0])  # one request x 8 KV heads: 8 programs
    assert policy.choose_by_makespan(one, 528, **base).num_splits == 2
    short = policy.choose_by_makespan(one, 528, min_keys_per_split=128, **base)
    assert short.num_splits == 8 and short.keys_per_split == 128
    ranged = policy.choose_by_makespan(
        np.asarray([4096.0, 256.0]), 528, min_keys_per_split=128, key_ranges=True,
        listed=True, **base,
    )  # fmt: skip
    assert ranged.keys_per_split >= 128


def test_a_grid_beside_another_launch_counts_only_the_free_slots_as_one_wave():
    """``free_share``: another launch holds the rest of the slots when this grid starts.
    The work still spreads over every slot, but a grid of more programs than the free
    slots pays the tail of several waves, so ranges that just fill the whole GPU lose to
    finer ones (the decodes of a two-part step beside its Gluon chunk)."""
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64)
    # pagedkv bench's D 256 mixed step: its 48 decodes x 4 KV heads, 3 programs an SM
    # of 132 (the H100's compiled m16-n32 kernel)
    keys = np.asarray([851, 3998, 1058, 339, 3005, 377, 1448, 2036, 1079, 508, 228, 536,
                       1122, 1023, 926, 7548, 679, 694, 2194, 2700, 3864, 4021, 142, 1970,
                       355, 430, 1903, 1231, 142, 174, 329, 522, 56, 452, 5591, 528, 2057,
                       703, 190, 339, 685, 4709, 2671, 539, 603, 5353, 882, 225],
                      dtype=np.float64)  # fmt: skip
    base = dict(granule=32, overhead_keys=64, copies=4, key_ranges=True, listed=True)
    # 1024-key ranges: 380 programs, one wave of the 396 slots
    alone = policy.choose_by_makespan(keys, 396, **base)
    assert alone.fixed_ranges and alone.keys_per_split == 1024
    # a fifth of the SMs held at the start: 317 free slots, so 1024-key ranges take two
    # waves too, and 512-key ones balance them better (H100: 146 us eager against 173)
    beside = policy.choose_by_makespan(keys, 396, free_share=0.8, **base)
    assert beside.fixed_ranges and beside.keys_per_split == 512
    # a grid within the free slots is planned as it was
    few = keys[:12]
    assert policy.choose_by_makespan(few, 396, free_share=0.8, **base) == (
        policy.choose_by_makespan(few, 396, **base)
    )


@pytest.mark.parametrize("seed", range(4))
def test_key_ranges_of_powers_of_two_tie_to_the_fewest_splits(seed):
    """Among fixed key ranges the longest power of two within ``RANGE_TIE`` of the best
    estimate wins (the fewest splits, as among even shares); a multiple of a power of
    two only where it beats every power by more than the tie, then the best estimate
    outright (the longest of equal ones)."""
    policy = SplitPolicy(min_keys_per_split=512, max_splits=64)
    rng = np.random.default_rng(seed)
    base = dict(granule=64, overhead_keys=64, copies=8)
    tied = multiple = 0
    for _ in range(40):
        n = int(rng.integers(8, 200))
        keys = np.minimum(65536, rng.lognormal(0, 1.2, n) * 2048).astype(np.int64) + 16
        slots = int(rng.choice([264, 396, 528]))
        for multiples in ((1.0,), (1.0, 1.25, 1.5, 1.75)):
            choice = policy.choose_by_makespan(
                keys.astype(np.float64), slots, key_ranges=True, listed=True,
                range_multiples=multiples, **base,
            )  # fmt: skip
            if not choice.fixed_ranges:
                continue
            ranges = policy.key_range_candidates(float(keys.max()), 64, 64, multiples)
            estimates = policy.key_range_estimates(keys, slots, ranges, listed=True, **base)
            bound = estimates.min() * (1 + RANGE_TIE)
            powers = [r for r, e in zip(ranges, estimates) if e <= bound and is_pow2(r // 64)]
            best = [r for r, e in zip(ranges, estimates) if e <= estimates.min()]
            assert choice.keys_per_split == max(powers or best), (ranges, estimates)
            tied += choice.keys_per_split != ranges[int(np.argmin(estimates))]
            multiple += not is_pow2(choice.keys_per_split // 64)
    assert tied  # the tie decides some of these batches
    assert multiple  # and some take a multiple of a power of two


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def test_merging_only_the_cut_programs_lets_a_ragged_batch_cut_its_long_ones():
    """``merge_split_only``: a kernel that writes an uncut sequence's output itself pays
    the reduction only for the programs the ranges cut, so a full ragged grid whose
    merge would be dear for every row still cuts its one long request."""
    policy = SplitPolicy(min_keys_per_split=256, max_splits=64)
    keys = np.asarray([1024.0] * 255 + [16384.0])
    base = dict(granule=64, overhead_keys=288, key_ranges=True, listed=True)
    merge = 20000.0  # every row's partials, one split: dearer than the long request's excess
    every = policy.choose_by_makespan(keys, 132, merge_keys_per_split=merge, **base)
    cut = policy.choose_by_makespan(
        keys, 132, merge_keys_per_split=merge, merge_split_only=True, **base
    )
    assert not every.fixed_ranges and every.num_splits == 1
    assert cut.fixed_ranges and 1024 <= cut.keys_per_split < 16384  # the short ones uncut
