"""pytest plugin of the conformance harness (the ``pytest11`` entry point ``pagedkv``).

Options: ``--backend NAME`` (repeatable, a config string such as
``flashinfer(kv_layout=HND)``, or ``all``), ``--conformance-level quick|full``,
``--conformance-report PATH`` and ``--device``. The suite itself is
``pagedkv/conformance/test_suite.py``: ``pytest conformance/`` in the repository,
``pytest --pyargs pagedkv.conformance`` anywhere pagedkv is installed.

Loaded into every pytest session of an environment holding pagedkv, so it does no
work until asked: the registry loads and scenarios are planned only once a
conformance test is collected (or a --backend/--device is given, to reject a bad
one early).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pagedkv.conformance.run import ConformanceRun, Target

RUN_KEY = pytest.StashKey["ConformanceRun"]()
LEVELS = ("quick", "full")
# fixture names the suite's tests take; parametrized here
CASE, TARGET, CROSS = "conformance_case", "conformance_target", "conformance_cross"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedkv", "pagedkv conformance")
    _add(
        group,
        ("--backend", "--conformance-backend"),
        action="append",
        dest="pagedkv_backends",
        default=[],
        metavar="NAME",
        help="Backend to check: a name or config string such as 'flashinfer(kv_layout=HND)'; "
        "repeatable; 'all' checks every registered backend. Default: torch.",
    )
    group.addoption(
        "--conformance-level",
        dest="pagedkv_level",
        choices=LEVELS,
        default="quick",
        help="quick: a few minutes per backend on a CPU. full: the whole matrix, for a GPU "
        "(large pools, long contexts, DeepSeek MLA dims). Default: quick.",
    )
    group.addoption(
        "--conformance-report",
        dest="pagedkv_report",
        default=None,
        metavar="PATH",
        help="Write PATH.json and PATH.md: the backend x scenario matrix with max errors.",
    )
    group.addoption(
        "--conformance-models",
        dest="pagedkv_models",
        action="store_true",
        default=False,
        help="Also serve tiny random-weight Hugging Face models through each backend and "
        "compare with transformers (conformance/test_models.py; needs pagedkv[models]).",
    )
    _add(
        group,
        ("--device", "--conformance-device"),
        dest="pagedkv_device",
        default=None,
        help="Device to run on (cpu, cuda, cuda:1). Default: cuda when available, else cpu.",
    )


def _add(group: Any, names: tuple[str, ...], **kwargs: Any) -> None:
    """Add the short name and its prefixed alias; only the alias when another plugin
    already owns the short name."""
    try:
        group.addoption(*names, **kwargs)
    except ValueError:
        group.addoption(*names[1:], **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("pagedkv_backends") or config.getoption("pagedkv_device"):
        _resolve_or_usage_error(get_run(config))  # the user asked for conformance: fail fast


def get_run(config: pytest.Config) -> ConformanceRun:
    """The conformance session of this pytest run (created on first use)."""
    run = config.stash.get(RUN_KEY, None)
    if run is None:
        from pagedkv.conformance.run import ConformanceRun

        run = ConformanceRun(
            names=list(config.getoption("pagedkv_backends") or []),
            level=config.getoption("pagedkv_level"),
            device_option=config.getoption("pagedkv_device"),
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
    params = []
    for target in run.targets:
        if not target.available:
            params.append(
                pytest.param(
                    (target, None), id=f"{target.label}:unavailable", marks=_unavailable(target)
                )
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


def _params(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    return set(callspec.params) if callspec is not None else set()


# -- reporting --------------------------------------------------------------------------


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(RUN_KEY, None)
    path = session.config.getoption("pagedkv_report")
    if run is None or not run.collected or not path:
        return
    from pagedkv.conformance.report import write_report

    run.report_files = write_report(run, path)


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
        unavailable = "REQUESTED BUT UNAVAILABLE" in line
        tr.write_line(line, red=unavailable, bold=unavailable)
    if config.get_verbosity() > 0:
        tr.write_line("")
        tr.write_line(format_table(*matrix_rows(data)))
    for path in run.report_files:
        tr.write_line(f"report: {path}")
