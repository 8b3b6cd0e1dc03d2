"""CUDA-graph capture and replay for every backend that declares graph support (see
pagedkv.conformance.graphs). Imports are absolute: pytest may import this file as
``conformance.test_graphs`` from a source tree."""

from __future__ import annotations

import pytest
from pagedkv.conformance.graphs import graph_replay_results
from pagedkv.conformance.plugin import fail_check, fuzz_draws, get_run
from pagedkv.conformance.run import CheckResult
from pagedkv.graph import GraphSupport


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "graph_target" not in metafunc.fixturenames:
        return
    run = get_run(metafunc.config)
    params = []
    for target in run.targets:
        support = target.backend.capabilities.graph_support if target.backend else None
        if not target.available or support in (None, GraphSupport.NEVER):
            why = target.reason if not target.available else "declares cuda_graph never"
            params.append(
                pytest.param(
                    target,
                    id=f"{target.label}:graph",
                    marks=pytest.mark.skip(reason=f"{target.label}: {why}"),
                )
            )
        else:
            params.append(pytest.param(target, id=f"{target.label}:graph-{support}"))
    metafunc.parametrize("graph_target", params)


def test_graph_capture_and_replay(graph_target, conformance_run) -> None:
    """Capture step A, build a different step B into the same buffers, replay both."""
    base = conformance_run.plan(graph_target).base
    if base is None:
        pytest.skip("no base layer (see test_scenario_plan)")
    mode, results = graph_replay_results(
        graph_target.backend, base, conformance_run.device, label=graph_target.label
    )
    failed = [r for r in results if not r.passed]
    if failed:
        pytest.fail(
            f"[{graph_target.label}] {mode}:\n" + "\n".join(r.report() for r in failed),
            pytrace=False,
        )


def test_graph_fuzz(graph_target, conformance_run, request) -> None:
    """--conformance-fuzz N: N reservations drawn within the declared capabilities
    (two or three steps of one layer: the first captured, the others built into its
    buffers and replayed), each step against the reference; a failure is shrunk to
    small steps (the reproduction replays them)."""
    examples, seed = fuzz_draws(request.config)
    base = conformance_run.plan(graph_target).base
    if base is None:
        pytest.skip("no base layer (see test_scenario_plan)")
    from pagedkv.conformance.fuzz import fuzz_graph_problems

    problems = fuzz_graph_problems(
        graph_target.backend, graph_target.label, base, conformance_run.device, examples, seed
    )
    detail = {"examples": examples, "seed": seed}
    fail_check(
        conformance_run.record(CheckResult("graph-fuzz", graph_target.label, problems, detail))
    )
