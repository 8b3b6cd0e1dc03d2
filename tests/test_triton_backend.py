"""The Triton backend against the float64 reference, on shuffled physical blocks.

On a CPU the kernels run in Triton's interpreter (enabled below, before the kernel
modules are first imported): float16/float32 only, small shapes. On a GPU the same
scenarios run compiled, bfloat16 included.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref

import numpy as np
import pagedkv
import pytest
import torch
import triton
import triton.language as tl
from pagedkv import (
    AttentionSpec,
    CommonAttentionMetadata,
    ConfigError,
    GraphBounds,
    MetadataError,
    UnsupportedError,
)
from pagedkv.backends.triton.attention_kernel import fp16_rows
from pagedkv.backends.triton.builder import StepSplits, TritonMetadataBuilder
from pagedkv.backends.triton.configs import (
    BYTES_IN_FLIGHT_PER_SM,
    MIN_STEP_BYTES,
    SPLIT_PARTIAL_BYTES,
    SPLIT_POLICY,
    LaunchForm,
    LayerShape,
    StepShape,
    TileConfig,
    fits,
    graph_items,
    key_range_estimates,
    partial_bytes_per_split,
    plan_step,
    plan_tiles,
    saturates,
    slots_per_sm,
    step_bytes,
    step_splits,
)
from pagedkv.backends.triton.parts import decode_and_longer_runs
from pagedkv.bench.workloads import MATRICES, Layer
from pagedkv.conformance import Scenario, run_scenario
from pagedkv.conformance.problem import build_problem
from pagedkv.toolkit.launch import MAX_GRID_Y, KernelFit
from pagedkv.toolkit.split_kv import RANGE_TIE

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
DECODE = dict(seq_lens=(97, 3, 200, 64), query_lens=(1, 1, 1, 1))
# decodes (one long enough to split) then chunked prefills: two launches, two plans
TWO_PARTS = dict(seq_lens=(1100, 40, 33, 300, 70), query_lens=(1, 1, 2, 40, 17))
# lengths one short of, at and one past the key tiles (16 to 128 keys): off-by-one traps
EDGES = dict(seq_lens=(127, 128, 129, 63, 65, 15), query_lens=(1, 1, 1, 1, 1, 1))
SCENARIOS = [
    Scenario("mixed-fp16", **MIXED, num_padding_tokens=3),
    Scenario("mixed-fp32-gqa5", **MIXED, num_heads=10, num_kv_heads=2, dtype=torch.float32),
    Scenario("mqa-head128", **MIXED, num_heads=8, num_kv_heads=1, head_size=128),
    Scenario("mha", **MIXED, num_heads=4, num_kv_heads=4),
    Scenario("decode", **DECODE),
    Scenario("two-parts-decodes-first", **TWO_PARTS, num_padding_tokens=3),
    Scenario("two-parts-chunks-first", seq_lens=(300, 70, 1100, 40), query_lens=(40, 17, 1, 1)),
    Scenario(
        "two-parts-sinks-softcap-fp32",
        **TWO_PARTS,
        use_sinks=True,
        logits_soft_cap=20.0,
        dtype=torch.float32,
    ),
    Scenario("decode-tile-edges", **EDGES),
    Scenario("decode-tile-edges-fp32", **EDGES, dtype=torch.float32, head_size=128),
    Scenario("prefill-q-block-edges", seq_lens=(131, 64), query_lens=(100, 64)),
    Scenario("spec-decode-4", seq_lens=(40, 90), query_lens=(4, 4)),
    Scenario("prefill-block32", seq_lens=(70, 9), query_lens=(70, 9), block_size=32),
    Scenario("chunked-prefill-block48", seq_lens=(150, 20), query_lens=(37, 20), block_size=48),
    Scenario("block128-tile-inside-page", seq_lens=(300, 5), query_lens=(2, 5), block_size=128),
    Scenario("head32", **MIXED, head_size=32),
    Scenario("head80", **MIXED, head_size=80),
    Scenario(
        "head256-fp32", seq_lens=(40, 3), query_lens=(2, 3), head_size=256, dtype=torch.float32
    ),
    Scenario("window-smaller-than-block", **MIXED, sliding_window=5),
    # windows whose first key lands on a tile boundary (tiles of 64 and 128 keys)
    Scenario("window-several-tiles", seq_lens=(300, 70), query_lens=(3, 70), sliding_window=107),
    Scenario("decode-window-tile-edge", seq_lens=(300, 200), query_lens=(1, 1), sliding_window=43),
    Scenario("softcap", **MIXED, logits_soft_cap=5.0),
    Scenario("alibi", **MIXED, alibi=True),
    Scenario("sinks", **MIXED, use_sinks=True),
    Scenario("non-causal", seq_lens=(30, 12), query_lens=(20, 12), causal=False),
    Scenario(
        "non-causal-window", seq_lens=(30, 12), query_lens=(30, 12), causal=False, sliding_window=9
    ),
    # the scales belong to fp8 caches: a 16-bit cache is read as it is
    Scenario("scales-on-a-16-bit-cache", **MIXED, k_scale=0.5, v_scale=0.5),
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
# flash-decoding: every split count must give the single-pass answer
# a split holds whole key tiles (16-128 keys): one sequence long enough for each count
MIXED_LONG = dict(seq_lens=(1, 17, 33, 400, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
SPLIT_SCENARIOS = [
    (3, Scenario("split3-mixed", **MIXED_LONG, num_padding_tokens=2)),
    (4, Scenario("split4-decode-sinks", **DECODE, use_sinks=True)),
    (2, Scenario("split2-window-fp32", **DECODE, sliding_window=70, dtype=torch.float32)),
    (5, Scenario("split5-fp8", **DECODE, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0)),
    (
        3,
        Scenario(
            "split3-everything",
            **MIXED_LONG,
            logits_soft_cap=30.0,
            alibi=True,
            use_sinks=True,
            sliding_window=40,
        ),
    ),
]
# one long request among short ones: splits of fixed key ranges (the short requests'
# programs past their keys exit; each row merges the ranges below its keys)
RAGGED = dict(seq_lens=(3000, 40, 100, 70), query_lens=(1, 1, 3, 1), num_heads=4,
              num_kv_heads=2, head_size=32)  # fmt: skip
RANGE_SCENARIOS = [
    Scenario("ranges-ragged-spec", **RAGGED, num_padding_tokens=2),
    Scenario(
        "ranges-sinks-softcap-fp32",
        **RAGGED,
        use_sinks=True,
        logits_soft_cap=20.0,
        dtype=torch.float32,
    ),
    Scenario("ranges-non-causal", **RAGGED, causal=False),
    # a request of two query blocks (8 queries x GQA 2 over 16-row tiles): the
    # (query blocks, splits) grid, not the list of work items
    Scenario("ranges-two-query-blocks", **{**RAGGED, "query_lens": (1, 1, 8, 1),
                                           "num_heads": 8}),
]  # fmt: skip
BF16 = [
    s.replace(name=s.name + "-bf16", dtype=torch.bfloat16)
    for s in SCENARIOS
    if s.dtype == torch.float16
]


def _check(scenario: Scenario, **options: object) -> None:
    backend = pagedkv.get_backend("triton", **options)
    result = run_scenario(backend, scenario, DEVICE, backend_label="triton")
    assert result.passed, result.report()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_reference(scenario):
    _check(scenario)


@pytest.mark.parametrize(
    "splits, scenario", SPLIT_SCENARIOS, ids=[s.name for _, s in SPLIT_SCENARIOS]
)
def test_split_kv_matches_reference(splits, scenario):
    problem = build_problem(scenario, DEVICE)
    builder = pagedkv.get_backend("triton", num_splits=splits).make_builder(problem.spec, DEVICE)
    assert builder.build(problem.common).num_splits > 1  # the forced split happens
    _check(scenario, num_splits=splits)


@pytest.mark.parametrize("split_grid", ["auto", "blocks"])
@pytest.mark.parametrize("scenario", RANGE_SCENARIOS, ids=lambda s: s.name)
def test_fixed_key_range_splits_match_reference(scenario, split_grid):
    problem = build_problem(scenario, DEVICE)
    backend = pagedkv.get_backend("triton", split_grid=split_grid)
    metadata = backend.make_builder(problem.spec, DEVICE).build(problem.common)
    plan = metadata.plan
    # the rule balances this batch with fixed ranges, most of them empty for the short
    # requests (the CPU's stand-in SM count and the GPU's compiled fits agree on that)
    assert plan.trim_splits and plan.num_splits > 2, metadata.describe()
    # one query block per request: one program per range that holds keys, listed
    attention = metadata.parts[0].attention
    listed = split_grid == "auto" and max(scenario.query_lens) <= plan.block_q
    assert attention.kwargs["RANGE_LIST"] == listed
    if listed:
        keys = plan.tiles_per_split * plan.tile.tile_n
        items = sum(-(-n // keys) for n in scenario.seq_lens)
        assert attention.grid == (items * scenario.num_kv_heads, 1, 1)
        assert attention.kwargs["RangeStarts"].tolist()[-1] == items
    else:
        assert attention.grid[2] == plan.num_splits
        # a (requests, splits) grid where every request's queries fit one block
        by_request = max(scenario.query_lens) <= plan.block_q and plan.split
        assert attention.kwargs["BLOCK_PER_REQUEST"] == by_request
        if by_request:
            assert attention.grid[:2] == (scenario.num_kv_heads, len(scenario.seq_lens))
    _check(scenario, split_grid=split_grid)


@pytest.mark.parametrize(
    "options",
    [dict(num_splits=4), dict(), dict(split_grid="blocks")],
    ids=["even-shares", "key-ranges-listed", "key-ranges-by-request"],
)
def test_split_decodes_merge_in_their_last_program(options):
    """A split launch of one query block per request launches no merge: the program
    that counts its block's last split merges them all (``MERGE_LAST``), with the sinks,
    and leaves the block's counter at zero for the next launch. Two forwards in a row
    give the separate merge's answer; a programmatic launch has no dependent to start."""
    scenario = RANGE_SCENARIOS[1]  # speculative rows, sinks and a softcap, fp32
    problem = build_problem(scenario, DEVICE)
    cache = pagedkv.get_backend("triton").allocate_kv_cache(
        problem.num_blocks, problem.spec, DEVICE
    )
    cache.normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    answers = {}
    for merge in ("auto", "separate"):
        backend = pagedkv.get_backend("triton", split_merge=merge, **options)
        builder = backend.make_builder(problem.spec, DEVICE)
        builder.programmatic = True  # as on an H100: the merge launch would be dependent
        builder.num_sms = 132  # (one wave: ``_merges_in_attention``)
        (part,) = builder.build(problem.common).parts
        assert part.plan.split and part.plan.num_splits > 2, part.plan
        merged_last = part.attention.kwargs["MERGE_LAST"]
        assert merged_last == (merge == "auto") == (part.reduce is None)
        assert part.attention.kwargs["LAUNCH_DEPENDENTS"] == (0 if merged_last else 1)
        builder.programmatic = False  # (the interpreter's: no programmatic launch)
        md = builder.build(problem.common)
        impl = backend.make_impl(problem.spec, sinks=problem.sinks)
        outs = [impl.forward(problem.query, None, None, cache, md) for _ in range(2)]
        if merged_last:
            # every block's counts back at zero (its last column: its splits)
            assert not builder._counts[:, :-1].any()
        n = problem.common.num_actual_tokens
        torch.testing.assert_close(outs[1][:n], outs[0][:n], atol=0, rtol=0)
        answers[merge] = outs[0][:n]
    torch.testing.assert_close(answers["auto"], answers["separate"], atol=1e-5, rtol=1e-5)
    _check(scenario, **options)


