"""pytest plugin of the conformance harness (the ``pytest11`` entry point ``pagedkv``).

The suite itself is ``pagedkv/conformance/test_suite.py``: ``pytest conformance/`` in
the repository, ``pytest --pyargs pagedkv.conformance`` anywhere pagedkv is installed.

Loaded into every pytest session of an environment holding pagedkv, so it must never
get in another project's way:

- It does no work until asked: the registry loads and scenarios are planned only once
  a conformance test is collected (or a backend or device is given, to reject a bad
  one early).
- Its options are namespaced (``--pagedkv-backend``, ``--pagedkv-device``, ...) and
  always exist. The short names (``--backend``, ``--device``, ``--conformance-level``,
  ...) are registered only after the initial conftest files have added their options
  (pytest loads ``pytest11`` plugins before conftests), only when the command line
  uses them (or asks for ``--help``), and only when nothing else has taken them. A
  project whose conftest defines ``--device`` keeps it; pagedkv's stays reachable as
  ``--pagedkv-device``. ``-p no:pagedkv`` disables the plugin altogether.
"""

from __future__ import annotations

import argparse
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pagedkv.conformance.run import CheckResult, ConformanceRun, Target

RUN_KEY = pytest.StashKey["ConformanceRun"]()
# short names the command line used but another plugin or conftest owns
TAKEN_KEY = pytest.StashKey["list[tuple[str, str]]"]()
LEVELS = ("quick", "full")
# fixture names the suite's tests take; parametrized here
CASE, TARGET, CROSS = "conformance_case", "conformance_target", "conformance_cross"
GROUP = "pagedkv"


@dataclass(frozen=True)
class Option:
    """One option: its namespaced name (always registered), the short names added
    when free, and argparse's keyword arguments."""

    name: str
    short: tuple[str, ...]
    kwargs: dict[str, Any]


OPTIONS = (
    Option(
        "--pagedkv-backend",
        ("--backend", "--conformance-backend"),
        dict(
            action="append",
            dest="pagedkv_backends",
            default=[],
            metavar="NAME",
            help="Backend to check: a name or config string such as "
            "'flashinfer(kv_layout=HND)'; repeatable; 'all' checks every registered backend. "
            "Default: torch.",
        ),
    ),
    Option(
        "--pagedkv-level",
        ("--conformance-level",),
        dict(
            dest="pagedkv_level",
            choices=LEVELS,
            default="quick",
            help="quick: a few minutes per backend on a CPU. full: the whole matrix, for a GPU "
            "(large pools, long contexts, DeepSeek MLA dims). Default: quick.",
        ),
    ),
    Option(
        "--pagedkv-report",
        ("--conformance-report",),
        dict(
            dest="pagedkv_report",
            default=None,
            metavar="PATH",
            help="Write PATH.json and PATH.md: the backend x scenario matrix with max errors.",
        ),
    ),
    Option(
        "--pagedkv-device",
        ("--device", "--conformance-device"),
        dict(
            dest="pagedkv_device",
            default=None,
            metavar="DEVICE",
            help="Device to run on (cpu, cuda, cuda:1). Default: cuda when available, else cpu.",
        ),
    ),
    Option(
        "--pagedkv-allow-unavailable",
        ("--allow-unavailable",),
        dict(
            dest="pagedkv_allow_unavailable",
            action="store_true",
            default=False,
            help="Skip a requested backend that is unavailable here (for matrix jobs) instead "
            "of failing the run.",
        ),
    ),
    Option(
        "--pagedkv-fuzz",
        ("--conformance-fuzz",),
        dict(
            dest="pagedkv_fuzz",
            type=int,
            default=0,
            metavar="N",
            help="Also check N scenarios drawn at random within each backend's declared "
            "capabilities, and N CUDA-graph reservations of drawn steps where it declares "
            "graph support; a failure is shrunk to a small one (needs hypothesis). Default: 0.",
        ),
    ),
    Option(
        "--pagedkv-fuzz-seed",
        ("--conformance-fuzz-seed",),
        dict(
            dest="pagedkv_fuzz_seed",
            type=int,
            default=0,
            metavar="S",
            help="The seed of the drawn scenarios: the same seed draws the same scenarios; "
            "vary it (e.g. per nightly run) to reach new ones. Default: 0.",
        ),
    ),
    Option(
        "--pagedkv-models",
        ("--conformance-models",),
        dict(
            dest="pagedkv_models",
            action="store_true",
            default=False,
            help="Also serve tiny random-weight Hugging Face models through each backend and "
            "compare with transformers (conformance/test_models.py; needs pagedkv[models]).",
        ),
    ),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "pagedkv conformance")
    for option in OPTIONS:
        group.addoption(option.name, **option.kwargs)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> Generator[None, None, None]:
    # after the conftests: their options are known, ours may take only what is left
    try:
        return (yield)
    finally:
        early_config.stash[TAKEN_KEY] = add_short_names(parser, args)


