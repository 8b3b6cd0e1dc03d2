"""Drawn scenarios (``--conformance-fuzz N``): a bug no listed scenario reaches is found
and shrunk to a small scenario with its reproduction."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from pagedkv.backend import AttentionImpl, BackendMetadata
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.builder import TorchMetadataBuilder
from pagedkv.backends.torch.impl import TorchAttentionImpl
from pagedkv.conformance import Scenario, run_scenario
from pagedkv.conformance.design import design_scenarios
from pagedkv.graph import GraphSupport

pytest.importorskip("hypothesis")


class _AdjacentEmptyImpl(TorchAttentionImpl):
    """Wrong when two neighbouring requests schedule no query token (a request lookup
    that steps past one empty request, not two): every output row is zeroed."""

    def attend(self, query, kv_cache, metadata, output):
        super().attend(query, kv_cache, metadata, output)
        query_lens = metadata.common.query_start_loc_cpu.diff().tolist()
        if any(a == b == 0 for a, b in itertools.pairwise(query_lens)):
            output.zero_()


class _AdjacentEmptyBackend(TorchBackend):
    name = "adjacent_empty"

    def get_impl_cls(self):
        return _AdjacentEmptyImpl


def test_drawn_scenarios_find_what_the_listed_ones_miss_and_shrink_it():
    from pagedkv.conformance.fuzz import fuzz_problems

    backend = _AdjacentEmptyBackend()
    plan = design_scenarios(backend, "quick", "cpu")
    assert plan.base is not None
    # every listed scenario passes: none has two empty requests side by side
    for scenario in plan.scenarios:
        assert run_scenario(backend, scenario, "cpu").passed, scenario.name
    problems = fuzz_problems(backend, "adjacent_empty", plan.base, "cpu", examples=120)
    assert problems and problems[0].startswith("a drawn scenario fails: Scenario('fuzz'")
    shrunk = eval(problems[0].split(": ", 1)[1], {"Scenario": Scenario, "torch": torch})
    lens = shrunk.query_lens
    assert any(a == b == 0 for a, b in itertools.pairwise(lens))
    assert sum(lens) > 0 and len(lens) <= 3  # small: hypothesis shrank it
    assert "reproduce:" in "\n".join(problems)


def test_a_correct_backend_passes_the_drawn_scenarios():
    from pagedkv.conformance.fuzz import fuzz_problems

    backend = TorchBackend()
    base = design_scenarios(backend, "quick", "cpu").base
    assert fuzz_problems(backend, "torch", base, "cpu", examples=25) == []


def test_a_backend_that_refuses_every_drawn_layer_is_named():
    from pagedkv.conformance.fuzz import fuzz_problems

    class RefusesAll(TorchBackend):
        name = "refuses_all"

        def validate(self, spec, device=None):
            return ["nothing here"]

    base = Scenario("base", seq_lens=(5,), query_lens=(5,), dtype=torch.float32)
    problems = fuzz_problems(RefusesAll(), "refuses_all", base, "cpu", examples=5)
    assert problems and "validate() refused every drawn scenario" in problems[0]


def test_the_seed_fixes_the_draw_and_another_seed_draws_others(monkeypatch):
    from pagedkv.conformance import fuzz

    backend = TorchBackend()
    base = design_scenarios(backend, "quick", "cpu").base
    drawn: list[Scenario] = []

    def record(backend, scenario, device, backend_label):
        drawn.append(scenario)
        return run_scenario(backend, scenario.replace(seq_lens=(1,), query_lens=(1,)), device)

    monkeypatch.setattr(fuzz, "run_scenario", record)

    def draw(seed: int) -> list[Scenario]:
        drawn.clear()
        assert fuzz.fuzz_problems(backend, "torch", base, "cpu", examples=6, seed=seed) == []
        return list(drawn)

    first = draw(3)
    assert len(first) == 6 and draw(3) == first
    assert draw(4) != first


def test_a_failure_names_its_seed():
    from pagedkv.conformance.fuzz import fuzz_problems

    backend = _AdjacentEmptyBackend()
    base = design_scenarios(backend, "quick", "cpu").base
    problems = fuzz_problems(backend, "adjacent_empty", base, "cpu", examples=120, seed=5)
    assert problems[-1].startswith("(drawn with seed 5, among 120 scenarios")


@dataclasses.dataclass(frozen=True)
class _Replay(BackendMetadata):
    """The torch impl's lengths read from the reserved device buffers at each call, as
    a replay reads them, up to ``live`` requests."""

    live: int

    @property
    def query_starts(self):
        return self.common.query_start_loc[: self.live + 1].tolist()

    @property
    def seq_lens(self):
        return self.common.seq_lens[: self.live].tolist()


class _ReplayBuilder(TorchMetadataBuilder):
    def build_metadata(self, common, **overrides):
        return _Replay(common, common.num_reqs)


class _CapturedCountBuilder(TorchMetadataBuilder):
    """Wrong in a replay whose step has more requests with keys than the captured one:
    it keeps the captured step's count (past its last request with keys)."""

    def build_metadata(self, common, **overrides):
        seq_lens = common.seq_lens_cpu.tolist()
        live = max((i + 1 for i, n in enumerate(seq_lens) if n), default=0)
        return _Replay(common, live)


class _ReplayImpl(TorchAttentionImpl, AttentionImpl[_Replay]):
    """The torch impl, declared to read the replay metadata the builders above build."""


