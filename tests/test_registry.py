"""The registry through real entry points of installed distributions."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import warnings

import pagedkv
import pytest
import torch
from pagedkv import DuplicateBackendError, NoUsableBackendError, UnknownBackendError
from pagedkv.cli import main
from pagedkv.registry import (
    BackendErrorWarning,
    PluginLoadWarning,
    Registry,
    get_registry,
    reset_registry,
)

SPEC = pagedkv.AttentionSpec(
    num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16
)
PLUGIN_MODULES = (
    "pagedkv_example_plugin",
    "pagedkv_broken_plugins",
    "pagedkv_duplicate_plugin",
    "pagedkv_duplicate_template",
    "pagedkv_misbehaving",
)


@pytest.fixture
def on_path(monkeypatch):
    def add(*dirs):
        for d in dirs:
            monkeypatch.syspath_prepend(str(d))
        importlib.invalidate_caches()

    yield add
    for name in list(sys.modules):
        if name.startswith(PLUGIN_MODULES):
            del sys.modules[name]
    reset_registry()


@pytest.fixture
def load(plugin_site, on_path, monkeypatch):
    """Load the registry with the given test distributions installed and only the
    given plugins allowed; returns it with the messages of the warnings it gave."""

    def load(*sites, plugins=None):
        on_path(*(plugin_site[s] for s in sites))
        if plugins is not None:
            monkeypatch.setenv("PAGEDKV_PLUGINS", ",".join(plugins))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry = get_registry(reload=True)
        return registry, [str(w.message) for w in caught if w.category is PluginLoadWarning]

    return load


def records():
    return {r.name: r for r in pagedkv.list_backends()}


def test_builtin_backend_comes_from_our_entry_point():
    record = next(r for r in pagedkv.list_backends() if r.name == "torch")
    assert record.available and record.plugin == "torch"
    assert record.distribution.startswith("pagedkv ")
    assert record.layout == "(2, num_blocks, block_size, num_kv_heads, head_size)"


def test_records_carry_notes_and_devices():
    record = records()["pallas"]
    assert any("CUDA graphs" in note for note in record.notes)
    assert record.capabilities["devices"] == ["cpu", "cuda"]


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


def test_allowlist_naming_no_installed_plugin_warns(load):
    reg, warned = load("example", plugins=["torch", "exampel", "trtion"])
    assert reg.names() == ["torch"]
    (message,) = warned
    assert "$PAGEDKV_PLUGINS names no installed plugin called exampel, trtion" in message
    assert "(installed: " in message and "example, " in message and "triton" in message
    assert message in [str(w) for w in reg.warnings]


def test_broken_plugins_are_isolated(load):
    plugins = ["torch", "example", "broken_import", "broken_hook", "broken_return"]
    reg, warned = load("broken", "example", plugins=plugins)
    assert {"torch", "example", "example_two"} <= set(reg.names())
    failures = {f.plugin: f for f in reg.failures}
    assert set(failures) == {"broken_import", "broken_hook", "broken_return"}
    assert "ModuleNotFoundError" in failures["broken_import"].error
    assert "pagedkv_kernel_library_that_does_not_exist" in failures["broken_import"].error
    assert "import_error.py:1)" in failures["broken_import"].error
    assert "vendor runtime not initialised" in failures["broken_hook"].error
    assert "hook_raises.py:6)" in failures["broken_hook"].error
    assert "not a named AttentionBackend subclass" in failures["broken_return"].error
    assert failures["broken_hook"].distribution == "pagedkv-broken-plugins 0.0.1"
    assert len(warned) == 3
    listed = records()
    assert not listed["broken_import"].available
    assert listed["broken_import"].reason.startswith("plugin failed to load")
    with pytest.raises(
        pagedkv.PagedKVError, match="backend 'broken_hook' is unavailable: plugin 'broken_hook'"
    ):
        pagedkv.get_backend("broken_hook")


def test_a_plugin_that_exits_at_import_is_contained(load):
    reg, warned = load("misbehaving", plugins=["torch", "exits_at_import"])
    assert reg.names() == ["torch"]
    (failure,) = reg.failures
    assert failure.plugin == "exits_at_import"
    assert "failed: SystemExit: 3 (at " in failure.error
    assert failure.error.endswith("pagedkv_misbehaving/exits_at_import.py:5)")
    assert len(warned) == 1


def test_an_import_error_is_located_at_the_plugin_line(load):
    reg, _ = load("misbehaving", plugins=["torch", "fails_in_stdlib"])
    (failure,) = reg.failures
    assert failure.error.startswith(
        "import of 'pagedkv_misbehaving.fails_in_stdlib' failed: JSONDecodeError: "
    )
    # the plugin's own line first, then where the standard library raised
    assert "pagedkv_misbehaving/fails_in_stdlib.py:7, in the plugin; raised in " in failure.error
    assert "json/decoder.py:" in failure.error


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("auto", "backend name 'auto' is reserved (reserved: all, auto, split)"),
        ("split", "backend name 'split' is reserved"),
        ("../x", "backend name '../x' cannot be written in a config string"),
        ("my backend", "backend name 'my backend' cannot be written in a config string"),
        ("word_priority", "priority must be an int, got 'high'"),
        ("bad_option_name", "option_specs must map option names (config-string names)"),
        (
            "misspelt_capabilities",
            "capabilities must be a pagedkv.Capabilities, got nothing (no such attribute)",
        ),
        (
            "unfinished",
            "abstract methods not implemented: get_builder_cls, get_impl_cls",
        ),
    ],
)
def test_ill_formed_backends_are_refused_at_registration(load, name, reason):
    reg, warned = load("misbehaving", plugins=["torch", "bad_backends"])
    assert sorted(reg.names()) == ["torch", "well_behaved"]
    failure = reg.failure_for(name)
    assert failure is not None and failure.backend == name and failure.plugin == "bad_backends"
    assert reason in failure.error
    assert any(f"backend {name!r} of plugin 'bad_backends'" in w for w in warned)
    record = records()[name]
    assert not record.available and reason in record.reason
    if name == "split":  # the name means the phase-split composite, whatever a plugin says
        with pytest.raises(pagedkv.ConfigError, match="needs decode= and prefill="):
            pagedkv.get_backend(name)
        return
    with pytest.raises(pagedkv.PagedKVError, match="of plugin 'bad_backends'"):
        pagedkv.get_backend(name)


def test_a_name_that_is_not_a_str_is_refused(load):
    reg, _ = load("misbehaving", plugins=["torch", "bad_backends"])
    (failure,) = [f for f in reg.failures if "must be a str" in f.error]
    assert failure.error == "backend name must be a str, got int 42"
    assert failure.backend.endswith("Backend_42")


def test_reserved_names_cannot_be_hijacked(load):
    load("misbehaving", plugins=["torch", "bad_backends"])
    # "auto" still means every usable backend by priority
    assert pagedkv.select_backend("auto", SPEC, "cpu").name in {"torch", "well_behaved"}
    with pytest.raises(NoUsableBackendError) as info:
        pagedkv.select_backend("auto", SPEC, "meta")  # a device nobody supports
    assert "  auto: backend name 'auto' is reserved" in str(info.value)


def test_selection_skips_backends_that_raise_or_answer_junk(load):
    load("misbehaving", plugins=["torch", "raising_backends"])
    # every raising backend outranks torch, and auto still ends at torch
    with pytest.warns(BackendErrorWarning) as warned:
        assert pagedkv.select_backend("auto", SPEC, "cpu").name == "torch"
    assert len(warned) == 6
    config = ",".join(
        [
            "raises_in_init",
            "config_error_in_init",
            "raises_in_is_available",
            "raises_in_validate",
            "junk_is_available",
            "junk_validate",
        ]
    )
    with pytest.warns(BackendErrorWarning), pytest.raises(NoUsableBackendError) as info:
        pagedkv.select_backend(config, SPEC, "cpu")
    reasons = {k: v[0] for k, v in info.value.reasons.items()}
    assert reasons["raises_in_init"].startswith(
        "constructing it raised RuntimeError: driver handle missing (at "
    )
    assert "raising_backends.py:" in reasons["raises_in_init"]
    assert reasons["config_error_in_init"].startswith("constructing it raised ConfigError")
    assert reasons["raises_in_is_available"].startswith("is_available() raised RuntimeError")
    assert reasons["raises_in_validate"].startswith("validate() raised RuntimeError")
    assert reasons["junk_is_available"] == "is_available() returned 'yes', expected (bool, str)"
    assert reasons["junk_validate"] == "validate() returned None, expected a list of str"
    listed = records()  # listing asks is_available too, and never raises
    assert listed["raises_in_is_available"].reason.startswith("is_available() raised")
    assert listed["raises_in_init"].reason.startswith("constructing it raised RuntimeError")


def test_misspelt_unmarked_and_empty_plugins_are_reported(load):
    plugins = ["torch", "misspelt_hook", "unmarked_hook", "registers_nothing", "partly_misspelt"]
    reg, warned = load("misbehaving", plugins=plugins)
    assert sorted(reg.names()) == ["partly_misspelt", "torch"]
    failures = {f.plugin: f.error for f in reg.failures}
    assert failures["misspelt_hook"] == (
        "it registers no pagedkv hook implementation: pagedkv_backend is not a pagedkv hook "
        "(did you mean pagedkv_backends?)"
    )
    assert failures["unmarked_hook"] == (
        "it registers no pagedkv hook implementation: function pagedkv_backends is a pagedkv "
        "hook but not marked @pagedkv.hookimpl, so it is never called"
    )
    assert failures["registers_nothing"] == (
        "it registers no pagedkv hook implementation: it defines none of pagedkv_backends, "
        "pagedkv_conformance_scenarios"
    )
    # a plugin that works but has a misspelt hook: a warning, on its backends' records
    (warning,) = reg.warnings
    assert str(warning) == (
        "plugin 'partly_misspelt' (pagedkv-misbehaving-plugins 0.1.0): "
        "pagedkv_conformance_scenario is not a pagedkv hook (did you mean "
        "pagedkv_conformance_scenarios?)"
    )
    listed = records()
    assert listed["partly_misspelt"].available
    assert listed["partly_misspelt"].warnings == (str(warning),)
    assert not listed["misspelt_hook"].available
    assert len(warned) == 4
    # the author asking for the backend learns why, not just "unknown backend"
    with pytest.raises(pagedkv.PagedKVError, match="pagedkv_backend is not a pagedkv hook"):
        pagedkv.get_backend("misspelt_hook")


def test_a_hook_that_uses_the_registry_gets_an_error_not_a_deadlock(load):
    outcome = {}

    def run():
        try:
            outcome["registry"] = load(
                "misbehaving", plugins=["torch", "reentrant_hook", "reentrant_import"]
            )[0]
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    loader = threading.Thread(target=run, daemon=True)
    loader.start()
    loader.join(timeout=60)
    assert not loader.is_alive(), "loading the registry deadlocked"
    assert "error" not in outcome, outcome.get("error")
    reg = outcome["registry"]
    assert reg.names() == ["torch"]
    failures = {f.plugin: f.error for f in reg.failures}
    for plugin, what in (
        ("reentrant_hook", "pagedkv_backends() raised RegistryReentryError: "),
        ("reentrant_import", "import of 'pagedkv_misbehaving.reentrant_import' failed: "),
    ):
        assert what in failures[plugin]
        assert (
            f"the pagedkv registry was used while it loads its plugins (by plugin {plugin!r})"
            in failures[plugin]
        )
    # the registry works afterwards, from any thread
    assert pagedkv.get_backend("torch").name == "torch"


def test_a_duplicated_name_disables_only_that_name(load):
    reg, warned = load(
        "duplicate", "misbehaving", plugins=["torch", "triton", "impostor", "my_backend"]
    )
    assert reg.names() == ["triton"]
    listed = records()
    torch_record = listed["torch"]
    assert not torch_record.available
    assert torch_record.reason == (
        "backend name 'torch' is claimed by plugin 'impostor' of pagedkv-duplicate-plugin 1.2.3 "
        f"and plugin 'torch' of pagedkv {pagedkv.__version__}: neither is used; uninstall all "
        "but one, or choose one with $PAGEDKV_PLUGINS"
    )
    # two copies of the plugin template: same entry-point name, same backend name
    mine = listed["my_backend"]
    assert not mine.available
    assert "plugin 'my_backend' of pagedkv-misbehaving-plugins 0.1.0" in mine.reason
    assert "plugin 'my_backend' of pagedkv-duplicate-plugin 1.2.3" in mine.reason
    assert sum("is claimed by" in w for w in warned) == 2
    # everything else keeps working; the duplicated names give a clear error
    assert pagedkv.select_backend("torch,triton", SPEC, "cpu").name == "triton"
    with pytest.raises(NoUsableBackendError, match="'my_backend' is claimed by plugin"):
        pagedkv.select_backend("my_backend", SPEC, "cpu")
    with pytest.raises(DuplicateBackendError, match="backend 'torch' is unusable: backend name"):
        pagedkv.get_backend("torch")


def test_pagedkv_backends_lists_every_problem_and_exits_0(load, capsys, monkeypatch):
    plugins = ["torch", "triton", "impostor", "my_backend", "misspelt_hook", "partly_misspelt"]
    load("duplicate", "misbehaving", plugins=[*plugins, "tourch"])
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    flat = " ".join(out.split())
    assert (
        "backend name 'torch' is claimed by plugin 'impostor' of pagedkv-duplicate-plugin" in flat
    )
    assert "backend name 'my_backend' is claimed by plugin 'my_backend' of" in flat
    assert "pagedkv_backend is not a pagedkv hook (did you mean pagedkv_backends?)" in flat
    assert "plugin problems: $PAGEDKV_PLUGINS names no installed plugin called tourch" in flat
    assert (
        "plugin 'partly_misspelt' (pagedkv-misbehaving-plugins 0.1.0): "
        "pagedkv_conformance_scenario is not a pagedkv hook" in flat
    )
    assert main(["backends", "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out) if r["available"]}
    assert set(listed) >= {"triton", "partly_misspelt"}
    assert listed["partly_misspelt"]["warnings"][0].endswith(
        "(did you mean pagedkv_conformance_scenarios?)"
    )


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


def test_in_process_plugin_with_an_unmarked_method_is_reported():
    class Plugin:
        def pagedkv_backends(self):
            return []

    reg = Registry()
    with pytest.warns(PluginLoadWarning, match="not marked @pagedkv.hookimpl"):
        reg.register_plugin(Plugin(), "unmarked")
    assert reg.failure_for("unmarked") is not None


def test_a_hook_with_a_wrong_signature_registers_nothing_of_its_plugin():
    class Plugin:
        @pagedkv.hookimpl
        def pagedkv_conformance_scenarios(self, backend, level):
            return []

        @pagedkv.hookimpl
        def pagedkv_backends(self, device):
            return []

    reg = Registry()
    with pytest.warns(PluginLoadWarning, match="registration failed: PluginValidationError"):
        reg.register_plugin(Plugin(), "wrong-signature")
    assert reg.plugin_manager.hook.pagedkv_conformance_scenarios.get_hookimpls() == []


def test_listing_survives_declarations_that_raise():
    from pagedkv.backends.torch import TorchBackend

    class BrokenDeclarations(TorchBackend):
        name = "broken_declarations"

        @property
        def capabilities(self):
            raise RuntimeError("adapter table missing")

        @property
        def layout(self):
            raise RuntimeError("no layout yet")

    class Plugin:
        @pagedkv.hookimpl
        def pagedkv_backends(self):
            return [BrokenDeclarations]

    reg = Registry()
    reg.register_plugin(Plugin(), "broken-declarations")
    (record,) = reg.records()
    assert not record.available and record.layout == "?" and record.capabilities is None
    # is_available() reads the capabilities first
    assert record.reason.startswith("is_available() raised RuntimeError: adapter table missing")


def test_a_hook_may_not_exit_the_process_but_ctrl_c_still_stops_loading():
    def plugin_raising(exc):
        class Plugin:
            @pagedkv.hookimpl
            def pagedkv_backends(self):
                raise exc

        return Plugin()

    reg = Registry()
    with pytest.warns(PluginLoadWarning, match=r"pagedkv_backends\(\) raised SystemExit: 4"):
        reg.register_plugin(plugin_raising(SystemExit(4)), "exits")
    with pytest.raises(KeyboardInterrupt):
        reg.register_plugin(plugin_raising(KeyboardInterrupt()), "interrupted")
