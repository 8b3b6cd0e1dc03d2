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
        assert backend.layout == "(num_blocks, block_size, num_kv_heads, 2, head_size)"
        scenario = Scenario("template", seq_lens=(20, 33), query_lens=(1, 33), sliding_window=8)
        assert run_scenario(backend, scenario, "cpu").passed
    finally:
        for name in [m for m in sys.modules if m == "my_backend" or m.startswith("my_backend.")]:
            sys.modules.pop(name)
        reset_registry()


def test_plugin_template_uses_only_the_documented_api():
    """The template is what authors copy: it may import pagedkv's documented API
    (the top-level names, the layout axes, the toolkit), never a backend's internals."""
    allowed = ("pagedkv", "pagedkv.layout", "pagedkv.toolkit.")
    for path in (EXAMPLES / "plugin_template" / "my_backend").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and words[1].startswith("pagedkv"):
                module = words[1]
                assert module in allowed or module.startswith(allowed[-1]), (path.name, line)