def _decodes_on_consecutive_pages(seq_lens: list[int]) -> CommonAttentionMetadata:
    """A decode step of ``seq_lens``, each request's pages after the previous one's
    (block 0 left as the null block), pages of 16."""
    blocks, first = [], 1
    for n in seq_lens:
        blocks.append(list(range(first, first + -(-n // 16))))
        first += len(blocks[-1])
    return CommonAttentionMetadata.from_requests(seq_lens, [1] * len(seq_lens), blocks, 16, DEVICE)


@pytest.mark.parametrize("rounds, values", [(0, 4096), (1, 256), (64, 4096)])
def test_a_reserved_decode_step_merges_where_its_splits_take_few_rounds(
    monkeypatch, rounds, values
):
    """Under a CUDA-graph reservation the decode launch is compiled to merge in its last
    program of each block and captures the merge kernel too: each step's build picks
    one (``_merges_in_attention``: one wave of programs, at most ``MERGE_ROUNDS`` rounds
    of the block's loads; here none, one of 4 splits, or any), written where both
    kernels read it (``StepSplits.merged``). Every step attends as an eager step does,
    its counters back at zero."""
    from pagedkv.backends.triton import builder as triton_builder
    from pagedkv.backends.triton import configs as triton_configs

    monkeypatch.setattr(triton_builder, "MERGE_ROUNDS", rounds)
    monkeypatch.setattr(triton_configs, "MERGE_TILE_VALUES", values)
    bounds = GraphBounds(max_num_reqs=3, max_num_tokens=3, max_blocks_per_req=320, max_query_len=1)
    reserved, eager_builder, impl, cache = _reserved(bounds, 400, dict(num_heads=4))
    reserved.num_sms = 132  # (every step one wave)
    gen = torch.Generator().manual_seed(5)
    merged = set()
    for seq_lens in ([5000], [2500, 1200, 30], [40, 60, 50]):
        common = _decodes_on_consecutive_pages(seq_lens)
        md = reserved.build(common)
        (part,) = md.parts
        assert part.attention.kwargs["MERGE_LAST"] and part.reduce.kwargs["SKIP_MERGED"]
        here = StepSplits.read(part.attention.kwargs["NumSplits"]).merged
        assert here == (md.step_splits <= rounds * part.attention.kwargs["MERGE_CHUNK"])
        merged.add(here)
        q = torch.randn(3, 4, 32, generator=gen).half().to(DEVICE)
        n = len(seq_lens)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common, num_splits=1))
        got = impl.forward(q, None, None, cache, md)[:n]
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        assert not reserved._counts[:, :-1].any()
    assert merged == ({False} if rounds == 0 else {True} if rounds == 64 else {False, True})


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_split_merge_takes_blocks_of_heads(batch_invariant):
    """One merge program per (token, block of query heads): 6 heads of 80 (padded to
    128) over 7 splits (padded to 8) fit 4 heads a program when all splits merge at
    once (two blocks, the second half empty); the batch-invariant merge, split by split
    (3 ranges of 512 keys), fits 8 (one block, 2 of its heads past the last). Sinks give
    every head its own term."""
    scenario = Scenario(
        "head-blocks", seq_lens=(1100, 3, 200, 64), query_lens=(1, 1, 1, 1), num_heads=6,
        num_kv_heads=3, head_size=80, use_sinks=True, num_padding_tokens=2,
    )  # fmt: skip
    # (the separate merge: a decode step's split launch otherwise merges in its programs)
    options = (
        dict(batch_invariant=True)
        if batch_invariant
        else dict(num_splits=7, split_merge="separate")
    )
    problem = build_problem(scenario, DEVICE)
    metadata = (pagedkv.get_backend("triton", **options).make_builder(problem.spec, DEVICE)).build(
        problem.common
    )
    reduce = metadata.parts[0].reduce
    assert reduce.kwargs["SPLIT_PAD"] == (4 if batch_invariant else 8), metadata.describe()
    assert reduce.kwargs["ORDERED"] == batch_invariant
    block_h = reduce.kwargs["BLOCK_H"]
    assert block_h == (8 if batch_invariant else 4)
    assert reduce.grid[1] == -(-6 // block_h)
    _check(scenario, **options)


@pytest.mark.parametrize("splits", [1, 3])
def test_split_decode_grid_has_one_program_per_request(splits):
    """Decode steps, split or not, launch one program per (request, KV head, split): none
    searches for its request, none is empty; prefill steps keep the query-block grid."""
    decode = Scenario("decodes", **DECODE)
    problem = build_problem(decode, DEVICE)
    backend = pagedkv.get_backend("triton", num_splits=splits)
    metadata = backend.make_builder(problem.spec, DEVICE).build(problem.common)
    attention = metadata.parts[0].attention
    assert (metadata.plan.num_splits > 1) == (splits > 1)
    assert attention.kwargs["BLOCK_PER_REQUEST"]
    assert not attention.kwargs["RANGE_LIST"]
    assert attention.grid == (decode.num_kv_heads, 4, metadata.plan.num_splits)
    _check(decode, num_splits=splits)
    prefill = decode.replace(name="prefills", query_lens=(37, 3, 90, 64))
    problem = build_problem(prefill, DEVICE)
    metadata = backend.make_builder(problem.spec, DEVICE).build(problem.common)
    assert not metadata.parts[0].attention.kwargs["BLOCK_PER_REQUEST"]


def test_a_decode_step_past_the_grid_axis_limit_searches_for_its_requests():
    """A by-request grid puts the requests on CUDA's second axis (at most 65535): a
    bigger decode step takes the query-block grid, whose first axis has room."""
    spec = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=32, dtype=torch.float16, block_size=16
    )
    builder = pagedkv.get_backend("triton", num_splits=1).make_builder(spec, DEVICE)
    for num_reqs, by_request in ((MAX_GRID_Y, True), (MAX_GRID_Y + 1, False)):
        common = CommonAttentionMetadata.from_requests(
            [5] * num_reqs, [1] * num_reqs, [[i] for i in range(num_reqs)], 16, DEVICE
        )
        attention = builder.build(common).parts[0].attention
        assert attention.kwargs["BLOCK_PER_REQUEST"] == by_request
        assert max(attention.grid[1:]) <= MAX_GRID_Y, attention.grid


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 needs a GPU (Triton's interpreter gets it wrong)")
@pytest.mark.parametrize("scenario", BF16, ids=lambda s: s.name)
def test_bfloat16_matches_reference(scenario):
    _check(scenario)


def test_two_part_steps_are_planned_as_two_launches():
    """The two-part scenarios above run as two launches (the decodes split on their own),
    so their reference checks cover the parts' offsets into the step's tensors."""
    for scenario in SCENARIOS:
        if not scenario.name.startswith("two-parts"):
            continue
        problem = build_problem(scenario, DEVICE)
        md = pagedkv.get_backend("triton").make_builder(problem.spec, DEVICE).build(problem.common)
        assert len(md.parts) == 2, scenario.name
        long_decode = scenario.seq_lens.index(1100)
        decode_part = next(p for p in md.parts if p.first <= long_decode < p.end)
        assert decode_part.plan.num_splits > 1, (scenario.name, md.describe())


def test_a_two_part_step_launches_its_longer_part_first_when_overlapped():
    """The overlapped forward's order (on a GPU: the longer part's launch leaves the host
    before the decodes' arguments are found): the same launches, the longer part's
    first, each part's launches in their own order."""
    scenario = next(s for s in SCENARIOS if s.name.startswith("two-parts"))
    problem = build_problem(scenario, DEVICE)
    backend = pagedkv.get_backend("triton", split_merge="separate")  # the decodes' merge too
    md = backend.make_builder(problem.spec, DEVICE).build(problem.common)
    impl = backend.make_impl(problem.spec)
    cache = backend.allocate_kv_cache(problem.num_blocks, problem.spec, DEVICE)
    out = torch.empty_like(problem.query)
    in_order = list(impl._launches(problem.query, cache, md, out))
    longer_first = list(impl._launches(problem.query, cache, md, out, longer_first=True))
    assert [p for p, *_ in in_order] == [0, 0, 1], md.describe()  # the chunk: one split
    by_part = sorted(longer_first, key=lambda launch: -launch[0])  # stable: each part's order
    assert [(p, t) for p, t, *_ in longer_first] == [(p, t) for p, t, *_ in by_part]
    assert sorted((p, id(t)) for p, t, *_ in longer_first) == sorted(
        (p, id(t)) for p, t, *_ in in_order
    )


def test_a_padded_two_part_step_matches_the_reference():
    """Decodes, then a chunk and a request without queries (the padding joins the
    chunk's launch): two launches, exact."""
    scenario = Scenario(
        "two-parts-padded", seq_lens=(1100, 33, 300, 5), query_lens=(1, 1, 20, 0),
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip
    problem = build_problem(scenario, DEVICE)
    md = pagedkv.get_backend("triton").make_builder(problem.spec, DEVICE).build(problem.common)
    assert [(p.first, p.end) for p in md.parts] == [(0, 2), (2, 4)], md.describe()
    _check(scenario)


def test_automatic_split_on_a_long_decode():
    """One long sequence, few programs: the builder splits on its own and stays exact."""
    scenario = Scenario(
        "auto-split", seq_lens=(1200,), query_lens=(1,), num_heads=4, num_kv_heads=2
    )
    builder = pagedkv.get_backend("triton").make_builder(scenario.spec(), DEVICE)
    common = CommonAttentionMetadata.from_requests([1200], [1], [list(range(1, 76))], 16, DEVICE)
    assert builder.build(common).num_splits > 1
    _check(scenario)


# -- decisions (host only) ------------------------------------------------------------------

H200_SMS = 132
SPEC = AttentionSpec(
    num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
)
H200_LAYER = LayerShape.of(SPEC)


def _step(seq_lens, query_lens) -> StepShape:
    return StepShape(np.asarray(seq_lens) * 0 + np.asarray(query_lens), np.asarray(seq_lens))


def _plan(layer, seq_lens, query_lens, **kwargs):
    return plan_tiles(layer, _step(seq_lens, query_lens), H200_SMS, **kwargs)


# Registers of the attention kernel compiled for the H200 (Triton 3.6, D 128, 16-row
# programs, 4 warps; unsplit, split), as benchmarks/triton_sweep.py read them there
# (docs/results/sweep-h200-sixth-session-before.txt): what the builder's CompiledFits gives the
# rule on that GPU (both split forms the split column). fp8 m16-n64 split spills 4 bytes.
H200_REGISTERS = {
    ("bf16", 16): (80, 78),
    ("bf16", 32): (112, 104),
    ("bf16", 64): (128, 124),  # unsplit: 164 before it took one program per request
    ("bf16", 128): (241, 200),
    ("fp8", 16): (96, 96),
    ("fp8", 32): (139, 128),
    ("fp8", 64): (150, 168),
    ("fp8", 128): (178, 168),
}


def h200_fits(kind: str):
    def fit(tile: TileConfig, form: LaunchForm) -> KernelFit:
        split = form is not LaunchForm.UNSPLIT
        registers = H200_REGISTERS[(kind, tile.tile_n)][split]
        spill = 4 if (kind, tile.tile_n, split) in (("fp8", 64, True), ("bf16", 64, False)) else 0
        per_sm = 65536 // (-(-registers // 8) * 8 * 32 * tile.num_warps)
        return KernelFit(registers, spill, 0, per_sm)

    return fit


@pytest.mark.parametrize(
    "num_seqs, seq_len, query_len, expect",
    [
        # 512 programs (64 requests x 8 KV heads) in the 528 slots of the unsplit tile (4
        # per SM, one program per request): one wave, no merge. H200: 260.7 us eager
        # against 266.4 in 2 splits
        (64, 4096, 1, 1),
        # 2048 programs, 3.9 waves of those slots; 2 splits would be 7.8 and a merge
        # (H200: 269.1 us against 282.8)
        (256, 1024, 1, 1),
        (4, 32768, 1, 16),  # 512 programs: one wave of the 528 slots
        (1, 32768, 1, 64),  # capped by max_splits
        (1, 100, 1, 1),  # too short to split: fewer keys than two 128-key splits
        (8, 2048, 2048, 1),  # a full prefill grid does not split
    ],
)
def test_split_choice_on_the_h200(num_seqs, seq_len, query_len, expect):
    plan = _plan(H200_LAYER, [seq_len] * num_seqs, [query_len] * num_seqs, fit=h200_fits("bf16"))
    assert plan.num_splits == expect
    assert plan.split == (expect > 1) and plan.tiles_per_split == 0


@pytest.mark.parametrize(
    "num_seqs, seq_len, expect",
    [
        (64, 4096, 3),  # 1536 programs in 396 slots: 3.9 waves, the last one nearly full
        (256, 1024, 1),  # 5.2 waves: splitting only adds programs
        (4, 32768, 12),  # 384 programs: one wave
    ],
)
def test_split_choice_by_the_estimate(num_seqs, seq_len, expect):
    """Where nothing compiles (the interpreter), the register estimate's occupancy."""
    assert _plan(H200_LAYER, [seq_len] * num_seqs, [1] * num_seqs).num_splits == expect


def test_the_compiled_registers_choose_the_fp8_tile():
    """fp8 m16-n128 compiles to 168-178 registers (the estimate: 460): 3 split programs
    per SM hold 96 KiB of K/V in flight, which m16-n64 (spills when split) and m16-n32
    (4 x 8 KiB) do not; the estimate alone keeps m16-n32."""
    fp8 = LayerShape.of(SPEC.replace(kv_cache_dtype="fp8_e4m3"))
    compiled = _plan(fp8, [4096] * 64, [1] * 64, fit=h200_fits("fp8"))
    assert (compiled.tile.tile_n, compiled.split) == (128, True)
    assert _plan(fp8, [4096] * 64, [1] * 64).tile.tile_n == 32
    # nothing compiled (fit gives None): the estimate decides
    assert _plan(fp8, [4096] * 64, [1] * 64, fit=lambda tile, split: None).tile.tile_n == 32


def test_small_key_steps_do_not_count_as_saturating():
    """The twenty-second session's H200 compile of m16-n32 (D 128, bf16) took 80
    registers split: 6 programs x 16 KiB reach the 96 KiB in flight that m16-n64's 4 x
    32 KiB exceed, but ran slower on every decode row. A step must hold MIN_STEP_BYTES
    (32 KiB) to count; a layer too narrow for that (D 16) takes its widest step."""
    registers = {16: (80, 80), 32: (92, 80), 64: (128, 126), 128: (241, 200)}

    def fit(tile: TileConfig, form: LaunchForm) -> KernelFit:
        regs = registers[tile.tile_n][form is not LaunchForm.UNSPLIT]
        return KernelFit(regs, 0, 0, 65536 // (-(-regs // 8) * 8 * 32 * tile.num_warps))

    plan = _plan(H200_LAYER, [32768] * 4, [1] * 4, fit=fit)
    assert plan.tile.tile_n == 64, plan
    assert step_bytes(H200_LAYER, 32) * 6 >= BYTES_IN_FLIGHT_PER_SM
    assert not saturates(H200_LAYER, 32, 6 * step_bytes(H200_LAYER, 32))
    assert saturates(H200_LAYER, 64, 4 * step_bytes(H200_LAYER, 64))
    narrow = LayerShape.of(SPEC.replace(head_size=16))
    widest = step_bytes(narrow, 128)
    assert widest < MIN_STEP_BYTES and saturates(narrow, 128, 12 * widest)


def test_a_step_that_leaves_sms_idle_takes_short_splits():
    """A step of fewer programs than SMs unsplit splits down to 128 keys (H200,
    twenty-sixth session: 1 x 1024 in a graph reserved for 32k 15.0 -> 8.3 us at 8
    splits); one that fills the SMs keeps 512. A CUDA-graph plan is as wide as one
    request of its longest sequence splits at the floor of the bounds' fullest step:
    bounds of a full grid keep its narrow width, and their short steps still take short
    splits within it. A graph step keeps the short floor while its unsplit grid leaves
    slots of the split kernel free."""
    fit = h200_fits("bf16")
    assert _plan(H200_LAYER, [1024], [1], fit=fit).num_splits == 8  # 8 programs
    assert _plan(H200_LAYER, [700], [1], fit=fit).num_splits == 6
    assert _plan(H200_LAYER, [1024] * 16, [1] * 16, fit=fit).num_splits == 4  # 128
    assert _plan(H200_LAYER, [1024] * 17, [1] * 17, fit=fit).num_splits == 2  # 136
    assert _plan(H200_LAYER, [512] * 32, [1] * 32, fit=fit).num_splits == 1

    def width(seq_len, requests):
        bounds = _step([seq_len] * requests, [1] * requests)
        return plan_tiles(H200_LAYER, bounds, H200_SMS, bounded=True, fit=fit).num_splits

    assert width(1024, 1) == width(1024, 16) == 8
    assert width(1024, 256) == 2 and width(512, 32) == 1
    bounds = _step([32768] * 64, [1] * 64)
    graph = plan_tiles(H200_LAYER, bounds, H200_SMS, bounded=True, fit=fit)
    items = graph_items(H200_LAYER, graph, 64, H200_SMS)

    def in_graph(seq_len, requests):
        step = _step([seq_len] * requests, [1] * requests)
        return step_splits(H200_LAYER, step, graph, H200_SMS, fit, True, items)

    assert (in_graph(1024, 1).num_splits, in_graph(1024, 1).keys_per_split) == (8, 128)
    assert in_graph(1024, 64).num_splits == 1
    # a graph step pays the merge whatever its splits: 32 x 512 (256 programs, more than
    # the SMs, fewer than the split kernel's slots) splits in two there, not eagerly
    assert (in_graph(512, 32).num_splits, in_graph(512, 32).keys_per_split) == (2, 256)


def test_a_reserved_list_holds_32_programs_an_sm_and_binds_no_ragged_row():
    """A CUDA-graph plan's list of work items is capped in programs an SM, not in waves
    of its tile: what a step wants is items, whatever the tile's occupancy. H200, 16
    requests reserved for 32k: 528 items of 8 KV heads (4,224 programs), of which a
    16 x 1024 step takes 64 (twenty-seventh session: 31.0 -> 26.2 us from a list of 16
    waves of the m16-n64 tile). The cap leaves the choice of every decode step of the
    standard matrix on this layer as it is uncapped, in a reservation for 32k and in one
    of the step's own bounds."""
    fit = h200_fits("bf16")
    bounds = _step([32768] * 16, [1] * 16)
    graph = plan_tiles(H200_LAYER, bounds, H200_SMS, bounded=True, fit=fit)
    items = graph_items(H200_LAYER, graph, 16, H200_SMS)
    assert items * H200_LAYER.num_kv_heads == 32 * H200_SMS
    step = _step([1024] * 16, [1] * 16)
    assert step_splits(H200_LAYER, step, graph, H200_SMS, fit, True, items).num_splits == 4
    rows = [
        w for w in MATRICES["standard"]
        if w.layer == Layer() and max(w.query_lens) == 1 and w.kind != "prefill"
    ]  # fmt: skip
    assert {w.name for w in rows} >= {
        "decode-64x4096",
        "ragged-decode-128",
        "ragged-decode-32-long",
    }
    for w in rows:
        step = _step(list(w.seq_lens), list(w.query_lens))
        for seq_len in (32768, max(w.seq_lens)):
            reserved = _step([max(seq_len, *w.seq_lens)] * w.num_reqs, [1] * w.num_reqs)
            graph = plan_tiles(H200_LAYER, reserved, H200_SMS, bounded=True, fit=fit)
            capped = graph_items(H200_LAYER, graph, w.num_reqs, H200_SMS)
            choice = step_splits(H200_LAYER, step, graph, H200_SMS, fit, True, capped)
            free = step_splits(H200_LAYER, step, graph, H200_SMS, fit, True, None)
            assert choice == free, (w.name, seq_len, choice, free)


def test_eager_key_ranges_may_fall_between_powers_of_two():
    """An eager step's fixed key ranges are compared at 1.25x-1.75x powers of two of the
    tile too (the decodes of mixed-16d+1chunk on the H200: 20 tiles of 64 keys, where
    powers of two alone gave 8); a CUDA-graph step's stay powers of two."""
    seq_lens = [1237, 1659, 592, 3675, 2235, 1093, 3881, 855, 31622, 3561, 2074, 1949,
                2302, 10561, 2099, 2760]  # fmt: skip
    fit = h200_fits("bf16")
    plan = _plan(H200_LAYER, seq_lens, [1] * 16, fit=fit)
    assert plan.tile.tile_n == 64 and plan.tiles_per_split == 20, plan
    bounds = _step([32768] * 16, [1] * 16)
    graph = plan_tiles(H200_LAYER, bounds, H200_SMS, bounded=True, fit=fit)
    items = graph_items(H200_LAYER, graph, 16, H200_SMS)
    step = step_splits(H200_LAYER, _step(seq_lens, [1] * 16), graph, H200_SMS, fit, True, items)
    tiles = step.keys_per_split // 64
    assert step.fixed_ranges and tiles & (tiles - 1) == 0, step
    # the estimate the sweep records per range ranks the rule's pick first among them
    multiples = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112)
    ranges = [64 * m for m in multiples]
    estimates = key_range_estimates(H200_LAYER, _step(seq_lens, [1] * 16), plan.tile, ranges,
                                    H200_SMS, fit)  # fmt: skip
    assert ranges[int(np.argmin(estimates))] == 20 * 64, dict(zip(ranges, estimates))


def test_eager_key_ranges_tie_to_the_longest_power_of_two():
    """Within ``split_kv.RANGE_TIE`` of the best estimate an eager step takes the longest
    power of two of the tile, a multiple of one only where it wins by more: pagedkv
    bench's speculative 64x4 step (1280-key ranges best by the estimate, 2048 1.8%
    above) takes 2048 (H100: 359.4 us eager against 364.0 at the 1536 of the best
    estimate there), GQA 16 ragged (the best power of two 10% above) keeps 1792."""
    rows = {w.name: w for w in MATRICES["standard"]}
    fit = h200_fits("bf16")
    for name, tiles in (("spec-decode-64x4", 32), ("gqa16-ragged-decode", 28)):
        w = rows[name]
        layer = LayerShape.of(w.layer.spec())
        plan = _plan(layer, list(w.seq_lens), list(w.query_lens), fit=fit)
        assert plan.tile.tile_n == 64 and plan.tiles_per_split == tiles, (name, plan)
        ranges = [64 * t for t in (20, 24, 28, 32)]
        step = _step(list(w.seq_lens), list(w.query_lens))
        estimates = dict(
            zip(
                ranges,
                key_range_estimates(layer, step, plan.tile, ranges, H200_SMS, fit),
                strict=True,
            )
        )
        best = min(estimates.values())
        assert estimates[64 * tiles] <= best * (1 + RANGE_TIE), estimates
        if tiles & (tiles - 1) == 0:  # the power of two, not the best estimate
            assert estimates[64 * tiles] > best, estimates


def test_decodes_beside_a_chunk_take_powers_of_two_ranges():
    """The decodes of a two-part step share the GPU with the chunk (the impl's two
    streams), so the 1.25x-1.75x ranges, which fit the whole GPU's waves, are not
    compared: the same decodes as above, alone 20 tiles a range, take a power of two of
    the tile before a 256-query chunk (H200, mixed-16d+1chunk: eager 142 -> 130 us)."""
    seq_lens = [1237, 1659, 592, 3675, 2235, 1093, 3881, 855, 31622, 3561, 2074, 1949,
                2302, 10561, 2099, 2760]  # fmt: skip
    step = _step([*seq_lens, 4352], [*[1] * 16, 256])
    fit = h200_fits("bf16")
    decodes, _ = plan_step(H200_LAYER, step, H200_SMS, fit=fit)
    tiles = decodes.plan.tiles_per_split
    assert tiles > 0 and tiles & (tiles - 1) == 0, decodes.plan
    (alone,) = plan_step(H200_LAYER, _step(seq_lens, [1] * 16), H200_SMS, fit=fit)
    assert alone.plan.tiles_per_split == 20, alone.plan


def test_eager_splits_keep_their_partials_within_the_graph_plans_budget():
    """A decode-like step of many tokens splits no further than its partial results fit
    ``SPLIT_PARTIAL_BYTES``, eagerly as under a CUDA-graph reservation: speculative
    decoding, 64 requests x 4 tokens x 32 heads, at most 15 splits (H200: the uncapped
    rule's 1280-key ranges, 18 splits, ran 294 us; 2048-key ranges 279)."""
    rng = np.random.default_rng(5)
    seq_lens = np.minimum(32768, (rng.lognormal(0, 1, 64) * 2048).astype(int) + 4).tolist()
    fit = h200_fits("bf16")
    budget = SPLIT_PARTIAL_BYTES // partial_bytes_per_split(H200_LAYER, 256)
    assert budget == 15
    plan = _plan(H200_LAYER, seq_lens, [4] * 64, fit=fit)
    assert 1 < plan.num_splits <= budget, plan
    assert plan.num_splits * plan.tiles_per_split * plan.tile.tile_n >= max(seq_lens)
    # a CUDA-graph plan of bounds that hold the step: the same limit
    bounds = _step([max(seq_lens)] * 64, [4] * 64)
    graph = plan_tiles(H200_LAYER, bounds, H200_SMS, bounded=True, fit=fit)
    assert graph.num_splits == budget, graph
    # a step of few tokens keeps the policy's maximum
    one = _plan(H200_LAYER, [32768], [1], fit=fit)
    assert one.num_splits == SPLIT_POLICY.max_splits


def test_key_ranges_are_estimated_with_their_own_launchs_occupancy():
    """Each launch form compiles to its own variant (H200, GQA 16: the listed key ranges
    hold 4 programs per SM where even shares hold 3): the ranges' estimate and choice
    read the KEY_RANGES fit, even shares the EVEN_SHARES one."""
    layer = dataclasses.replace(H200_LAYER, num_heads=64, num_kv_heads=4)
    rng = np.random.default_rng(3)
    seq_lens = rng.integers(200, 9000, 40).tolist()
    step = _step(seq_lens, [1] * 40)
    tile = TileConfig(16, 64, 4, 2)

    def fit_with(even: int, ranges: int):
        def fit(t: TileConfig, form: LaunchForm) -> KernelFit:
            per_sm = {LaunchForm.UNSPLIT: 3, LaunchForm.EVEN_SHARES: even}.get(form, ranges)
            return KernelFit(126, 0, 0, per_sm)

        return fit

    ranges = [512, 768, 1024, 1280, 1792, 2048]
    estimate = {
        (even, rng_): key_range_estimates(layer, step, tile, ranges, H200_SMS, fit_with(even, rng_))
        for even, rng_ in ((3, 4), (4, 4), (3, 3))
    }
    np.testing.assert_array_equal(estimate[(3, 4)], estimate[(4, 4)])  # even shares' fit unread
    assert not np.allclose(estimate[(3, 4)], estimate[(3, 3)])  # the ranges' fit is
    # and the rule's choice follows the ranges' fit
    plans = {
        key: _plan(layer, seq_lens, [1] * 40, fit=fit_with(*key), tile=tile)
        for key in ((3, 4), (3, 3))
    }
    assert plans[(3, 4)].tiles_per_split != plans[(3, 3)].tiles_per_split, plans


def test_a_ragged_batch_splits_its_long_requests():
    """One long request among short ones would be the grid's critical path: it is cut
    until its programs stream no more than about the step's work per slot."""
    seq_lens = [32768] + [1024] * 127
    fit = h200_fits("bf16")
    plan = _plan(H200_LAYER, seq_lens, [1] * 128, fit=fit)
    slots = slots_per_sm(H200_LAYER, plan.tile, LaunchForm.EVEN_SHARES, fit) * H200_SMS
    work_per_slot = sum(seq_lens) * H200_LAYER.num_kv_heads / slots
    assert plan.num_splits > 1 and 32768 / plan.num_splits <= work_per_slot * 1.25
    # without its long request the batch takes fewer splits (2: the split tile holds 4
    # programs per SM against the unsplit one's 3)
    assert _plan(H200_LAYER, [1024] * 128, [1] * 128, fit=fit).num_splits < plan.num_splits


def test_mixed_steps_launch_decodes_and_chunks_apart():
    """Decodes first and chunks after (or the reverse) are two launches, each with its
    own rows and splits: the decodes' long tail splits, the chunks keep 64-row tiles."""
    step = _step([32768] + [2048] * 15 + [4352], [1] * 16 + [256])
    decodes, chunk = plan_step(H200_LAYER, step, H200_SMS)
    assert (decodes.first, decodes.end, chunk.first, chunk.end) == (0, 16, 16, 17)
    assert decodes.plan.tile.block_m == 16 and decodes.plan.num_splits > 1
    assert chunk.plan.tile.block_m == 64
    reverse = plan_step(H200_LAYER, _step([4352] + [2048] * 4, [256] + [1] * 4), H200_SMS)
    assert [(p.first, p.end) for p in reverse] == [(0, 1), (1, 5)]
    # a request without queries (padding) joins the run before it, as in a CUDA-graph
    # step (parts.decode_and_longer_runs, the one split of a step into its two runs)
    padded = plan_step(H200_LAYER, _step([4352, 2048, 2048, 1], [256, 1, 1, 0]), H200_SMS)
    assert [(p.first, p.end) for p in padded] == [(0, 1), (1, 4)]
    padded = plan_step(H200_LAYER, _step([2048, 4352, 1], [1, 256, 0]), H200_SMS)
    assert [(p.first, p.end) for p in padded] == [(0, 1), (1, 3)]
    # interleaved kinds, forced tiles and CUDA-graph plans stay one launch
    interleaved = _step([2048, 4352, 2048], [1, 256, 1])
    assert len(plan_step(H200_LAYER, interleaved, H200_SMS)) == 1
    assert len(plan_step(H200_LAYER, step, H200_SMS, bounded=True)) == 1
    assert len(plan_step(H200_LAYER, step, H200_SMS, forced_splits=2)) == 1


def test_splits_keep_a_grid_out_of_a_thin_last_wave():
    """Wave quantisation: 31 requests of 64k keys x 8 KV heads at 2 splits are 496
    programs, one wave of the H200's 528 split slots; 34 requests at 2 splits would be
    544, a second wave of 16 programs as long as the first, so the rule takes many
    short programs instead (the choice is not monotone in the batch size)."""
    fit = h200_fits("bf16")
    assert _plan(H200_LAYER, [1 << 16] * 31, [1] * 31, fit=fit).num_splits == 2
    many = _plan(H200_LAYER, [1 << 16] * 34, [1] * 34, fit=fit).num_splits
    assert many >= 8 and 34 * 8 * many > 2 * 528


def test_rows_follow_the_work():
    """Decodes keep one 16-row block per request; long queries take 64-row blocks
    (wgmma); speculative tokens and wide GQA groups stay in one block per request."""
    decode = _plan(H200_LAYER, [4096] * 64, [1] * 64)
    assert decode.tile.block_m == 16 and decode.block_q == 4
    prefill = _plan(H200_LAYER, [2048] * 8, [2048] * 8)
    assert prefill.tile.block_m == 64
    # 4 speculative tokens x GQA 8 = 32 rows: one block per request
    spec8 = LayerShape.of(SPEC.replace(num_heads=64))
    assert _plan(spec8, [4096] * 64, [4] * 64).tile.block_m == 32
    # a group of 32 query heads is one program's rows
    mqa = LayerShape.of(SPEC.replace(num_kv_heads=1))
    assert _plan(mqa, [4096] * 8, [1] * 8).tile.block_m == 32
    # a mixed step whose work is in one long chunk takes the chunk's rows, one whose
    # work is in the decodes keeps the decode rows
    assert _plan(H200_LAYER, [4096] * 64 + [8192], [1] * 64 + [4096]).tile.block_m == 64
    assert _plan(H200_LAYER, [4096] * 256 + [300], [1] * 256 + [40]).tile.block_m == 16


def test_rule_keeps_the_h200_measurements():
    """Where the H200 sweep measured (bf16, D 128, docs/benchmarks.md), the rule picks
    a tile the sweep put among the fastest spill-free ones."""
    prefill = _plan(H200_LAYER, [2048] * 8, [2048] * 8).tile
    assert (prefill.block_m, prefill.tile_n, prefill.num_warps) == (64, 32, 4)
    decode = _plan(H200_LAYER, [4096] * 64, [1] * 64).tile
    assert (decode.block_m, decode.num_warps) == (16, 4) and decode.tile_n in (64, 128)


LAYERS = [
    SPEC.replace(head_size=d, num_heads=8 * g, dtype=dtype, kv_cache_dtype=kv, block_size=b)
    for d in (32, 64, 128, 256)
    for g in (1, 4, 8, 16)
    for dtype, kv in (
        (torch.bfloat16, "auto"),
        (torch.bfloat16, "fp8_e4m3"),
        (torch.float32, "auto"),
    )
    for b in (16, 64)
]
STEPS = {
    "decode": ([4096] * 64, [1] * 64),
    "long-decode": ([32768] * 2, [1] * 2),
    "spec-decode": ([2048] * 32, [4] * 32),
    "mixed": ([3000] * 48 + [5000], [1] * 48 + [1024]),
    "prefill": ([2048] * 4, [2048] * 4),
}


@pytest.mark.parametrize("step", STEPS)
def test_every_planned_tile_fits_the_kernel_rules(step):
    seq_lens, query_lens = STEPS[step]
    for spec in LAYERS:
        layer = LayerShape.of(spec)
        for invariant in (False, True):
            plan = _plan(layer, seq_lens, query_lens, batch_invariant=invariant)
            t = plan.tile
            assert t.block_m >= 16 and t.tile_n >= 16, (spec, t)
            assert t.block_m & (t.block_m - 1) == 0 and t.tile_n & (t.tile_n - 1) == 0
            assert plan.block_q == t.block_m // layer.group >= 1
            assert t.num_warps in (4, 8) and t.num_stages == 2
            assert t.tile_n == 16 or fits(layer, t.block_m, t.tile_n, t.num_warps), (spec, t)
            assert 1 <= plan.num_splits <= SPLIT_POLICY.max_splits


def test_batch_invariant_plan_depends_on_the_layer_only():
    layer = H200_LAYER
    plans = [
        _plan(layer, seq_lens, query_lens, batch_invariant=True)
        for seq_lens, query_lens in STEPS.values()
    ]
    assert len({p.tile for p in plans}) == 1
    for p, (seq_lens, _) in zip(plans, STEPS.values(), strict=True):
        keys = p.tiles_per_split * p.tile.tile_n
        assert p.split and p.ordered_reduction and keys == 512
        assert p.num_splits == -(-max(seq_lens) // keys)


def test_the_batch_invariant_merge_takes_any_number_of_splits():
    """The batch-invariant plan cuts a sequence into fixed ranges however long it is,
    past the 64 splits the default merge's tile widths hold: its ordered merge takes
    them one by one (33000 keys: 65 ranges of 512)."""
    scenario = Scenario(
        "invariant-65-splits", seq_lens=(33000, 40), query_lens=(1, 1), num_heads=4,
        num_kv_heads=2, head_size=32, dtype=torch.float16,
    )  # fmt: skip
    problem = build_problem(scenario, DEVICE)
    backend = pagedkv.get_backend("triton", batch_invariant=True)
    metadata = backend.make_builder(problem.spec, DEVICE).build(problem.common)
    assert metadata.num_splits == 65 and metadata.parts[0].reduce.kwargs["ORDERED"]
    _check(scenario, batch_invariant=True)


def test_forced_splits_option_is_checked():
    with pytest.raises(ConfigError, match="num_splits=65: expected 0"):
        pagedkv.get_backend("triton", num_splits=65)
    with pytest.raises(ConfigError, match="num_splits=65: expected 0"):
        TritonMetadataBuilder(SPEC, "cpu", num_splits=65)
    with pytest.raises(ConfigError, match="expected an int"):
        pagedkv.get_backend("triton", num_splits="many")


# -- CUDA-graph bounds (the mechanics, runnable on a CPU) ------------------------------------


def _reserved(bounds: GraphBounds, num_blocks: int, layer: dict | None = None, **options):
    """A builder reserved for ``bounds``, an eager one, the impl and a random cache, for
    a small fp16 layer (Hq 4, Hkv 2, D 32, or with ``layer``'s changes)."""
    shape = {**dict(num_heads=4, num_kv_heads=2, head_size=32), **(layer or {})}
    spec = SPEC.replace(dtype=torch.float16, **shape)
    backend = pagedkv.get_backend("triton", **options)
    builder = backend.make_builder(spec, DEVICE)
    builder.reserve_cuda_graph(bounds)
    cache = backend.allocate_kv_cache(num_blocks, spec, DEVICE)
    cache.normal_()
    return builder, backend.make_builder(spec, DEVICE), backend.make_impl(spec), cache


def test_reserved_builds_keep_one_plan_and_their_buffers():
    """Under a reservation every step gets the same plan and the same buffers (the step
    arrays and the split partials), and attends as an eager step does."""
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=6, max_blocks_per_req=8, max_query_len=3)
    builder, eager_builder, impl, cache = _reserved(bounds, 40, num_splits=3)
    gen = torch.Generator().manual_seed(0)
    seen = None
    for seq_lens, query_lens, blocks in (
        ([20, 33], [1, 3], [[3, 4], [5, 6, 7]]),
        ([5, 120, 2], [1, 1, 2], [[9], list(range(10, 18)), [8]]),
    ):
        common = CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 16, DEVICE)
        md = builder.build(common)
        buffers = [md.common.query_start_loc, md.common.block_table, md.common.seq_lens]
        buffers += [md.parts[0].attention.kwargs[k] for k in ("PartAcc", "PartMax", "PartSum")]
        now = (md.plan, md.parts[0].attention.grid, [b.data_ptr() for b in buffers])
        assert seen is None or now == seen
        seen = now
        n = common.num_tokens
        q = torch.randn(6, 4, 32, generator=gen).half().to(DEVICE)
        out = impl.forward(q, None, None, cache, md)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("max_query_len", [1, 40])
def test_a_reservation_is_planned_at_its_first_step(monkeypatch, max_query_len):
    """A CUDA-graph plan comes from the bounds alone: it is planned at the reservation's
    first step and kept (pure decodes: ``plan_step``; decodes and chunks: the two
    ``plan_tiles``), planned again for another override of the rule, and the same as a
    builder planning it afresh."""
    from pagedkv.backends.triton import builder as triton_builder

    calls = []
    for name in ("plan_step", "plan_tiles"):
        planner = getattr(triton_builder, name)
        counted = lambda *a, planner=planner, name=name, **k: calls.append(name) or planner(*a, **k)  # noqa: E731
        monkeypatch.setattr(triton_builder, name, counted)
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=44, max_blocks_per_req=70,
                         max_query_len=max_query_len)  # fmt: skip
    builder, *_ = _reserved(bounds, 400)
    steps = (([1100, 40], [1, 1], [list(range(1, 70)), [70, 71, 72]]),
             ([300, 7, 9], [1, 1, 1], [list(range(73, 92)), [92], [93]]))  # fmt: skip
    plans = []
    for seq_lens, query_lens, blocks in steps:
        common = CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 16, DEVICE)
        plans.append([p.plan for p in builder.build(common).parts])
    planned = len(calls)
    assert planned == (1 if max_query_len == 1 else 2), calls
    assert plans[0] == plans[1]
    fresh, *_ = _reserved(bounds, 400)
    assert [p.plan for p in fresh.build(common).parts] == plans[1]
    if max_query_len == 1:  # another forced split count: another plan
        builder.build(common, num_splits=2)
        assert len(calls) == 2 * planned + 1, calls


def test_keys_per_split_override_runs_fixed_ranges():
    """``build(..., keys_per_split=K)`` (tuning: benchmarks/triton_sweep.py --key-ranges)
    splits every sequence into fixed K-key ranges, K any whole number of key tiles (here
    3), listed and trimmed like the rule's ranges, and attends as the rule's plan does;
    what it cannot run is refused by name."""
    reserved, eager_builder, impl, cache = _reserved(GraphBounds(4, 4, 70), 400)
    seq_lens, blocks = (
        [1100, 40, 300, 7],
        [list(range(1, 70)), [70, 71, 72], list(range(73, 92)), [92]],
    )
    common = CommonAttentionMetadata.from_requests(seq_lens, [1] * 4, blocks, 16, DEVICE)
    tile_n = eager_builder.build(common).plan.tile.tile_n
    md = eager_builder.build(common, keys_per_split=3 * tile_n)
    plan = md.plan
    assert plan.trim_splits and plan.tiles_per_split == 3
    assert plan.num_splits == -(-1100 // (3 * tile_n)), md.describe()
    attention = md.parts[0].attention
    assert attention.kwargs["RANGE_LIST"]
    # an item's KV heads adjacent: one axis of items x heads
    assert attention.grid == (sum(-(-n // (3 * tile_n)) for n in seq_lens) * 2, 1, 1)
    q = torch.randn(4, 4, 32, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    want = impl.forward(q, None, None, cache, eager_builder.build(common, num_splits=1))
    assert torch.allclose(impl.forward(q, None, None, cache, md), want, atol=1e-3, rtol=1e-3)
    with pytest.raises(ConfigError, match=f"multiple of the tile's {tile_n} keys"):
        eager_builder.build(common, keys_per_split=tile_n + 1)
    long = 64 * tile_n + 1
    one = CommonAttentionMetadata.from_requests(
        [long], [1], [list(range(1, -(-long // 16) + 1))], 16, DEVICE
    )
    per_range = -(-long // 64)  # the fewest keys a range of 64 may hold
    least = -(-per_range // tile_n) * tile_n
    with pytest.raises(ConfigError, match=f"into 65 ranges; at most 64: expected at least {least}"):
        eager_builder.build(one, keys_per_split=tile_n)
    with pytest.raises(ConfigError, match="not with num_splits"):
        eager_builder.build(common, keys_per_split=3 * tile_n, num_splits=2)
    with pytest.raises(ConfigError, match="a CUDA-graph reservation"):
        reserved.build(common, keys_per_split=3 * tile_n)
    chunk = CommonAttentionMetadata.from_requests([40], [20], [[1, 2, 3]], 16, DEVICE)
    with pytest.raises(ConfigError, match="decode-like steps only"):
        eager_builder.build(chunk, keys_per_split=3 * tile_n)
    # the reduction merges every range below a row's keys, the kernel skips those
    # before a window: the rule's own ranges avoid windows, and so must the override
    windowed = pagedkv.get_backend("triton").make_builder(
        eager_builder.spec.replace(sliding_window=64), DEVICE
    )
    with pytest.raises(ConfigError, match="fixed key ranges with a sliding window"):
        windowed.build(common, keys_per_split=3 * tile_n)


def test_reserved_decode_grid_is_capped_and_steps_stay_within(monkeypatch):
    """A decode reservation's list of work items holds at most
    GRAPH_ITEM_PROGRAMS_PER_SM split programs an SM (each item not used is a program that
    starts and exits): with a cap below every split of every request, the grid is the
    cap, each step's split choice keeps within it, and the steps still attend as eager
    ones do."""
    from pagedkv.backends.triton import configs

    monkeypatch.setattr(configs, "GRAPH_ITEM_PROGRAMS_PER_SM", 4)
    bounds = GraphBounds(max_num_reqs=8, max_num_tokens=8, max_blocks_per_req=320, max_query_len=1)
    builder, eager_builder, impl, cache = _reserved(bounds, 400)
    builder.num_sms = 8  # a small GPU: 32 programs, 16 items of 2 KV heads
    gen = torch.Generator().manual_seed(1)
    grids, totals = set(), []
    # uncapped, the first step takes 8 even splits of each request (64 items)
    for seq_lens in ([5020, 4000, 3000, 2000, 1000, 600, 300, 100], [2500]):
        blocks, first = [], 0
        for n in seq_lens:  # pages may repeat across requests (the cache has 400)
            blocks.append([1 + (first + j) % 399 for j in range(-(-n // 16))])
            first += len(blocks[-1])
        common = CommonAttentionMetadata.from_requests(
            seq_lens, [1] * len(seq_lens), blocks, 16, DEVICE
        )
        md = builder.build(common)
        attention = md.parts[0].attention
        layer = LayerShape.of(impl.spec)
        cap = configs.graph_items(layer, md.plan, 8, builder.num_sms)
        assert cap < 8 * md.plan.num_splits  # the cap binds
        grids.add(attention.grid)
        assert attention.grid == (cap * 2, 1, 1)
        totals.append(attention.kwargs["RangeStarts"].tolist()[-1])
        assert totals[-1] <= cap
        n = common.num_tokens
        q = torch.randn(8, 4, 32, generator=gen).half().to(DEVICE)
        out = impl.forward(q, None, None, cache, md)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3)
    assert len(grids) == 1 and totals[0] > 8, totals  # the first step still splits


def test_reserved_even_shares_find_each_items_request_by_a_division():
    """A CUDA-graph step of even shares (each request the same number of work items,
    the padding requests after them) tells the kernel so (``NumSplits[4]``): an item's
    request is its index over that count, no search; both steps attend as eager ones."""
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=4, max_blocks_per_req=160, max_query_len=1)
    builder, eager_builder, impl, cache = _reserved(bounds, 400)
    gen = torch.Generator().manual_seed(2)
    for num_reqs in (4, 3):  # the second step is padded with a request without queries
        # (pages may repeat across requests: the cache has 400)
        blocks = [[1 + (157 * i + j) % 399 for j in range(157)] for i in range(num_reqs)]
        common = CommonAttentionMetadata.from_requests(
            [2500] * num_reqs, [1] * num_reqs, blocks, 16, DEVICE
        )
        md = builder.build(common)
        written = StepSplits.read(md.parts[0].attention.kwargs["NumSplits"])
        splits = written.num_splits
        assert not md.step_choice.fixed_ranges and splits > 1 and written.per_request == splits
        n = common.num_tokens
        q = torch.randn(4, 4, 32, generator=gen).half().to(DEVICE)
        out = impl.forward(q, None, None, cache, md)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3)


def test_reserved_decode_steps_choose_their_own_splits():
    """A decode reservation keeps one grid and one set of buffers, the most splits any
    step within the bounds may take, and each step's own split count is written where
    the kernels read it: a lone long request splits, a full batch of short ones does
    not, and both attend as eager steps do."""
    bounds = GraphBounds(max_num_reqs=8, max_num_tokens=8, max_blocks_per_req=320, max_query_len=1)
    builder, eager_builder, impl, cache = _reserved(bounds, 400)
    gen = torch.Generator().manual_seed(0)
    seen, chosen, first, ranged = None, [], None, []
    short = [list(range(378 + 3 * i, 381 + 3 * i)) for i in range(6)]
    for seq_lens, blocks in (
        ([2500], [list(range(1, 158))]),  # one long request: many splits
        ([40] * 8, [[2 * i + 1, 2 * i + 2, 2 * i + 3] for i in range(8)]),  # short ones
        # one long request among shorter ones: fixed key ranges
        ([5020, 1000, *[40] * 6], [list(range(1, 315)), list(range(315, 378)), *short]),
    ):
        common = CommonAttentionMetadata.from_requests(
            seq_lens, [1] * len(seq_lens), blocks, 16, DEVICE
        )
        md = builder.build(common)
        plan = md.plan
        assert plan.dynamic_splits and plan.num_splits > 1
        num_splits = md.parts[0].attention.kwargs["NumSplits"]
        # (each block's last split merges them, or the merge kernel a step of more)
        assert md.parts[0].attention.kwargs["MERGE_LAST"]
        assert md.parts[0].reduce.kwargs["SKIP_MERGED"]
        splits, tiles, keys, partial_first, per_request, _merged = StepSplits.read(num_splits)
        assert partial_first == 0  # a pure-decode step's partials: the step's rows
        assert splits == md.step_splits and 1 <= md.step_splits <= plan.num_splits
        choice = md.step_choice  # even shares (0) or fixed key ranges of whole tiles
        assert (tiles, keys) == ((0, 0) if not choice.fixed_ranges else
                                 (keys // plan.tile.tile_n, choice.keys_per_split))  # fmt: skip
        # even shares: an item's request is a division (the padding requests come last)
        assert per_request == (0 if choice.fixed_ranges else splits)
        ranged.append(choice.fixed_ranges)
        # the grid lists every split of every request of the bounds (within
        # GRAPH_ITEM_PROGRAMS_PER_SM an SM here); this step's work items (its ranges that hold
        # keys, or all its splits) come first
        attention = md.parts[0].attention
        assert attention.kwargs["RANGE_LIST"] and attention.grid == (8 * plan.num_splits * 2, 1, 1)
        per_request = [-(-n // keys) if choice.fixed_ranges else splits for n in seq_lens]
        assert attention.kwargs["RangeStarts"].tolist()[-1] == sum(per_request)
        buffers = [num_splits, *(md.parts[0].attention.kwargs[k] for k in ("PartAcc", "PartMax"))]
        now = (plan, md.parts[0].attention.grid, [b.data_ptr() for b in buffers])
        assert seen is None or now == seen
        seen = now
        chosen.append(md.step_splits)
        n = common.num_tokens
        q = torch.randn(8, 4, 32, generator=gen).half().to(DEVICE)
        # an emulated replay: the first step's launches (what a graph captured), this
        # step's buffer contents, its split count among them
        first = first or md
        out = impl.forward(q, None, None, cache, first)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3)
    assert chosen[0] > chosen[1] == 1, chosen  # the lone long request splits, the batch not
    # the ragged step balances its requests with fixed key ranges, inside the same graph
    # (a lone request's ranges and even shares are the same cut: either may be taken)
    assert ranged[1:] == [False, True], ranged
    assert "keys of at most" in md.describe()


def test_reserved_unlisted_decodes_take_one_axis_of_heads_requests_and_splits():
    """Under ``split_grid=blocks`` a decode reservation launches a program per (KV head,
    request, split) of its bounds, on one axis (the kernel's dynamic by-request variant:
    on three it compiled to 156 registers on sm_90 instead of its probe's 126); the
    programs past a step's requests or splits exit, and every step (a lone request, a
    batch, a ragged one of fixed key ranges, one padded) attends as an eager step does."""
    bounds = GraphBounds(max_num_reqs=8, max_num_tokens=8, max_blocks_per_req=320, max_query_len=1)
    builder, eager_builder, impl, cache = _reserved(bounds, 400, split_grid="blocks")
    gen = torch.Generator().manual_seed(3)
    first, splits = None, set()
    short = [list(range(378 + 3 * i, 381 + 3 * i)) for i in range(6)]
    for seq_lens, blocks in (
        ([2500], [list(range(1, 158))]),
        ([40] * 8, [[2 * i + 1, 2 * i + 2, 2 * i + 3] for i in range(8)]),
        ([5020, 1000, *[40] * 6], [list(range(1, 315)), list(range(315, 378)), *short]),
        ([900, 40, 3000], [list(range(1, 58)), [60, 61, 62], list(range(100, 288))]),
    ):
        common = CommonAttentionMetadata.from_requests(
            seq_lens, [1] * len(seq_lens), blocks, 16, DEVICE
        )
        md = builder.build(common)
        attention = md.parts[0].attention
        assert md.plan.dynamic_splits and attention.kwargs["BLOCK_PER_REQUEST"]
        assert not attention.kwargs["RANGE_LIST"]
        assert attention.grid == (2 * 8 * md.plan.num_splits, 1, 1), attention.grid
        splits.add(md.step_splits)
        n = common.num_tokens
        q = torch.randn(8, 4, 32, generator=gen).half().to(DEVICE)
        first = first or md  # an emulated replay: the first step's launches
        out = impl.forward(q, None, None, cache, first)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3)
    assert len(splits) > 1, splits  # the steps took different splits in one grid


@pytest.mark.parametrize("heads", [4, 64])
def test_each_row_is_merged_in_the_narrowest_tile_that_holds_its_splits(monkeypatch, heads):
    """The merge of a launch whose rows take fewer splits than its most (a CUDA-graph
    plan's steps, a ragged step's fixed key ranges) picks per row the narrowest
    power-of-two tile that holds them, from ``REDUCE_MIN_WIDTH`` (here 2, so that the
    CPU's small plans meet several widths), with more heads a program: with 64 heads the
    programs a narrower tile leaves without heads exit. Every width attends as one pass
    does, with the sink. A launch whose rows all take its splits compiles one width."""
    from pagedkv.backends.triton import builder as triton_builder

    monkeypatch.setattr(triton_builder, "REDUCE_MIN_WIDTH", 2)
    bounds = GraphBounds(max_num_reqs=3, max_num_tokens=3, max_blocks_per_req=320, max_query_len=1)
    layer = dict(num_heads=heads, head_size=32 if heads == 4 else 64)
    reserved, eager_builder, _, cache = _reserved(bounds, 400, layer, split_merge="separate")
    sinks = torch.linspace(-1.0, 2.0, heads, device=DEVICE)
    impl = pagedkv.get_backend("triton").make_impl(
        reserved.spec.replace(use_sinks=True), sinks=sinks
    )
    gen = torch.Generator().manual_seed(4)
    widths = set()
    for seq_lens in ([5000], [2500, 1200, 30], [40, 60, 50], [5000, 40, 300]):
        common = _decodes_on_consecutive_pages(seq_lens)
        md = reserved.build(common)
        reduce = md.parts[0].reduce
        assert reduce.kwargs["MIN_WIDTH"] == 2 < reduce.kwargs["SPLIT_PAD"], md.describe()
        # (64 heads: several programs a token, for the widest tile; a narrower one
        # leaves some of them without heads)
        assert (reduce.grid[1] > 1) == (heads == 64), reduce.grid
        widths.add(md.step_splits)
        d = reserved.spec.head_size
        q = torch.randn(3, heads, d, generator=gen).half().to(DEVICE)  # the bounds' rows
        n = len(seq_lens)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common, num_splits=1))
        got = impl.forward(q, None, None, cache, md)[:n]
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert len(widths) >= 3 and 1 in widths, widths  # one split up to many
    forced = eager_builder.build(common, num_splits=3)
    assert forced.parts[0].reduce.kwargs["MIN_WIDTH"] == 4  # every row merges its 3


def test_a_mixed_reservations_launches_choose_splits_for_their_captured_form(monkeypatch):
    """Each launch of a mixed reservation chooses its step's splits for the form it was
    captured in: the decodes' list of work items, the longer requests' grid of query
    blocks, even where this step's longer requests are speculative ones that would fit
    a list (one query block each)."""
    import pagedkv.backends.triton.builder as builder_module

    asked = []
    real = builder_module.step_splits

    def recording(layer, step, plan, num_sms, fit=None, listing=True, max_items=None):
        asked.append((int(step.max_query_len), listing, max_items is not None))
        return real(layer, step, plan, num_sms, fit, listing, max_items)

    monkeypatch.setattr(builder_module, "step_splits", recording)
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=40, max_blocks_per_req=320,
                         max_query_len=32)  # fmt: skip
    builder, *_ = _reserved(bounds, 400)
    blocks = [list(range(1, 161)), list(range(161, 321))]
    common = CommonAttentionMetadata.from_requests([2500, 2500], [1, 4], blocks, 16, DEVICE)
    decodes, longer = builder.build(common).parts
    assert decodes.attention.kwargs["RANGE_LIST"]
    assert longer.plan.dynamic_splits and longer.choice.num_splits > 1  # it did split
    assert longer.plan.block_q >= 4 and not longer.attention.kwargs["RANGE_LIST"]
    # (queries, listed, capped): the decodes' list, then the longer requests' grid
    assert asked == [(1, True, True), (4, False, False)], asked


def test_reserved_mixed_steps_cap_only_a_list_of_work_items():
    """The cap of a captured list of work items (``graph_items``) binds a listed launch
    only: under ``split_grid=blocks`` a mixed reservation's decodes (a program per
    head, request and split) split as the listed ones do (a lone long decode: the plan's
    most), and both attend as an eager step does."""
    bounds = GraphBounds(
        max_num_reqs=4, max_num_tokens=40, max_blocks_per_req=320, max_query_len=32
    )
    seq_lens = [5000, 40]
    blocks = [[1 + j % 399 for j in range(-(-n // 16))] for n in seq_lens]
    common = CommonAttentionMetadata.from_requests(seq_lens, [1, 32], blocks, 16, DEVICE)
    chosen = {}
    q = torch.randn(40, 4, 32, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    for split_grid in ("auto", "blocks"):
        builder, eager_builder, impl, cache = _reserved(bounds, 400, split_grid=split_grid)
        md = builder.build(common)
        chosen[split_grid] = (md.step_splits, md.parts[0].plan.num_splits)
        # (blocks: the decodes' by-request launch on one axis, the kernel's note)
        decodes = md.parts[0].attention
        assert decodes.kwargs["RANGE_LIST"] == (split_grid == "auto")
        assert decodes.kwargs["BLOCK_PER_REQUEST"] == (split_grid == "blocks")
        n = common.num_tokens
        out = impl.forward(q, None, None, cache, md)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3)
    assert chosen["blocks"] == chosen["auto"], chosen
    assert chosen["auto"][0] == chosen["auto"][1] > 4, chosen  # more than max_num_reqs


def test_reserved_mixed_steps_launch_decodes_and_longer_requests_apart():
    """Under bounds that allow chunk-length queries a step runs as two captured launches:
    its run of decodes and its run of longer requests, each copied into its launch's
    persistent buffers and each with the splits the step chooses within its plan's
    width. Whatever the composition (decodes first or last, only one kind, kinds
    interleaved: all to the longer launch), every step keeps the grids and buffers of
    the first and attends as an eager step does."""
    bounds = GraphBounds(max_num_reqs=5, max_num_tokens=48, max_blocks_per_req=160,
                         max_query_len=24)  # fmt: skip
    builder, eager_builder, impl, cache = _reserved(bounds, 200)
    gen = torch.Generator().manual_seed(0)

    def pages(*lens):
        start, rows = 1, []
        for n in lens:
            rows.append(list(range(start, start + -(-n // 16))))
            start += len(rows[-1])
        return rows

    # (seq_lens, query_lens, decode run, longer run); the padding requests up to the
    # bounds' 5 join the run before them
    steps = (
        # decodes, then a speculative request and a chunk (the longer launch's)
        ((2500, 40, 300, 100), (1, 1, 3, 24), (0, 2), (2, 5)),
        ((64, 2000, 30), (20, 1, 1), (1, 5), (0, 1)),  # a chunk, then decodes
        ((1200, 17, 90), (1, 1, 1), (0, 5), (5, 5)),  # decodes only
        ((24, 400), (24, 16), (0, 0), (0, 5)),  # longer requests only
        ((900, 50, 33, 700), (1, 20, 1, 12), (0, 0), (0, 5)),  # interleaved: one launch
    )
    first, seen, choices = None, None, set()
    for seq_lens, query_lens, decode_run, longer_run in steps:
        common = CommonAttentionMetadata.from_requests(
            list(seq_lens), list(query_lens), pages(*seq_lens), 16, DEVICE
        )
        md = builder.build(common)
        decodes, longer = md.parts
        assert (decodes.role, longer.role) == ("decodes", "longer requests")
        assert (decodes.first, decodes.end) == decode_run
        assert (longer.first, longer.end) == longer_run
        assert decodes.plan.dynamic_splits and longer.plan.dynamic_splits
        assert decodes.attention.kwargs["RANGE_LIST"]  # one program per work item
        assert not longer.attention.kwargs["RANGE_LIST"]  # chunks: query blocks x splits
        # ... in even shares, so their kernel keeps no range check (its registers)
        assert not longer.attention.kwargs["TRIM_SPLITS"] and not longer.choice.fixed_ranges
        for part, run in ((decodes, decode_run), (longer, longer_run)):
            # each part's split count and its partials' first row: its first token
            written = StepSplits.read(part.attention.kwargs["NumSplits"])
            assert written.num_splits == part.choice.num_splits <= part.plan.num_splits
            assert written.partial_first == md.common.query_start_loc_cpu[run[0]]
            choices.add((part.role, part.choice.num_splits))
        kwargs = [p.attention.kwargs for p in md.parts]
        buffers = [k[name] for k in kwargs for name in ("QueryStartLoc", "SeqLens", "BlockTable")]
        buffers += [k[name] for k in kwargs for name in ("NumSplits", "PartAcc")]
        now = ([p.plan for p in md.parts], [p.attention.grid for p in md.parts],
               [b.data_ptr() for b in buffers])  # fmt: skip
        assert seen is None or now == seen
        seen = now
        assert md.describe().startswith("graph parts; decodes")
        n = common.num_tokens
        q = torch.randn(48, 4, 32, generator=gen).half().to(DEVICE)
        first = first or md  # an emulated replay of the first step's launches
        out = impl.forward(q, None, None, cache, first)
        want = impl.forward(q[:n], None, None, cache, eager_builder.build(common))
        assert torch.allclose(out[:n], want, atol=1e-3, rtol=1e-3), (query_lens, md.describe())
    # the longer launch split its long contexts and kept short ones whole
    assert {n for role, n in choices if role == "longer requests"} > {1}, choices


# -- bad metadata is refused or honoured, never read wrongly ---------------------------------

SMALL = SPEC.replace(dtype=torch.float16, num_heads=4, num_kv_heads=2, head_size=32)


def _small_problem():
    backend = pagedkv.get_backend("triton")
    gen = torch.Generator().manual_seed(3)
    cache = backend.allocate_kv_cache(12, SMALL, DEVICE)
    cache.copy_(torch.randn(cache.shape, generator=gen).half())
    common = CommonAttentionMetadata.from_requests(
        [40, 7, 33], [3, 7, 1], [[4, 9, 2], [7], [11, 1, 5]], 16, DEVICE
    )
    q = torch.randn(common.num_tokens, 4, 32, generator=gen).half().to(DEVICE)
    return backend, cache, common, q


def _strided(t: torch.Tensor, junk: int) -> torch.Tensor:
    """The same values as ``t`` in a view whose last axis has stride 2 (junk between)."""
    pair = torch.stack([t, torch.full_like(t, junk)], dim=-1)
    view = pair[..., 0]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def test_strided_metadata_gives_the_contiguous_answer():
    """A strided slot_mapping, block_table, query_start_loc or seq_lens view (junk between
    the values) attends and writes exactly as the contiguous tensor does."""
    backend, cache, common, q = _small_problem()
    builder, impl = backend.make_builder(SMALL, DEVICE), backend.make_impl(SMALL)
    k = torch.randn(common.num_tokens, 2, 32).half().to(DEVICE)
    want_cache = cache.clone()
    want = impl.forward(q, k, k, want_cache, builder.build(common))
    for name, junk in (
        ("slot_mapping", 3),
        ("block_table", 6),
        ("query_start_loc", 9),
        ("seq_lens", 60),
    ):
        bad = dataclasses.replace(common, **{name: _strided(getattr(common, name), junk)})
        got_cache = cache.clone()
        got = impl.forward(q, k, k, got_cache, builder.build(bad))
        assert torch.equal(got, want), name
        assert torch.equal(got_cache, want_cache), name


def test_more_scheduled_tokens_than_rows_is_refused():
    """query_start_loc[-1] past the token rows would write past the output."""
    backend, _, common, _ = _small_problem()
    short = dataclasses.replace(common, slot_mapping=common.slot_mapping[:-1])
    with pytest.raises(MetadataError, match=r"query_start_loc\[-1\] = 11 scheduled tokens"):
        backend.make_builder(SMALL, DEVICE).build(short)


def test_sequence_wider_than_its_block_table_row_is_refused():
    """A seq_len needing more blocks than the row holds would read junk block ids."""
    backend, _, common, _ = _small_problem()
    narrow = dataclasses.replace(common, block_table=common.block_table[:, :2].contiguous())
    with pytest.raises(MetadataError, match=r"seq_lens\[0\] = 40 needs 3 blocks of 16"):
        backend.make_builder(SMALL, DEVICE).build(narrow)


def test_cache_views_follow_the_cache_and_do_not_keep_it_alive():
    """The impl keeps its K/V views between forwards: a new cache (or new storage
    behind the same tensor) gets new views, and a dropped cache is freed."""
    backend, cache, common, q = _small_problem()
    md = backend.make_builder(SMALL, DEVICE).build(common)
    impl = backend.make_impl(SMALL)
    first = impl.forward(q, None, None, cache, md)
    other = torch.randn(cache.shape, generator=torch.Generator().manual_seed(9)).half()
    other = other.to(DEVICE)
    want = backend.make_impl(SMALL).forward(q, None, None, other, md)
    assert torch.equal(impl.forward(q, None, None, other, md), want)
    cache.set_(other.clone())  # the same tensor object over new storage
    assert torch.equal(impl.forward(q, None, None, cache, md), want)
    assert not torch.equal(first, want)
    ref = weakref.ref(cache)
    # the launches' arguments over the cache (views of its storage) go with the views
    launch_args = weakref.ref(impl.cache_views(cache).derived["triton launches"])
    del cache
    gc.collect()
    assert ref() is None and launch_args() is None and impl._kept_views is None


# -- declared support ----------------------------------------------------------------------


def test_declares_graph_support_and_the_kv_first_layout():
    backend = pagedkv.get_backend("triton")
    assert str(backend.capabilities.graph_support) == "mixed"
    assert pagedkv.Feature.CUDA_GRAPH not in backend.capabilities.features
    assert backend.get_kv_layout() is pagedkv.layout.KV_FIRST


def test_rejections_carry_reasons():
    backend = pagedkv.get_backend("triton")
    assert "head_size 36 not supported by triton" in backend.validate(SPEC.replace(head_size=36))[0]
    assert "head_size 512" in backend.validate(SPEC.replace(head_size=512))[0]
    assert "block_size 8 not supported" in backend.validate(SPEC.replace(block_size=8))[0]
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
    assert "MLA layers (kv_lora_rank set) are not supported by triton" in backend.validate(mla)
    if not ON_GPU:
        reasons = backend.validate(SPEC, "cpu")
        assert any("bfloat16 on cpu" in r for r in reasons)
        with pytest.raises(UnsupportedError, match="bfloat16 on cpu"):
            backend.make_builder(SPEC, "cpu")
    assert backend.validate(SPEC.replace(dtype=torch.float16), DEVICE) == []


def test_forward_argument_errors_name_the_argument():
    spec = SPEC.replace(dtype=torch.float16, num_heads=4, num_kv_heads=2, head_size=64)
    backend = pagedkv.get_backend("triton")
    md = backend.make_builder(spec, DEVICE).build(
        CommonAttentionMetadata.from_requests([3], [3], [[1]], 16, DEVICE)
    )
    impl = backend.make_impl(spec)
    q = torch.randn(3, 4, 64, device=DEVICE).half()
    kv = torch.randn(3, 2, 64, device=DEVICE).half()
    cache = backend.allocate_kv_cache(2, spec, DEVICE)
    with pytest.raises(
        UnsupportedError,
        match=r"kv_cache: expected the kv_first layout \[2, num_blocks, 16, 2, 64\]",
    ):
        impl.forward(q, kv, kv, cache[:, :, :8], md)
    with pytest.raises(UnsupportedError, match="kv_cache: expected dtype torch.float16"):
        impl.forward(q, kv, kv, cache.float(), md)
    with pytest.raises(UnsupportedError, match=r"query: expected shape \[3, 4, 64\]"):
        impl.forward(q[:2], kv, kv, cache, md)
    with pytest.raises(UnsupportedError, match="query: the head dimension must be contiguous"):
        strided = torch.randn(3, 4, 128, device=DEVICE).half()[..., ::2]
        impl.forward(strided, None, None, cache, md)
    other = backend.make_impl(spec.replace(num_heads=8))
    with pytest.raises(UnsupportedError, match="metadata: planned for Hq 4, Hkv 2, D 64"):
        other.forward(torch.randn(3, 8, 64, device=DEVICE).half(), None, None, cache, md)


def test_prefill_steps_choose_the_gluon_kernel_where_it_runs():
    """Where the layer allows the Gluon sm_90 kernel (on a CPU its reason is the
    device), whole prefill steps take it; steps with decodes, split steps and tuning
    overrides keep the portable kernel; the batch-invariant mode never takes it."""
    spec = SPEC.replace(dtype=torch.float16)
    builder = pagedkv.get_backend("triton").make_builder(spec, DEVICE)
    if not ON_GPU:
        assert builder.gluon_problem is not None  # no sm_90 here
    builder.gluon_problem = None  # as on an H200

    def step(seq_lens, query_lens):
        blocks = [list(range(1 + 20 * i, 1 + 20 * i + -(-s // 16))) for i, s in enumerate(seq_lens)]
        return CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 16, DEVICE)

    def kernels(md) -> list[bool]:  # per part: the Gluon kernel?
        return [part.gluon is not None for part in md.parts]

    assert kernels(builder.build(step([200, 150], [200, 100]))) == [True]
    assert kernels(builder.build(step([200, 150], [1, 1]))) == [False]  # decodes
    # a mixed step: its decodes on the portable kernel, its chunk (a part of its own,
    # numbered from its first request) on the Gluon kernel
    mixed = builder.build(step([200, 300], [1, 100]))
    assert kernels(mixed) == [False, True]
    gluon = mixed.parts[1].gluon
    assert gluon.kwargs["num_seqs"] == 1 and gluon.kwargs["QueryStartLoc"].tolist() == [1, 101]
    assert gluon.grid == (101 // 32 - 1 // 32 + 1, spec.num_kv_heads)  # 32 queries a block
    assert "requests 1-1: Gluon sm_90 prefill" in mixed.describe()
    assert kernels(builder.build(step([20, 24], [20, 24]))) == [False]  # no 128-row tile
    # speculative queries that fill a tile at GQA 16 (8 tokens x 16 heads) keep their
    # split portable plan, even with enough programs for every SM
    wide = pagedkv.get_backend("triton").make_builder(
        spec.replace(num_heads=32, num_kv_heads=2), DEVICE
    )
    # 32 programs on 12 SMs: two waves and a thin third, which splits fill
    # (the register estimate's plan, as on a CPU: a GPU's compiled registers hold more
    # programs per SM, so one wave, which no split would fill)
    wide.gluon_problem, wide.num_sms, wide.fits = None, 12, None
    speculative = wide.build(step([8000] * 8, [8] * 8))
    assert speculative.plan.split and kernels(speculative) == [False]
    tile = TileConfig(64, 32, 4, 2)
    assert kernels(builder.build(step([200, 150], [200, 100]), tile=tile)) == [False]
    invariant = pagedkv.get_backend("triton", batch_invariant=True).make_builder(spec, DEVICE)
    assert "batch-invariant" in invariant.gluon_problem
    portable = pagedkv.get_backend("triton", prefill_kernel="portable").make_builder(spec, DEVICE)
    assert "prefill_kernel=portable" in portable.gluon_problem
    with pytest.raises(ConfigError, match="prefill_kernel"):
        pagedkv.get_backend("triton", prefill_kernel="fast")


def test_a_mixed_steps_chunk_takes_the_gluon_kernel_beside_its_decodes():
    """A chunk the portable rule splits, whose Gluon programs would leave SMs idle, takes
    the Gluon kernel unsplit in a two-part step when one program of it takes no longer
    than the model's time for both parts (the decodes run on the idle SMs meanwhile):
    a short context does, and 256 queries at 32k; 64 queries at 32k do not (one program
    would run for 3 times the split step), nor does any chunk when the parts do not
    overlap."""
    spec = SPEC.replace(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16)

    def step(context: int, queries: int) -> CommonAttentionMetadata:
        seq_lens, query_lens = [8000] * 16 + [context], [1] * 16 + [queries]
        blocks, first = [], 1
        for n in seq_lens:
            blocks.append(list(range(first, first + -(-n // 16))))
            first += len(blocks[-1])
        return CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 16, DEVICE)

    def chunk_kernel(overlap: bool, context: int, queries: int) -> str:
        builder = pagedkv.get_backend("triton", overlap_parts=overlap).make_builder(spec, DEVICE)
        builder.gluon_problem, builder.num_sms = None, 132  # as on an H200
        part = builder.build(step(context, queries)).parts[1]
        assert part.gluon is not None or part.plan.split  # the case of the rule
        return "gluon" if part.gluon is not None else "portable"

    assert chunk_kernel(True, 4096, 256) == "gluon"  # 72 programs on 132 SMs
    assert chunk_kernel(True, 32768, 64) == "portable"
    # 256 queries at 32k: 64 programs of 421 us by the model against 628 us split (H200,
    # fifteenth session: 498.4 us against 570.6 beside 16 decodes)
    assert chunk_kernel(True, 32768, 256) == "gluon"
    assert chunk_kernel(False, 4096, 256) == "portable"
    # a chunk that takes the Gluon kernel whatever the portable rule's splits is planned
    # without the rule: its portable plan, the fallback where TMA cannot read the cache,
    # is unsplit (the rule would split it), the decodes' plan is the rule's
    from pagedkv.backends.triton.configs import StepShape, plan_tiles

    builder = pagedkv.get_backend("triton").make_builder(spec, DEVICE)
    builder.gluon_problem, builder.num_sms, builder.fits = None, 132, None
    md = builder.build(step(4096, 256))
    decodes, chunk = md.parts
    requests = StepShape.of(md.common)
    assert chunk.gluon is not None and not chunk.plan.split
    assert plan_tiles(builder.layer, requests.part(chunk.first, chunk.end), 132).split
    # (on the slots the chunk's Gluon programs leave free: _free_beside_gluon)
    free = builder._free_beside_gluon(requests, decodes.first, decodes.end, lambda *_: True)
    assert 0 < free < 1
    assert decodes.plan == plan_tiles(
        builder.layer, requests.part(decodes.first, decodes.end), 132, range_multiples=(1.0,),
        free_share=free,
    )  # fmt: skip


@pytest.mark.parametrize(
    "decodes, median, context, queries, head_size, gluon",
    [
        # the H200 A/B's shapes and the rule's picks there (eager us, portable split ->
        # the pick; docs/results/bench-h200-fourteenth-gluon-beside-decodes.md)
        (64, 1024, 2048, 256, 128, True),  # 159.0 -> 129.7
        (128, 1024, 4096, 128, 128, True),  # 275.3 -> 239.0
        (16, 2048, 8192, 128, 128, False),  # Gluon forced: 143.2 against 111.3
        (16, 2048, 32768, 64, 128, False),  # Gluon forced: 418.3 against 173.8
        # the fourteenth session's two misses (it kept the split): the fifteenth session's
        # per-SM rate, fitted on the 32k step above, takes them (measured again: Gluon
        # 236.1 against the split's 276.1, and 197.2 against 207.8)
        (16, 2048, 16384, 256, 128, True),  # 273.3 -> 236.3
        (32, 2048, 4096, 256, 256, True),  # 207.3 -> 198.2
    ],
)
def test_the_gluon_beside_decodes_rule_on_the_h200s_measured_steps(
    decodes, median, context, queries, head_size, gluon
):
    """The rule's picks on the steps the fourteenth session timed every plan of (132 SMs):
    a change to its rates moves these, and should come with new measurements."""
    from pagedkv.backends.triton.configs import StepShape
    from pagedkv.bench.workloads import mixed_shape

    # fp16: a CPU builder refuses bf16 (the rule reads shapes only)
    w = mixed_shape(f"{decodes}:{median}:{context}:{queries}:{head_size}", dtype="fp16")
    builder = pagedkv.get_backend("triton").make_builder(w.layer.spec(), DEVICE)
    builder.num_sms = 132
    step = StepShape(np.array(w.query_lens), np.array(w.seq_lens))
    assert builder._gluon_beside_decodes(step, decodes, decodes + 1) is gluon


# programs an SM holds of the decodes' tile (unsplit / even shares / key ranges) as the
# H100's compiled kernels gave them (thirty-eighth session)
_H100_FITS = {64: (3, 4, 4), 128: (4, 4, 4), 256: (3, 3, 3)}


def _h100_step(row: str, **layer: str) -> tuple[AttentionSpec, CommonAttentionMetadata]:
    """The layer (fp16: a CPU builder refuses bf16, and the rule reads shapes only;
    ``layer``'s changes) and the step of a matrix row or a ``bench.workloads.mixed_shape``
    step (`decodes:median:context:queries[:head size]`), its pages laid out in turn."""
    from pagedkv.bench.workloads import MATRICES, mixed_shape

    matrix = {w.name: w for rows in MATRICES.values() for w in rows}
    w = matrix[row] if row in matrix else mixed_shape(row)
    spec = dataclasses.replace(w.layer, dtype="fp16", **layer).spec()
    seq_lens, query_lens = list(w.seq_lens), list(w.query_lens)
    blocks, first = [], 1
    for n in seq_lens:
        blocks.append(list(range(first, first + -(-n // spec.block_size))))
        first += len(blocks[-1])
    return spec, CommonAttentionMetadata.from_requests(
        seq_lens, query_lens, blocks, spec.block_size, DEVICE
    )


def _h100_fp8_builder(
    step: str, graph: bool, **options: object
) -> tuple[TritonMetadataBuilder, CommonAttentionMetadata]:
    """A triton builder of ``_h100_step``'s step over an fp8 cache, planning as the H100
    did (132 SMs, its compiled fits: three programs an SM), and the step; ``graph``:
    reserved for the step's own bounds, as `pagedkv bench` reserves."""
    from pagedkv.toolkit.launch import KernelFit

    spec, common = _h100_step(step, kv_cache_dtype="fp8_e4m3")
    builder = pagedkv.get_backend("triton", **options).make_builder(spec, DEVICE)
    builder.num_sms = 132
    builder.fits = lambda tile, form: KernelFit(0, 0, 0, 3)
    if graph:
        builder.reserve_cuda_graph(
            GraphBounds(
                max_num_reqs=common.num_reqs,
                max_num_tokens=common.num_tokens,
                max_blocks_per_req=common.block_table.shape[1],
                max_query_len=common.max_query_len,
            )
        )
    return builder, common


@pytest.mark.parametrize(
    "row, every_sm_keys, beside_keys",
    [
        # the H100 A/B of the thirty-eighth session (eager us, whole GPU -> free share;
        # docs/results/beside-gluon-ab-h100-thirtyeighth.log): a matrix row, then
        # `decodes:median:context:queries[:head size]` (``bench.workloads.mixed_shape``)
        ("d256-mixed", 1024, 512),  # 173.3 -> 146.3
        ("32:2048:4096:256:256", 1024, 512),  # 224.2 -> 196.8
        ("40:1536:3072:256:256", 1024, 512),  # 187.7 -> 163.3
        ("24:4096:8192:128", 2048, 512),  # 252.1 -> 205.1
        ("28:3072:4096:128", 2048, 512),  # 208.1 -> 182.7
        ("12:6144:12288:256", 1024, 512),  # 240.5 -> 219.0
        ("8:4096:16384:256", 512, 256),  # 244.3 -> 236.1
        ("48:2048:4096:256:64", 1024, 512),  # 95.6 -> 86.0
        # unchanged: the plan for the whole GPU (the probe's 512-key or 1024-key
        # alternatives were slower on the first three rows)
        ("mixed-16d+1chunk", 512, 512),
        ("d64-b32-mixed", 1024, 1024),
        ("mixed-96d+2chunks", 1024, 1024),
        ("48:1024:2048:512", 512, 512),
        ("24:2048:2048:128:256", 256, 256),
    ],
)
def test_decodes_beside_a_gluon_chunk_count_the_slots_it_leaves_them(
    row, every_sm_keys, beside_keys
):
    """A two-part step's decodes, beside a chunk on the Gluon kernel, plan their key
    ranges on the share of the slots the chunk's programs leave free at their launch
    (``_free_beside_gluon``): on the steps the H100 timed both plans of, the plan with
    it, and the plan it replaced (every SM free), with the H100's compiled fits."""
    from pagedkv.toolkit.launch import KernelFit

    spec, common = _h100_step(row)
    per_sm = dict(zip(LaunchForm, _H100_FITS[spec.head_size], strict=True))

    def decode_keys(every_sm: bool) -> int:
        builder = pagedkv.get_backend("triton").make_builder(spec, DEVICE)
        builder.gluon_problem, builder.num_sms = None, 132  # as on an H100
        builder.fits = lambda tile, form: KernelFit(0, 0, 0, per_sm[form])
        if every_sm:
            builder._free_beside_gluon = lambda *args: 1.0
        md = builder.build(common)
        decodes, chunk = md.parts
        assert chunk.gluon is not None and decodes.plan.tiles_per_split
        return decodes.plan.tiles_per_split * decodes.plan.tile.tile_n

    assert decode_keys(every_sm=True) == every_sm_keys
    assert decode_keys(every_sm=False) == beside_keys


@pytest.mark.parametrize(
    "step, chosen, width",
    [
        # the H100 plans of the thirty-ninth session's A/B (graph µs unsplit -> split;
        # docs/results/graph-longer-ab2-h100-thirtyninth.log): `decodes:median:context:
        # queries` (``bench.workloads.mixed_shape``), fp8, each in its own reservation
        ("16:2048:8192:256", 3, 3),  # 398.0 -> 203.7
        ("24:3072:4096:128", 6, 6),  # 220.9 -> 129.2
        ("32:2048:4096:256", 3, 3),  # 217.6 -> 172.0
        ("8:4096:16384:512", 3, 3),  # 812.3 -> 664.8
        ("4:8192:32768:64", 12, 12),  # 1506.8 -> 210.5
        ("2:16384:16384:16", 31, 46),  # 765.5 -> 80.8
        ("12:1024:4096:32", 12, 15),  # 154.3 -> 34.4
        ("48:1024:2048:1024", 2, 3),  # 293.2 -> 304.2
        ("fp8-mixed", 3, 3),  # 186.5 -> 193.1
    ],
)
def test_a_mixed_reservations_chunk_splits_as_on_the_h100(step, chosen, width):
    """A mixed reservation's longer launch (the portable kernel: an fp8 cache) takes the
    splits each step chooses within its plan's width, in even shares (its kernel keeps
    no range check), as the H100 planned them, with its compiled fits (three programs
    an SM) injected."""
    builder, common = _h100_fp8_builder(step, graph=True)
    decodes, longer = builder.build(common).parts
    assert (decodes.role, longer.role) == ("decodes", "longer requests")
    assert longer.gluon is None and longer.plan.dynamic_splits
    assert (longer.choice.num_splits, longer.plan.num_splits) == (chosen, width)
    assert not longer.choice.fixed_ranges and not longer.attention.kwargs["TRIM_SPLITS"]
    assert StepSplits.read(longer.attention.kwargs["NumSplits"]).num_splits == chosen


@pytest.mark.parametrize(
    "query_lens, runs",
    [
        ((1, 1, 24, 0, 0), ((0, 2), (2, 5))),  # decodes, a chunk, padding after it
        ((24, 1, 1, 0), ((1, 4), (0, 1))),  # a chunk first: the decodes keep the padding
        ((1, 0, 1), ((0, 3), (3, 3))),  # decodes only, an empty request among them
        ((0, 30, 9), ((0, 0), (0, 3))),  # longer requests only, an empty one first
        ((1, 30, 1), ((0, 0), (0, 3))),  # interleaved: all to the longer launch
        ((0, 0), ((0, 2), (2, 2))),  # nothing to attend
    ],
)
def test_a_graph_steps_runs_of_decodes_and_longer_requests(query_lens, runs):
    assert decode_and_longer_runs(np.array(query_lens), 1) == runs


def test_each_launch_form_is_probed_as_it_launches():
    """CompiledFits compiles, per tile, the variant each launch form runs (planned here on
    the CPU; the GPU compiles them): unsplit, even shares, and listed key ranges; a
    backend's num_splits option does not reach the probes."""
    from pagedkv.backends.triton.occupancy import CompiledFits

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=torch.float16)  # fmt: skip
    fits = CompiledFits(spec, torch.device("cpu"), {"num_splits": 4})
    tile = TileConfig(16, 64, 4, 2)
    flags = {}
    for form in LaunchForm:
        kwargs = fits.probe_launch(tile, form).kwargs
        flags[form] = (kwargs["SPLIT"], kwargs["TRIM_SPLITS"], kwargs["RANGE_LIST"])
    assert flags == {
        LaunchForm.UNSPLIT: (False, False, False),
        LaunchForm.EVEN_SHARES: (True, False, False),
        LaunchForm.KEY_RANGES: (True, True, True),
    }


@triton.jit
def _fp16_rows_kernel(Q, Out, Down, M: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    q16, down = fp16_rows(tl.load(Q + offs))
    tl.store(Out + offs, q16)
    tl.store(Down + tl.arange(0, M)[:, None], down)


def test_bfloat16_rows_become_float16_rows_scaled_by_powers_of_two():
    """``fp16_rows`` (a bfloat16 query over an fp8 cache): each row times a power of two,
    its largest element in [2^14, 2^15), in float16 (a row of subnormals: 2^126); the
    row's inverse scale restores it exactly (a zero row stays zero, scale 1; elements
    2^28 below their row's largest round away, nothing else)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 32, generator=gen)
    magnitudes = [1.0, 0.0, 1e-30, 3e30, 65504.0, 1e5, 2.0**-133, 7.0]
    for row, magnitude in enumerate(magnitudes):
        q[row] *= magnitude
    q[8, 0], q[8, 1] = 1e4, 1e-9  # 2^13 over 2^-30: within the 2^28 kept
    q = q.to(torch.bfloat16).to(DEVICE)
    out = torch.empty(16, 32, dtype=torch.float16, device=DEVICE)
    down = torch.empty(16, 1, dtype=torch.float32, device=DEVICE)
    _fp16_rows_kernel[(1,)](q, out, down, M=16, D=32)
    q, out, down = q.double().cpu(), out.double().cpu(), down.double().cpu()
    largest = out.abs().amax(dim=1)
    normal = q.abs().amax(dim=1) >= 2.0**-126  # a bfloat16 normal number
    assert ((largest[normal] >= 2**14) & (largest[normal] < 2**15)).all(), largest
    # a row of subnormals (scores below 2^-110: nothing to a softmax): scaled by 2^126
    # exactly, or read as zero where the device flushes subnormals (the interpreter does)
    assert torch.equal(out[6] * down[6], q[6]) or (out[6] == 0).all()
    assert (out[1] == 0).all() and (down[1] == 1).all()  # a zero row
    kept = (q.abs() >= q.abs().amax(dim=1, keepdim=True) * 2.0**-28) & normal[:, None]
    assert torch.equal((out * down)[kept], q[kept])


def test_a_mixed_reservations_kept_parts_pad_as_new_ones_would():
    """Under bounds that allow chunks, the decodes' and the longer requests' staged
    parts are kept across steps and write their padding only where it changed: after
    any sequence of steps their buffers hold what a new reservation's parts give."""
    import random

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16,
                         block_size=16)  # fmt: skip
    bounds = GraphBounds(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=32, max_query_len=32)
    backend = pagedkv.get_backend("triton")
    kept = backend.make_builder(spec, "cpu")
    kept.reserve_cuda_graph(bounds)
    rng = random.Random(0)
    parts = None
    for _ in range(40):
        n = rng.randint(1, 8)
        query = [rng.choice([1, 1, 1, 3, 17, 32]) for _ in range(n)]
        while sum(query) > 64:
            query[query.index(max(query))] //= 2
        seq = [q + rng.randint(0, 400) for q in query]
        tables, first = [], 1
        for s in seq:
            tables.append(list(range(first, first + -(-s // 16))))
            first += len(tables[-1])
        common = CommonAttentionMetadata.from_requests(seq, query, tables, 16)
        fresh = backend.make_builder(spec, "cpu")
        fresh.reserve_cuda_graph(bounds)
        got, want = kept.build(common), fresh.build(common)
        assert [p.role for p in got.parts] == ["decodes", "longer requests"]
        for a, b in zip(got.parts, want.parts, strict=True):
            for name in ("QueryStartLoc", "SeqLens"):
                assert torch.equal(a.attention.kwargs[name], b.attention.kwargs[name]), name
        # the same two parts every step of the reservation
        assert parts is None or all(kept._staged_parts[k] is v for k, v in parts.items()), (
            "the parts were staged anew"
        )
        parts = dict(kept._staged_parts)


def test_a_gluon_part_runs_its_portable_plan_where_tma_cannot_read_the_cache():
    """A part planned for the Gluon prefill keeps a portable plan (unsplit: the split
    rule is not asked for it), which the forward runs where TMA cannot read the cache
    (here its rows start 2 bytes past 16-byte alignment): the output is the torch
    backend's."""
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16
    )
    seq_lens = query_lens = [200, 100]  # prefills: no context to fill
    blocks, first = [], 1
    for n in seq_lens:
        blocks.append(list(range(first, first + -(-n // 16))))
        first += len(blocks[-1])
    common = CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 16, DEVICE)
    backend = pagedkv.get_backend("triton")
    builder = backend.make_builder(spec, DEVICE)
    builder.gluon_problem, builder.num_sms = None, 132  # as on an H200
    md = builder.build(common)
    (part,) = md.parts
    assert part.gluon is not None and not part.plan.split
    shape = backend.get_kv_cache_shape(first, spec.block_size, spec.num_kv_heads, spec.head_size)
    flat = torch.zeros(int(np.prod(shape)) + 1, dtype=spec.dtype, device=DEVICE)
    cache = flat[1:].view(shape)  # 2 bytes past the buffer's alignment
    impl = backend.make_impl(spec)
    assert impl._gluon_launch_args(cache) is None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(300, h, 64, generator=g).half().to(DEVICE) for h in (8, 2, 2))
    out = impl.forward(q, k, v, cache, md)
    torch_backend = pagedkv.get_backend("torch")
    want = torch_backend.make_impl(spec).forward(
        q, k, v, torch_backend.allocate_kv_cache(first, spec, DEVICE),
        torch_backend.make_builder(spec, DEVICE).build(common),
    )  # fmt: skip
    torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("graph", [False, True])
def test_a_split_chunk_beside_decodes_launches_its_reduction_after_its_keys(overlap, graph):
    """A two-part step's longer requests, split on the portable kernel (an fp8 cache, as
    the H100 plans fp8 mixed), let their reduction launch after their keys where the
    impl overlaps the parts (its programs waiting from the chunk's start would hold the
    decodes' slots); the decodes, and both parts run one after the other, at once."""
    from pagedkv.backends.triton.attention_kernel import (
        DEPENDENTS_AFTER_KEYS,
        DEPENDENTS_AT_START,
    )

    builder, common = _h100_fp8_builder(
        "fp8-mixed", graph, overlap_parts=overlap, split_merge="separate"
    )
    builder.programmatic = True  # as on an H100
    decodes, longer = builder.build(common).parts
    assert decodes.plan.split and longer.plan.split and longer.gluon is None
    chunk_at = DEPENDENTS_AFTER_KEYS if overlap else DEPENDENTS_AT_START
    assert decodes.attention.kwargs["LAUNCH_DEPENDENTS"] == DEPENDENTS_AT_START
    assert longer.attention.kwargs["LAUNCH_DEPENDENTS"] == chunk_at
