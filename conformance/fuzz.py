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
from pagedkv.conformance.scenario import Scenario
from pagedkv.features import Feature

_KINDS = ("decode", "prefill", "chunk", "spec", "empty")


class _Failed(Exception):
    def __init__(self, result: ScenarioResult) -> None:
        super().__init__(result.scenario.repro())
        self.result = result


def scenarios(base: Scenario, backend: AttentionBackend) -> Any:
    """The hypothesis strategy of scenarios around ``base`` (the backend's accepted base
    layer): the batch always, the layer along each axis the backend declares. MLA
    layers keep their latent dims and heads."""
    from hypothesis import strategies as st

    caps = backend.capabilities
    blocks = list(dict.fromkeys([base.block_size, *_preferred_block_sizes(caps.block_sizes)[:5]]))
    dtypes = [base.dtype, *(d for d in _DTYPES if d in caps.dtypes and d != base.dtype)]
    fp8 = sorted(k for k in caps.kv_cache_dtypes if k != "auto")
    features = caps.features

    @st.composite
    def draw(draw: Any) -> Scenario:
        b = draw(st.sampled_from(blocks))
        seq_lens, query_lens = [], []
        for _ in range(draw(st.integers(1, 5))):
            # within a block, over a few, over many (long contexts are listed scenarios)
            longest = draw(st.sampled_from([b, 2 * b + 3, 6 * b + 7, 16 * b + 5]))
            seq = draw(st.integers(0, longest))
            kind = draw(st.sampled_from(_KINDS))
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
        changes: dict[str, Any] = dict(
            seq_lens=tuple(seq_lens),
            query_lens=tuple(query_lens),
            num_padding_tokens=draw(st.integers(0, 3)),
            block_size=b,
            dtype=draw(st.sampled_from(dtypes)),
            seed=draw(st.integers(0, 2**16)),
        )
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
                changes["sliding_window"] = draw(st.integers(1, 3 * b + 2))
            if Feature.LOGITS_SOFT_CAP in features and draw(st.booleans()):
                changes["logits_soft_cap"] = 2.0
            if Feature.ALIBI in features:
                changes["alibi"] = draw(st.booleans())
            if Feature.SINKS in features:
                changes["use_sinks"] = draw(st.booleans())
        return base.replace(name="fuzz", tags=frozenset({"fuzz"}), **changes)

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
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Unsatisfiable

    @fixed_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(scenario=scenarios(base, backend))
    def check(scenario: Scenario) -> None:
        assume(not scenario_problems(backend, scenario, device))
        result = run_scenario(backend, scenario, device, backend_label=label)
        if not result.passed:
            raise _Failed(result)

    try:
        check()
    except Unsatisfiable:
        return [
            f"validate() refused every drawn scenario around the base layer {base.repro()}: "
            "the declared capabilities promise layers the backend does not take"
        ]
    except _Failed as failed:
        return [
            f"a drawn scenario fails: {failed.result.scenario.repro()}",
            *failed.result.report().splitlines()[1:],
            f"(drawn with seed {seed}, among {examples} scenarios: --conformance-fuzz-seed {seed})",
        ]
    return []
