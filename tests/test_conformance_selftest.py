"""The harness tests itself: the suite, run as a third party runs it (an installed
plugin distribution, ``pytest --pyargs pagedkv.conformance`` from a temporary
directory), must fail each deliberately broken backend and point at its bug (each
diagnosis hint is checked against the bug it names), pass the torch backend, and
fail a requested backend that is unavailable, with its reason."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROKEN = [
    "broken_block_table",
    "broken_full_block",
    "broken_last_token",
    "broken_gqa",
    "broken_window",
    "broken_write_offset",
    "broken_unreferenced_read",
    "broken_scale",
    "broken_decode_window",
]
PLUGIN_SCENARIO = "plugin-tiny-requests-quick"


def _env(site: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PAGEDKV_PLUGINS", "PAGEDKV_BACKEND", "PYTEST_ADDOPTS", "PYTHONPATH")
    }
    env["PYTHONPATH"] = str(site)
    return env


def _run(args: list[str], site: Path, cwd: Path, timeout: int = 600):
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def suite(broken_backends_site, tmp_path_factory):
    """One quick-level run over torch, every broken backend and an unavailable one."""
    cwd = tmp_path_factory.mktemp("third-party")
    names = ["torch", *BROKEN, "broken_copy_axis", "vendor_missing"]
    backends = [arg for name in names for arg in ("--backend", name)]
    proc = _run(
        [
            "-m",
            "pytest",
            "--pyargs",
            "pagedkv.conformance",
            "-p",
            "no:cacheprovider",
            "-q",
            "--conformance-level",
            "quick",
            "--device",
            "cpu",
            "--conformance-report",
            str(cwd / "report"),
            *backends,
        ],
        broken_backends_site,
        cwd,
    )
    data = json.loads((cwd / "report.json").read_text())
    cells = {(c["backend"], c["scenario"]): c for c in data["results"]}
    return proc, data, cells


def _failed(cells, backend: str) -> set[str]:
    return {s for (b, s), c in cells.items() if b == backend and c["status"] == "fail"}


def _requests_named(cell) -> set[int]:
    """Requests the failures name as wrong (their structured "requests" field)."""
    return {r for failure in cell["failures"] for r in failure.get("requests", [])}


def _hints(cells, backend: str, scenario: str) -> str:
    return "\n".join(cells[(backend, scenario)]["hints"])


def test_the_suite_fails_and_the_control_passes(suite):
    proc, _, cells = suite
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    torch_cells = [c for (b, _), c in cells.items() if b == "torch"]
    assert torch_cells and all(c["status"] == "pass" for c in torch_cells)
    for name in BROKEN:
        assert _failed(cells, name), name
        assert f"test_scenario[{name}:" in proc.stdout
    assert "reproduce: python -c" in proc.stdout


def test_a_requested_unavailable_backend_fails_with_its_reason(suite):
    proc, data, cells = suite
    entry = data["backends"]["vendor_missing"]
    assert entry["requested"] and not entry["available"] and entry["fails_run"]
    assert entry["reason"] == "vendor runtime libpagedkv_vendor.so not found"
    assert (
        "vendor_missing: REQUESTED BUT UNAVAILABLE: vendor runtime libpagedkv_vendor.so not found "
        "(fails the run; --pagedkv-allow-unavailable skips it instead)" in proc.stdout
    )
    assert "FAILED " in proc.stdout and "test_scenario[vendor_missing:unavailable]" in proc.stdout
    assert not [c for (b, _), c in cells.items() if b == "vendor_missing"]  # nothing ran
    assert re.search(r"\d+ failed, \d+ passed, \d+ skipped", proc.stdout)


def test_ignoring_the_block_table_fails_exactly_the_multi_block_requests(suite):
    _, data, cells = suite
    cell = cells[("broken_block_table", "decode")]
    seq_lens = data["scenarios"]["decode"]["seq_lens"]
    multi_block = {i for i, s in enumerate(seq_lens) if s > 16}
    assert multi_block and _requests_named(cell) == multi_block
    assert "exactly those spanning more than one block" in _hints(
        cells, "broken_block_table", "decode"
    )


def test_a_wrong_full_last_block_is_named_by_its_pattern(suite):
    _, data, cells = suite
    for scenario in ("decode", "prefill"):
        cell = cells[("broken_full_block", scenario)]
        seq_lens = data["scenarios"][scenario]["seq_lens"]
        assert _requests_named(cell) == {i for i, s in enumerate(seq_lens) if s % 16 == 0}
        assert "every failing request has a full last block" in _hints(
            cells, "broken_full_block", scenario
        )
    # the hint appears only where the pattern holds
    assert "full last block" not in _hints(cells, "broken_last_token", "decode")


def test_dropping_the_last_token_fails_every_request_longer_than_one(suite):
    _, data, cells = suite
    cell = cells[("broken_last_token", "decode")]
    seq_lens = data["scenarios"]["decode"]["seq_lens"]
    assert _requests_named(cell) == {i for i, s in enumerate(seq_lens) if s > 1}
    (output,) = [f for f in cell["failures"] if f["check"] == "output"]
    assert output["seq_lens"] == [s for s in seq_lens if s > 1]
    assert output["query_lens"] == [1] * len(output["seq_lens"])
    assert "one key fewer" in _hints(cells, "broken_last_token", "decode")
    assert "one key fewer" not in _hints(cells, "broken_gqa", "decode")


def test_a_wrong_gqa_mapping_fails_grouped_heads_only(suite):
    _, _, cells = suite
    assert cells[("broken_gqa", "gqa-1")]["status"] == "pass"
    assert cells[("broken_gqa", "mqa")]["status"] == "pass"
    assert cells[("broken_gqa", "gqa-5")]["status"] == "fail"
    # 8 query heads on 2 KV heads: h % 2 != h // 4 for heads 1, 3, 4 and 6
    (output,) = cells[("broken_gqa", "decode")]["failures"]
    assert output["heads"] == [1, 3, 4, 6] and "query heads [1, 3, 4, 6] (4)" in output["message"]
    assert "the kernel seems to use h % num_kv_heads" in _hints(cells, "broken_gqa", "decode")
    assert "h % num_kv_heads" not in _hints(cells, "broken_window", "sliding-window")


def test_an_ignored_window_fails_exactly_the_window_scenarios(suite):
    _, data, cells = suite
    window = {n for n, s in data["scenarios"].items() if "sliding_window" in s["tags"]}
    assert "window-smaller-than-block" in window
    assert _failed(cells, "broken_window") == window
    for scenario in window:
        assert "without the sliding window" in _hints(cells, "broken_window", scenario)


def test_a_decode_path_ignoring_the_window_fails_even_refusing_small_windows(suite):
    """The window scenario with decodes far past the window is the one that catches a
    decode kernel without the window, when the backend refuses windows smaller than
    its block size (the scenario with decodes inside a block is then n/a)."""
    _, data, cells = suite
    assert cells[("broken_decode_window", "window-smaller-than-block")]["status"] == "n/a"
    assert _failed(cells, "broken_decode_window") == {"sliding-window-decode"}
    hints = _hints(cells, "broken_decode_window", "sliding-window-decode")
    assert "without the sliding window" in hints
    layer = data["scenarios"]["sliding-window-decode"]["layer"]
    assert layer["sliding_window"] >= layer["block_size"]


def test_a_copy_along_the_wrong_axis_is_named(suite):
    _, _, cells = suite
    checks = [c for c in suite[1]["checks"] if c["subject"] == "broken_copy_axis"]
    copy = next(c for c in checks if c["check"] == "copy_blocks")
    assert copy["status"] == "fail"
    assert copy["problems"][-1] == (
        "hint: the cache equals the copy along axis 2 of the kv_cache tensor (shape (2, 8, 16, 2, "
        "64)): copy_blocks indexes axis 2, but blocks are on axis 1 (AttentionBackend.block_axis)"
    )
    assert not _failed(cells, "broken_copy_axis")  # its attention is right


def test_writing_one_slot_off_is_named_by_the_cache_check(suite):
    _, _, cells = suite
    # every scenario but the one without token rows (nothing to write)
    assert _failed(cells, "broken_write_offset") == {
        s for (b, s) in cells if b == "broken_write_offset" and s != "empty-step"
    }
    failures = cells[("broken_write_offset", "prefill")]["failures"]
    cache = [f for f in failures if f["check"] == "cache" and f["tensor"] == "K"]
    assert cache and "(the slot is computed off by +1)" in cache[0]["message"]
    assert cache[0]["slot_shift"] == 1 and cache[0]["request"] == 0


def test_reading_an_unreferenced_block_shows_as_poison_in_the_output(suite):
    _, _, cells = suite
    failures = cells[("broken_unreferenced_read", "decode")]["failures"]
    assert any(
        f["check"] == "non-finite-output"
        and "read a block the request's table does not name" in f["message"]
        for f in failures
    )
    assert not any(f["check"] == "cache" for f in failures)  # its writes are right


def test_a_wrong_softmax_scale_fails_the_custom_scale_scenario(suite):
    _, _, cells = suite
    assert _failed(cells, "broken_scale") == {"custom-scale"}
    assert "the kernel derives its own scale" in _hints(cells, "broken_scale", "custom-scale")


def test_the_json_report_has_structured_failures_and_layers(suite):
    _, data, cells = suite
    assert data["format_version"] == 2
    (output,) = cells[("broken_scale", "custom-scale")]["failures"]
    assert output["check"] == "output"
    for key in ("request", "seq_len", "query_len", "token", "position", "head", "kv_head", "dim"):
        assert isinstance(output[key], int), key
    assert output["abs_error"] > 0.005 and output["elements"] > 0
    layer = data["scenarios"]["custom-scale"]["layer"]
    assert layer["scale"] == 0.2125 and layer["num_heads"] == 8 and layer["dtype"] == "float16"


def test_plugin_scenarios_and_cross_backend_comparison(suite):
    _, data, cells = suite
    tags = data["scenarios"][PLUGIN_SCENARIO]["tags"]
    assert "plugin:broken_backends" in tags
    assert cells[("torch", PLUGIN_SCENARIO)]["status"] == "pass"
    cross = {c["subject"]: c for c in data["checks"] if c["check"] == "cross-backend"}
    decode = cross["decode"]
    assert decode["status"] == "pass" and decode["baseline"] == "torch"
    assert {"broken_window", "broken_scale"} <= set(decode["compared"])
    assert "broken_gqa" in decode["skipped"]  # failed the reference: not compared


def test_the_reproduction_line_reproduces(suite, broken_backends_site, tmp_path):
    _, _, cells = suite
    line = cells[("broken_scale", "custom-scale")]["reproduce"]
    argv = shlex.split(line)
    assert argv[0] == "python"
    proc = _run(argv[1:], broken_backends_site, tmp_path, timeout=120)
    assert "[broken_scale] scenario custom-scale: FAIL" in proc.stdout, proc.stderr


def test_in_the_repository_the_default_backend_is_torch(broken_backends_site):
    proc = _run(
        ["-m", "pytest", "conformance", "--collect-only", "-q", "-p", "no:cacheprovider"],
        broken_backends_site,
        ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_scenario[torch:decode]" in proc.stdout
    assert "broken_" not in proc.stdout


def test_an_unknown_backend_is_a_usage_error(broken_backends_site, tmp_path):
    proc = _run(
        ["-m", "pytest", "--pyargs", "pagedkv.conformance", "--backend", "torhc"],
        broken_backends_site,
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 4
    assert "unknown attention backend 'torhc'; did you mean 'torch'?" in proc.stderr


def test_pagedkv_conform_shows_progress_and_the_matrix(broken_backends_site, tmp_path):
    proc = _run(
        [
            "-m",
            "pagedkv.cli",
            "conform",
            "--backend",
            "torch",
            "--backend",
            "broken_scale",
            "--backend",
            "vendor_missing",
            "-k",
            "scale or copy",
            "--device",
            "cpu",
            "--report",
            str(tmp_path / "r"),
        ],
        broken_backends_site,
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"\[ +\d+/\d+\] pass copy_blocks torch \(\d+\.\d+s, ETA \d+s\)", proc.stderr)
    deselected = re.search(r"(\d+) tests selected, (\d+) deselected by -k", proc.stderr)
    assert deselected and int(deselected[2]) > 0
    # each backend's summary counts what -k left out
    # custom-scale and kv-scales-unquantized
    assert re.search(r"torch: 2 passed, 0 failed, \d+ deselected of \d+ scenarios", proc.stdout)
    assert "[broken_scale] scenario custom-scale: FAIL" in proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line}
    assert rows["scenario"] == ["torch", "broken_scale"]
    assert rows["custom-scale"][0] == "pass" and rows["custom-scale"][2] == "FAIL"
    assert "vendor_missing: REQUESTED BUT UNAVAILABLE" in proc.stdout
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.md").exists()
