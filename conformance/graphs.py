"""Conformance of CUDA-graph support: capture one step, replay another.

For a backend declaring ``cuda_graph`` support: reserve bounds that hold two different
steps A and B (B smaller, so it is padded), build A, run it once (compilation), capture
``forward`` into a CUDA graph, replay and check A; then write B's context, build B into
the same buffers, copy B's query/key/value into the captured input buffers, replay and
check B against the float64 reference. Everything a replay reads must therefore live
in the persistent buffers, and every launch parameter must depend only on the bounds.

On a CPU there is no graph to capture; the same check runs as an *emulated replay*:
``forward`` is called again with A's metadata object after B was built into the
buffers. A real replay reuses exactly what that call reuses (A's Python-level launch
parameters, the buffers' new contents), so a backend that plans from host data per
step fails it too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.check import ScenarioResult, _check_output, _context_rows
from pagedkv.conformance.problem import PagedProblem, build_problem, poison_cache
from pagedkv.conformance.scenario import Scenario
from pagedkv.graph import GraphBounds, GraphSupport
from pagedkv.intmath import cdiv


def graph_steps(base: Scenario, support: GraphSupport) -> list[tuple[Scenario, Scenario]]:
    """Pairs of different steps A and B on ``base``'s layer, each pair one reservation:
    pure decodes (what engines capture most), and mixed steps too when the backend
    declares MIXED. B has fewer requests and tokens (padding) and other lengths; the
    decode pair's B holds one long request (more than 1024 keys), so a backend that
    chooses splits per step chooses differently for A and B within one graph."""
    B = base.block_size
    decodes = (
        base.replace(
            name="graph-step-a", seq_lens=(3 * B + 5, 40, 2 * B, 9), query_lens=(1, 1, 1, 1),
            num_padding_tokens=0, seed=base.seed + 101,
        ),
        base.replace(
            name="graph-step-b", seq_lens=(1100 // B * B + 3, 7), query_lens=(1, 1),
            num_padding_tokens=0, seed=base.seed + 202,
        ),
    )  # fmt: skip
    if support is not GraphSupport.MIXED:
        return [decodes]
    mixed = (
        base.replace(
            name="graph-mixed-step-a", seq_lens=(3 * B + 5, 40, 2 * B, 9), query_lens=(1, 17, 2 * B, 1),
            num_padding_tokens=0, seed=base.seed + 101,
        ),
        base.replace(
            name="graph-mixed-step-b", seq_lens=(B + 1, 5 * B - 3, 12), query_lens=(4, 1, 12),
            num_padding_tokens=0, seed=base.seed + 202,
        ),
    )  # fmt: skip
    return [mixed, decodes]


def _bounds(a: PagedProblem, b: PagedProblem) -> GraphBounds:
    steps = (a.scenario, b.scenario)
    return GraphBounds(
        max_num_reqs=max(len(s.seq_lens) for s in steps),
        max_num_tokens=max(s.num_tokens for s in steps) + 2,  # rows past every step
        max_blocks_per_req=max(cdiv(n, a.spec.block_size) for s in steps for n in s.seq_lens) + 1,
        max_query_len=max(q for s in steps for q in s.query_lens),
    )


def _write_context(impl, builder, cache: torch.Tensor, problem: PagedProblem) -> None:
    if problem.context.num_actual_tokens:
        key, value = _context_rows(problem)
        # the context write is an eager step of its own (its own builder, not reserved)
        impl.write_kv(key, value, cache, builder.build(problem.context))


def graph_replay_results(
    backend: AttentionBackend, base: Scenario, device: str
) -> tuple[str, list[ScenarioResult]]:
    """(mode, [result of step A, result of step B, ...]: every pair of ``graph_steps``);
    mode is "cuda graph" or "emulated replay (cpu)"."""
    mode, results = "", []
    for scenario_a, scenario_b in graph_steps(base, backend.capabilities.graph_support):
        mode, pair = _replay_pair(backend, scenario_a, scenario_b, device)
        results += pair
    return mode, results


def _replay_pair(
    backend: AttentionBackend, scenario_a: Scenario, scenario_b: Scenario, device: str
) -> tuple[str, list[ScenarioResult]]:
    """Capture A in its reservation, replay A, then B built into A's buffers."""
    a, b = build_problem(scenario_a, device), build_problem(scenario_b, device)
    b.sinks = a.sinks  # one impl, one set of sink logits
    spec = a.spec
    bounds = _bounds(a, b)
    cache = backend.allocate_kv_cache(max(a.num_blocks, b.num_blocks), spec, device)
    impl = backend.make_impl(spec, sinks=a.sinks)
    eager_builder = backend.make_builder(spec, device)
    builder = backend.make_builder(spec, device)
    builder.reserve_cuda_graph(bounds)
    rows = bounds.max_num_tokens
    q = torch.zeros(rows, *a.query.shape[1:], dtype=a.query.dtype, device=device)
    k = torch.zeros(rows, *a.new_key.shape[1:], dtype=a.new_key.dtype, device=device)
    v = (
        None
        if a.new_value is None
        else torch.zeros(rows, *a.new_value.shape[1:], dtype=a.new_value.dtype, device=device)
    )
    out = torch.zeros(rows, spec.num_heads, spec.head_size_v, dtype=spec.dtype, device=device)

    def load(problem: PagedProblem) -> None:
        n = problem.common.num_tokens
        q[:n].copy_(problem.query)
        k[:n].copy_(problem.new_key)
        if v is not None:
            v[:n].copy_(problem.new_value)

    poison_cache(backend, cache, a)
    _write_context(impl, eager_builder, cache, a)
    metadata_a = builder.build(a.common)
    load(a)
    replay: Callable[[], object]
    if torch.device(device).type == "cuda":
        mode = "cuda graph"
        impl.forward(q, k, v, cache, metadata_a, out)  # compile outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            impl.forward(q, k, v, cache, metadata_a, out)
        replay = graph.replay
    else:
        mode = "emulated replay (cpu)"

        def replay() -> None:
            impl.forward(q, k, v, cache, metadata_a, out)

    results = []
    for problem in (a, b):
        if problem is b:
            poison_cache(backend, cache, b)
            _write_context(impl, eager_builder, cache, b)
            builder.build(b.common)  # into the buffers metadata_a reads
            load(b)
        replay()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        result = ScenarioResult(repr(backend), problem.scenario, device=str(device))
        _check_output(result, problem, out[: problem.common.num_tokens].clone())
        results.append(result)
    return mode, results
