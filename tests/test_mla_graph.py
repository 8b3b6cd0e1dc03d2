"""CUDA graphs for the MLA backend through the contract (``reserve_cuda_graph``).

A CUDA graph replays the kernel launches it captured, with the arguments they had.
On a CPU the capture is simulated the same way: ``forward_mla`` runs once with its
launches recorded, the builder builds a *different* step into the same buffers, and
the recorded launches run again; the result must equal the eager output of that step,
bit for bit, and no padding tile or row may write anything. On a GPU the real graph
is captured and replayed (test_capture_build_replay_on_the_gpu).
"""

from __future__ import annotations

import os

import numpy as np
import pagedkv
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import AttentionSpec, GraphBounds
from pagedkv.backends.mla import MLABackend
from pagedkv.backends.mla.builder import MLAMetadataBuilder
from pagedkv.backends.mla.configs import choose_config
from pagedkv.backends.mla.plan import GLUON, max_tiles, tile_table
from pagedkv.graph import GraphSupport
from pagedkv.toolkit.launch import run_launches

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

BLOCK = 16
# 4 requests of up to 5 blocks, 20 token rows, chunks of up to 8 tokens
MIXED_BOUNDS = GraphBounds(max_num_reqs=4, max_num_tokens=20, max_blocks_per_req=5, max_query_len=8)
STEP_A = ((40, 9, 70), (1, 8, 3))  # (seq_lens, query_lens): 12 tokens
STEP_B = ((75, 3, 20, 33), (5, 3, 1, 1))  # 10 tokens, a request more
DECODE_BOUNDS = GraphBounds(max_num_reqs=4, max_num_tokens=4, max_blocks_per_req=5)
DECODE_A = ((40, 9, 70), (1, 1, 1))
DECODE_B = ((75, 3, 20, 33), (1, 1, 1, 1))
# decodes of up to 1280 keys that the rule cuts (4 SMs on a CPU): 2 ranges of 304 keys
# at capture, 2 of 1024 for the longest request at replay (a CUDA-graph step takes its
# own ranges)
LONG_BOUNDS = GraphBounds(max_num_reqs=3, max_num_tokens=3, max_blocks_per_req=80)
LONG_A = ((600,), (1,))
LONG_B = ((5, 1270, 40), (1, 1, 1))


def _spec(dtype=torch.float32, **changes) -> AttentionSpec:
    fields = dict(
        num_heads=32,  # one token's heads span two 16-row tiles on the CPU
        num_kv_heads=1,
        head_size=80,
        dtype=dtype,
        block_size=BLOCK,
        scale=0.3,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
    )
    fields.update(changes)
    return AttentionSpec(**fields)


def _step(seq_lens, query_lens, num_tokens, bounds=MIXED_BOUNDS):
    """Each request's blocks, shuffled over the pool (block 0 stays the null block)."""
    rng = np.random.default_rng(sum(seq_lens))
    order = rng.permutation(bounds.max_num_reqs * bounds.max_blocks_per_req) + 1
    blocks = [
        order[i * bounds.max_blocks_per_req : (i + 1) * bounds.max_blocks_per_req].tolist()
        for i in range(len(seq_lens))
    ]
    return pagedkv.CommonAttentionMetadata.from_requests(
        seq_lens, query_lens, blocks, BLOCK, DEVICE, num_tokens=num_tokens
    )


class Recorder:
    """Stands in for a CUDA graph: runs and records launches while capturing."""

    def __init__(self, monkeypatch):
        self.recorded = None
        self._monkeypatch = monkeypatch

    def capture(self, fn):
        from pagedkv.backends.mla.plan import StepPlan

        def record(plan, *args):
            assert self.recorded is None, "one forward per capture"
            self.recorded = plan.launches(*args)  # what ``run`` launches, argument for argument
            run_launches(self.recorded)

        self._monkeypatch.setattr(StepPlan, "run", record)
        fn()
        self._monkeypatch.undo()

    def replay(self):
        run_launches(self.recorded)


def _problem(spec, bounds):
    g = torch.Generator().manual_seed(0)
    num_blocks = 1 + bounds.max_num_reqs * bounds.max_blocks_per_req
    cache = torch.randn(num_blocks, BLOCK, spec.head_size, generator=g).to(spec.dtype)
    query = torch.zeros(bounds.max_num_tokens, spec.num_heads, spec.head_size, dtype=spec.dtype)
    return cache.to(DEVICE), query.to(DEVICE)


