"""The Triton backend's Gluon sm_90 prefill kernel on an H100/H200, against the float64
reference: prefills and chunked prefills with ragged lengths, context before the
chunk, shuffled block tables, block sizes 16/64 (and 128), head sizes 64/128 (and
256), GQA groups 1/4/8, bf16 and fp16, at the conformance tolerances.

The kernel is launched through its own planner (``gluon_plan``) over a cache laid out
as the Triton backend's, poisoned as the conformance suite poisons it (NaN in every
block no request holds, large finite values past each sequence's end in its last
block); the output starts as NaN, so rows the kernel must not write stay NaN.

    python -m pytest -q tests/test_triton_gluon_prefill_gpu.py
"""

from __future__ import annotations

import itertools

import pagedkv
import pytest
import torch
from pagedkv.conformance import TOLERANCES, Scenario
from pagedkv.conformance.problem import build_problem, poison_cache, reference_output


def _why_not_here() -> str | None:
    if not torch.cuda.is_available():
        return (
            "needs a CUDA GPU (the CPU compiles the kernel in test_triton_gluon_prefill_compile.py)"
        )
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return f"the Gluon prefill kernel is sm_90 only (sm_{capability[0]}{capability[1]} here)"
    return None


_WHY = _why_not_here()
if _WHY is not None:
    print(f"test_triton_gluon_prefill_gpu: skipped: {_WHY}")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

BACKEND = pagedkv.get_backend("triton")
# whole prefills, chunks after context (one of them longer than a tile), a one-token
# chunk, and lengths that are and are not multiples of pages and tiles
RAGGED = dict(seq_lens=(1000, 77, 300, 129, 2048, 256), query_lens=(1000, 77, 40, 1, 512, 256))
NUM_KV_HEADS = 2


def _scenario(name, head_size, block_size, group, dtype, **changes) -> Scenario:
    fields = dict(
        RAGGED,
        num_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )
    fields.update(changes)
    return Scenario(name, **fields)


def _cases() -> list[Scenario]:
    out = []
    for d, b, g, dtype in itertools.product(
        (64, 128), (16, 64), (1, 4, 8), (torch.bfloat16, torch.float16)
    ):
        name = f"d{d}-b{b}-g{g}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}"
        out.append(_scenario(name, d, b, g, dtype))
    out += [
        _scenario("d256-b16-g4-bf16", 256, 16, 4, torch.bfloat16),
        _scenario("d256-b128-g1-bf16", 256, 128, 1, torch.bfloat16),
        _scenario("d128-b32-g6-bf16", 128, 32, 6, torch.bfloat16),  # 21 tokens x 6 heads
        _scenario("d128-b16-g4-non-causal", 128, 16, 4, torch.bfloat16, causal=False),
        _scenario("d128-b16-g4-padded", 128, 16, 4, torch.bfloat16, num_padding_tokens=7),
        # a 16-bit cache holds K and V unscaled: k_scale / v_scale do not apply
        _scenario(
            "d128-b16-g4-scaled", 128, 16, 4, torch.bfloat16, scale=0.3, k_scale=2.0, v_scale=0.5
        ),
        # more requests than one vector load of query_start_loc covers (128)
        _scenario(
            "d64-b16-g4-150-requests",
            64,
            16,
            4,
            torch.float16,
            seq_lens=tuple(40 + (37 * i) % 260 for i in range(150)),
            query_lens=tuple(1 + (13 * i) % 40 for i in range(150)),
        ),
        # the benchmark's chunk: 2048 queries after 8k of context
        _scenario(
            "d128-b16-g4-chunk-after-8k",
            128,
            16,
            4,
            torch.bfloat16,
            seq_lens=(10240, 3000),
            query_lens=(2048, 3000),
        ),
    ]
    return out


CASES = _cases()


