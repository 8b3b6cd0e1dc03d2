"""``pagedkv conform``: the conformance suite (the same pytest suite, in-process), with a
progress bar, ending with the backend x scenario matrix."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from pagedkv.textutil import format_table


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "conform",
        help="Run the conformance suite on backends and print the scenario matrix.",
        description="Runs `pytest --pyargs pagedkv.conformance` in-process: every scenario "
        "drawn from each backend's declared capabilities, against the float64 reference.",
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="Backend name or config string; repeatable; 'all' = every registered backend "
        "(default: torch).",
    )
    parser.add_argument(
        "--level", choices=["quick", "full"], default="quick", help="Scenario level."
    )
    parser.add_argument("--report", metavar="PATH", help="Write PATH.json and PATH.md.")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when present).")
    parser.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="Skip a requested backend that is unavailable here instead of failing (for "
        "matrix jobs).",
    )
    parser.add_argument(
        "--fuzz",
        type=scenario_count,
        default=0,
        metavar="N",
        help="Also check N scenarios drawn at random within each backend's declared "
        "capabilities, and N CUDA-graph reservations of drawn steps where it declares graph "
        "support; a failure is shrunk to a small one, shown with its repro.",
    )
    parser.add_argument(
        "--fuzz-seed",
        type=int,
        default=0,
        metavar="S",
        help="The drawn scenarios' seed (default 0): the same seed draws the same scenarios.",
    )
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="Only tests matching EXPR.")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="Stop at the first failure.")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="REPORT",
        help="Run nothing: merge the JSON reports of runs that split the suite (-k groups, CI "
        "shards) into --report PATH and print the matrix; exit 1 if any cell or check failed.",
    )
    return parser


def scenario_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of scenarios is >= 0, got {value}")
    return value


# exit status when the suite cannot start: pytest missing, an unknown backend, a
# device this host lacks (argparse's status for usage errors)
CANNOT_START = 2
INSTALL_HINT = 'pip install "pagedkv[conformance]"'


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merge(args.merge, args.report, sys.stdout)
    try:
        import pytest
    except ImportError as exc:
        print(
            f"pagedkv conform: error: the conformance suite runs under pytest, which cannot be "
            f"imported here ({exc}); install it with: {INSTALL_HINT}",
            file=sys.stderr,
        )
        return CANNOT_START
    from pagedkv.conformance.run import ConformanceRun, ConformanceUsageError

    try:  # what pytest would reject later, rejected here with our exit status
        checked = ConformanceRun(list(args.backend), args.level, device_option=args.device)
        _ = checked.device, checked.targets
    except ConformanceUsageError as exc:
        print(f"pagedkv conform: error: {exc}", file=sys.stderr)
        return CANNOT_START
    argv = [
        "--pyargs",
        "pagedkv.conformance",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:terminal",  # the progress bar and the matrix below replace pytest's output
        # the suite is pagedkv's: the pytest settings and conftests of the directory it
        # is started from are not its own (their addopts may need the terminal plugin)
        "--noconftest",
        "-o",
        "addopts=",
        "--pagedkv-level",
        args.level,
    ]
    for name in args.backend:
        argv += ["--pagedkv-backend", name]
    if args.report:
        argv += ["--pagedkv-report", args.report]
    if args.device:
        argv += ["--pagedkv-device", args.device]
    if args.allow_unavailable:
        argv.append("--pagedkv-allow-unavailable")
    if args.fuzz:
        argv += ["--pagedkv-fuzz", str(args.fuzz), "--pagedkv-fuzz-seed", str(args.fuzz_seed)]
    if args.keyword:
        argv += ["-k", args.keyword]
    if args.exitfirst:
        argv.append("-x")
    progress = Progress(sys.stderr)
    code = int(pytest.main(argv, plugins=[progress]))
    if progress.config is not None:
        print_results(progress.config, sys.stdout, progress.unrecorded)
    return code


class Progress:
    """A pytest plugin drawing one bar (a line per test when not on a terminal)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.total = 0
        self.done = 0
        self.failed = 0
        self.deselected = 0
        self.start = time.monotonic()
        self.config: Any = None
        # failed tests that recorded no failing result or check (the harness itself
        # raised, or a test that reports through pytest alone): pytest's report of
        # each, printed in full at the end
        self.unrecorded: list[tuple[str, str]] = []
        self._recorded_before = 0

    def pytest_configure(self, config: Any) -> None:
        self.config = config

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self._line(f"collection error in {report.nodeid or 'session'}:\n{report.longreprtext}")

    def pytest_deselected(self, items: Any) -> None:
        self.deselected += len(items)

    def pytest_collection_finish(self, session: Any) -> None:
        self.total = len(session.items)
        if self.deselected:
            self._line(f"{self.total} tests selected, {self.deselected} deselected by -k")
        self.start = time.monotonic()  # the ETA counts the tests, not the collection

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self._recorded_before = self._failures_recorded()

    def _failures_recorded(self) -> int:
        from pagedkv.conformance.plugin import RUN_KEY

        run = self.config.stash.get(RUN_KEY, None) if self.config is not None else None
        if run is None:
            return 0
        return sum(not r.passed for r in run.results.values()) + sum(
            not c.passed for c in run.checks
        )

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and self._failures_recorded() == self._recorded_before:
            self.unrecorded.append((_short_name(report.nodeid), report.longreprtext))
        # one count per test: its call, or its setup when that skipped or failed
        if report.when != "call" and not (report.when == "setup" and not report.passed):
            return
        self.done += 1
        self.failed += report.failed
        status = "FAIL" if report.failed else "skip" if report.skipped else "pass"
        name = _short_name(report.nodeid)
        elapsed = time.monotonic() - self.start
        eta = f"ETA {_duration(elapsed / self.done * (self.total - self.done))}"
        if self.tty:
            width = 30
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(
                f"\r[{bar}] {self.done}/{self.total} {self.failed} failed "
                f"{_duration(elapsed)} {eta}  {name[:40]:<40}"
            )
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            self._line(
                f"[{self.done:>4}/{self.total}] {status} {name} ({report.duration:.2f}s, {eta})"
            )

    def _line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r")
        self.stream.write(text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _short_name(nodeid: str) -> str:
    """test_scenario[torch:decode] -> torch:decode; test_copy_blocks[torch] -> copy_blocks torch."""
    name = nodeid.rsplit("::", 1)[-1]
    func, _, param = name.partition("[")
    param = param.rstrip("]")
    if func == "test_scenario":
        return param
    return f"{func.removeprefix('test_')} {param}".strip()


def print_results(
    config: Any, out: TextIO, unrecorded: list[tuple[str, str]] | None = None
) -> None:
    """Failures in full (``unrecorded``: (test, pytest's report) of failed tests that
    recorded no result or check), then the matrix and one summary line per backend."""
    from pagedkv.conformance.plugin import RUN_KEY
    from pagedkv.conformance.report import matrix_rows, report_data, summary_lines

    run = config.stash.get(RUN_KEY, None)
    if run is None or not run.collected:
        return
    for target in run.targets:
        if run.fails_run(target):
            print(f"[{target.label}] cannot be tested: {target.reason}", file=out)
    for result in run.results.values():
        if not result.passed:
            print(result.report(), file=out)
    for check in run.checks:
        if not check.passed:
            print(f"[{check.subject}] {check.name}: FAIL", file=out)
            for problem in check.problems:
                print(f"  - {problem}", file=out)
    for name, text in unrecorded or ():
        print(f"[{name}] FAIL (pytest's report):\n{text}", file=out)
    data = report_data(run)
    print(file=out)
    print(format_table(*matrix_rows(data)), file=out)
    print(file=out)
    print(f"pagedkv conformance, {run.level} level on {run.device}:", file=out)
    for line in summary_lines(data):
        print(f"  {line}", file=out)

    for path in run.report_files:
        print(f"report: {path}", file=out)


def merge(paths: list[str], report: str | None, out: TextIO) -> int:
    """``pagedkv conform --merge``: one report from several runs' JSON reports."""
    import json
    from pathlib import Path

    from pagedkv.conformance.report import (
        ReportMergeError,
        markdown,
        matrix_rows,
        merge_reports,
        report_paths,
        summary_lines,
    )

    if report is None:
        print("pagedkv conform: error: --merge needs --report PATH to write", file=sys.stderr)
        return CANNOT_START
    reports = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"pagedkv conform: error: cannot read report {path}: {exc}", file=sys.stderr)
            return CANNOT_START
        if not isinstance(data, dict) or "results" not in data:
            print(f"pagedkv conform: error: {path} is not a conformance report", file=sys.stderr)
            return CANNOT_START
        reports.append(data)
    try:
        merged = merge_reports(reports)
    except ReportMergeError as exc:
        print(f"pagedkv conform: error: {exc}", file=sys.stderr)
        return CANNOT_START
    json_path, md_path = report_paths(report)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(merged, indent=2) + "\n")
    md_path.write_text(markdown(merged))
    print(format_table(*matrix_rows(merged)), file=out)
    print(file=out)
    print(
        f"pagedkv conformance, {merged['level']} level on {merged['device']}, "
        f"{len(reports)} reports merged:",
        file=out,
    )
    for line in summary_lines(merged):
        print(f"  {line}", file=out)
    print(f"report: {json_path}\nreport: {md_path}", file=out)
    failed = any(c["status"] == "fail" for c in merged["results"])
    failed = failed or any(c["status"] == "fail" for c in merged["checks"])
    return 1 if failed else 0
