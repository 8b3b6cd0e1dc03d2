"""Scenarios drawn at random within a backend's declared capabilities
(``--conformance-fuzz N``, ``pagedkv conform --fuzz N``).

The suite's scenarios are a list: each batch shape and each feature on its own, pairs
of features, a few long contexts. A bug can sit between them: the pallas backend
raised from inside JAX on a step of no token rows, which no listed scenario had, until
a longer run of the unit tests' fuzzing drew one. Here hypothesis draws whole
scenarios (a batch of decodes, prefills, chunks, speculative and empty requests with
padding rows, on a layer of the block sizes, dtypes, head sizes, GQA ratios, features
and cache dtypes the backend declares and ``validate`` accepts), checks each against
the float64 reference as a listed scenario is checked, and shrinks a failure to a
small scenario, reported with its one-line reproduction. ``seed`` fixes the draw.

Needs hypothesis (``pip install "pagedkv[conformance]"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.check import ScenarioResult, run_scenario
from pagedkv.conformance.design import (
    _DTYPES,
    _preferred_block_sizes,
    _preferred_head_sizes,
    scenario_problems,
)
from pagedkv.conformance.graphs import Headroom
from pagedkv.conformance.scenario import Scenario
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport

_KINDS = ("decode", "prefill", "chunk", "spec", "empty")


class _Failed(Exception):
    """A drawn value failed: what the attempt returned for it."""

    def __init__(self, failure: object) -> None:
        super().__init__(repr(failure))
        self.failure = failure


def _batch(draw: Any, block_size: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """A drawn batch of 1-5 requests of ``kinds``: its sequence and query lengths."""
    from hypothesis import strategies as st

    b = block_size
    seq_lens, query_lens = [], []
    for _ in range(draw(st.integers(1, 5))):
        # within a block, over a few, over many (long contexts are listed scenarios)
        longest = draw(st.sampled_from([b, 2 * b + 3, 6 * b + 7, 16 * b + 5]))
        seq = draw(st.integers(0, longest))
        kind = draw(st.sampled_from(kinds))
        if seq == 0 or kind == "empty":
            query = 0
        elif kind == "decode":
            query = 1
        elif kind == "prefill":
            query = seq
        elif kind == "spec":
            query = min(seq, draw(st.integers(2, 8)))
        else:
            query = draw(st.integers(1, seq))
        seq_lens.append(seq)
        query_lens.append(query)
    return dict(seq_lens=tuple(seq_lens), query_lens=tuple(query_lens))


def _layer(draw: Any, base: Scenario, backend: AttentionBackend, block_size: int) -> dict[str, Any]:
    """A drawn layer around ``base``: along each axis the backend declares (MLA layers
    keep their latent dims and heads)."""
    from hypothesis import strategies as st

    caps = backend.capabilities
    dtypes = [base.dtype, *(d for d in _DTYPES if d in caps.dtypes and d != base.dtype)]
    fp8 = sorted(k for k in caps.kv_cache_dtypes if k != "auto")
    features = caps.features
    changes: dict[str, Any] = dict(block_size=block_size, dtype=draw(st.sampled_from(dtypes)))
    if Feature.NON_CAUSAL in features:
        changes["causal"] = draw(st.booleans())
    if fp8 and draw(st.booleans()):
        changes.update(kv_cache_dtype=draw(st.sampled_from(fp8)), k_scale=0.5, v_scale=0.25)
    if not base.is_mla:
        sizes = _preferred_head_sizes(caps.head_sizes, (base.head_size, 128, 32, 256))[:4]
        kv_heads = draw(st.sampled_from([1, 2, 4]))
        changes.update(
            head_size=draw(st.sampled_from(sizes)),
            num_kv_heads=kv_heads,
            num_heads=kv_heads * draw(st.sampled_from([1, 2, 3, 4])),
        )
        if Feature.SLIDING_WINDOW in features and draw(st.booleans()):
            changes["sliding_window"] = draw(st.integers(1, 3 * block_size + 2))
        if Feature.LOGITS_SOFT_CAP in features and draw(st.booleans()):
            changes["logits_soft_cap"] = 2.0
        if Feature.ALIBI in features:
            changes["alibi"] = draw(st.booleans())
        if Feature.SINKS in features:
            changes["use_sinks"] = draw(st.booleans())
    return changes


def _block_sizes(base: Scenario, backend: AttentionBackend) -> list[int]:
    preferred = _preferred_block_sizes(backend.capabilities.block_sizes)[:5]
    return list(dict.fromkeys([base.block_size, *preferred]))


def scenarios(base: Scenario, backend: AttentionBackend) -> Any:
    """The hypothesis strategy of scenarios around ``base`` (the backend's accepted base
    layer): the batch always, the layer along each axis the backend declares."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw: Any) -> Scenario:
        b = draw(st.sampled_from(_block_sizes(base, backend)))
        batch = _batch(draw, b, _KINDS)
        padding = draw(st.integers(0, 3))
        layer = _layer(draw, base, backend, b)
        return base.replace(
            name="fuzz",
            tags=frozenset({"fuzz"}),
            num_padding_tokens=padding,
            seed=draw(st.integers(0, 2**16)),
            **batch,
            **layer,
        )

    return draw()


