"""Hints for a failed output: what the failing requests and query heads have in
common, and which plausible bug the output matches.

Patterns come from the failure alone (which requests and heads are out of
tolerance). Hypotheses recompute the reference with one plausible bug built in (the
window ignored, the default softmax scale, one key too few, ...) and name that bug
when every failing row equals the alternative within the tolerance. Both run only
after a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from pagedkv.conformance.problem import PagedProblem, cached_kv
from pagedkv.reference import reference_attention
from pagedkv.spec import AttentionSpec

# an alternative reference for some requests: [num_actual_tokens, Hq, Dv] float64, NaN
# in the rows of other requests and in those the hypothesis says nothing about
Alternative = Callable[[set[int]], torch.Tensor]


def output_hints(
    problem: PagedProblem,
    actual: torch.Tensor,
    failing: torch.Tensor,
    atol: float,
    rtol: float,
) -> list[str]:
    """Hints for ``actual`` ([num_actual_tokens, Hq, Dv] float64) whose elements
    ``failing`` (same shape, bool) are non-finite or out of tolerance."""
    hints = _last_block_pattern(problem, failing)
    hints += _multi_block_pattern(problem, failing)
    hints += _gqa_pattern(problem, failing)
    if not problem.scenario.is_mla:  # the MLA reference has no such modifiers
        bad, _ = _failing_requests(problem, failing)  # only their rows are recomputed
        for claim, alternative in _hypotheses(problem):
            if _explains(alternative(bad), actual, failing, atol, rtol):
                hints.append(claim + _rows_qualifier(problem, failing))
    return hints


# -- patterns ---------------------------------------------------------------------------


def _failing_requests(problem: PagedProblem, failing: torch.Tensor) -> tuple[set[int], set[int]]:
    """(requests with a failing row, requests with query rows and none failing)."""
    rows = failing.flatten(1).any(dim=1).tolist()
    owners = problem.scenario.row_requests()
    bad = {owners[t] for t, is_bad in enumerate(rows) if is_bad}
    return bad, set(owners) - bad


def _last_block_pattern(problem: PagedProblem, failing: torch.Tensor) -> list[str]:
    scenario = problem.scenario
    b, seq = scenario.block_size, scenario.seq_lens
    bad, good = _failing_requests(problem, failing)
    if bad and all(seq[r] % b == 0 for r in bad) and any(seq[r] % b for r in good):
        lens = ", ".join(str(seq[r]) for r in sorted(bad))
        return [
            f"every failing request has a full last block (seq_len % block_size == 0: seq_lens "
            f"{lens} with block size {b}) and the requests whose last block is partly filled "
            "pass: look at the full-block case (the last block is (seq_len - 1) // block_size "
            "and holds block_size tokens; seq_len // block_size and seq_len % block_size are "
            "one block too far and 0)"
        ]
    return []


def _multi_block_pattern(problem: PagedProblem, failing: torch.Tensor) -> list[str]:
    scenario = problem.scenario
    b, seq = scenario.block_size, scenario.seq_lens
    bad, good = _failing_requests(problem, failing)
    if bad and bad == {r for r in bad | good if seq[r] > b} and good:
        return [
            f"the failing requests are exactly those spanning more than one block (seq_len > "
            f"block_size {b}): look at how the kernel walks the block table past its first "
            "entry (a request's blocks are scattered over the pool, not contiguous)"
        ]
    return []


def _gqa_pattern(problem: PagedProblem, failing: torch.Tensor) -> list[str]:
    spec = problem.spec
    hq, hkv = spec.num_heads, spec.num_kv_heads
    if problem.scenario.is_mla or hkv < 2 or hq == hkv:
        return []
    group = hq // hkv
    heads = torch.nonzero(failing.flatten(2).any(dim=2).any(dim=0)).flatten().tolist()
    modulo = [h for h in range(hq) if h % hkv != h // group]
    if heads != modulo:
        return []
    return [
        f"the failing query heads {heads} are exactly those where h % num_kv_heads differs "
        f"from h // {group}: query head h reads KV head h // (num_heads / num_kv_heads) (heads "
        f"0-{group - 1} read KV head 0, heads {group}-{2 * group - 1} KV head 1, ...), and the "
        "kernel seems to use h % num_kv_heads"
    ]


# -- hypotheses -------------------------------------------------------------------------


def _hypotheses(problem: PagedProblem) -> Iterator[tuple[str, Alternative]]:
    """(what the bug is, the reference with that bug) for each bug this layer allows."""
    spec = problem.spec
    if spec.sliding_window is not None:
        yield (
            f"the failing rows equal attention without the sliding window ({spec.sliding_window}"
            "): the kernel ignores the window there",
            lambda reqs: _reference(problem, reqs, spec.replace(sliding_window=None)),
        )
    default_scale = spec.head_size**-0.5
    if abs(spec.scale - default_scale) > 1e-9 * default_scale:
        yield (
            f"the failing rows equal attention with the softmax scale head_size ** -0.5 = "
            f"{default_scale:.6g} instead of spec.scale = {spec.scale:.6g}: the kernel derives "
            "its own scale",
            lambda reqs: _reference(problem, reqs, spec.replace(scale=default_scale)),
        )
    if spec.logits_soft_cap is not None:
        yield (
            f"the failing rows equal attention without the logits soft cap "
            f"({spec.logits_soft_cap}): the kernel ignores the cap there",
            lambda reqs: _reference(problem, reqs, spec.replace(logits_soft_cap=None)),
        )
    if spec.alibi_slopes is not None:
        yield (
            "the failing rows equal attention without the ALiBi bias: the kernel ignores "
            "alibi_slopes there",
            lambda reqs: _reference(problem, reqs, spec.replace(alibi_slopes=None)),
        )
    if problem.sinks is not None:
        yield (
            "the failing rows equal attention without the sink logits: the kernel leaves the "
            "sinks out of the softmax denominator",
            lambda reqs: _reference(problem, reqs, spec, sinks=None),
        )
    yield (
        f"the failing rows equal {'non-causal' if spec.causal else 'causal'} attention: the "
        f"kernel's causal flag is inverted (spec.causal is {spec.causal})",
        lambda reqs: _reference(problem, reqs, spec.replace(causal=not spec.causal)),
    )
    yield (
        "the failing rows equal attention over one key fewer (each query misses the last key "
        "it should see): the sequence length or the causal mask is off by one",
        lambda reqs: _reference(problem, reqs, spec, drop_last_key=True),
    )


_KEEP = object()


def _reference(
    problem: PagedProblem,
    requests: set[int],
    spec: AttentionSpec,
    sinks: object = _KEEP,
    drop_last_key: bool = False,
) -> torch.Tensor:
    """The reference of ``requests`` for ``spec`` (and ``sinks``), NaN in other rows.
    With ``drop_last_key``, each request attends to its keys but the last; one
    without a context (a prefill) is left out: the hypothesis says nothing there."""
    scenario = problem.scenario
    owners = scenario.row_requests()
    keys, values = cached_kv(problem)
    included = set(requests)
    if drop_last_key:
        for r in sorted(included):
            if scenario.seq_lens[r] > scenario.query_lens[r]:
                keys[r], values[r] = keys[r][:-1], values[r][:-1]
            else:
                included.discard(r)
    out = torch.full(
        (len(owners), spec.num_heads, spec.head_size_v), float("nan"), dtype=torch.float64
    )
    rows = [t for t, r in enumerate(owners) if r in included]
    if rows:
        out[rows] = reference_attention(
            problem.query[rows].cpu(),
            keys,
            values,
            [q if r in included else 0 for r, q in enumerate(scenario.query_lens)],
            spec,
            problem.sinks if sinks is _KEEP else sinks,
        )
    return out


def _explains(
    alternative: torch.Tensor,
    actual: torch.Tensor,
    failing: torch.Tensor,
    atol: float,
    rtol: float,
) -> bool:
    """Every (row, head) with a failing element equals ``alternative`` within the
    tolerance, in every element."""
    pairs = failing.any(dim=2)  # [rows, heads]
    got, want = actual[pairs], alternative[pairs]
    if not got.numel() or not bool(torch.isfinite(want).all()):
        return False
    return bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def _rows_qualifier(problem: PagedProblem, failing: torch.Tensor) -> str:
    """ " (in decode rows only ...)" when every failing row is a decode and others pass."""
    scenario = problem.scenario
    rows = failing.flatten(1).any(dim=1).tolist()
    owners = scenario.row_requests()
    decode = [scenario.query_lens[r] == 1 for r in owners]
    bad_decode = [d for d, bad in zip(decode, rows, strict=True) if bad]
    if bad_decode and all(bad_decode) and not all(decode):
        return " (only decode rows, query_len 1, fail: look at the decode path)"
    return ""
