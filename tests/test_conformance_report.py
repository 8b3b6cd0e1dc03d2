"""The report and the session never crash on a broken backend, and ``reproduce``
hands back the problem for a debugger."""

from __future__ import annotations

import json

import pagedkv
import pytest
import torch
from pagedkv import Capabilities
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.impl import TorchAttentionImpl, TorchMetadataBuilder
from pagedkv.conformance import Scenario, reproduce
from pagedkv.conformance.check import TOLERANCES
from pagedkv.conformance.problem import reference_output
from pagedkv.conformance.report import markdown, report_data, summary_lines, write_report
from pagedkv.conformance.run import ConformanceRun
from pagedkv.registry import get_registry, reset_registry


class _Misspelt(pagedkv.AttentionBackend):
    """A backend written from scratch whose ``capabilites`` never reach
    ``capabilities``."""

    name = "misspelt"
    layout = "(2, num_blocks, block_size, num_kv_heads, head_size)"
    block_axis = 1
    capabilites = TorchBackend.capabilities

    def get_kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def kv_cache_to_logical(self, kv_cache, spec):
        return kv_cache[0], kv_cache[1]

    def get_builder_cls(self):
        return TorchMetadataBuilder

    def get_impl_cls(self):
        return TorchAttentionImpl


class _BadBlockSizes(TorchBackend):
    """block_sizes=16 instead of (16,): reading the declaration raises."""

    name = "bad_block_sizes"
    capabilities = Capabilities(dtypes=frozenset({torch.float16}), block_sizes=16)


@pytest.fixture
def registered():
    class Plugin:
        @pagedkv.hookimpl
        def pagedkv_backends(self):
            return [_Misspelt, _BadBlockSizes]

    get_registry(reload=True).register_plugin(Plugin(), "broken-declarations")
    yield
    reset_registry()


def test_broken_declarations_are_reported_not_crashed_on(registered, tmp_path):
    run = ConformanceRun(["torch", "misspelt", "bad_block_sizes"], device_option="cpu")
    torch_target, misspelt, bad = run.targets
    assert torch_target.available and not torch_target.broken
    # the registry refuses a class whose declaration is missing; one it cannot read
    # until the backend introspects itself breaks at that point
    assert misspelt.broken and not misspelt.available and run.fails_run(misspelt)
    assert "capabilities must be a pagedkv.Capabilities" in misspelt.reason
    assert bad.broken and not bad.available and run.fails_run(bad)
    assert bad.reason.startswith("introspecting the backend raised ")
    assert "TypeError: 'int' object is not iterable" in bad.reason
    run.run(torch_target, run.plan(torch_target).scenarios[0])
    data = report_data(run)
    assert data["backends"]["bad_block_sizes"]["capabilities"].startswith("unreadable: TypeError")
    lines = summary_lines(data)
    assert any(
        line.startswith("misspelt: BROKEN: capabilities must be a pagedkv.Capabilities")
        for line in lines
    )
    assert "bad_block_sizes: BROKEN" in markdown(data)
    json_path, _ = write_report(run, tmp_path / "r")
    assert json.loads(json_path.read_text())["backends"]["misspelt"]["fails_run"]


def test_a_broken_backend_fails_the_run_even_when_not_requested(registered):
    run = ConformanceRun(["all"], device_option="cpu", allow_unavailable=True)
    by_label = {t.label: t for t in run.targets}
    assert not by_label["misspelt"].requested and run.fails_run(by_label["misspelt"])


def test_planning_that_raises_is_a_plan_problem(monkeypatch):
    def explode(*args, **kwargs):
        raise TypeError("capabilities are not what the design expects")

    monkeypatch.setattr("pagedkv.conformance.run.design_scenarios", explode)
    run = ConformanceRun(["torch"], device_option="cpu")
    plan = run.plan(run.targets[0])
    assert not plan.scenarios
    assert plan.problems[0].startswith(
        "planning its scenarios raised TypeError: capabilities are not what the design expects"
    )
    assert "plan problems: 1" in summary_lines(report_data(run))[0]


def test_reproduce_returns_the_problem_for_a_debugger(capsys):
    scenario = Scenario("debug-me", seq_lens=(20, 7), query_lens=(1, 7), num_padding_tokens=2)
    result = reproduce("torch", scenario, "cpu", quiet=True)
    assert capsys.readouterr().out == ""
    assert result.passed
    debug = result.debug
    problem = debug.problem
    assert tuple(problem.query.shape) == (10, 8, 64)  # 8 scheduled rows + 2 padding
    assert tuple(problem.new_key.shape) == (10, 2, 64) and problem.block_ids
    backend = pagedkv.get_backend("torch")
    assert tuple(debug.kv_cache.shape) == backend.get_kv_cache_shape(problem.num_blocks, 16, 2, 64)
    assert debug.metadata is not None and tuple(debug.output.shape) == (10, 8, 64)
    torch.testing.assert_close(debug.reference, reference_output(problem))
    tol = TOLERANCES[torch.float16]
    torch.testing.assert_close(
        debug.output[:8].double(), debug.reference, atol=tol.atol, rtol=tol.rtol
    )


def test_the_markdown_checks_say_skipped_pass_or_fail_with_the_problems():
    """Each check's result cell: its status, or FAIL with its problems (a ``|`` in one
    escaped, so the row stays one row)."""
    from pagedkv.conformance.run import CheckResult

    run = ConformanceRun(["torch"], device_option="cpu")
    run.checks += [
        CheckResult("copy_blocks", "torch"),
        CheckResult("plan", "torch", skipped=True),
        CheckResult("capabilities", "torch", problems=["head size 80 | 96 refused"]),
    ]
    text = markdown(report_data(run))
    assert "| copy_blocks | torch | pass |" in text
    assert "| plan | torch | skipped |" in text
    assert "| capabilities | torch | FAIL: head size 80 \\| 96 refused |" in text