def reservations(base: Scenario, backend: AttentionBackend) -> Any:
    """The hypothesis strategy of CUDA-graph reservations around ``base``: (two or three
    steps of one drawn layer, the bounds' ``Headroom`` past them: a slack and the
    longest context they are reserved for). The steps are what the backend's ``graph_support`` takes: decodes
    and empty requests under ``pure_decode``, any batch under ``mixed``; the first is
    captured, the others replayed. A reservation for a long context (4096 keys, as an
    engine reserves for its model's) takes the plans a long step would, split ones
    among them, and replays short steps in them."""
    from hypothesis import strategies as st

    mixed = backend.capabilities.graph_support is GraphSupport.MIXED
    kinds = _KINDS if mixed else ("decode", "empty")

    @st.composite
    def draw(draw: Any) -> tuple[list[Scenario], Headroom]:
        b = draw(st.sampled_from(_block_sizes(base, backend)))
        layer = _layer(draw, base, backend, b)
        steps = [
            base.replace(
                name=f"graph-fuzz-{'abc'[i]}",
                tags=frozenset({"fuzz", "graph"}),
                num_padding_tokens=0,  # the reservation's rows past the step pad it
                seed=draw(st.integers(0, 2**16)),
                **_batch(draw, b, kinds),
                **layer,
            )
            for i in range(draw(st.integers(2, 3)))
        ]
        return steps, Headroom(draw(st.integers(0, 3)), draw(st.sampled_from([0, 0, 4096])))

    return draw()


def fuzz_problems(
    backend: AttentionBackend,
    label: str,
    base: Scenario,
    device: torch.device | str,
    examples: int,
    seed: int = 0,
) -> list[str]:
    """Run ``examples`` scenarios drawn around ``base`` that the backend accepts; the
    problems of the smallest failing one hypothesis finds (empty: all passed)."""
    from hypothesis import assume

    def attempt(scenario: Scenario) -> ScenarioResult | None:
        assume(not scenario_problems(backend, scenario, device))
        result = run_scenario(backend, scenario, device, backend_label=label)
        return None if result.passed else result

    outcome = _smallest_failure(scenarios(base, backend), examples, seed, attempt)
    if outcome.refused:
        return [_refused_line(base)]
    if outcome.failure is None:
        return []
    result = outcome.failure
    return [
        f"a drawn scenario fails{outcome.flaky_note}: {result.scenario.repro()}",
        *result.report().splitlines()[1:],
        _seed_line(seed, examples, "scenarios"),
    ]


def fuzz_graph_problems(
    backend: AttentionBackend,
    label: str,
    base: Scenario,
    device: str,
    examples: int,
    seed: int = 0,
) -> list[str]:
    """Replay ``examples`` drawn CUDA-graph reservations (``reservations``: two or three
    steps of one layer, the first captured, the others built into its buffers and
    replayed; on a CPU the emulated replay of ``conformance/graphs.py``); the problems of
    the smallest failing one hypothesis finds (empty: all passed)."""
    from hypothesis import assume
    from pagedkv.conformance.graphs import replay_steps

    def attempt(drawn: tuple[list[Scenario], Headroom]) -> tuple[str, ScenarioResult] | None:
        steps, headroom = drawn
        assume(not any(scenario_problems(backend, s, device) for s in steps))
        mode, results = replay_steps(backend, steps, device, headroom, label)
        failed = [r for r in results if not r.passed]
        return (mode, failed[0]) if failed else None

    outcome = _smallest_failure(reservations(base, backend), examples, seed, attempt)
    if outcome.refused:
        return [_refused_line(base)]
    if outcome.failure is None:
        return []
    mode, result = outcome.failure
    return [
        f"a drawn reservation fails{outcome.flaky_note} ({mode}) at its step "
        f"{result.scenario.name}: {result.scenario.repro()}",
        *result.report().splitlines()[1:],
        _seed_line(seed, examples, "reservations"),
    ]


@dataclass
class _Outcome:
    """What a draw found: what the attempt returned for the smallest failing value
    (None: every value passed), whether every value was refused, and whether the
    failure was flaky (it passed when hypothesis ran the same value again: then the
    failure is the first one seen, not shrunk)."""

    failure: Any = None
    refused: bool = False
    flaky: bool = False

    @property
    def flaky_note(self) -> str:
        if not self.flaky:
            return ""
        return " once and passed when run again (not deterministic; not shrunk)"


def _refused_line(base: Scenario) -> str:
    return (
        f"validate() refused every drawn scenario around the base layer {base.repro()}: "
        "the declared capabilities promise layers the backend does not take"
    )


def _seed_line(seed: int, examples: int, what: str) -> str:
    return f"(drawn with seed {seed}, among {examples} {what}: --conformance-fuzz-seed {seed})"


def _smallest_failure(
    strategy: Any, examples: int, seed: int, attempt: Callable[[Any], Any]
) -> _Outcome:
    """Draw ``examples`` values of ``strategy`` (seeded) and run ``attempt`` on each (it
    rejects a value with hypothesis's ``assume``, returns None when the value passes,
    else what describes the failure); the ``_Outcome``."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Flaky, Unsatisfiable

    seen: list[Any] = []  # every failure, in order: a flaky one is only here

    @fixed_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(drawn=strategy)
    def check(drawn: Any) -> None:
        failure = attempt(drawn)
        if failure is not None:
            seen.append(failure)
            raise _Failed(failure)

    try:
        check()
    except Unsatisfiable:
        return _Outcome(refused=True)
    except _Failed as failed:
        return _Outcome(failed.failure)
    except Flaky:
        if not seen:
            raise
        return _Outcome(seen[0], flaky=True)
    return _Outcome()
