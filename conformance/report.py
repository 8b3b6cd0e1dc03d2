"""The conformance report: PATH.json (every verdict) and PATH.md (a backend x
scenario matrix with max errors, then each failure with its reproduction)."""

from __future__ import annotations

import datetime
import json
import math
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pagedkv.capabilities import dtype_name
from pagedkv.conformance.check import TOLERANCES, ScenarioResult
from pagedkv.conformance.run import ConformanceRun, Target
from pagedkv.conformance.scenario import Scenario
from pagedkv.textutil import markdown_table

# 2: failures are objects (check, message and the fields they name), cells carry
# hints, scenarios their layer, backends "broken"/"fails_run" and deselected counts
FORMAT_VERSION = 2


def report_paths(path: str | Path) -> tuple[Path, Path]:
    """PATH.json and PATH.md (a .json or .md suffix on PATH is dropped first)."""
    path = Path(path)
    if path.suffix in (".json", ".md"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".json"), path.with_name(path.name + ".md")


def write_report(run: ConformanceRun, path: str | Path) -> tuple[Path, Path]:
    data = report_data(run)
    json_path, md_path = report_paths(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    md_path.write_text(markdown(data))
    return json_path, md_path


def report_data(run: ConformanceRun) -> dict[str, Any]:
    """Everything the session decided, JSON-ready."""
    import pagedkv

    backends, cells, scenarios = {}, [], {}
    for target in run.targets:
        backends[target.label] = _backend_entry(run, target)
        if not target.available:
            continue
        plan = run.plan(target)
        for scenario in plan.scenarios:
            scenarios.setdefault(scenario.name, _scenario_entry(scenario))
            result = run.results.get((target.label, scenario.name))
            cells.append(_cell(target.label, scenario.name, result))
        for scenario, reasons in plan.not_applicable:
            scenarios.setdefault(scenario.name, _scenario_entry(scenario))
            cells.append(
                {
                    "backend": target.label,
                    "scenario": scenario.name,
                    "status": "n/a",
                    "reasons": reasons,
                }
            )
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "level": run.level,
        "device": run.device,
        "allow_unavailable": run.allow_unavailable,
        "device_name": _device_name(run.device),
        "versions": {
            "pagedkv": pagedkv.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "tolerances": {
            dtype_name(d): {"atol": t.atol, "rtol": t.rtol} for d, t in TOLERANCES.items()
        },
        "backends": backends,
        "scenarios": scenarios,
        "results": cells,
        "checks": [
            {
                "check": c.name,
                "subject": c.subject,
                "status": c.status,
                "problems": c.problems,
                **c.detail,
            }
            for c in run.checks
        ],
    }


def _backend_entry(run: ConformanceRun, target: Target) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "requested": target.requested,
        "available": target.available,
        "broken": target.broken,
        "fails_run": run.fails_run(target),
        "reason": target.reason,
        "distribution": target.distribution,
    }
    if target.backend is not None:
        # a broken backend may lack either: the report states what it can
        entry["layout"] = _introspect(lambda: str(target.backend.layout))
        entry["capabilities"] = _introspect(lambda: target.backend.capabilities.describe())
    if target.available:
        plan = run.plan(target)
        entry["plan_problems"] = plan.problems
        entry["notes"] = plan.notes
        entry.update(run.counts(target))
    return entry


