"""One conformance session: the backends under test, their scenario plans, and
every verdict, for the pytest plugin, the report and ``pagedkv conform``.

Resolving backends and planning scenarios happen lazily, so a pytest session that
collects no conformance test pays nothing for the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.config import parse_config
from pagedkv.conformance.check import ScenarioResult, compare_outputs, run_scenario
from pagedkv.conformance.design import Plan, design_scenarios
from pagedkv.conformance.failure import describe_exception
from pagedkv.conformance.scenario import Scenario
from pagedkv.errors import PagedKVError, UnknownBackendError
from pagedkv.registry import PHASE_SPLIT, PluginFailure, get_registry

DEFAULT_BACKEND = "torch"
ALL = "all"


class ConformanceUsageError(PagedKVError, ValueError):
    """A --backend or --device value names nothing that can be tested."""


def resolve_device(option: str | None) -> str:
    """The device a run uses: ``option`` when this host can allocate on it, else a
    ConformanceUsageError saying why not (a backend must not be judged on a device
    that does not exist here). Default: cuda when available, else cpu."""
    if not option:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(option)
    except (RuntimeError, ValueError) as exc:
        raise ConformanceUsageError(f"--device {option!r}: {exc}") from None
    if device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except Exception as exc:
            cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
            why = "".join(str(exc).strip().splitlines()[:1])
            raise ConformanceUsageError(
                f"--device {option!r} is not usable on this host ({type(exc).__name__}: "
                f"{why}); devices here: {', '.join(['cpu', *cuda])}"
            ) from None
    return str(device)


@dataclass
class Target:
    """One backend under test, as named on the command line."""

    label: str  # the config string, e.g. "flashinfer(kv_layout=HND)"
    requested: bool  # named explicitly (not through "all" or the default)
    backend: AttentionBackend | None = None
    available: bool = False
    reason: str = ""  # why not available
    distribution: str = ""
    plan: Plan | None = None
    # creating or introspecting the backend raised: a bug in the backend, which fails
    # the run whether or not it was requested
    broken: bool = False


def _failed(target: Target, failure: PluginFailure) -> Target:
    """A target the registry could not load: a backend it refused for its declarations
    (or a duplicated name) is broken; a plugin that failed to import is unavailable."""
    target.available, target.reason = False, failure.reason
    target.distribution = failure.distribution
    target.broken = bool(failure.backend) and not failure.conflict
    return target


def _broken(target: Target, reason: str) -> Target:
    target.available, target.broken, target.reason = False, True, reason
    return target


@dataclass
class CheckResult:
    """A verdict that is not one scenario: plan, capability honesty, copy_blocks, cross."""

    name: str
    subject: str  # a backend label, or a scenario name for cross-backend checks
    problems: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False  # nothing to judge (e.g. fewer than two outputs to compare)

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        return "fail" if self.problems else "skipped" if self.skipped else "pass"


@dataclass
class ConformanceRun:
    names: list[str]  # --backend values; empty: the default backend
    level: str = "quick"
    device_option: str | None = None
    # a requested backend that is unavailable is skipped instead of failing the run
    allow_unavailable: bool = False
    results: dict[tuple[str, str], ScenarioResult] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    collected: bool = False  # a conformance test was collected in this session
    report_files: tuple[Path, ...] = ()  # written at the end of the session
    deselected: set[tuple[str, str]] = field(default_factory=set)  # (label, scenario) by -k

    # -- backends ---------------------------------------------------------------------

    @cached_property
    def device(self) -> str:
        return resolve_device(self.device_option)

    @cached_property
    def targets(self) -> list[Target]:
        """The backends under test, in command-line order ("all": by priority)."""
        registry = get_registry()
        out: dict[str, Target] = {}
        for name in self.names or [DEFAULT_BACKEND]:
            if name == ALL:
                for entry in registry.by_priority():
                    out.setdefault(entry.name, self._resolve(entry.name, False))
                for failure in registry.failures:
                    out.setdefault(failure.name, _failed(Target(failure.name, False), failure))
            else:
                out[name] = self._resolve(name, bool(self.names))
        return list(out.values())

    def _resolve(self, label: str, requested: bool) -> Target:
        registry = get_registry()
        try:
            choices = parse_config(label)
        except PagedKVError as exc:
            raise ConformanceUsageError(f"--backend {label!r}: {exc}") from None
        if len(choices) != 1 or choices[0].name == "auto":
            raise ConformanceUsageError(
                f"--backend {label!r}: name one backend per --backend (or 'all'), not a "
                "preference list"
            )
        choice = choices[0]
        target = Target(label, requested)
        entry = registry.entries.get(choice.name)
        if entry is None and choice.name != PHASE_SPLIT:
            failure = registry.failure_for(choice.name)
            if failure is None:
                raise ConformanceUsageError(str(UnknownBackendError(choice.name, registry.entries)))
            return _failed(target, failure)
        target.distribution = entry.distribution if entry is not None else "pagedkv"
        try:
            target.backend = registry.create(choice.name, **choice.options)
        except PagedKVError as exc:
            raise ConformanceUsageError(f"--backend {label!r}: {exc}") from None
        except Exception as exc:
            return _broken(target, f"creating the backend raised {describe_exception(exc)}")
        try:
            target.available, target.reason = target.backend.is_available()
            devices = set(target.backend.capabilities.devices)
            _ = target.backend.layout, target.backend.capabilities.describe()
        except Exception as exc:
            return _broken(target, f"introspecting the backend raised {describe_exception(exc)}")
        device_type = torch.device(self.device).type
        if target.available and device_type not in devices:
            target.available = False
            target.reason = (
                f"does not run on {device_type} (declares devices: {', '.join(sorted(devices))})"
            )
        return target

    def fails_run(self, target: Target) -> bool:
        """An untestable backend that fails the run: a broken one, or a requested one
        that is unavailable (unless unavailable backends are allowed)."""
        if target.available:
            return False
        return target.broken or (target.requested and not self.allow_unavailable)

    @property
    def available_targets(self) -> list[Target]:
        return [t for t in self.targets if t.available]

    # -- plans ------------------------------------------------------------------------

    def plan(self, target: Target) -> Plan:
        """The target's scenarios; a backend whose declarations cannot be read gets an
        empty plan with the reason as its problem (test_scenario_plan fails it)."""
        if target.plan is None:
            assert target.backend is not None
            extra, problems = self._plugin_scenarios(target.backend)
            try:
                target.plan = design_scenarios(target.backend, self.level, self.device, extra)
            except Exception as exc:
                target.plan = Plan()
                problems.insert(
                    0,
                    f"planning its scenarios raised {describe_exception(exc)} (are its "
                    "capabilities a pagedkv.Capabilities?)",
                )
            target.plan.problems += problems
        return target.plan

    def _plugin_scenarios(self, backend: AttentionBackend) -> tuple[list[Scenario], list[str]]:
        """Scenarios from every plugin's ``pagedkv_conformance_scenarios``, tagged with
        the plugin; a hook that raises or returns junk is a problem, not a crash."""
        hook = get_registry().plugin_manager.hook.pagedkv_conformance_scenarios
        extra, problems = [], []
        offered = {"backend": backend, "level": self.level}
        for impl in hook.get_hookimpls():
            who = f"plugin {impl.plugin_name!r}"
            try:
                got = impl.function(**{k: offered[k] for k in impl.argnames})
                items = list(got or [])
            except Exception as exc:
                problems.append(
                    f"{who}: pagedkv_conformance_scenarios raised {type(exc).__name__}: {exc}"
                )
                continue
            for item in items:
                if not isinstance(item, Scenario):
                    problems.append(
                        f"{who}: pagedkv_conformance_scenarios returned {item!r}, not a Scenario"
                    )
                    continue
                extra.append(item.replace(tags=item.tags | {f"plugin:{impl.plugin_name}"}))
        return extra, problems

    def scenario_order(self) -> list[str]:
        """Every planned scenario name, first appearance first."""
        names: dict[str, None] = {}
        for target in self.available_targets:
            for scenario in self.plan(target).scenarios:
                names.setdefault(scenario.name, None)
        return list(names)

    def cross_scenarios(self) -> list[str]:
        """Scenarios that at least two available backends run identically (same name
        and same problem: an MLA "decode" is not a standard "decode")."""
        counts: dict[Scenario, int] = {}
        for target in self.available_targets:
            for scenario in self.plan(target).scenarios:
                counts[scenario] = counts.get(scenario, 0) + 1
        shared = {s.name for s, n in counts.items() if n >= 2}
        return [name for name in self.scenario_order() if name in shared]

    # -- running ----------------------------------------------------------------------

    def run(self, target: Target, scenario: Scenario) -> ScenarioResult:
        assert target.backend is not None
        result = run_scenario(target.backend, scenario, self.device, backend_label=target.label)
        if scenario.name not in self._cross_names:
            result.output = None  # kept only for the cross-backend comparison
        self.results[(target.label, scenario.name)] = result
        return result

    @cached_property
    def _cross_names(self) -> set[str]:
        return set(self.cross_scenarios())

    def cross_check(self, scenario_name: str) -> CheckResult:
        """Every backend's output against the first that passed the reference check."""
        check = CheckResult("cross-backend", scenario_name)
        by_problem: dict[Scenario, list[ScenarioResult]] = {}
        for target in self.available_targets:
            scenario = next(
                (s for s in self.plan(target).scenarios if s.name == scenario_name), None
            )
            if scenario is None:
                continue
            result = self.results.get((target.label, scenario_name))
            if result is None:  # deselected, or not run yet: run it now
                result = self.run(target, scenario)
            by_problem.setdefault(scenario, []).append(result)
        # only backends that ran the very same problem are comparable
        runs = max(by_problem.values(), key=len, default=[])
        passed = [r for r in runs if r.passed and r.output is not None]
        check.detail["compared"] = [r.backend for r in passed]
        check.detail["skipped"] = [r.backend for r in runs if r not in passed]
        check.skipped = len(passed) < 2
        if not check.skipped:
            baseline = passed[0]
            diffs = [_max_abs_diff(r.output, baseline.output) for r in passed[1:]]
            check.detail["baseline"] = baseline.backend
            check.detail["max_abs_diff"] = max(diffs)
            for other in passed[1:]:
                check.problems += compare_outputs(other, baseline)
        for r in runs:
            r.output = None  # compared once; free the memory
        self.checks.append(check)
        return check

    def record(self, check: CheckResult) -> CheckResult:
        self.checks.append(check)
        return check

    # -- summary ----------------------------------------------------------------------

    def counts(self, target: Target) -> dict[str, int]:
        ran = [r for (label, _), r in self.results.items() if label == target.label]
        plan = target.plan
        planned = len(plan.scenarios) if plan else 0
        deselected = sum(label == target.label for label, _ in self.deselected)
        return {
            "passed": sum(r.passed for r in ran),
            "failed": sum(not r.passed for r in ran),
            "deselected": deselected,
            # planned, not deselected, and yet not run (-x stopped the session, say)
            "not_run": max(0, planned - len(ran) - deselected),
            "not_applicable": len(plan.not_applicable) if plan else 0,
            "planned": planned,
        }


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| (0 for outputs of no rows: an empty step)."""
    return float((a - b).abs().max()) if a.numel() else 0.0