def add_short_names(parser: pytest.Parser, args: Sequence[str]) -> list[tuple[str, str]]:
    """Register each short name that ``args`` uses (all of them for ``--help``) and no
    other option holds; returns (short name, namespaced name) of those already taken."""
    wanted_all = any(a in ("-h", "--help") for a in args)
    used = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    group = parser.getgroup(GROUP)
    taken: list[tuple[str, str]] = []
    for option in OPTIONS:
        wanted = [s for s in option.short if wanted_all or s in used]
        existing = _option_names(parser)
        free = [s for s in wanted if s not in existing]
        taken += [(s, option.name) for s in wanted if s in existing]
        if not free:
            continue
        try:
            group.addoption(*free, **{**option.kwargs, "help": f"Same as {option.name}."})
        except (ValueError, argparse.ArgumentError):  # held by an option we could not see
            taken += [(s, option.name) for s in free]
    return taken


def _option_names(parser: pytest.Parser) -> set[str]:
    """Every option string registered so far, by any plugin or conftest. pytest has no
    public query for this: read its groups (pytest 8 and 9) and, on pytest 9, the
    option-to-dest map; adding still catches a conflict these miss."""
    groups = [getattr(parser, "_anonymous", None), *getattr(parser, "_groups", ())]
    names = {n for g in groups if g is not None for o in g.options for n in o.names()}
    return names | set(getattr(parser, "_opt2dest", {}))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("pagedkv_backends") or config.getoption("pagedkv_device"):
        _resolve_or_usage_error(get_run(config))  # the user asked for conformance: fail fast


def fail_check(check: CheckResult) -> None:
    """Fail the calling test with a check's problems, if it has any."""
    if check.problems:
        lines = [f"[{check.subject}] {check.name}: FAIL", *(f"  - {p}" for p in check.problems)]
        pytest.fail("\n".join(lines), pytrace=False)


def fuzz_draws(config: pytest.Config) -> tuple[int, int]:
    """(how many, seed) of the drawn checks' values (``--conformance-fuzz N``,
    ``--conformance-fuzz-seed S``); skips the calling test when N is 0 or hypothesis
    is missing, a usage error when N is negative."""
    examples = config.getoption("pagedkv_fuzz")
    if examples < 0:
        raise pytest.UsageError(f"--conformance-fuzz N: N is a number of scenarios, got {examples}")
    if not examples:
        pytest.skip("drawn scenarios run with --conformance-fuzz N")
    pytest.importorskip("hypothesis", reason='needs hypothesis: pip install "pagedkv[conformance]"')
    return examples, config.getoption("pagedkv_fuzz_seed")


def get_run(config: pytest.Config) -> ConformanceRun:
    """The conformance session of this pytest run (created on first use)."""
    run = config.stash.get(RUN_KEY, None)
    if run is None:
        from pagedkv.conformance.run import ConformanceRun

        run = ConformanceRun(
            names=list(config.getoption("pagedkv_backends") or []),
            level=config.getoption("pagedkv_level"),
            device_option=config.getoption("pagedkv_device"),
            allow_unavailable=config.getoption("pagedkv_allow_unavailable"),
        )
        config.stash[RUN_KEY] = run
    return run


def _resolve_or_usage_error(run: ConformanceRun) -> None:
    from pagedkv.conformance.run import ConformanceUsageError

    try:
        _ = run.device, run.targets
    except ConformanceUsageError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture(scope="session")
def conformance_run(request: pytest.FixtureRequest) -> ConformanceRun:
    """The session's backends, plans and verdicts."""
    return get_run(request.config)


# -- parametrization --------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    wanted = {CASE, TARGET, CROSS} & set(metafunc.fixturenames)
    if not wanted:
        return
    run = get_run(metafunc.config)
    _resolve_or_usage_error(run)
    run.collected = True
    if CASE in wanted:
        metafunc.parametrize(CASE, _case_params(run))
    if TARGET in wanted:
        metafunc.parametrize(TARGET, _target_params(run))
    if CROSS in wanted:
        names = run.cross_scenarios()
        params = [pytest.param(n, id=n) for n in names] or [
            pytest.param(
                None,
                id="single-backend",
                marks=pytest.mark.skip(reason="cross-backend comparison needs two backends"),
            )
        ]
        metafunc.parametrize(CROSS, params)


