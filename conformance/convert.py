"""Conformance of live KV-cache conversion (``pagedkv.convert_kv_cache``) between two backends.

A cache written by backend A (context and the step's rows, through A's own writer,
every unreferenced block poisoned with NaN) is converted into backend B's layout in
several chunks. Then:

- B's logical K/V equal A's bit for bit, every block (NaN poison included);
- B attends over the converted cache exactly as over a cache B wrote itself
  (bitwise equal outputs).
"""

from __future__ import annotations

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.cache import _bits
from pagedkv.conformance.check import _context_rows
from pagedkv.conformance.problem import PagedProblem, build_problem, poison_cache
from pagedkv.conformance.scenario import Scenario
from pagedkv.convert import convert_kv_cache


def _written_cache(backend: AttentionBackend, problem: PagedProblem, device: str) -> torch.Tensor:
    """A poisoned cache holding every request's context and this step's rows, written
    through ``backend``'s own writer."""
    spec = problem.spec
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
    poison_cache(backend, cache, problem)
    builder = backend.make_builder(spec, device)
    impl = backend.make_impl(spec, sinks=problem.sinks)
    if problem.context.num_actual_tokens:
        key, value = _context_rows(problem)
        impl.write_kv(key, value, cache, builder.build(problem.context))
    impl.write_kv(problem.new_key, problem.new_value, cache, builder.build(problem.common))
    return cache


def _attend(backend: AttentionBackend, cache: torch.Tensor, problem: PagedProblem, device: str):
    spec = problem.spec
    metadata = backend.make_builder(spec, device).build(problem.common)
    impl = backend.make_impl(spec, sinks=problem.sinks)
    out = impl.forward(problem.query, None, None, cache, metadata)
    return out[: problem.common.num_actual_tokens]


def conversion_problems(
    src: AttentionBackend, dst: AttentionBackend, scenario: Scenario, device: str
) -> list[str]:
    """Everything wrong with converting ``src``'s cache of ``scenario`` to ``dst`` (empty: ok)."""
    problem = build_problem(scenario, device)
    spec = problem.spec
    source = _written_cache(src, problem, device)
    before = [_bits(v).clone() for v in src.kv_cache_to_logical(source, spec)]
    # several chunks, so chunk boundaries are exercised
    converted = convert_kv_cache(src, source, dst, spec, chunk_blocks=3)
    out: list[str] = []
    names = ("K", "V")
    after = dst.kv_cache_to_logical(converted, spec)
    for name, want, view in zip(names, before, after, strict=True):
        got = _bits(view)
        if got.shape != want.shape:
            out.append(f"logical {name}: shape {list(got.shape)} != source {list(want.shape)}")
            continue
        diff = (got != want).flatten(1).any(1).nonzero().flatten()
        if diff.numel():
            out.append(
                f"logical {name} differs from the source in {diff.numel()} block(s), first "
                f"block {int(diff[0])}"
            )
    for name, want, view in zip(names, before, src.kv_cache_to_logical(source, spec), strict=True):
        if not torch.equal(_bits(view), want):
            out.append(f"the source cache's {name} changed during the conversion")
    if out:
        return out
    direct = _written_cache(dst, problem, device)
    via_conversion, own = (
        _attend(dst, converted, problem, device),
        _attend(dst, direct, problem, device),
    )
    if not torch.equal(_bits(via_conversion), _bits(own)):
        err = float((via_conversion.float() - own.float()).abs().max())
        out.append(
            f"{dst.name} attends differently over the converted cache than over its own "
            f"(max abs difference {err:.3g})"
        )
    return out
