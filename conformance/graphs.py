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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.check import (
    ScenarioResult,
    _check_output,
    record_raise,
    write_context,
)
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


@dataclass(frozen=True)
class Headroom:
    """How far a reservation's bounds reach past the steps it holds."""

    slack: int = 0  # each bound this far above the steps' largest
    # the block bound holds at least this many keys, as an engine reserves its graphs
    # for its model's longest context
    max_context: int = 0


def reservation(problems: Sequence[PagedProblem], headroom: Headroom = Headroom()) -> GraphBounds:
    """Bounds that hold every step of ``problems`` with ``headroom`` (the token bound also
    2 rows past every step); the query bound of decode steps stays 1."""
    steps = [p.scenario for p in problems]
    block_size = problems[0].spec.block_size
    slack = headroom.slack
    longest_query = max(q for s in steps for q in s.query_lens)
    blocks = max(cdiv(n, block_size) for s in steps for n in s.seq_lens) + 1 + slack
    return GraphBounds(
        max_num_reqs=max(len(s.seq_lens) for s in steps) + slack,
        max_num_tokens=max(s.num_tokens for s in steps) + 2 + slack,
        max_blocks_per_req=max(blocks, cdiv(headroom.max_context, block_size)),
        # a decode reservation (every query <= 1) stays one: a pure_decode backend's
        max_query_len=1 if longest_query <= 1 else longest_query + slack,
    )


def graph_reproduction(
    backend_label: str, scenarios: Sequence[Scenario], device: str, headroom: Headroom
) -> str:
    """One shell line that replays ``scenarios`` in one reservation and prints the
    verdicts (``pagedkv.conformance.reproduce_graph``)."""
    steps = ", ".join(s.repro() for s in scenarios)
    extra = "" if device == "cpu" else f", device={device!r}"
    extra += f", slack={headroom.slack}" if headroom.slack else ""
    extra += f", max_context={headroom.max_context}" if headroom.max_context else ""
    return (
        'python -c "import torch; from pagedkv.conformance import Scenario, reproduce_graph; '
        f'reproduce_graph({backend_label!r}, [{steps}]{extra})"'
    )


def graph_replay_results(
    backend: AttentionBackend, base: Scenario, device: str, label: str | None = None
) -> tuple[str, list[ScenarioResult]]:
    """(mode, [result of step A, result of step B, ...]: every pair of ``graph_steps``);
    mode is "cuda graph" or "emulated replay (cpu)"."""
    mode, results = "", []
    for steps in graph_steps(base, backend.capabilities.graph_support):
        mode, replayed = replay_steps(backend, steps, device, label=label)
        results += replayed
    return mode, results


def replay_steps(
    backend: AttentionBackend,
    scenarios: Sequence[Scenario],
    device: str,
    headroom: Headroom = Headroom(),
    label: str | None = None,
) -> tuple[str, list[ScenarioResult]]:
    """Capture the first of ``scenarios`` (steps of one layer) in a reservation that
    holds them all (``reservation`` with ``headroom``), replay it, then build each
    later step into the same buffers and replay; a result per step. A step that raises is a failure of
    that step, and the steps after it do not run."""
    label = label or repr(backend)
    reproduction = graph_reproduction(label, scenarios, device, headroom)
    cuda = torch.device(device).type == "cuda"
    mode = "cuda graph" if cuda else "emulated replay (cpu)"
    results = []
    for scenario in scenarios:
        result = ScenarioResult(label, scenario, device=str(device))
        result.reproduce_with = reproduction
        results.append(result)
    try:
        problems = [build_problem(s, device) for s in scenarios]
        first = problems[0]
        for problem in problems[1:]:
            problem.sinks = first.sinks  # one impl, one set of sink logits
        spec = first.spec
        bounds = reservation(problems, headroom)
        cache = backend.allocate_kv_cache(max(p.num_blocks for p in problems), spec, device)
        impl = backend.make_impl(spec, sinks=first.sinks)
        eager_builder = backend.make_builder(spec, device)
        builder = backend.make_builder(spec, device)
        builder.reserve_cuda_graph(bounds)
    except Exception as exc:
        record_raise(results[0], "reserving the graph", exc)
        return mode, results[:1]
    rows = bounds.max_num_tokens
    q = torch.zeros(rows, *first.query.shape[1:], dtype=first.query.dtype, device=device)
    k = torch.zeros(rows, *first.new_key.shape[1:], dtype=first.new_key.dtype, device=device)
    v = (
        None
        if first.new_value is None
        else torch.zeros(
            rows, *first.new_value.shape[1:], dtype=first.new_value.dtype, device=device
        )
    )
    out = torch.zeros(rows, spec.num_heads, spec.head_size_v, dtype=spec.dtype, device=device)

    def load(problem: PagedProblem) -> None:
        n = problem.common.num_tokens
        q[:n].copy_(problem.query)
        k[:n].copy_(problem.new_key)
        if v is not None:
            v[:n].copy_(problem.new_value)

    replay: Callable[[], object] | None = None
    for index, (problem, result) in enumerate(zip(problems, results, strict=True)):
        try:
            poison_cache(backend, cache, problem)
            write_context(impl, eager_builder, cache, problem)
            if replay is None:  # the first step: captured
                metadata = builder.build(problem.common)
                load(problem)
                forward = functools.partial(impl.forward, q, k, v, cache, metadata, out)
                replay = _capture(forward, device) if cuda else forward
            else:
                builder.build(problem.common)  # into the buffers the captured step reads
                load(problem)
            replay()
            if cuda:
                torch.cuda.synchronize(device)
        except Exception as exc:
            record_raise(result, "a replay" if index else "the captured step", exc)
            return mode, results[: index + 1]
        _check_output(result, problem, out[: problem.common.num_tokens].clone())
    return mode, results


def _capture(forward: Callable[[], object], device: str) -> Callable[[], object]:
    """``forward`` captured into a CUDA graph on ``device`` (compiled by a first call
    outside it)."""
    with torch.cuda.device(device):
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
    return graph.replay