def _graph_backend(name, builder):
    capabilities = dataclasses.replace(TorchBackend.capabilities, cuda_graph=GraphSupport.MIXED)
    attributes = dict(
        name=name,
        capabilities=capabilities,
        get_builder_cls=lambda self: builder,
        get_impl_cls=lambda self: _ReplayImpl,
    )
    return type(name, (TorchBackend,), attributes)()


def test_drawn_reservations_replay_steps_the_listed_pairs_do_not():
    from pagedkv.conformance.fuzz import fuzz_graph_problems
    from pagedkv.conformance.graphs import graph_replay_results

    sound = _graph_backend("replays", _ReplayBuilder)
    base = design_scenarios(sound, "quick", "cpu").base
    assert fuzz_graph_problems(sound, "replays", base, "cpu", examples=15) == []

    wrong = _graph_backend("captured_count", _CapturedCountBuilder)
    # the listed pairs replay steps of fewer requests than the captured one: they pass
    _, results = graph_replay_results(wrong, base, "cpu")
    assert all(r.passed for r in results)
    problems = fuzz_graph_problems(wrong, "captured_count", base, "cpu", examples=60, seed=2)
    assert problems and problems[0].startswith("a drawn reservation fails (emulated replay")
    assert "reproduce_graph('captured_count', [Scenario('graph-fuzz-a'" in "\n".join(problems)
    assert problems[-1].startswith("(drawn with seed 2, among 60 reservations")


def test_a_long_context_reservation_replays_short_steps_in_a_split_plan():
    """A drawn reservation for a 4096-key context takes the triton backend's split plan
    (a reduction launch), so the draw reaches the split path of a graph."""
    pytest.importorskip("triton")
    from pagedkv.conformance.graphs import Headroom, reservation
    from pagedkv.conformance.problem import build_problem
    from pagedkv.registry import get_registry

    backend = get_registry().create("triton")
    step = Scenario("graph-fuzz-a", seq_lens=(40, 9), query_lens=(1, 1), dtype=torch.float32)
    problem = build_problem(step, "cpu")

    def kernels(headroom: Headroom) -> list[str]:
        builder = backend.make_builder(problem.spec, "cpu")
        bounds = reservation([problem], headroom)
        builder.reserve_cuda_graph(bounds)
        metadata = builder.build(problem.common)
        query = torch.zeros(bounds.max_num_tokens, step.num_heads, step.head_size)
        cache = backend.allocate_kv_cache(problem.num_blocks, problem.spec, "cpu")
        plan = backend.make_impl(problem.spec).plan(query, cache, metadata, query.clone())
        return [launch.kernel.fn.__name__ for launch in plan]

    assert not any("reduce" in k for k in kernels(Headroom()))
    assert any("reduce" in k for k in kernels(Headroom(max_context=4096)))


def test_reproduce_graph_replays_steps_through_a_registered_backend(capsys):
    from pagedkv.conformance import reproduce_graph

    steps = [
        Scenario("graph-fuzz-a", seq_lens=(0, 9), query_lens=(0, 1), dtype=torch.float32),
        Scenario("graph-fuzz-b", seq_lens=(5, 17, 3), query_lens=(1, 1, 1), dtype=torch.float32),
    ]
    results = reproduce_graph("triton", steps, "cpu", slack=1)
    assert [r.passed for r in results] == [True, True]
    printed = capsys.readouterr().out
    assert printed.startswith("emulated replay (cpu):")
    assert "scenario graph-fuzz-b: PASS" in printed


class _OnceWrongImpl(TorchAttentionImpl):
    """Wrong on one call in the process (its fourth with query rows): a
    nondeterministic backend."""

    calls = 0

    def attend(self, query, kv_cache, metadata, output):
        super().attend(query, kv_cache, metadata, output)
        if metadata.common.num_actual_tokens:
            type(self).calls += 1
            if type(self).calls == 4:
                output.zero_()


def test_a_failure_that_does_not_repeat_is_named_not_deterministic():
    from pagedkv.conformance.fuzz import fuzz_problems

    backend = type("once_wrong", (TorchBackend,), {"get_impl_cls": lambda self: _OnceWrongImpl})()
    base = design_scenarios(TorchBackend(), "quick", "cpu").base
    problems = fuzz_problems(backend, "once_wrong", base, "cpu", examples=20)
    assert problems[0].startswith(
        "a drawn scenario fails once and passed when run again (not deterministic; not shrunk)"
    )


def test_pagedkv_conform_prints_a_check_that_raised_inside_the_harness(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "boom_plugin.py").write_text(
        "import pagedkv.conformance.fuzz as fuzz\n"
        "def boom(*args, **kwargs):\n"
        "    raise RuntimeError('boom in the harness')\n"
        "fuzz.fuzz_problems = boom\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTEST_PLUGINS="boom_plugin")
    cmd = [sys.executable, "-m", "pagedkv.cli", "conform", "--backend", "torch",
           "--device", "cpu", "--fuzz", "2", "-k", "test_fuzz"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[fuzz torch] FAIL (pytest's report):" in proc.stdout
    assert "RuntimeError: boom in the harness" in proc.stdout


def test_pagedkv_conform_draws_scenarios_with_fuzz(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pagedkv.cli", "conform", "--backend", "torch",
           "--device", "cpu", "--fuzz", "3", "--fuzz-seed", "11", "-k", "fuzz",
           "--report", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pass fuzz torch" in proc.stderr
    assert "; passed checks: fuzz" in proc.stdout  # the summary says the draw passed
    report = json.loads((tmp_path / "run.json").read_text())
    (check,) = [c for c in report["checks"] if c["check"] == "fuzz"]
    assert (check["examples"], check["seed"]) == (3, 11)
