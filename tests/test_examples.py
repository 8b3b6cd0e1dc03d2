"""The examples stay runnable."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

import pagedkv
import pytest
from conftest import install_distribution
from pagedkv.registry import reset_registry

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_serving_loop_runs(capsys, monkeypatch):
    pytest.importorskip("transformers", reason="the example needs pagedkv[models]")
    monkeypatch.setenv("PAGEDKV_BACKEND", "torch")
    runpy.run_path(str(EXAMPLES / "serving_loop.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "twins sample 1:" in out and "1 forks, 1 block copies" in out
    assert "all freed: 0 blocks in use of 63" in out


def test_plugin_template_installs_and_conforms(tmp_path, monkeypatch):
    site = install_distribution(EXAMPLES / "plugin_template", tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    reset_registry()
    try:
        record = next(r for r in pagedkv.list_backends() if r.name == "my_backend")
        assert record.available and record.distribution == "pagedkv-my-backend 0.1.0"
        from pagedkv.conformance import Scenario, run_scenario

        backend = pagedkv.get_backend("my_backend")
        scenario = Scenario("template", seq_lens=(20, 33), query_lens=(1, 33), sliding_window=8)
        assert run_scenario(backend, scenario, "cpu").passed
    finally:
        sys.modules.pop("my_backend", None)
        reset_registry()
