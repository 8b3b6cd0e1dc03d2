"""Capture one step of a backend in a CUDA graph, replay it on other steps, and compare
each replay with the float64 reference (the GPU tests' graph check).

The flow is the contract's: ``reserve_cuda_graph(bounds)``, build step A into the
persistent buffers, warm up, capture ``forward`` (the K/V write included), then for
each later step write its context eagerly, ``build`` it into the same buffers, copy
its query/key/value into the captured inputs and replay. The steps share one layer
(one spec and one set of sinks) and one cache; each fills the cache with large finite
garbage first, so a replay that reads another step's pages shows.

On a CPU (the backends' plumbing tests, with their kernel models) there is no graph:
each "replay" runs ``forward`` on the latest step's metadata instead, which checks
everything here but the capture itself.
"""

from __future__ import annotations

import dataclasses

import torch
from pagedkv import BackendMetadata, GraphBounds
from pagedkv.backend import AttentionBackend
from pagedkv.conformance import TOLERANCES, Scenario
from pagedkv.conformance.problem import GARBAGE, build_problem, reference_output
from pagedkv.toolkit.kv_write import quantize_for_cache

# Pure-decode steps of one layer (8 query heads over 2 KV heads, head size 64, fp16,
# blocks of 16): other batch sizes, a request without a query token, a long context.
DECODE_BOUNDS = GraphBounds(max_num_reqs=6, max_num_tokens=8, max_blocks_per_req=260)
DECODE_STEPS = [
    Scenario("decode-a", seq_lens=(17, 40, 1, 128), query_lens=(1, 1, 1, 1), num_padding_tokens=1),
    Scenario("decode-b-fewer-requests", seq_lens=(100, 3, 77), query_lens=(1, 1, 1), seed=1),
    Scenario("decode-c-empty-request", seq_lens=(18, 41, 2, 128, 9), query_lens=(1, 0, 1, 1, 1),
             seed=2),
    Scenario("decode-d-long", seq_lens=(4100, 16, 2048, 1, 33, 700), query_lens=(1,) * 6, seed=3),
]  # fmt: skip
# Mixed steps (decodes, chunked prefills, a prefill) within one reservation
MIXED_BOUNDS = GraphBounds(max_num_reqs=6, max_num_tokens=96, max_blocks_per_req=260,
                           max_query_len=48)  # fmt: skip
MIXED_STEPS = [
    Scenario("mixed-a", seq_lens=(17, 300, 1, 128), query_lens=(1, 40, 1, 16), num_padding_tokens=2),
    Scenario("mixed-b-decodes", seq_lens=(100, 3, 77), query_lens=(1, 1, 1), seed=1),
    Scenario("mixed-c-prefill", seq_lens=(48, 41, 2, 4100, 9), query_lens=(48, 0, 2, 1, 9), seed=2),
]  # fmt: skip
# Mixed steps of every composition a backend that launches decodes and longer requests
# apart must handle within MIXED_BOUNDS: decodes first or after the chunk (whose
# partials then start past the chunk's rows), decodes only, kinds interleaved
MIXED_PART_STEPS = [
    Scenario("parts-a-decodes-first", seq_lens=(4000, 33, 700, 96), query_lens=(1, 1, 3, 40),
             num_padding_tokens=2),
    Scenario("parts-b-chunk-first", seq_lens=(300, 2500, 17, 1200), query_lens=(48, 1, 1, 1),
             seed=1),
    Scenario("parts-c-decodes-only", seq_lens=(4100, 60), query_lens=(1, 1), seed=2),
    Scenario("parts-d-interleaved", seq_lens=(50, 900, 33, 128), query_lens=(1, 20, 1, 16),
             seed=3),
]  # fmt: skip


def replay_errors(
    backend: AttentionBackend,
    steps: list[Scenario],
    bounds: GraphBounds,
    device: str = "cuda",
) -> list[tuple[str, float, bool]]:
    """(step name, max abs error, within tolerance) for the warm-up run of ``steps[0]``
    and the replay of every step (the first one included) on the graph captured on it."""
    problems = [build_problem(s, device) for s in steps]
    sinks = problems[0].sinks
    problems = [dataclasses.replace(p, sinks=sinks) for p in problems]  # one layer
    spec = problems[0].spec
    for p in problems[1:]:
        assert p.spec == spec, "the steps of one graph share one layer"
    cache = backend.allocate_kv_cache(max(p.num_blocks for p in problems), spec, device)
    builder = backend.make_builder(spec, device)
    impl = backend.make_impl(spec, sinks=sinks)
    builder.reserve_cuda_graph(bounds)
    rows, s = bounds.max_num_tokens, spec
    q = torch.zeros(rows, s.num_heads, s.head_size, dtype=s.dtype, device=device)
    k = torch.zeros(rows, s.num_kv_heads, s.head_size, dtype=s.dtype, device=device)
    v = torch.zeros(rows, s.num_kv_heads, s.head_size_v, dtype=s.dtype, device=device)
    out = torch.zeros(rows, s.num_heads, s.head_size_v, dtype=s.dtype, device=device)
    garbage = quantize_for_cache(torch.full((), GARBAGE), cache.dtype, 1.0)  # fp8 saturates

    def prepare(problem):
        cache.copy_(garbage.to(device).expand(cache.shape))
        lens = zip(problem.scenario.seq_lens, problem.scenario.query_lens, strict=True)
        context = [n - q_len for n, q_len in lens]
        # the context goes through the backend's writer, which needs only the slots
        impl.write_kv(
            torch.cat([kk[:c] for kk, c in zip(problem.keys, context, strict=True)]).to(device),
            torch.cat([vv[:c] for vv, c in zip(problem.values, context, strict=True)]).to(device),
            cache,
            BackendMetadata(problem.context),
        )
        md = builder.build(problem.common)
        for static, new in ((q, problem.query), (k, problem.new_key), (v, problem.new_value)):
            static.zero_()
            static[: new.shape[0]].copy_(new)
        return md

    def check(name, problem):
        n = problem.common.num_actual_tokens
        expected = reference_output(problem)
        err = (out[:n].double().cpu() - expected).abs()
        tol = TOLERANCES[spec.dtype]
        ok = bool((err <= tol.atol + tol.rtol * expected.abs()).all())
        return name, float(err.max()) if err.numel() else 0.0, ok

    on_gpu = torch.device(device).type == "cuda"
    results = []
    md = prepare(problems[0])
    impl.forward(q, k, v, cache, md, output=out)  # warm-up: compiles, moves per-head vectors
    results.append(check(f"{steps[0].name} (eager)", problems[0]))
    if on_gpu:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            impl.forward(q, k, v, cache, md, output=out)
    for step, problem in zip(steps, problems, strict=True):
        md = prepare(problem)
        out.fill_(float("nan"))
        if on_gpu:
            graph.replay()
            torch.cuda.synchronize()
        else:
            impl.forward(q, k, v, cache, md, output=out)
        results.append(check(f"{step.name} (replay)", problem))
    return results
