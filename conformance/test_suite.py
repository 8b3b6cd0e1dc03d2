"""The conformance suite. Parametrized by the pagedkv pytest plugin from --backend,
--conformance-level and --device; see docs/conformance.md.

Imports are absolute (``pagedkv.conformance...``): pytest may import this file as
``conformance.test_suite`` from a source tree.
"""

from __future__ import annotations

import pytest
from pagedkv.conformance.cache import check_copy_blocks
from pagedkv.conformance.honesty import capability_problems
from pagedkv.conformance.plugin import fail_check, fuzz_draws
from pagedkv.conformance.run import CheckResult, ConformanceRun, Target


def test_scenario_plan(conformance_target: Target, conformance_run: ConformanceRun) -> None:
    """A base layer the backend accepts exists, and plugin scenarios are well formed."""
    plan = conformance_run.plan(conformance_target)
    check = conformance_run.record(
        CheckResult("scenario-plan", conformance_target.label, list(plan.problems))
    )
    fail_check(check)


def test_capabilities_are_honest(
    conformance_target: Target, conformance_run: ConformanceRun
) -> None:
    """Declared features pass validate() and select_backend; undeclared ones are refused
    (device-independent: a limit of one device shows as not-applicable scenarios)."""
    base = conformance_run.plan(conformance_target).base
    if base is None:
        pytest.skip("no base layer (see test_scenario_plan)")
    assert conformance_target.backend is not None
    problems = capability_problems(
        conformance_target.backend, conformance_target.label, base.spec()
    )
    fail_check(
        conformance_run.record(CheckResult("capabilities", conformance_target.label, problems))
    )


def test_copy_blocks(conformance_target: Target, conformance_run: ConformanceRun) -> None:
    """copy_blocks copies exactly the named blocks, every source read before any write."""
    base = conformance_run.plan(conformance_target).base
    if base is None:
        pytest.skip("no base layer (see test_scenario_plan)")
    assert conformance_target.backend is not None
    problems = check_copy_blocks(conformance_target.backend, base.spec(), conformance_run.device)
    fail_check(
        conformance_run.record(CheckResult("copy_blocks", conformance_target.label, problems))
    )


def test_bad_input(conformance_target: Target, conformance_run: ConformanceRun) -> None:
    """A valid step with one field of its metadata or one forward argument broken
    raises a PagedKVError naming it, before the cache changes (conformance/bad_input.py)."""
    base = conformance_run.plan(conformance_target).base
    if base is None:
        pytest.skip("no base layer (see test_scenario_plan)")
    from pagedkv.conformance.bad_input import bad_input_problems

    assert conformance_target.backend is not None
    problems = bad_input_problems(conformance_target.backend, base, conformance_run.device)
    fail_check(conformance_run.record(CheckResult("bad-input", conformance_target.label, problems)))


def test_fuzz(
    conformance_target: Target, conformance_run: ConformanceRun, request: pytest.FixtureRequest
) -> None:
    """--conformance-fuzz N: N scenarios drawn within the declared capabilities, each
    against the reference; a failure is shrunk to a small scenario (its repro shown)."""
    examples, seed = fuzz_draws(request.config)
    base = conformance_run.plan(conformance_target).base
    if base is None:
        pytest.skip("no base layer (see test_scenario_plan)")
    from pagedkv.conformance.fuzz import fuzz_problems

    assert conformance_target.backend is not None
    problems = fuzz_problems(
        conformance_target.backend,
        conformance_target.label,
        base,
        conformance_run.device,
        examples,
        seed=seed,
    )
    detail = {"examples": examples, "seed": seed}
    fail_check(
        conformance_run.record(CheckResult("fuzz", conformance_target.label, problems, detail))
    )


def test_scenario(conformance_case: tuple, conformance_run: ConformanceRun) -> None:
    """Output vs the float64 reference, and the cache after writing. An unavailable
    backend's single case gets here only when it fails the run (see
    ConformanceRun.fails_run); otherwise it is skipped."""
    target, scenario = conformance_case
    if scenario is None:
        what = "is broken" if target.broken else "was requested but is unavailable here"
        pytest.fail(
            f"backend {target.label} {what}: {target.reason}"
            + ("" if target.broken else ". Pass --pagedkv-allow-unavailable to skip it instead"),
            pytrace=False,
        )
    result = conformance_run.run(target, scenario)
    if not result.passed:
        pytest.fail(result.report(), pytrace=False)


def test_cross_backend(conformance_cross: str, conformance_run: ConformanceRun) -> None:
    """Every backend's output against the first that passed the reference check."""
    check = conformance_run.cross_check(conformance_cross)
    if check.skipped:
        pytest.skip(
            f"fewer than two backends passed {conformance_cross} "
            f"(not compared: {', '.join(check.detail['skipped']) or 'none'})"
        )
    fail_check(check)
