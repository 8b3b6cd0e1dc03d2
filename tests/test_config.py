import math
import re

import pytest
import torch
from pagedkv import (
    AttentionSpec,
    BackendChoice,
    BackendOption,
    ConfigError,
    NoUsableBackendError,
    UnknownBackendError,
    get_backend,
    parse_config,
    select_backend,
)
from pagedkv.backends.torch import TorchBackend
from pagedkv.config import name_problem
from pagedkv.registry import Registry

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("triton", [BackendChoice("triton")]),
        (
            " flashinfer(kv_layout=HND) , triton ",
            [BackendChoice("flashinfer", {"kv_layout": "HND"}), BackendChoice("triton")],
        ),
        (
            "flash_attn(impl=fa4, block=16),auto",
            [BackendChoice("flash_attn", {"impl": "fa4", "block": "16"}), BackendChoice("auto")],
        ),
        ("x(a='b, c')", [BackendChoice("x", {"a": "b, c"})]),
        ("x()", [BackendChoice("x")]),
        ("my-plugin.v2", [BackendChoice("my-plugin.v2")]),
    ],
)
def test_parse_good(text, expected):
    assert parse_config(text) == expected


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        ("", 1, "expected a backend name"),
        ("triton,", 8, "expected a backend name"),
        ("flashinfer(kv_layout HND)", 22, "expected '=' after option name 'kv_layout'"),
        ("flashinfer(kv_layout=HND", 25, "expected ',' or '\\)'"),
        ("a b", 3, "expected ',' between backends"),
        ("x(=1)", 3, "expected an option name"),
        ("x(a=1,a=2)", 7, "option 'a' given twice"),
        ("auto(x=1)", 5, "'auto' takes no options"),
        ("torch,torch", 7, "backend 'torch' listed twice"),
        ("x(a='1)", 5, "unterminated ' string"),
        ("9lives", 1, "expected a backend name"),
    ],
)
def test_parse_bad_points_at_character(text, column, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(text)
    text_lines = str(info.value).splitlines()
    assert f"at character {column}:" in text_lines[0]
    assert text_lines[-1].index("^") - 2 == column - 1


def registry_with(*classes):
    reg = Registry()
    for cls in classes:
        reg._add(cls, cls.name, "test-dist 1.0")
    return reg


class Fast(TorchBackend):
    name = "fast"
    priority = 50
    capabilities = TorchBackend.capabilities.__class__(
        dtypes=frozenset({torch.bfloat16}), devices=frozenset({"cpu", "cuda"})
    )


class Missing(TorchBackend):
    name = "missing"
    priority = 100

    def missing_dependency(self):
        return "kernel library 'nothere' is not installed"


def test_select_explicit_and_fallback():
    reg = registry_with(TorchBackend, Fast, Missing)
    assert select_backend("torch", SPEC, registry=reg).name == "torch"
    # fast rejects fp16, missing is unavailable: both fall through to torch
    assert select_backend("missing,fast,torch", SPEC, registry=reg).name == "torch"
    assert select_backend("auto", SPEC, registry=reg).name == "torch"
    assert select_backend("auto", SPEC.replace(dtype=torch.bfloat16), registry=reg).name == "fast"


def test_select_reports_every_reason():
    reg = registry_with(TorchBackend, Fast, Missing)
    with pytest.raises(NoUsableBackendError) as info:
        select_backend("missing,fast", SPEC, registry=reg)
    text = str(info.value)
    assert "missing: kernel library 'nothere' is not installed" in text
    assert "fast: dtype float16 not supported by fast (supports bfloat16)" in text


def test_select_unknown_name_suggests_closest():
    reg = registry_with(TorchBackend, Fast)
    with pytest.raises(
        UnknownBackendError, match="unknown attention backend 'tourch'; did you mean 'torch'"
    ):
        select_backend("tourch", SPEC, registry=reg)


def test_options_are_checked():
    reg = registry_with(TorchBackend)
    with pytest.raises(
        ConfigError, match=r"torch: unknown option\(s\) kv_layout \(accepted: none\)"
    ):
        select_backend("torch(kv_layout=HND)", SPEC, registry=reg)


def test_env_default(monkeypatch):
    reg = registry_with(TorchBackend, Fast)
    monkeypatch.setenv("PAGEDKV_BACKEND", "fast,torch")
    assert select_backend(None, SPEC.replace(dtype=torch.bfloat16), registry=reg).name == "fast"


def test_option_keys_that_are_constructor_parameters_are_config_errors():
    reg = registry_with(TorchBackend)
    for config in ("torch(self=1)", "torch(name=x)", "torch(options=1)"):
        with pytest.raises(ConfigError, match=r"torch: unknown option\(s\) "):
            select_backend(config, SPEC, registry=reg)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) self"):
        get_backend("torch", self=1)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("triton(num_splits=-1)", "option num_splits=-1: expected 0 to 64"),
        ("triton(num_splits=65)", "option num_splits=65: expected 0 to 64"),
        ("triton(num_splits=2.5)", "option num_splits='2.5': expected an int"),
        ("mla(num_splits=0)", "option num_splits=0: expected 1 to 64"),
        ("pallas(num_splits=-1)", "option num_splits=-1: expected 0 to 64"),
        ("pallas(num_warps=-1)", "option num_warps=-1: expected >= 0"),
        ("pallas(block_m=-16)", "option block_m=-16: expected >= 0"),
    ],
)
def test_option_ranges_are_checked_at_selection(config, message):
    # a bad option is the caller's error: it is raised, not skipped for the next candidate
    with pytest.raises(ConfigError, match=re.escape(message)):
        select_backend(f"{config},torch", SPEC, "cpu")


def test_backend_option_ranges_and_types():
    option = BackendOption(None, "splits", kind=int, minimum=0, maximum=64)
    assert option.parse("n", "64") == 64 and option.parse("n", 0) == 0
    assert option.parse("n", None) is None  # unset, as the default
    for bad, expected in [
        (-1, "expected 0 to 64"),
        ("65", "expected 0 to 64"),
        (True, "expected an int, got bool"),
        (2.0, "expected an int, got float"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            option.parse("n", bad)
    scale = BackendOption(1.0, "scale", kind=float, minimum=0.0)
    assert scale.parse("s", 2) == 2 and scale.parse("s", "0.5") == 0.5
    for bad in ("nan", "inf", math.inf):
        with pytest.raises(ConfigError, match="expected a finite float"):
            scale.parse("s", bad)
    with pytest.raises(ConfigError, match="expected a str, got NoneType"):
        BackendOption("NHD", "layout").parse("kv_layout", None)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("triton", None),
        ("my-plugin.v2", None),
        ("auto", "is reserved"),
        ("AUTO", "is reserved"),
        ("split", "is reserved"),
        ("all", "is reserved"),
        ("../x", "cannot be written in a config string"),
        ("my backend", "cannot be written in a config string"),
        ("", "cannot be written in a config string"),
        (None, "must be a str, got NoneType None"),
    ],
)
def test_backend_names_follow_the_config_grammar(name, problem):
    found = name_problem(name)
    assert found is None if problem is None else problem in found
    if problem is None:
        assert parse_config(name) == [BackendChoice(name)]


def test_config_must_be_a_str():
    with pytest.raises(ConfigError, match="a backend config must be a str, got list"):
        parse_config(["torch"])