def _introspect(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:
        return f"unreadable: {type(exc).__name__}: {exc}"


def _scenario_entry(scenario: Scenario) -> dict[str, Any]:
    return {
        "repro": scenario.repro(),
        "tags": sorted(scenario.tags),
        "dtype": dtype_name(scenario.dtype),
        "seq_lens": list(scenario.seq_lens),
        "query_lens": list(scenario.query_lens),
        "num_padding_tokens": scenario.num_padding_tokens,
        "min_num_blocks": scenario.min_num_blocks,
        "seed": scenario.seed,
        "layer": _introspect(scenario.layer),
    }


def _cell(backend: str, scenario: str, result: ScenarioResult | None) -> dict[str, Any]:
    if result is None:
        return {"backend": backend, "scenario": scenario, "status": "not run"}
    return {
        "backend": backend,
        "scenario": scenario,
        "status": "pass" if result.passed else "fail",
        "max_abs_error": _finite(result.max_abs_error),
        "max_rel_error": _finite(result.max_rel_error),
        "non_finite_output": math.isinf(result.max_abs_error),
        "tolerance": {
            "atol": TOLERANCES[result.scenario.dtype].atol,
            "rtol": TOLERANCES[result.scenario.dtype].rtol,
        },
        "failures": [f.to_json() for f in result.failures],
        "hints": result.hints,
        "duration_s": round(result.duration_s, 4),
        "reproduce": None if result.passed else result.reproduction(),
    }


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: None (an output that was not compared, or non-finite)."""
    return value if math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    return str(value)


class ReportMergeError(ValueError):
    """Reports that cannot be merged: another level, device or format."""


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the reports of runs that split one suite between them (``-k``
    groups, CI shards, processes that each compile their own kernels): per backend and
    scenario the cell of the run that ran it, a failure over a pass when two ran it;
    checks likewise; counts recomputed. The runs must share format, level and device
    (``cuda``, ``cpu``); the GPU models of the parts are all named."""
    if not reports:
        raise ReportMergeError("no reports to merge")
    first = reports[0]
    for i, data in enumerate(reports):
        for key in ("format_version", "level", "device"):
            if data.get(key) != first.get(key):
                raise ReportMergeError(
                    f"report {i + 1}: {key} is {data.get(key)!r}, report 1 has "
                    f"{first.get(key)!r}: only runs of one level on one device merge"
                )
    merged = dict(first)
    merged["created"] = max(d["created"] for d in reports)
    # parts run in different sessions may have had different GPUs of one device kind:
    # the report names every one, not the first part's alone
    names = sorted({str(d.get("device_name")) for d in reports})
    merged["device_name"] = " and ".join(names)
    versions = {json.dumps(d["versions"], sort_keys=True) for d in reports}
    if len(versions) > 1:
        merged["versions"] = {"mixed": [json.loads(v) for v in sorted(versions)]}
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    checks: dict[tuple[str, str], dict[str, Any]] = {}
    merged["scenarios"] = {}
    for data in reports:
        merged["scenarios"].update(data["scenarios"])
        for cell in data["results"]:
            key = (cell["backend"], cell["scenario"])
            if _cell_rank(cell) >= _cell_rank(cells.get(key)):
                cells[key] = cell
        for check in data["checks"]:
            key = (check["check"], check["subject"])
            old = checks.get(key)
            if old is None or (check["status"] == "fail" and old["status"] != "fail"):
                checks[key] = check
    merged["results"] = list(cells.values())
    merged["checks"] = list(checks.values())
    merged["backends"] = {}
    for data in reports:
        for label, entry in data["backends"].items():
            kept = merged["backends"].get(label)
            if kept is None or (entry["available"] and not kept["available"]):
                merged["backends"][label] = dict(entry)
    for label, entry in merged["backends"].items():
        if entry["available"]:
            entry.update(_merged_counts(label, merged["results"]))
    return merged


def _cell_rank(cell: dict[str, Any] | None) -> int:
    """Which of two cells of one backend and scenario a merge keeps: the higher."""
    if cell is None:
        return -1
    return {"not run": 0, "n/a": 1, "pass": 2, "fail": 3}[cell["status"]]


def _merged_counts(label: str, cells: list[dict[str, Any]]) -> dict[str, int]:
    mine = [c for c in cells if c["backend"] == label]
    statuses = [c["status"] for c in mine]
    not_applicable = statuses.count("n/a")
    return {
        "passed": statuses.count("pass"),
        "failed": statuses.count("fail"),
        # a merged run cannot tell deselected from interrupted: both are "not run"
        "deselected": 0,
        "not_run": statuses.count("not run"),
        "not_applicable": not_applicable,
        "planned": len(mine) - not_applicable,
    }


# -- rendering --------------------------------------------------------------------------


def matrix_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the scenario x backend matrix (one cell: status and max abs error)."""
    labels = [b for b, e in data["backends"].items() if e["available"]]
    by_key = {(c["backend"], c["scenario"]): c for c in data["results"]}
    rows = []
    for name in data["scenarios"]:
        row = [name]
        for label in labels:
            row.append(_cell_text(by_key.get((label, name))))
        rows.append(row)
    return ["scenario", *labels], rows


def _cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None or cell["status"] == "not run":
        return "-"
    if cell["status"] == "n/a":
        return "n/a"
    err = cell.get("max_abs_error")
    err_text = " non-finite" if cell.get("non_finite_output") else ""
    err_text = f" {err:.1e}" if err is not None else err_text
    return ("pass" if cell["status"] == "pass" else "FAIL") + err_text


def summary_lines(data: dict[str, Any]) -> list[str]:
    """One line per backend: counts, or why it was not tested."""
    lines = []
    for label, entry in data["backends"].items():
        if not entry["available"]:
            lines.append(_unavailable_line(label, entry))
            continue
        own = [c for c in data["checks"] if c["subject"] == label]
        failed_checks = [c["check"] for c in own if c["status"] == "fail"]
        passed_checks = [c["check"] for c in own if c["status"] == "pass"]
        skipped = [
            f"{entry[key]} {words}"
            for key, words in (("deselected", "deselected"), ("not_run", "not run"))
            if entry.get(key)
        ]
        line = (
            f"{label}: {entry['passed']} passed, {entry['failed']} failed"
            + "".join(f", {s}" for s in skipped)
            + f" of {entry['planned']} scenarios, {entry['not_applicable']} not applicable"
        )
        if failed_checks:
            line += f"; failed checks: {', '.join(failed_checks)}"
        if passed_checks:
            line += f"; passed checks: {', '.join(passed_checks)}"
        if entry.get("plan_problems"):
            line += f"; plan problems: {len(entry['plan_problems'])}"
        lines.append(line)
    cross = [c for c in data["checks"] if c["check"] == "cross-backend"]
    if cross:
        bad = [c["subject"] for c in cross if c["status"] == "fail"]
        compared = [c for c in cross if c["status"] != "skipped"]
        lines.append(
            f"cross-backend: {len(compared) - len(bad)} of {len(compared)} compared scenarios "
            f"agree; {len(cross) - len(compared)} not compared (fewer than two backends passed)"
            + (f"; disagree: {', '.join(bad)}" if bad else "")
        )
    return lines


def _unavailable_line(label: str, entry: dict[str, Any]) -> str:
    if entry.get("broken"):
        return f"{label}: BROKEN: {entry['reason']} (fails the run)"
    if not entry["requested"]:
        return f"{label}: unavailable: {entry['reason']} (its scenarios were skipped)"
    consequence = (
        "fails the run; --pagedkv-allow-unavailable skips it instead"
        if entry.get("fails_run")
        else "skipped: unavailable backends are allowed"
    )
    return f"{label}: REQUESTED BUT UNAVAILABLE: {entry['reason']} ({consequence})"


def markdown(data: dict[str, Any]) -> str:
    out = [
        "# pagedkv conformance report",
        "",
        f"Level **{data['level']}** on **{data['device']}** ({data['device_name']}); "
        f"pagedkv {data['versions']['pagedkv']}, torch {data['versions']['torch']}, "
        f"Python {data['versions']['python']}; {data['created']}.",
        "",
        "Tolerances against the float64 reference: "
        + ", ".join(f"{d} atol {t['atol']} rtol {t['rtol']}" for d, t in data["tolerances"].items())
        + ". Cells: status and max abs error; `n/a`: the backend does not declare what the "
        "scenario needs; `-`: not run.",
        "",
        "## Summary",
        "",
        *[f"- {line}" for line in summary_lines(data)],
        "",
        "## Matrix",
        "",
        markdown_table(*matrix_rows(data)),
        "",
    ]
    failures = [c for c in data["results"] if c["status"] == "fail"]
    if failures:
        out += ["## Failures", ""]
        for cell in failures:
            out.append(f"### {cell['backend']} / {cell['scenario']}")
            out.append("")
            out += [f"- {f['message']}" for f in cell["failures"]]
            out += [f"- hint: {h}" for h in cell.get("hints", [])]
            out += ["", "```", cell["reproduce"], "```", ""]
    checks = [c for c in data["checks"] if c["check"] != "cross-backend"]
    if checks:
        rows = [[c["check"], c["subject"], _check_result(c)] for c in checks]
        out += ["## Checks", "", markdown_table(["check", "backend", "result"], rows), ""]
    cross = [c for c in data["checks"] if c["check"] == "cross-backend"]
    if cross:
        rows = []
        for c in cross:
            diff = c.get("max_abs_diff")
            diff_text = "-" if diff is None or not math.isfinite(diff) else f"{diff:.1e}"
            rows.append([
                c["subject"], c.get("baseline", "-"), ", ".join(c["compared"]), diff_text,
                _check_result(c),
            ])  # fmt: skip
        headers = ["scenario", "baseline", "compared", "max abs diff", "result"]
        out += ["## Cross-backend", "", markdown_table(headers, rows), ""]
    na = [c for c in data["results"] if c["status"] == "n/a"]
    if na:
        out += ["## Not applicable", ""]
        out += [f"- {c['backend']} / {c['scenario']}: {'; '.join(c['reasons'])}" for c in na]
        out.append("")
    return "\n".join(out)


def _check_result(check: dict[str, Any]) -> str:
    """A check's result cell: its status (pass, skipped), or FAIL and its problems."""
    if check["status"] != "fail":
        return check["status"]
    return "FAIL: " + "; ".join(check["problems"])
