"""Batch invariance (see pagedkv.conformance.invariance): required bit for bit from a
backend declaring it, measured and reported for every other. Imports are absolute:
pytest may import this file as ``conformance.test_invariance`` from a source tree."""

from __future__ import annotations

import pytest
from pagedkv.conformance.invariance import invariance_differences
from pagedkv.conformance.plugin import get_run
from pagedkv.conformance.run import CheckResult


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "invariance_target" not in metafunc.fixturenames:
        return
    run = get_run(metafunc.config)
    params = [
        pytest.param(t, id=f"{t.label}:batch-invariance")
        if t.available
        else pytest.param(
            t, id=f"{t.label}:batch-invariance", marks=pytest.mark.skip(reason=t.reason)
        )
        for t in run.targets
    ]
    metafunc.parametrize("invariance_target", params)


def test_batch_invariance(invariance_target, conformance_run, record_property) -> None:
    """Declared: bitwise identical outputs in every batch. Not declared: reported."""
    plan = conformance_run.plan(invariance_target)
    if plan.base is None or plan.base.is_mla:
        pytest.skip("needs a standard (non-MLA) base layer")
    backend = invariance_target.backend
    diffs = invariance_differences(backend, plan.base, conformance_run.device)
    worst = max(diffs.values())
    declared = bool(getattr(backend.capabilities, "batch_invariant", False))
    record_property("batch_invariance_max_diff", worst)
    problems = (
        [f"{name}: max |difference| {d:.3g}" for name, d in diffs.items() if d] if declared else []
    )
    check = CheckResult("batch-invariance", invariance_target.label, problems)
    check.detail.update(declared=declared, max_abs_difference=worst, batches=diffs)
    conformance_run.record(check)
    if problems:
        pytest.fail(
            f"[{invariance_target.label}] declares batch_invariant, but request R's output "
            "changes with its batch:\n" + "\n".join(f"  - {p}" for p in problems),
            pytrace=False,
        )
    if not declared:
        print(
            f"{invariance_target.label}: not declared batch-invariant; max |difference| {worst:.3g}"
        )
