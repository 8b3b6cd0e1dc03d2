"""GPU-only checks of the Triton backend: CUDA-graph replay with new metadata, and
caches past 2**31 elements. Skipped on a CPU (they need compiled kernels)."""

from __future__ import annotations

import pagedkv
import pytest
import torch
from graph_replay import MIXED_BOUNDS, MIXED_PART_STEPS, replay_errors
from pagedkv import AttentionSpec, CommonAttentionMetadata, GraphBounds
from pagedkv.conformance import TOLERANCES, Scenario, run_scenario
from pagedkv.conformance.problem import build_problem
from pagedkv.reference import reference_attention
from pagedkv.spec import alibi_slopes

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)"
)

BACKEND = pagedkv.get_backend("triton")


def _random_step(gen, num_reqs, max_tokens, max_blocks, block_size, pool, device):
    """A decode step: num_reqs requests of one query token each, random lengths and
    distinct random blocks from ``pool`` (block 0 stays the null block)."""
    seq_lens = torch.randint(1, max_blocks * block_size + 1, (num_reqs,), generator=gen).tolist()
    needed = [-(-s // block_size) for s in seq_lens]
    order = (torch.randperm(pool - 1, generator=gen) + 1).tolist()
    block_ids, taken = [], 0
    for n in needed:
        block_ids.append(order[taken : taken + n])
        taken += n
    common = CommonAttentionMetadata.from_requests(
        seq_lens, [1] * num_reqs, block_ids, block_size, device, num_tokens=max_tokens
    )
    return common, seq_lens, block_ids


def _reference(spec, kv_cache, query, seq_lens, block_ids, sinks):
    k_view, v_view = BACKEND.kv_cache_to_logical(kv_cache, spec)
    keys, values = [], []
    for s, ids in zip(seq_lens, block_ids, strict=True):
        idx = torch.tensor(ids, device=kv_cache.device)
        keys.append(k_view[idx].flatten(0, 1)[:s].double().cpu())
        values.append(v_view[idx].flatten(0, 1)[:s].double().cpu())
    n = len(seq_lens)
    return reference_attention(query[:n].cpu(), keys, values, [1] * n, spec, sinks)


@pytest.mark.parametrize(
    "max_reqs, max_blocks, features",
    [
        (160, 16, {}),  # enough programs: single pass
        (4, 256, {}),  # few long sequences: split-KV + reduction inside the graph
        (4, 256, dict(use_sinks=True, alibi_slopes=alibi_slopes(8), logits_soft_cap=20.0)),
    ],
    ids=["single-pass", "split", "split-sinks-alibi-softcap"],
)
def test_cuda_graph_replays_new_metadata(max_reqs, max_blocks, features):
    device = "cuda"
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, block_size=16, **features
    )
    gen = torch.Generator().manual_seed(0)
    pool = max_reqs * max_blocks + 8
    kv_cache = BACKEND.allocate_kv_cache(pool, spec, device)
    kv_cache.normal_()
    sinks = torch.randn(8, generator=gen).to(device) if spec.use_sinks else None
    builder = BACKEND.make_builder(spec, device)
    builder.reserve_cuda_graph(GraphBounds(max_reqs, max_reqs, max_blocks))
    impl = BACKEND.make_impl(spec, sinks=sinks)
    q = torch.randn(max_reqs, 8, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(max_reqs, 2, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn(max_reqs, 2, 128, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)

    first, _, _ = _random_step(gen, max_reqs, max_reqs, max_blocks, 16, pool, device)
    metadata = builder.build(first)
    expect_split = max_reqs < 100
    assert (metadata.num_splits > 1) == expect_split
    impl.forward(q, k, v, kv_cache, metadata, out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(q, k, v, kv_cache, metadata, out)

    for step in range(2):
        # fewer requests than reserved: the builder pads with empty requests
        num_reqs = max_reqs - 1 - step
        common, seq_lens, block_ids = _random_step(
            gen, num_reqs, max_reqs, max_blocks, 16, pool, device
        )
        builder.build(common)  # new metadata into the captured buffers
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        slots = common.slot_mapping[:num_reqs]
        written = BACKEND.kv_cache_to_logical(kv_cache, spec)[0].flatten(0, 1)[slots]
        assert torch.equal(written, k[:num_reqs]), "the graph's KV write missed the new slots"
        want = _reference(spec, kv_cache, q, seq_lens, block_ids, sinks)
        got = out[:num_reqs].double().cpu()
        tol = TOLERANCES[torch.bfloat16]
        assert torch.allclose(got, want, atol=tol.atol, rtol=tol.rtol), (
            f"step {step}: max abs error {float((got - want).abs().max()):.3g}"
        )


def test_offsets_past_2_31_elements():
    """Each K/V view holds 2**32 elements (8 GiB); about half the shuffled blocks lie
    past element 2**31, where 32-bit offsets would wrap."""
    blocks = 2 * ((1 << 31) // (16 * 8 * 128))
    scenario = Scenario(
        "past-2**31",
        seq_lens=(700, 1500, 33),
        query_lens=(1, 40, 33),
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        min_num_blocks=blocks,
    )
    for splits in (1, 4):
        backend = pagedkv.get_backend("triton", num_splits=splits)
        result = run_scenario(backend, scenario, "cuda", backend_label=f"triton-split{splits}")
        assert result.passed, result.report()


def test_the_rule_reads_the_compiled_kernels_registers():
    """On a GPU the builder's tile rule asks the compiled kernel how many programs an
    SM holds (configs.FitSource): every variant it asked about compiled, each launch
    form (unsplit, even shares, listed key ranges) with its own registers, and the plan's
    tile is one of them."""
    from pagedkv.backends.triton.configs import LaunchForm, LayerShape, StepShape

    spec = AttentionSpec(
        num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16
    )
    builder = BACKEND.make_builder(spec, "cuda")
    assert builder.fits is not None
    seq_lens = [4096] * 64
    blocks = [list(range(1 + 256 * i, 1 + 256 * (i + 1))) for i in range(64)]
    common = CommonAttentionMetadata.from_requests(seq_lens, [1] * 64, blocks, 16, "cuda")
    md = builder.build(common)
    asked = builder.fits._fits
    assert {(md.tile, form) for form in LaunchForm} <= set(asked)
    for (tile, _form), fit in asked.items():
        assert fit is not None and fit.registers > 0 and fit.programs_per_sm >= 1, tile
    # the plan is what the rule makes of those fits
    from pagedkv.backends.triton.configs import plan_tiles

    again = plan_tiles(LayerShape.of(spec), StepShape.of(common), builder.num_sms, fit=builder.fits)
    assert (again.tile, again.num_splits) == (md.tile, md.num_splits)
    # the batch-invariant mode's plan must not depend on the GPU's compiler
    invariant = pagedkv.get_backend("triton", batch_invariant=True).make_builder(spec, "cuda")
    assert invariant.fits is None


def test_forwards_after_the_first_skip_tritons_dispatch(monkeypatch):
    """The second forward of a specialisation launches the compiled variants directly
    (pagedkv.toolkit.dispatch): same output bits as the dispatched first forward, and
    a query of another alignment goes through Triton's dispatch again."""
    from pagedkv.toolkit import dispatch

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
                         block_size=16)  # fmt: skip
    seq_lens, block_ids = (
        [4000, 37, 900],
        [list(range(1, 251)), [251, 252, 253], list(range(254, 311))],
    )
    common = CommonAttentionMetadata.from_requests(seq_lens, [1, 1, 1], block_ids, 16, "cuda")
    kv_cache = BACKEND.allocate_kv_cache(320, spec, "cuda").normal_()
    metadata = BACKEND.make_builder(spec, "cuda").build(common)
    assert metadata.num_splits > 1  # a split step: attention and reduction both launched
    # (or the attention alone, its last split of each request merging them: MERGE_LAST)
    launches = sum(1 + (part.reduce is not None) for part in metadata.parts)
    impl = BACKEND.make_impl(spec)
    query = torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    dispatched = []
    real = dispatch._dispatch
    monkeypatch.setattr(dispatch, "_dispatch", lambda *a: dispatched.append(a) or real(*a))
    first = impl.forward(query[:3], None, None, kv_cache, metadata)
    assert len(dispatched) == launches
    second = impl.forward(query[:3].clone(), None, None, kv_cache, metadata)
    assert len(dispatched) == launches and torch.equal(first, second)
    misaligned = torch.empty(4 * 8 * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:]
    misaligned = misaligned.view(4, 8, 128)[:3].copy_(query[:3])
    third = impl.forward(misaligned, None, None, kv_cache, metadata)
    assert len(dispatched) == launches + 1 and torch.equal(first, third)  # the attention's


@pytest.mark.parametrize("use_sinks", [False, True], ids=["plain", "sinks"])
def test_mixed_graph_replays_decodes_and_longer_requests_apart(use_sinks):
    """A graph captured on a mixed step (two launches: decodes with their own splits,
    longer requests with the bounds' tiles, the Gluon kernel where it runs) replayed on
    steps of every composition, each against the reference."""
    steps = [s.replace(use_sinks=use_sinks) for s in MIXED_PART_STEPS]
    results = replay_errors(BACKEND, steps, MIXED_BOUNDS)
    print("\n".join(f"{name}: max error {err:.3g}" for name, err, _ in results))
    assert all(ok for _, _, ok in results), results


def test_overlapped_parts_match_the_serial_launches():
    """A step of decodes and a chunk runs its two parts on two streams (overlap_parts):
    each config matches the reference, and one plan launched on two streams or one part
    after the other gives the same bits (the same kernels), also when the caller works
    on a stream of its own. (The configs' own plans differ: without the overlap the
    chunk takes the portable kernel split where its Gluon programs would leave SMs
    idle, so their outputs differ in rounding.)"""
    scenario = Scenario(
        "overlap", seq_lens=(4000, 33, 700, 2100), query_lens=(1, 1, 1, 300), num_heads=32,
        num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
    )  # fmt: skip
    for overlap in (True, False):
        backend = pagedkv.get_backend("triton", overlap_parts=overlap)
        result = run_scenario(backend, scenario, "cuda", backend_label=f"overlap={overlap}")
        assert result.passed, result.report()
    backend = pagedkv.get_backend("triton")
    problem = build_problem(scenario, "cuda")
    spec = problem.spec
    kv_cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cuda").normal_()
    md = backend.make_builder(spec, "cuda").build(problem.common)
    assert len(md.parts) == 2, md.describe()
    serial_impl = pagedkv.get_backend("triton", overlap_parts=False).make_impl(spec)
    overlapped = backend.make_impl(spec).forward(problem.query, None, None, kv_cache, md)
    serial = serial_impl.forward(problem.query, None, None, kv_cache, md)
    assert torch.equal(overlapped, serial)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        again = backend.make_impl(spec).forward(problem.query, None, None, kv_cache, md)
    torch.cuda.synchronize()
    assert torch.equal(again, overlapped)
