"""The Triton builder's launch plans at a GPU's scale stay within what they launch over.

The interpreter runs small steps only, but the rule plans for 132 SMs, 32k contexts and
hundreds of requests: dynamic split counts within a CUDA graph's width, lists of work
items within its grid, fixed key ranges, two staged launches of a mixed step. A plan
that lists more items than its grid holds, gives a request with queries no program,
cuts fixed key ranges that stop short of a request's last key, or writes partials past
their rows would run on a GPU without an error: a skipped or out-of-bounds read, an
output never written. A CUDA-graph step whose launches differ from the captured ones
(a grid, a constant, a buffer) would replay the old ones.

Hypothesis draws the layer, the GPU (SMs, programs an SM, the Gluon prefill kernel or
not), eager steps and reservations with several steps within them. Nothing runs: each
plan is checked on its launches' arguments and the host copies of its tensors.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pagedkv
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedkv import CommonAttentionMetadata
from pagedkv.backends.triton.builder import StepSplits, TritonMetadata, TritonMetadataBuilder
from pagedkv.backends.triton.configs import TilePlan
from pagedkv.backends.triton.gluon_plan import gluon_prefill_problem
from pagedkv.graph import GraphBounds
from pagedkv.intmath import cdiv
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.launch import MAX_GRID_Y, KernelFit, KernelLaunch

# (query heads, KV heads): GQA 4, 8, 1, 16, 8 and 8 again at fewer heads
HEADS = [(32, 8), (64, 8), (32, 32), (64, 4), (8, 1), (16, 2)]


@st.composite
def layers(draw: Any) -> AttentionSpec:
    num_heads, num_kv_heads = draw(st.sampled_from(HEADS))
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([64, 128, 256])),
        dtype=torch.float16,  # (a CPU builder refuses bfloat16; the rule reads shapes)
        block_size=draw(st.sampled_from([16, 32, 64])),
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8_e4m3"])),
        sliding_window=draw(st.sampled_from([None, None, 1000])),
    )


def _builder(spec: AttentionSpec, draw: Any) -> TritonMetadataBuilder:
    """A builder planning as on a GPU of the drawn size: its compiled kernels hold the
    drawn programs an SM, and the Gluon prefill kernel runs where an H200 runs it."""
    options = draw(st.sampled_from([{}, {}, {"overlap_parts": False}, {"split_grid": "blocks"}]))
    builder = pagedkv.get_backend("triton", **options).make_builder(spec, "cpu")
    builder.num_sms = draw(st.sampled_from([8, 78, 132]))
    programs = draw(st.integers(1, 4))
    builder.fits = lambda tile, form: KernelFit(0, 0, 0, programs)
    if draw(st.booleans()):
        builder.gluon_problem = gluon_prefill_problem(spec, "cpu", capability=(9, 0))
    return builder


def _step(
    draw: Any, spec: AttentionSpec, max_reqs: int, max_tokens: int, max_query: int, context: int
) -> CommonAttentionMetadata:
    """A step within those bounds: decodes, speculative and longer queries, and requests
    without queries, each over up to ``context`` keys, an eighth of it or 600 (ragged)."""
    num_reqs = draw(st.integers(1, max_reqs))
    seq_lens, query_lens, tokens = [], [], 0
    for _ in range(num_reqs):
        kind = draw(st.sampled_from(["decode", "decode", "spec", "chunk", "empty"]))
        longest = draw(st.sampled_from([context, context // 8 + 1, 600]))
        if kind == "decode":
            query = 1
        elif kind == "spec":
            query = draw(st.integers(2, 8))
        elif kind == "chunk":
            query = draw(st.integers(9, max(9, max_query)))
        else:
            query = 0
        query = min(query, max_query, max_tokens - tokens)
        seq = draw(st.integers(max(query, 1), max(query, 1, longest)))
        seq_lens.append(seq)
        query_lens.append(query)
        tokens += query
    blocks, first = [], 1
    for seq in seq_lens:
        blocks.append(range(first, first + cdiv(seq, spec.block_size)))
        first += len(blocks[-1])
    return CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, spec.block_size)


# -- the checks ----------------------------------------------------------------------------


def _host(t: torch.Tensor, n: int) -> np.ndarray:
    return t[:n].cpu().numpy().astype(np.int64)


def _check_attention(
    launch: KernelLaunch, plan: TilePlan, spec: AttentionSpec, num_tokens: int
) -> None:
    """One portable launch of ``plan`` over its requests (its tensors' host copies)."""
    kw, grid = launch.kwargs, launch.grid
    n = kw["num_seqs"]
    qsl, seq_lens = _host(kw["QueryStartLoc"], n + 1), _host(kw["SeqLens"], n)
    query_lens = np.diff(qsl)
    live = query_lens > 0
    assert (query_lens >= 0).all() and qsl[0] >= 0 and qsl[-1] <= num_tokens, qsl
    assert (seq_lens[live] >= query_lens[live]).all()
    block_q, tile_n, hkv = kw["BLOCK_Q"], kw["TILE_N"], spec.num_kv_heads
    assert len(grid) == 3 and min(grid) >= 1 and grid[1] <= MAX_GRID_Y, grid
    split, dynamic = kw["SPLIT"], kw["DYNAMIC_SPLITS"]
    width = plan.num_splits  # the grid's (a CUDA-graph plan's: the most a step takes)
    if split:  # (the step's partials: the most of its parts)
        assert width <= kw["PartAcc"].shape[2], (width, kw["PartAcc"].shape)
    splits, range_keys = width, kw["tiles_per_split"] * tile_n
    if dynamic:
        values = StepSplits.read(kw["NumSplits"])
        splits, range_keys, partial_first = (
            values.num_splits,
            values.keys_per_split,
            values.partial_first,
        )
        assert 1 <= splits <= width, (values, width)
        assert values.keys_per_split == values.tiles_per_split * tile_n
        # the partials' rows hold the launch's tokens
        rows = qsl[[0, -1]] - partial_first
        assert rows[0] >= 0 and rows[1] <= kw["PartAcc"].shape[0], (rows, kw["PartAcc"].shape)
    elif split:
        assert qsl[-1] <= kw["PartAcc"].shape[0]
    if range_keys:  # fixed key ranges (never with a window): every key within a split
        assert (cdiv(seq_lens[live], range_keys) <= splits).all(), (
            f"fixed key ranges of {range_keys} keys x {splits} stop short of a request's keys"
        )
    if kw["MERGE_LAST"]:
        # one query block per request, whose every row the merging program holds, and a
        # row of counters for each token the launch's blocks may start at
        assert split and (kw["RANGE_LIST"] or kw["BLOCK_PER_REQUEST"])
        assert (query_lens <= block_q).all()
        group = spec.num_heads // hkv
        assert kw["MERGE_ROWS"] >= query_lens.max(initial=0) * group, (kw["MERGE_ROWS"], qsl)
        counts = kw["SplitCounts"]
        assert counts.shape[1] == hkv + 1 and qsl[-1] <= counts.shape[0], (counts.shape, qsl)
    if kw["RANGE_LIST"]:
        starts = _host(kw["RangeStarts"], n + 1)
        items = np.diff(starts)
        assert starts[0] == 0 and (items >= 0).all(), starts
        assert starts[-1] * hkv <= grid[0], f"{starts[-1]} items x {hkv} heads past grid {grid}"
        assert (items[live] >= 1).all(), "a request with queries has no work item"
        assert (items[~live] == 0).all()
        assert (query_lens <= block_q).all()  # a list's item is one query block
        assert (items <= splits).all()
        if range_keys:
            assert (items[live] == cdiv(seq_lens[live], range_keys)).all()
        else:
            assert (items[live] == splits).all()
        if (
            dynamic and StepSplits.read(kw["NumSplits"]).per_request > 0
        ):  # owners found by a division
            assert (items[: int(live.sum())] == splits).all() and live[: int(live.sum())].all()
    elif kw["BLOCK_PER_REQUEST"]:
        shape = (hkv, n, width if split else 1)
        # a dynamic-split plan's: one axis, program p head p % hkv, request p // hkv % n,
        # split p // (hkv * n)
        assert grid == ((hkv * n * width, 1, 1) if dynamic else shape), grid
        assert (query_lens <= block_q).all()
    else:
        assert grid[1] == hkv and grid[2] == (width if split else 1), grid
        # program p takes global query block first + grid[0] - 1 - p; request i's
        # blocks start at qsl[i] // block_q + i
        first = qsl[0] // block_q
        starts = qsl[:-1] // block_q + np.arange(n)
        ends = starts + cdiv(query_lens, block_q)
        assert (starts[live] >= first).all() and (ends[live] <= first + grid[0]).all(), (
            "query blocks past the grid"
        )


def _check_reduce(launch: KernelLaunch, plan: TilePlan, attention: KernelLaunch) -> None:
    kw = launch.kwargs
    n = kw["num_seqs"]
    qsl = _host(kw["QueryStartLoc"], n + 1)
    assert launch.grid[0] >= qsl[-1] - qsl[0], (launch.grid, qsl)
    assert kw["NumSplits"] is attention.kwargs["NumSplits"]
    assert kw["PartAcc"] is attention.kwargs["PartAcc"]
    assert kw["num_splits"] == plan.num_splits <= kw["SPLIT_PAD"]


def _check_staged(
    launch: KernelLaunch, common: CommonAttentionMetadata, first: int, end: int
) -> None:
    """A CUDA-graph launch's persistent buffers hold requests ``[first, end)`` of the
    step, then requests without queries."""
    kw, n = launch.kwargs, end - first
    qsl = _host(kw["QueryStartLoc"], kw["num_seqs"] + 1)
    step_qsl = _host(common.query_start_loc, common.num_reqs + 1)
    assert (qsl[: n + 1] == step_qsl[first : end + 1]).all(), (qsl, step_qsl, first, end)
    assert (qsl[n + 1 :] == step_qsl[end]).all()
    seq_lens = _host(kw["SeqLens"], kw["num_seqs"])
    assert (seq_lens[:n] == _host(common.seq_lens, end)[first:]).all()
    assert (seq_lens[n:] == 0).all()
    width = common.block_table.shape[1]
    assert torch.equal(kw["BlockTable"][:n, :width], common.block_table[first:end])


def _check_plan(md: TritonMetadata, spec: AttentionSpec) -> None:
    num_tokens = md.common.num_tokens
    covered = np.zeros(md.common.num_reqs, bool)
    for part in md.parts:
        covered[part.first : part.end] = True
        if part.role is not None:
            _check_staged(part.attention, md.common, part.first, part.end)
        if part.gluon is not None:
            continue  # (its own plan's tests: test_triton_gluon*)
        _check_attention(part.attention, part.plan, spec, num_tokens)
        if part.reduce is not None:
            _check_reduce(part.reduce, part.plan, part.attention)
        else:  # unsplit, or each block's last split merges (a static plan's choice)
            kw = part.attention.kwargs
            assert not kw["SPLIT"] or (kw["MERGE_LAST"] and not kw["DYNAMIC_SPLITS"])
    assert covered.all(), [(p.first, p.end) for p in md.parts]  # every request launched


def _captured(md: TritonMetadata) -> list:
    """What a CUDA graph captures of the step's launches: kernels, grids, every
    argument but the contents of the tensors."""

    def args(launch: KernelLaunch) -> tuple:
        return tuple(
            (k, (v.data_ptr(), tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
            for k, v in sorted(launch.kwargs.items())
        )

    launches = []
    for part in md.parts:
        for launch in (part.attention, part.reduce, part.gluon and part.gluon.template):
            if launch is not None:
                launches.append((launch.kernel, launch.grid, args(launch)))
    return launches


# -- the properties ------------------------------------------------------------------------

SETTINGS = settings(
    max_examples=int(os.environ.get("PAGEDKV_PLAN_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(data=st.data(), spec=layers())
def test_eager_plans_stay_within_their_launches(data: Any, spec: AttentionSpec) -> None:
    builder = _builder(spec, data.draw)
    context = data.draw(st.sampled_from([600, 4096, 32768, 131072]))
    common = _step(data.draw, spec, 96, 4096, data.draw(st.sampled_from([1, 8, 512])), context)
    _check_plan(builder.build(common), spec)


@SETTINGS
@given(data=st.data(), spec=layers())
def test_graph_steps_stay_within_the_captured_launches(data: Any, spec: AttentionSpec) -> None:
    builder = _builder(spec, data.draw)
    max_reqs = data.draw(st.sampled_from([1, 4, 32, 128, 256]))
    max_query = data.draw(st.sampled_from([1, 4, 8, 512]))
    max_tokens = max_reqs * max_query if max_query <= 8 else max(max_query, max_reqs + 512)
    context = data.draw(st.sampled_from([600, 4096, 32768, 131072]))
    builder.reserve_cuda_graph(
        GraphBounds(max_reqs, max_tokens, cdiv(context, spec.block_size), max_query)
    )
    captured = None
    for _ in range(3):
        common = _step(data.draw, spec, max_reqs, max_tokens, max_query, context)
        md = builder.build(common)
        _check_plan(md, spec)
        now = _captured(md)
        assert captured is None or now == captured, "a step changed the captured launches"
        captured = now


@pytest.mark.parametrize("bad", ["items", "keys", "grid"])
def test_the_checks_catch_a_broken_plan(bad: str) -> None:
    """The checks fail on a plan broken as a bug would break it."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16,
                         block_size=16)  # fmt: skip
    builder = pagedkv.get_backend("triton").make_builder(spec, "cpu")
    builder.num_sms = 132
    builder.reserve_cuda_graph(GraphBounds(8, 8, 2048, 1))
    seq_lens = [32000, 900, 30, 5000]
    blocks, first = [], 1
    for seq in seq_lens:
        blocks.append(range(first, first + cdiv(seq, 16)))
        first += len(blocks[-1])
    md = builder.build(CommonAttentionMetadata.from_requests(seq_lens, [1] * 4, blocks, 16))
    _check_plan(md, spec)
    attention = md.parts[0].attention
    if bad == "items":  # the list's total past the grid
        attention.kwargs["RangeStarts"][4:] = attention.grid[0]
    elif bad == "keys":  # fixed ranges stopping before the longest request's last key
        attention.kwargs["NumSplits"][1:3] = torch.tensor([1, 64])
    else:  # a grid of fewer programs than the list's items
        attention = dataclasses.replace(attention, grid=(attention.grid[0] // 64, 1, 1))
    with pytest.raises(AssertionError, match="stop short" if bad == "keys" else "past grid"):
        _check_attention(attention, md.parts[0].plan, spec, md.common.num_tokens)
