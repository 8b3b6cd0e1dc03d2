"""Run one scenario through a backend and judge it against the reference."""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.capabilities import dtype_name
from pagedkv.conformance.cache import cache_problems
from pagedkv.conformance.diagnose import output_hints
from pagedkv.conformance.failure import Failure, describe_exception
from pagedkv.conformance.problem import (
    PagedProblem,
    build_problem,
    poison_cache,
    reference_output,
)
from pagedkv.conformance.scenario import Scenario

T = TypeVar("T")


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
class Debug:
    """What one scenario ran, kept for a debugger (``reproduce(...)`` fills it)."""

    # scenario, spec, block_ids, per-request keys/values, query [T, Hq, D], new_key,
    # new_value, common and context metadata, sinks
    problem: PagedProblem
    kv_cache: torch.Tensor | None = None  # the backend's cache after forward
    metadata: Any = None  # the backend's metadata of the step
    output: torch.Tensor | None = None  # forward's [T, Hq, Dv] in spec.dtype
    reference: torch.Tensor | None = None  # float64 [num_actual_tokens, Hq, Dv]


@dataclass
class ScenarioResult:
    backend: str
    scenario: Scenario
    max_abs_error: float = math.nan
    max_rel_error: float = math.nan
    failures: list[Failure] = field(default_factory=list)
    # what the failing requests and heads have in common, and which plausible bug the
    # output matches (conformance/diagnose.py)
    hints: list[str] = field(default_factory=list)
    output: torch.Tensor | None = None  # [num_actual_tokens, Hq, Dv] float64 (MLA: up-projected)
    device: str = "cpu"
    duration_s: float = 0.0
    error: str | None = None  # the traceback when a backend call raised
    debug: Debug | None = None
    # the shell line that reruns this result where rerunning the scenario alone would
    # not (a step replayed in a CUDA-graph reservation)
    reproduce_with: str | None = None

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
        lines += [f"  - {f.message}" for f in self.failures]
        lines += [f"  hint: {h}" for h in self.hints]
        if not self.passed:
            lines.append(f"  reproduce: {self.reproduction()}")
        if self.error:
            lines.append("  " + self.error.rstrip().replace("\n", "\n  "))
        return "\n".join(lines)

    def reproduction(self) -> str:
        """One shell line that reruns this scenario alone and prints the verdict."""
        if self.reproduce_with is not None:
            return self.reproduce_with
        device = "" if self.device == "cpu" else f", device={self.device!r}"
        return (
            'python -c "import torch; from pagedkv.conformance import Scenario, reproduce; '
            f'reproduce({self.backend!r}, {self.scenario.repro()}{device})"'
        )


class _BackendRaised(Exception):
    """A backend call raised (already a failure line of the result): stop this scenario."""


def record_raise(result: ScenarioResult, stage: str, exc: Exception) -> None:
    """``stage`` raised ``exc``: a failure of ``result``, with the traceback's end."""
    result.failures.append(
        Failure("raised", f"{stage} raised {describe_exception(exc)}", {"call": stage})
    )
    result.error = "".join(traceback.format_exception(exc)[-6:])


