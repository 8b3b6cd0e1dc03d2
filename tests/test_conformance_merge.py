"""``pagedkv conform --merge``: the reports of runs that split one suite (-k groups, CI
shards) become one report, with the same counts as one run would give; a failure in
any part fails the merge; reports of another level or device are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pagedkv.cli import main
from pagedkv.conformance.report import ReportMergeError, merge_reports


def _conform(tmp_path: Path, name: str, keyword: str) -> dict:
    """A real ``pagedkv conform`` run of the torch backend, quick level, on the CPU."""
    report = tmp_path / name
    code = (
        "from pagedkv.cli import main\n"
        f"raise SystemExit(main(['conform', '--backend', 'torch', '--device', 'cpu', "
        f"'-k', {keyword!r}, '--report', {str(report)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(report.with_name(name + ".json").read_text())


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("merge")
    return [
        _conform(tmp, "decodes", "torch:decode or spec-decode"),
        _conform(tmp, "prefills", "torch:prefill or chunked-prefill"),
    ]


def test_merged_report_counts_every_part(parts, tmp_path, capsys):
    for data in parts:
        assert data["backends"]["torch"]["passed"] == 2
    paths = []
    for i, data in enumerate(parts):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(data))
    assert main(["conform", "--merge", *map(str, paths), "--report", str(tmp_path / "all")]) == 0
    out = capsys.readouterr().out
    merged = json.loads((tmp_path / "all.json").read_text())
    entry = merged["backends"]["torch"]
    assert entry["passed"] == 4 and entry["failed"] == 0
    ran = {c["scenario"] for c in merged["results"] if c["status"] == "pass"}
    assert {"decode", "spec-decode", "prefill", "chunked-prefill"} <= ran
    assert "2 reports merged" in out and "torch: 4 passed, 0 failed" in out
    assert "| decode | pass" in (tmp_path / "all.md").read_text()


def test_a_failure_in_any_part_fails_the_merge(parts, tmp_path, capsys):
    broken = json.loads(json.dumps(parts[1]))
    cell = next(c for c in broken["results"] if c["scenario"] == "prefill")
    cell.update(status="fail", failures=[], reproduce="pagedkv.conformance.reproduce(...)")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(parts[0]))
    b.write_text(json.dumps(broken))
    assert main(["conform", "--merge", str(a), str(b), "--report", str(tmp_path / "m")]) == 1
    assert "torch: 3 passed, 1 failed" in capsys.readouterr().out
    # the same cell passing in another part does not hide the failure
    merged = merge_reports([parts[1], broken])
    assert next(c for c in merged["results"] if c["scenario"] == "prefill")["status"] == "fail"


def test_reports_of_another_level_or_device_are_refused(parts, tmp_path, capsys):
    other = dict(parts[1], level="full")
    with pytest.raises(ReportMergeError, match="report 2: level is 'full', report 1 has 'quick'"):
        merge_reports([parts[0], other])
    path = tmp_path / "other.json"
    path.write_text(json.dumps(dict(parts[1], device="cuda")))
    first = tmp_path / "first.json"
    first.write_text(json.dumps(parts[0]))
    code = main(["conform", "--merge", str(first), str(path), "--report", str(tmp_path / "x")])
    assert code == 2
    assert "report 2: device is 'cuda', report 1 has 'cpu'" in capsys.readouterr().err


def test_a_merge_of_parts_run_on_different_gpus_names_them_all(parts, tmp_path):
    h100 = dict(parts[0], device="cuda", device_name="NVIDIA H100 80GB HBM3")
    h200 = dict(parts[1], device="cuda", device_name="NVIDIA H200")
    merged = merge_reports([h200, h100])
    assert merged["device_name"] == "NVIDIA H100 80GB HBM3 and NVIDIA H200"
    assert merge_reports([h200, dict(h200)])["device_name"] == "NVIDIA H200"


def test_merge_names_an_unreadable_report_and_needs_a_report_path(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["conform", "--merge", str(missing), "--report", str(tmp_path / "x")]) == 2
    assert f"cannot read report {missing}" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("[1, 2]")
    assert main(["conform", "--merge", str(garbage), "--report", str(tmp_path / "x")]) == 2
    assert "is not a conformance report" in capsys.readouterr().err
    assert main(["conform", "--merge", str(garbage)]) == 2
    assert "--merge needs --report PATH" in capsys.readouterr().err
