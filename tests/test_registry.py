"""The registry through real entry points of installed distributions."""

from __future__ import annotations

import importlib
import sys

import pagedkv
import pytest
from pagedkv import DuplicateBackendError, UnknownBackendError
from pagedkv.registry import PluginLoadWarning, Registry, get_registry, reset_registry


@pytest.fixture
def on_path(monkeypatch):
    def add(*dirs):
        for d in dirs:
            monkeypatch.syspath_prepend(str(d))
        importlib.invalidate_caches()

    yield add
    for name in list(sys.modules):
        if name.startswith(
            ("pagedkv_example_plugin", "pagedkv_broken_plugins", "pagedkv_duplicate_plugin")
        ):
            del sys.modules[name]
    reset_registry()


def test_builtin_backend_comes_from_our_entry_point():
    record = next(r for r in pagedkv.list_backends() if r.name == "torch")
    assert record.available and record.plugin == "torch"
    assert record.distribution.startswith("pagedkv ")
    assert record.layout == "(2, num_blocks, block_size, num_kv_heads, head_size)"


def test_installed_plugin_is_found(plugin_site, on_path):
    on_path(plugin_site["example"])
    reg = get_registry(reload=True)
    assert {"example", "example_two", "torch"} <= set(reg.names())
    record = next(r for r in pagedkv.list_backends() if r.name == "example_two")
    assert record.distribution == "pagedkv-example-plugin 0.3.0" and record.plugin == "example"
    assert pagedkv.get_backend("example").name == "example"


def test_allowlist_excludes_plugins(plugin_site, on_path, monkeypatch):
    on_path(plugin_site["example"])
    monkeypatch.setenv("PAGEDKV_PLUGINS", "torch")
    reg = get_registry(reload=True)
    assert reg.names() == ["torch"]
    with pytest.raises(UnknownBackendError, match="Known backends: torch"):
        pagedkv.get_backend("example")


def test_broken_plugins_are_isolated(plugin_site, on_path):
    on_path(plugin_site["broken"], plugin_site["example"])
    with pytest.warns(PluginLoadWarning) as warned:
        reg = get_registry(reload=True)
    assert {"torch", "example", "example_two"} <= set(reg.names())
    failures = {f.plugin: f for f in reg.failures}
    assert set(failures) == {"broken_import", "broken_hook", "broken_return"}
    assert "ModuleNotFoundError" in failures["broken_import"].error
    assert "pagedkv_kernel_library_that_does_not_exist" in failures["broken_import"].error
    assert "vendor runtime not initialised" in failures["broken_hook"].error
    assert "not a named AttentionBackend subclass" in failures["broken_return"].error
    assert failures["broken_hook"].distribution == "pagedkv-broken-plugins 0.0.1"
    assert len(warned) == 3
    records = {r.name: r for r in pagedkv.list_backends()}
    assert not records["broken_import"].available
    assert records["broken_import"].reason.startswith("plugin failed to load")
    with pytest.raises(
        pagedkv.PagedKVError, match="backend 'broken_hook' is unavailable: plugin 'broken_hook'"
    ):
        pagedkv.get_backend("broken_hook")


def test_duplicate_names_are_an_error_naming_both(plugin_site, on_path):
    on_path(plugin_site["duplicate"])
    with pytest.raises(DuplicateBackendError) as info:
        get_registry(reload=True)
    text = str(info.value)
    assert "'torch' is registered twice" in text
    assert "pagedkv-duplicate-plugin 1.2.3" in text and "pagedkv 0." in text


def test_in_process_plugin_registration():
    from pagedkv.backends.torch import TorchBackend

    class Local(TorchBackend):
        name = "local"

    class Plugin:
        @pagedkv.hookimpl
        def pagedkv_backends(self):
            return [Local]

    reg = Registry()
    reg.register_plugin(Plugin(), "local-plugin")
    assert reg.names() == ["local"]