def _call(result: ScenarioResult, stage: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except Exception as exc:
        record_raise(result, stage, exc)
        raise _BackendRaised from exc


def run_scenario(
    backend: AttentionBackend,
    scenario: Scenario,
    device: torch.device | str = "cpu",
    *,
    backend_label: str | None = None,
    keep: bool = False,
) -> ScenarioResult:
    """Build, write, attend and check one scenario. Never raises for a backend bug:
    every problem (an exception from a backend call included) becomes a line in
    ``failures``. With ``keep``, ``result.debug`` holds the problem, the cache, the
    metadata, the output and the reference, for a debugger."""
    result = ScenarioResult(backend_label or repr(backend), scenario, device=str(device))
    start = time.perf_counter()
    problem = build_problem(scenario, device)
    problem.common.validate(problem.num_blocks)
    if keep:
        result.debug = Debug(problem)
    with contextlib.suppress(_BackendRaised):  # already recorded as a failure
        _run(result, backend, problem, device)
    result.duration_s = time.perf_counter() - start
    return result


def _run(
    result: ScenarioResult,
    backend: AttentionBackend,
    problem: PagedProblem,
    device: torch.device | str,
) -> None:
    spec = problem.spec
    kv_cache = _call(
        result,
        "allocate_kv_cache",
        lambda: backend.allocate_kv_cache(problem.num_blocks, spec, device),
    )
    expected_shape = _call(
        result,
        "get_kv_cache_shape",
        lambda: backend.get_kv_cache_shape(
            problem.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        ),
    )
    if result.debug is not None:
        result.debug.kv_cache = kv_cache
    if tuple(kv_cache.shape) != tuple(expected_shape):
        result.failures.append(
            Failure(
                "kv-cache-shape",
                f"allocate_kv_cache shape {tuple(kv_cache.shape)} != get_kv_cache_shape "
                f"{tuple(expected_shape)}",
                {"got": list(kv_cache.shape), "expected": list(expected_shape)},
            )
        )
        return
    _call(result, "kv_cache_to_logical", lambda: poison_cache(backend, kv_cache, problem))
    builder = _call(result, "make_builder", lambda: backend.make_builder(spec, device))
    impl = _call(result, "make_impl", lambda: backend.make_impl(spec, sinks=problem.sinks))

    # context: written through the backend's own writer
    if problem.context.num_actual_tokens:
        ctx_key, ctx_value = _context_rows(problem)
        ctx_metadata = _call(result, "build (context)", lambda: builder.build(problem.context))
        _call(
            result,
            "write_kv (context)",
            lambda: impl.write_kv(ctx_key, ctx_value, kv_cache, ctx_metadata),
        )

    metadata = _call(result, "build", lambda: builder.build(problem.common))
    output = _call(
        result,
        "forward",
        lambda: impl.forward(problem.query, problem.new_key, problem.new_value, kv_cache, metadata),
    )
    if torch.device(device).type == "cuda":
        _call(result, "forward (kernel)", lambda: torch.cuda.synchronize(device))
    if result.debug is not None:
        result.debug.metadata, result.debug.output = metadata, output

    _check_output(result, problem, output)
    views = _call(
        result, "kv_cache_to_logical", lambda: backend.kv_cache_to_logical(kv_cache, spec)
    )
    result.failures += cache_problems(views, problem)


def write_context(impl: Any, builder: Any, kv_cache: torch.Tensor, problem: PagedProblem) -> None:
    """Write the problem's context (the keys before this step's) into ``kv_cache``: an
    eager step of its own, built by ``builder`` (never a reserved one)."""
    if problem.context.num_actual_tokens:
        key, value = _context_rows(problem)
        impl.write_kv(key, value, kv_cache, builder.build(problem.context))


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


# -- output -----------------------------------------------------------------------------


def _check_output(result: ScenarioResult, problem: PagedProblem, output: torch.Tensor) -> None:
    spec, scenario = problem.spec, problem.scenario
    n = problem.common.num_actual_tokens
    want_shape = (problem.common.num_tokens, spec.num_heads, spec.head_size_v)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != want_shape:
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        result.failures.append(
            Failure(
                "output-shape",
                f"output shape {got}, expected {want_shape}",
                {"got": str(got), "expected": list(want_shape)},
            )
        )
        return
    if output.dtype != spec.dtype:
        result.failures.append(
            Failure(
                "output-dtype",
                f"output dtype {output.dtype}, expected {spec.dtype}",
                {"got": dtype_name(output.dtype), "expected": dtype_name(spec.dtype)},
            )
        )
    actual = output[:n].double().cpu()
    if scenario.is_mla:
        actual = torch.einsum("thl,lhv->thv", actual, problem.mla_weights["w_uv"].double())
    result.output = actual
    expected = reference_output(problem)
    if result.debug is not None:
        result.debug.reference = expected
    tol = TOLERANCES[spec.dtype]
    finite = torch.isfinite(actual)
    err = (actual - expected).abs().masked_fill(~finite, math.inf)
    excess = err - (tol.atol + tol.rtol * expected.abs())
    if not err.numel():
        result.max_abs_error = result.max_rel_error = 0.0
        return
    result.max_abs_error = float(err.max())
    result.max_rel_error = float((err / expected.abs().clamp_min(1e-6)).max())
    if not finite.all():
        token, head = torch.nonzero(~finite)[0, :2].tolist()
        bad_tokens = (~finite).flatten(1).any(dim=1)
        requests = _requests_of(scenario, bad_tokens)
        result.failures.append(
            Failure(
                "non-finite-output",
                f"non-finite output at {locate(scenario, token, head)}; "
                f"{int(bad_tokens.sum())} of {n} tokens have non-finite values, in "
                f"{_describe_requests(scenario, requests)}. Every block no request references "
                "(the null block 0 included) holds NaN, so the kernel read a block the "
                "request's table does not name, or produced NaN itself",
                {
                    **_location(scenario, token, head),
                    "tokens": int(bad_tokens.sum()),
                    "of_tokens": n,
                    **_request_fields(scenario, requests),
                },
            )
        )
    finite_excess = excess.masked_fill(~finite, -math.inf)
    if float(finite_excess.max()) > 0:
        token, head, dim = (
            int(i) for i in torch.unravel_index(finite_excess.argmax(), excess.shape)
        )
        bad = finite_excess > 0
        requests = _requests_of(scenario, bad.flatten(1).any(dim=1))
        heads = torch.nonzero(bad.any(dim=2).any(dim=0)).flatten().tolist()
        got, want = float(actual[token, head, dim]), float(expected[token, head, dim])
        result.failures.append(
            Failure(
                "output",
                f"output differs from the float64 reference beyond atol={tol.atol}, "
                f"rtol={tol.rtol}: largest at {locate(scenario, token, head)}, dim {dim}: got "
                f"{got:.6g}, expected {want:.6g} (abs error {err[token, head, dim]:.3g}); "
                f"{int(bad.sum())} of {excess.numel()} elements out of tolerance, in "
                f"{_describe_requests(scenario, requests)} and query heads {_compact(heads)}",
                {
                    **_location(scenario, token, head),
                    "dim": dim,
                    "got": got,
                    "expected": want,
                    "abs_error": float(err[token, head, dim]),
                    "elements": int(bad.sum()),
                    "of_elements": excess.numel(),
                    **_request_fields(scenario, requests),
                    "heads": heads,
                },
            )
        )
    failing = ~finite | (excess > 0)
    if bool(failing.any()):
        result.hints += output_hints(problem, actual, failing, tol.atol, tol.rtol)


def _location(scenario: Scenario, token: int, head: int) -> dict[str, Any]:
    """Request, position and heads of packed query row ``token`` (request None: a
    padding row)."""
    starts = [0]
    for q in scenario.query_lens:
        starts.append(starts[-1] + q)
    kv_heads = 1 if scenario.is_mla else scenario.num_kv_heads
    where: dict[str, Any] = {"request": None, "token": token, "head": head}
    if token < starts[-1]:
        req = max(i for i in range(len(starts) - 1) if starts[i] <= token)
        s, q = scenario.seq_lens[req], scenario.query_lens[req]
        where.update(request=req, seq_len=s, query_len=q, position=s - q + token - starts[req])
    where["kv_head"] = head // (scenario.num_heads // kv_heads)
    return where


def locate(scenario: Scenario, token: int, head: int) -> str:
    """Request, position and heads of packed query row ``token``, in words."""
    w = _location(scenario, token, head)
    if w["request"] is None:
        return f"padding token {token}, head {head}"
    return (
        f"request {w['request']} (seq_len {w['seq_len']}, query_len {w['query_len']}), "
        f"token {token} (position {w['position']}), query head {head} (kv head {w['kv_head']})"
    )


def _requests_of(scenario: Scenario, bad_tokens: torch.Tensor) -> list[int]:
    """The requests that own a row of ``bad_tokens`` ([num_actual_tokens] bool)."""
    owners = scenario.row_requests()
    return sorted({owners[t] for t in torch.nonzero(bad_tokens).flatten().tolist()})


def _request_fields(scenario: Scenario, requests: list[int]) -> dict[str, list[int]]:
    return {
        "requests": requests,
        "seq_lens": [scenario.seq_lens[r] for r in requests],
        "query_lens": [scenario.query_lens[r] for r in requests],
    }


def _describe_requests(scenario: Scenario, requests: list[int]) -> str:
    fields = _request_fields(scenario, requests)
    return (
        f"requests {_compact(requests)} with seq_lens {_compact(fields['seq_lens'], count=False)}"
        f" and query_lens {_compact(fields['query_lens'], count=False)}"
    )


def _compact(items: list[int], limit: int = 12, count: bool = True) -> str:
    text = ", ".join(map(str, items[:limit]))
    text = f"[{text}{', ...' if len(items) > limit else ''}]"
    return f"{text} ({len(items)})" if count else text


# -- backend against backend ------------------------------------------------------------


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
        token, head, dim = (int(i) for i in torch.unravel_index((err - limit).argmax(), err.shape))
        return [
            f"{a.backend} and {b.backend} differ by up to {float(err.max()):.3g} (beyond twice "
            f"the reference tolerance); largest excess at {locate(a.scenario, token, head)}, "
            f"dim {dim}: {a.output[token, head, dim]:.6g} vs {b.output[token, head, dim]:.6g}"
        ]
    return []
