"""The pagedkv conformance harness: proof that a backend computes the same attention
as the float64 reference from the same block tables (docs/conformance.md).

Run it with ``pytest --pyargs pagedkv.conformance --backend NAME`` (the pytest
plugin is ``pagedkv.conformance.plugin``) or ``pagedkv conform``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_exports

if TYPE_CHECKING:
    from pagedkv.conformance.check import (
        TOLERANCES,
        ScenarioResult,
        Tolerance,
        compare_outputs,
        run_scenario,
    )
    from pagedkv.conformance.design import design_scenarios
    from pagedkv.conformance.scenario import Scenario

# loaded on first use: the pytest plugin (a submodule) is imported into every pytest
# run of an environment holding pagedkv and must not pay for torch
_EXPORTS = {
    "TOLERANCES": "pagedkv.conformance.check",
    "ScenarioResult": "pagedkv.conformance.check",
    "Tolerance": "pagedkv.conformance.check",
    "compare_outputs": "pagedkv.conformance.check",
    "run_scenario": "pagedkv.conformance.check",
    "design_scenarios": "pagedkv.conformance.design",
    "Scenario": "pagedkv.conformance.scenario",
}


__getattr__, __dir__ = lazy_exports("pagedkv.conformance", _EXPORTS, globals())


__all__ = [
    "TOLERANCES",
    "Scenario",
    "ScenarioResult",
    "Tolerance",
    "compare_outputs",
    "design_scenarios",
    "reproduce",
    "reproduce_graph",
    "run_scenario",
]


def reproduce(
    backend: str, scenario: Scenario, device: str | None = None, *, quiet: bool = False
) -> ScenarioResult:
    """Run one scenario against a registered backend and print the verdict (unless
    ``quiet``). The result keeps the problem for a debugger: ``result.debug.problem``
    holds the query [T, Hq, D], new_key, new_value, each request's keys and values,
    block_ids, the common metadata and the sinks; ``result.debug.kv_cache``,
    ``.metadata``, ``.output`` ([T, Hq, Dv], spec.dtype) and ``.reference`` (float64
    [num_actual_tokens, Hq, Dv]) are the rest."""
    import torch
    from pagedkv.conformance.check import run_scenario
    from pagedkv.registry import get_registry
    from pagedkv.selection import parse_config

    choice = parse_config(backend)[0]
    impl = get_registry().create(choice.name, **choice.options)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = run_scenario(impl, scenario, device, backend_label=backend, keep=True)
    if not quiet:
        print(result.report())
    return result


def reproduce_graph(
    backend: str,
    steps: list[Scenario],
    device: str | None = None,
    *,
    slack: int = 0,
    max_context: int = 0,
    quiet: bool = False,
) -> list[ScenarioResult]:
    """Replay ``steps`` (scenarios of one layer) through a registered backend in one
    CUDA-graph reservation that holds them all, each bound ``slack`` above their
    largest, the block bound at least ``max_context`` keys: the first step captured (on a CPU, its metadata object called again as a
    replay would), each later one built into the same buffers and replayed; print each
    step's verdict (unless ``quiet``)."""
    import torch
    from pagedkv.conformance.graphs import Headroom, replay_steps
    from pagedkv.registry import get_registry
    from pagedkv.selection import parse_config

    choice = parse_config(backend)[0]
    impl = get_registry().create(choice.name, **choice.options)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    mode, results = replay_steps(impl, steps, device, Headroom(slack, max_context), backend)
    if not quiet:
        print(f"{mode}:")
        for result in results:
            print(result.report())
    return results