def _eager(options, spec, cache, step, query):
    backend = MLABackend(**options)
    md = backend.make_builder(spec, DEVICE).build(step)
    lora = spec.kv_lora_rank
    return backend.make_impl(spec).forward_mla(
        query[..., :lora], query[..., lora:], None, None, cache, md
    )


@pytest.mark.skipif(CUDA, reason="simulated capture: the GPU captures a real graph below")
@pytest.mark.parametrize("options", [{}, {"num_splits": 3}, {"use_tma": False}])
@pytest.mark.parametrize(
    ("bounds", "step_a", "step_b"),
    [
        (MIXED_BOUNDS, STEP_A, STEP_B),
        (DECODE_BOUNDS, DECODE_A, DECODE_B),
        (LONG_BOUNDS, LONG_A, LONG_B),
    ],
    ids=["mixed", "decode", "long"],
)
def test_a_replay_after_building_another_step_equals_eager(
    monkeypatch, options, bounds, step_a, step_b
):
    spec = _spec()
    cache, query = _problem(spec, bounds)
    backend = MLABackend(**options)
    builder, impl = backend.make_builder(spec, DEVICE), backend.make_impl(spec)
    builder.reserve_cuda_graph(bounds)
    lora, rows = spec.kv_lora_rank, bounds.max_num_tokens
    out = torch.empty(rows, spec.num_heads, lora, dtype=spec.dtype, device=DEVICE)
    g = torch.Generator().manual_seed(1)

    def fill_query(num_tokens):
        query.zero_()
        query[:num_tokens] = torch.randn(num_tokens, *query.shape[1:], generator=g).to(query)

    fill_query(sum(step_a[1]))
    md = builder.build(_step(*step_a, sum(step_a[1]), bounds))
    graph = Recorder(monkeypatch)
    graph.capture(
        lambda: impl.forward_mla(query[..., :lora], query[..., lora:], None, None, cache, md, out)
    )
    assert graph.recorded, "nothing was launched"
    num_b = sum(step_b[1])
    fill_query(num_b)
    step = _step(*step_b, num_b, bounds)
    md_b = builder.build(step)
    if bounds is LONG_BOUNDS and not options:
        assert (md.kv_per_split, md_b.kv_per_split) == (304, 1024)
        assert md.num_splits == md_b.num_splits == 2
    # the same launches, argument for argument: what the graph holds stays valid
    planned = impl.plan_attention(query[..., :lora], query[..., lora:], cache, md_b, out)
    assert _described(planned) == _described(graph.recorded)
    out.fill_(float("nan"))
    graph.replay()
    expected = _eager(options, spec, cache, step, query[:num_b])
    assert torch.equal(out[:num_b], expected[:num_b])
    # padding tiles and padding rows wrote nothing
    assert bool(out[num_b:].isnan().all())