def _unavailable(target: Target) -> pytest.MarkDecorator:
    return pytest.mark.skip(reason=f"backend {target.label} is unavailable: {target.reason}")


def _case_params(run: ConformanceRun) -> list[Any]:
    """Every planned scenario of every backend. An unavailable backend has one case
    instead, which fails the run when the backend was requested (see
    ``ConformanceRun.fails_run``) and is skipped otherwise."""
    params = []
    for target in run.targets:
        if not target.available:
            marks = () if run.fails_run(target) else _unavailable(target)
            params.append(
                pytest.param((target, None), id=f"{target.label}:unavailable", marks=marks)
            )
            continue
        for scenario in run.plan(target).scenarios:
            params.append(pytest.param((target, scenario), id=f"{target.label}:{scenario.name}"))
    return params


def _target_params(run: ConformanceRun) -> list[Any]:
    return [
        pytest.param(t, id=t.label, marks=() if t.available else _unavailable(t))
        for t in run.targets
    ]


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Per-backend checks first; then scenario by scenario, each backend's run followed
    by the cross-backend comparison (so outputs are compared, then freed, as they come)."""
    ours = [i for i, item in enumerate(items) if _params(item) & {CASE, TARGET, CROSS}]
    if not ours:
        return
    run = get_run(config)
    order = {name: n for n, name in enumerate(run.scenario_order())}
    labels = {t.label: n for n, t in enumerate(run.targets)}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        params = item.callspec.params  # type: ignore[attr-defined]
        if TARGET in params:
            return (0, labels.get(params[TARGET].label, 0), 0)
        if CASE in params:
            target, scenario = params[CASE]
            return (1, order.get(scenario.name, -1) if scenario else -1, labels[target.label])
        return (1, order.get(params[CROSS], len(order)), len(labels))

    ordered = sorted((items[i] for i in ours), key=key)
    for i, item in zip(ours, ordered, strict=True):
        items[i] = item


def pytest_deselected(items: Sequence[pytest.Item]) -> None:
    """Count the scenarios ``-k`` (or ``-m``) left out, per backend, for the summary."""
    for item in items:
        case = getattr(item, "callspec", None) and item.callspec.params.get(CASE)  # type: ignore[attr-defined]
        if case and case[1] is not None:
            run = item.config.stash.get(RUN_KEY, None)
            if run is not None:
                run.deselected.add((case[0].label, case[1].name))


def _params(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    return set(callspec.params) if callspec is not None else set()


# -- reporting --------------------------------------------------------------------------


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    run = config.stash.get(RUN_KEY, None)
    if run is None or not run.collected:
        return
    path = config.getoption("pagedkv_report")
    if path:
        from pagedkv.conformance.report import write_report

        run.report_files = write_report(run, path)
    # a requested backend that is unavailable fails the run even when -k deselected
    # its case
    clean = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    if clean and not config.option.collectonly and any(map(run.fails_run, run.targets)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    run = config.stash.get(RUN_KEY, None)
    if run is None or not run.collected:
        return
    from pagedkv.conformance.report import matrix_rows, report_data, summary_lines
    from pagedkv.textutil import format_table

    data = report_data(run)
    tr = terminalreporter
    tr.write_sep("=", f"pagedkv conformance ({run.level} level, {run.device})")
    for line in summary_lines(data):
        unavailable = "REQUESTED BUT UNAVAILABLE" in line or "BROKEN" in line
        tr.write_line(line, red=unavailable, bold=unavailable)
    for line in taken_lines(config):
        tr.write_line(line, yellow=True)
    if config.get_verbosity() > 0:
        tr.write_line("")
        tr.write_line(format_table(*matrix_rows(data)))
    for path in run.report_files:
        tr.write_line(f"report: {path}")


def taken_lines(config: pytest.Config) -> list[str]:
    """A line per short name the command line used that belongs to someone else."""
    return [
        f"note: {short} belongs to another plugin or conftest here (it was not passed to "
        f"pagedkv); pagedkv's option is {name}"
        for short, name in config.stash.get(TAKEN_KEY, [])
    ]
