"""Run one scenario through a backend and judge it against the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.problem import (
    GARBAGE,
    PagedProblem,
    build_problem,
    poison_cache,
    reference_output,
)
from pagedkv.conformance.scenario import Scenario
from pagedkv.kv_write import dequantize_from_cache, quantize_for_cache


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Against the float64 reference, on outputs of magnitude ~1. Why these values:
# docs/conformance.md. Never loosened to make a backend pass.
TOLERANCES = {
    torch.float32: Tolerance(atol=2e-4, rtol=2e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=1.5e-2, rtol=1e-2),
}


@dataclass
class ScenarioResult:
    backend: str
    scenario: Scenario
    max_abs_error: float = math.nan
    max_rel_error: float = math.nan
    failures: list[str] = field(default_factory=list)
    output: torch.Tensor | None = None  # [num_actual_tokens, Hq, Dv] float64 (MLA: up-projected)

    @property
    def passed(self) -> bool:
        return not self.failures

    def report(self) -> str:
        head = f"[{self.backend}] scenario {self.scenario.name}: " + (
            "PASS" if self.passed else "FAIL"
        )
        lines = [
            head,
            f"  max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}",
        ]
        lines += [f"  - {f}" for f in self.failures]
        if not self.passed:
            lines.append(
                '  reproduce: python -c "import torch; from pagedkv.conformance import Scenario, reproduce; '
                f"reproduce('{self.backend}', {self.scenario.repro()})\""
            )
        return "\n".join(lines)


def run_scenario(
    backend: AttentionBackend,
    scenario: Scenario,
    device: torch.device | str = "cpu",
    *,
    backend_label: str | None = None,
) -> ScenarioResult:
    """Build, write, attend and check one scenario. Never raises for a backend bug:
    every problem becomes a line in ``failures``."""
    result = ScenarioResult(backend_label or repr(backend), scenario)
    problem = build_problem(scenario, device)
    spec = problem.spec
    problem.common.validate(problem.num_blocks)

    kv_cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
    expected_shape = backend.get_kv_cache_shape(
        problem.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
    )
    if tuple(kv_cache.shape) != tuple(expected_shape):
        result.failures.append(
            f"allocate_kv_cache shape {tuple(kv_cache.shape)} != get_kv_cache_shape {expected_shape}"
        )
        return result
    poison_cache(backend, kv_cache, problem)
    builder = backend.make_builder(spec, device)
    impl = backend.make_impl(spec, sinks=problem.sinks)

    # context: written through the backend's own writer
    if problem.context.num_actual_tokens:
        ctx_key, ctx_value = _context_rows(problem)
        impl.write_kv(ctx_key, ctx_value, kv_cache, builder.build(problem.context))

    metadata = builder.build(problem.common)
    output = impl.forward(problem.query, problem.new_key, problem.new_value, kv_cache, metadata)
    if device != "cpu" and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

    _check_output(result, problem, output)
    _check_cache(result, backend, kv_cache, problem)
    return result


def _context_rows(problem: PagedProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = problem.query.device
    rows_k, rows_v = [], []
    for k, v, s, q in zip(
        problem.keys,
        problem.values,
        problem.scenario.seq_lens,
        problem.scenario.query_lens,
        strict=True,
    ):
        rows_k.append(k[: s - q])
        rows_v.append(v[: s - q])
    key = torch.cat(rows_k).to(device)
    value = None if problem.scenario.is_mla else torch.cat(rows_v).to(device)
    return key, value


def _check_output(result: ScenarioResult, problem: PagedProblem, output: torch.Tensor) -> None:
    spec, scenario = problem.spec, problem.scenario
    n = problem.common.num_actual_tokens
    want_shape = (problem.common.num_tokens, spec.num_heads, spec.head_size_v)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != want_shape:
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        result.failures.append(f"output shape {got}, expected {want_shape}")
        return
    if output.dtype != spec.dtype:
        result.failures.append(f"output dtype {output.dtype}, expected {spec.dtype}")
    actual = output[:n].double().cpu()
    if scenario.is_mla:
        actual = torch.einsum("thl,lhv->thv", actual, problem.mla_weights["w_uv"].double())
    result.output = actual
    if not torch.isfinite(actual).all():
        bad = torch.nonzero(~torch.isfinite(actual))[0].tolist()
        result.failures.append(f"non-finite output at {_locate(problem, bad[0], bad[1])}")
        return
    expected = reference_output(problem)
    tol = TOLERANCES[spec.dtype]
    err = (actual - expected).abs()
    result.max_abs_error = float(err.max()) if err.numel() else 0.0
    result.max_rel_error = (
        float((err / expected.abs().clamp_min(1e-6)).max()) if err.numel() else 0.0
    )
    excess = err - (tol.atol + tol.rtol * expected.abs())
    if err.numel() and float(excess.max()) > 0:
        token, head, dim = (int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        result.failures.append(
            f"output differs from the float64 reference beyond atol={tol.atol}, rtol={tol.rtol}: "
            f"largest at {_locate(problem, token, head)}, dim {dim}: got {actual[token, head, dim]:.6g}, "
            f"expected {expected[token, head, dim]:.6g} (abs error {err[token, head, dim]:.3g}); "
            f"{int((excess > 0).sum())} of {excess.numel()} elements out of tolerance"
        )


def _locate(problem: PagedProblem, token: int, head: int) -> str:
    starts = problem.common.query_start_loc_cpu.tolist()
    req = max(i for i in range(len(starts) - 1) if starts[i] <= token) if token < starts[-1] else -1
    if req < 0:
        return f"padding token {token}, head {head}"
    s, q = problem.scenario.seq_lens[req], problem.scenario.query_lens[req]
    pos = s - q + token - starts[req]
    kv_head = head // problem.spec.num_queries_per_kv
    return (
        f"request {req} (seq_len {s}, query_len {q}), token {token} (position {pos}), "
        f"query head {head} (kv head {kv_head})"
    )


def _check_cache(
    result: ScenarioResult, backend: AttentionBackend, kv_cache: torch.Tensor, problem: PagedProblem
) -> None:
    """The cache holds exactly the written K/V at their slots; nothing else changed."""
    spec = problem.spec
    k_view, v_view = backend.kv_cache_to_logical(kv_cache, spec)
    views = [("K", k_view, problem.keys, spec.k_scale)]
    if not problem.scenario.is_mla:  # MLA's V is a view of K's storage
        views.append(("V", v_view, problem.values, spec.v_scale))
    bs = spec.block_size
    referenced = torch.zeros(problem.num_blocks, dtype=torch.bool)
    for ids in problem.block_ids:
        referenced[ids] = True
    for label, view, rows, scale in views:
        view = view.cpu()
        for req, (ids, full) in enumerate(zip(problem.block_ids, rows, strict=True)):
            seq_len = full.shape[0]
            if not ids:
                continue
            stored = view[torch.tensor(ids)].flatten(0, 1)  # [num_blocks * bs, H, D]
            want = quantize_for_cache(full, view.dtype, scale)
            got = stored[:seq_len]
            if not _same_cache_values(got, want, scale):
                diff = _first_mismatch(got, want, scale)
                block = ids[diff // bs]
                result.failures.append(
                    f"cache {label} of request {req}, position {diff} (block {block}, offset {diff % bs}): "
                    "does not hold the written value (write_kv wrote the wrong slot or value)"
                )
                break
            tail = stored[seq_len:].float()
            garbage = float(torch.tensor(GARBAGE).to(view.dtype).float())  # as this dtype stores it
            if tail.numel() and not bool((tail == garbage).all()):
                pos = seq_len + int(torch.nonzero((tail != garbage).flatten(1).any(dim=1))[0, 0])
                result.failures.append(
                    f"cache {label} of request {req}: slot past the sequence end (position {pos}, "
                    f"block {ids[pos // bs]}, offset {pos % bs}) was overwritten"
                )
                break
        untouched = view[~referenced].float()
        if untouched.numel() and not bool(torch.isnan(untouched).all()):
            first = int(torch.nonzero(~torch.isnan(untouched.flatten(1)).all(dim=1))[0])
            block = int(torch.nonzero(~referenced)[first])
            what = (
                "block 0 (the null block)"
                if block == 0
                else f"block {block}, which no request references,"
            )
            result.failures.append(
                f"cache {label}: {what} was written (e.g. a -1 padding slot or a wrong slot)"
            )


def _same_cache_values(got: torch.Tensor, want: torch.Tensor, scale: float) -> bool:
    if got.dtype.itemsize == 1:
        # fp8 rounding may differ by one step between implementations
        a, b = dequantize_from_cache(got, scale), dequantize_from_cache(want, scale)
        return bool(((a - b).abs() <= 0.126 * b.abs() + 1e-6 * scale).all())
    return torch.equal(got, want)


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, scale: float) -> int:
    a, b = dequantize_from_cache(got, scale), dequantize_from_cache(want, scale)
    bad = ~((a - b).abs() <= 0.126 * b.abs() + 1e-6 * scale)
    return int(torch.nonzero(bad.flatten(1).any(dim=1))[0])


def compare_outputs(a: ScenarioResult, b: ScenarioResult) -> list[str]:
    """Backend against backend on the same scenario (both float64, same rows)."""
    if a.output is None or b.output is None:
        return []
    dtype = a.scenario.dtype
    tol = TOLERANCES[dtype]
    # two backends may each sit at the edge of the reference tolerance, in opposite directions
    err = (a.output - b.output).abs()
    limit = 2 * (tol.atol + tol.rtol * b.output.abs())
    if err.numel() and bool((err > limit).any()):
        i = int((err - limit).argmax())
        idx = torch.unravel_index(torch.tensor(i), err.shape)
        return [
            f"{a.backend} and {b.backend} differ by {float(err.max()):.3g} at token/head/dim {tuple(int(x) for x in idx)}"
        ]
    return []