def _described(launches) -> list:
    """Launches with tensors as (address, shape, strides): equal when a replay of one
    is a run of the other."""

    def arg(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", value.data_ptr(), tuple(value.shape), value.stride())
        if hasattr(value, "block_shape"):  # a TMA descriptor
            return ("desc", value.base.data_ptr(), list(value.shape), list(value.block_shape))
        return value

    return [
        (launch.kernel, launch.grid, {k: arg(v) for k, v in launch.kwargs.items()})
        for launch in launches
    ]


@pytest.mark.parametrize("num_splits", [None, 4])
def test_the_sm90_plan_is_the_same_for_every_step_within_the_bounds(num_splits):
    """The Gluon kernel's launches (planned as on an H200) depend on the bounds only."""
    spec = _spec(torch.float16, num_heads=16, kv_lora_rank=128, qk_rope_head_dim=64,
                 head_size=192, block_size=64)  # fmt: skip
    bounds = GraphBounds(max_num_reqs=3, max_num_tokens=6, max_blocks_per_req=40, max_query_len=3)
    backend = MLABackend(num_splits=num_splits)
    builder = _h200_builder(spec, bounds, num_splits=num_splits)
    impl = backend.make_impl(spec)
    cache = backend.allocate_kv_cache(1 + 3 * 40, spec, "cpu")
    query = torch.zeros(6, 16, 192, dtype=torch.float16)
    out = torch.empty(6, 16, 128, dtype=torch.float16)
    plans = []
    for seq_lens, query_lens in (((2000, 70), (1, 3)), ((5, 2560, 64), (2, 1, 3)), ((1,), (1,))):
        blocks = [list(range(1 + 40 * i, 1 + 40 * (i + 1))) for i in range(len(seq_lens))]
        common = pagedkv.CommonAttentionMetadata.from_requests(
            seq_lens, query_lens, blocks, 64, num_tokens=sum(query_lens)
        )
        md = builder.build(common)
        assert md.plan.kind == GLUON
        plans.append(
            _described(impl.plan_attention(query[..., :128], query[..., 128:], cache, md, out))
        )
    assert plans[0] == plans[1] == plans[2]
    assert len(plans[0]) == 2  # splits (from the bounds: 4 tiles for 132 SMs) and reduction


def test_graph_support_is_declared_mixed_and_bounds_are_enforced():
    assert MLABackend.capabilities.graph_support is GraphSupport.MIXED
    spec = _spec()
    builder = MLABackend().make_builder(spec, DEVICE)
    builder.reserve_cuda_graph(DECODE_BOUNDS)
    with pytest.raises(pagedkv.MetadataError, match="max_query_len"):
        builder.build(_step((40, 9), (2, 1), 3))


@settings(max_examples=200, deadline=None)
@given(
    bounds=st.builds(
        GraphBounds,
        max_num_reqs=st.integers(1, 6),
        max_num_tokens=st.integers(8, 40),
        max_blocks_per_req=st.just(4),
        max_query_len=st.integers(1, 8),
    ),
    heads=st.sampled_from([1, 3, 16, 20, 128]),
    block_m=st.sampled_from([16, 32, 64]),
    data=st.data(),
)
def test_no_step_within_the_bounds_has_more_tiles_than_the_bound(bounds, heads, block_m, data):
    num_reqs = data.draw(st.integers(0, bounds.max_num_reqs))
    query_lens = data.draw(
        st.lists(st.integers(0, bounds.max_query_len), min_size=num_reqs, max_size=num_reqs)
    )
    if sum(query_lens) > bounds.max_num_tokens:
        return
    tiles = tile_table(np.array(query_lens, dtype=np.int32), heads, block_m)
    assert tiles.shape[1] <= max_tiles(bounds, heads, block_m)


def test_the_tile_bound_is_exact_for_decode():
    # 64 decodes of 128 heads in 64-row tiles: 128 tiles, no padding tile
    bounds = GraphBounds(max_num_reqs=64, max_num_tokens=64, max_blocks_per_req=64)
    assert max_tiles(bounds, 128, 64) == 128
    assert tile_table(np.ones(64, dtype=np.int32), 128, 64).shape[1] == 128
    assert max_tiles(bounds, 16, 64) == 64


@pytest.mark.skipif(
    not CUDA, reason="capturing a CUDA graph needs a GPU (CPU: the simulated capture above)"
)
@pytest.mark.parametrize("config", ["mla", "mla(use_gluon=false)", "mla(num_splits=5)"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_capture_build_replay_on_the_gpu(config, kv_cache_dtype):
    """DeepSeek dims, 128 heads, bf16: capture forward_mla (write included) on step A,
    build step B into the same buffers, replay, compare with eager forward_mla on B."""
    spec = AttentionSpec(
        num_heads=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, block_size=64,
        scale=192**-0.5, kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=24, max_blocks_per_req=40, max_query_len=8)
    backend = pagedkv.select_backend(config, spec, "cuda")
    builder, impl = backend.make_builder(spec, "cuda"), backend.make_impl(spec)
    builder.reserve_cuda_graph(bounds)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = backend.allocate_kv_cache(1 + 4 * 40, spec, "cuda")
    context = torch.randn(cache.shape, generator=g, device="cuda") * 0.5
    cache.copy_(context.to(spec.cache_dtype))
    eager_cache = cache.clone()
    rows = bounds.max_num_tokens
    q = torch.randn(rows, 128, 576, generator=g, device="cuda").to(torch.bfloat16)
    latent = torch.randn(rows, 576, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.empty(rows, 128, 512, dtype=torch.bfloat16, device="cuda")
    step_a = ((1000, 9, 2500), (1, 8, 3))
    step_b = ((2560, 3, 20, 700), (5, 3, 1, 1))

    def step(seq_lens, query_lens):
        blocks = [list(range(1 + 40 * i, 1 + 40 * (i + 1))) for i in range(len(seq_lens))]
        return pagedkv.CommonAttentionMetadata.from_requests(
            seq_lens, query_lens, blocks, 64, "cuda", num_tokens=sum(query_lens)
        )

    def forward():
        impl.forward_mla(
            q[..., :512], q[..., 512:], latent[:, :512], latent[:, 512:], cache, md, out
        )

    md = builder.build(step(*step_a))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compiles the kernels before the capture
    torch.cuda.current_stream().wait_stream(stream)
    cache.copy_(eager_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    common_b = step(*step_b)
    md = builder.build(common_b)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_backend = pagedkv.select_backend(config, spec, "cuda")
    eager_md = eager_backend.make_builder(spec, "cuda").build(common_b)
    n = common_b.num_actual_tokens
    expected = eager_backend.make_impl(spec).forward_mla(
        q[:n, :, :512], q[:n, :, 512:], latent[:n, :512], latent[:n, 512:], eager_cache, eager_md
    )
    torch.testing.assert_close(out[:n], expected, atol=2e-2, rtol=2e-2)
    # the replay wrote step B's latent rows where eager did (a graph slot -1 pads the rest)
    assert torch.equal(cache.view(torch.uint8), eager_cache.view(torch.uint8))


def _h200_builder(spec, bounds=None, **options):
    """A builder planning as on an H200 (its configuration row, SMs and capability)."""
    backend = MLABackend(**options)
    builder = MLAMetadataBuilder(
        spec, "cpu", graph_support=backend.capabilities.graph_support, **backend.options
    )
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    builder.config = choose_config("sm90", 2, lora, rope)
    builder.capability, builder.num_sms = (9, 0), 132
    if bounds is not None:
        builder.reserve_cuda_graph(bounds)
    return builder


@pytest.mark.parametrize(
    "name",
    ["mla-ragged-decode-256", "mla-tp8-ragged-decode-64", "mla-decode-1x32k",
     "mla-decode-4x32k", "mla-decode-64x4096", "mla-mixed-64d+1chunk"],
)  # fmt: skip
@pytest.mark.parametrize("reserved_for", ["own", "32k"])
def test_a_graph_step_takes_the_eager_rules_ranges_on_an_h200(name, reserved_for):
    """Under a reservation (the step's own bounds, or 32k of context as an engine
    reserves) each step lists the work items its eager build lists: its own ranges,
    not the bounds' (the ragged rows' graphs took 389 and 288 µs where their eager
    calls took 290 and 114, nineteenth session)."""
    from pagedkv.bench.problem import build_problem
    from pagedkv.bench.workloads import MATRICES

    workload = next(w for w in MATRICES["mla"] if w.name == name)
    problem = build_problem(workload, "cpu")
    common, spec = problem.common, problem.spec
    longest = 32768 if reserved_for == "32k" else max(workload.seq_lens)
    bounds = GraphBounds(
        max_num_reqs=workload.num_reqs,
        max_num_tokens=workload.num_tokens,
        max_blocks_per_req=-(-longest // spec.block_size),
        max_query_len=max(workload.query_lens),
    )
    eager = _h200_builder(spec).build(common)
    graph = _h200_builder(spec, bounds).build(common)
    assert graph.plan.kind == eager.plan.kind == GLUON
    assert (graph.kv_per_split, graph.num_splits, graph.num_items) == (
        eager.kv_per_split, eager.num_splits, eager.num_items
    )  # fmt: skip
    n = eager.num_items
    assert torch.equal(graph.items[:, :n], eager.items)
    assert torch.equal(graph.token_ranges[:, : common.num_actual_tokens], eager.token_ranges)
    merged = int(eager.merges[0])
    assert torch.equal(graph.merges[: 1 + 3 * merged], eager.merges)
    # the grid beyond the step's items: padding
    assert (graph.items[3, n:] == 0).all()  # no keys: the programs end at once
    assert (graph.items[1, n:] >= bounds.max_query_len * spec.num_heads).all()  # no rows


def test_a_step_past_the_reservations_partials_takes_longer_ranges(monkeypatch):
    """A reservation's partials fit in GRAPH_PARTIAL_BYTES: a step whose ranges would
    write more takes ranges twice as long until they fit."""
    from pagedkv.backends.mla import work

    spec = AttentionSpec(
        num_heads=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, block_size=64,
        scale=192**-0.5, kv_lora_rank=512, qk_rope_head_dim=64,
    )  # fmt: skip
    seq_lens = [32768] * 4
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=4, max_blocks_per_req=512)
    blocks = [list(range(1 + 512 * i, 1 + 512 * (i + 1))) for i in range(4)]
    common = pagedkv.CommonAttentionMetadata.from_requests(seq_lens, [1] * 4, blocks, 64)
    eager = _h200_builder(spec).build(common)
    assert (eager.num_splits, eager.kv_per_split) == (16, 2048)  # 64 slots
    slot_bytes = 128 * 513 * 4
    grid = work.graph_grid(8, 32768, 4, slot_bytes, 132)
    # 64 ranges a request of 32k, the tiles and 2 programs an SM, 64 MiB of partials
    assert (grid.splits, grid.items, grid.partials, grid.merges) == (64, 8 + 264, 255, 4)
    assert _h200_builder(spec, bounds).build(common).kv_per_split == 2048  # as eager
    # room for 40 slots: 16 ranges a request (64 slots) do not fit, 8 (32) do
    monkeypatch.setattr(work, "GRAPH_PARTIAL_BYTES", 40 * slot_bytes)
    md = _h200_builder(spec, bounds).build(common)
    assert (md.num_splits, md.kv_per_split) == (8, 4096)
    assert md.mid_o.shape[0] == 40 and md.num_items == 4 * 2 * 8


@settings(max_examples=60, deadline=None)
@given(
    max_reqs=st.integers(1, 12),
    max_query_len=st.integers(1, 8),
    heads=st.sampled_from([16, 128]),
    budget_slots=st.sampled_from([None, 5, 20]),  # None: GRAPH_PARTIAL_BYTES
    data=st.data(),
)
def test_every_step_within_the_bounds_fits_the_reservations_grid(
    max_reqs, max_query_len, heads, budget_slots, data
):
    """Any step within a reservation (planned as on an H200, up to 32k keys a request)
    lists its work inside the captured grid: items, ranges, partial slots and merged
    tokens, each token's slots inside the partials (small partial budgets included)."""
    from unittest import mock

    from pagedkv.backends.mla import work

    budget = work.GRAPH_PARTIAL_BYTES
    if budget_slots is not None:
        budget = budget_slots * heads * 513 * 4
    with mock.patch.object(work, "GRAPH_PARTIAL_BYTES", budget):
        _steps_within_a_reservation(max_reqs, max_query_len, heads, data)


def _steps_within_a_reservation(max_reqs, max_query_len, heads, data):
    spec = AttentionSpec(
        num_heads=heads, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, block_size=64,
        scale=192**-0.5, kv_lora_rank=512, qk_rope_head_dim=64,
    )  # fmt: skip
    max_tokens = data.draw(st.integers(max(max_reqs, max_query_len), max_reqs * max_query_len))
    bounds = GraphBounds(
        max_num_reqs=max_reqs, max_num_tokens=max_tokens, max_blocks_per_req=512,
        max_query_len=max_query_len,
    )  # fmt: skip
    builder = _h200_builder(spec, bounds)
    for _ in range(3):  # several steps into one reservation
        query_lens = data.draw(
            st.lists(st.integers(1, max_query_len), min_size=1, max_size=max_reqs)
        )
        while sum(query_lens) > max_tokens:  # the step's tokens within the bounds
            query_lens.pop()
        num_reqs = len(query_lens)
        contexts = data.draw(
            st.lists(st.integers(0, 32768 - max_query_len), min_size=num_reqs, max_size=num_reqs)
        )
        seq_lens = [c + q for c, q in zip(contexts, query_lens, strict=True)]
        blocks = [list(range(1 + 512 * i, 1 + 512 * (i + 1))) for i in range(num_reqs)]
        common = pagedkv.CommonAttentionMetadata.from_requests(
            seq_lens, query_lens, blocks, 64, num_tokens=max_tokens
        )
        md = builder.build(common)
        grid = builder._grid[1]
        assert md.items.shape[1] == grid.items and md.num_items <= grid.items
        assert md.num_splits <= grid.splits
        count = md.token_ranges[0, : sum(query_lens)]
        merged = int(md.merges[0])
        assert merged <= grid.merges
        entries = md.merges[1 : 1 + 3 * merged].view(-1, 3)
        assert (entries[:, 1] > 1).all() and merged == int((count > 1).sum())
        if merged:
            assert int((entries[:, 2] + entries[:, 1]).max()) <= md.mid_o.shape[0]
            assert md.mid_o.shape[0] == grid.partials