def _filled_cache(problem) -> torch.Tensor:
    """The backend's cache, poisoned, holding every request's keys and values."""
    spec = problem.spec
    cache = BACKEND.allocate_kv_cache(problem.num_blocks, spec, "cuda")
    poison_cache(BACKEND, cache, problem)
    k_view, v_view = BACKEND.kv_cache_to_logical(cache, spec)
    bs = spec.block_size
    for ids, keys, values in zip(problem.block_ids, problem.keys, problem.values, strict=True):
        pos = torch.arange(keys.shape[0])
        blocks = torch.tensor(ids)[pos // bs]
        k_view[blocks, pos % bs] = keys.to("cuda")
        v_view[blocks, pos % bs] = values.to("cuda")
    return cache


def _assert_matches(scenario: Scenario, out: torch.Tensor, expected: torch.Tensor) -> None:
    n = expected.shape[0]
    actual = out[:n].double().cpu()
    tol = TOLERANCES[scenario.dtype]
    assert torch.isfinite(actual).all(), "NaN or inf in a request's rows"
    excess = (actual - expected).abs() - (tol.atol + tol.rtol * expected.abs())
    worst = torch.nonzero(excess == excess.max())[0].tolist()
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} values beyond atol={tol.atol}, "
        f"rtol={tol.rtol}; worst at (token, head, dim) {worst}: got {actual[tuple(worst)]:.5f}, "
        f"expected {expected[tuple(worst)]:.5f}"
    )
    # padding rows are no request's: never written
    assert torch.isnan(out[n:]).all()


def _run(scenario: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output [T, Hq, D] on the GPU, the float64 reference [n, Hq, D])."""
    from pagedkv.backends.triton.gluon_plan import (
        gluon_cache_args,
        gluon_layer_args,
        gluon_prefill_problem,
        gluon_step_problem,
        plan_gluon_prefill,
    )

    problem = build_problem(scenario, "cuda")
    spec = problem.spec
    assert gluon_prefill_problem(spec, "cuda") is None
    assert gluon_step_problem(problem.common, spec, num_splits=1) is None
    cache = _filled_cache(problem)
    k_view, v_view = BACKEND.kv_cache_to_logical(cache, spec)
    step = plan_gluon_prefill(spec, problem.common)
    out = torch.full_like(problem.query, float("nan"))
    cache_args = gluon_cache_args(spec, k_view, v_view)
    step.launch(problem.query, out, gluon_layer_args(spec), cache_args)()
    torch.cuda.synchronize()
    return out, reference_output(problem)


@pytest.mark.parametrize("scenario", CASES, ids=[s.name for s in CASES])
def test_matches_the_float64_reference(scenario):
    out, expected = _run(scenario)
    _assert_matches(scenario, out, expected)


# decodes first (as schedulers order them) or last, then chunks after context: two parts,
# the decodes on the portable kernel (split), the chunks on the Gluon kernel
MIXED = [
    _scenario(
        "decodes-then-chunks",
        128,
        16,
        4,
        torch.bfloat16,
        num_heads=32,
        num_kv_heads=8,
        seq_lens=(300, 77, 1500, 2048, 1100, 4000),
        query_lens=(1, 1, 1, 1024, 1024, 700),
        num_padding_tokens=5,
    ),
    _scenario(
        "chunks-then-decodes",
        64,
        32,
        8,
        torch.float16,
        num_heads=64,
        num_kv_heads=8,
        seq_lens=(2048, 1500, 900, 33, 5000),
        query_lens=(1024, 1500, 1, 1, 1),
    ),
]


@pytest.mark.parametrize("scenario", MIXED, ids=[s.name for s in MIXED])
def test_a_mixed_steps_chunks_take_the_gluon_kernel(scenario):
    """Through the backend: the chunk part's launch is the Gluon kernel's over views of
    the step from its first request on (its query blocks numbered from that request's)."""
    problem = build_problem(scenario, "cuda")
    cache = _filled_cache(problem)
    metadata = BACKEND.make_builder(problem.spec, "cuda").build(problem.common)
    kernels = [part.gluon is not None for part in metadata.parts]
    assert sorted(kernels) == [False, True], metadata.describe()
    out = torch.full_like(problem.query, float("nan"))
    impl = BACKEND.make_impl(problem.spec)
    for launch in impl.plan(problem.query, cache, metadata, out):
        launch()
    torch.cuda.synchronize()
    _assert_matches(scenario, out, reference_output(problem))


def test_the_same_step_gives_the_same_bits_twice():
    scenario = _scenario("repeat", 128, 16, 4, torch.bfloat16)
    first, _ = _run(scenario)
    second, _ = _run(scenario)
    assert torch.equal(first, second)
