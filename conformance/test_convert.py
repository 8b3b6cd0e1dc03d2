"""Live KV-cache conversion between every ordered pair of the backends under test
(see pagedkv.conformance.convert). Imports are absolute: pytest may import this file
as ``conformance.test_convert`` from a source tree."""

from __future__ import annotations

import itertools

import pytest
import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.convert import conversion_problems
from pagedkv.conformance.plugin import get_run
from pagedkv.conformance.scenario import Scenario
from pagedkv.convert import convert_kv_cache
from pagedkv.errors import UnsupportedError

# decodes, a chunk and a prefill; lengths on and off block boundaries (in units of 16)
_STANDARD = Scenario(
    "convert", seq_lens=(35, 17, 4, 64), query_lens=(1, 17, 2, 1), num_heads=8, num_kv_heads=2,
    head_size=64, dtype=torch.float16, block_size=16, seed=11,
)  # fmt: skip
_CANDIDATES = (
    _STANDARD,
    _STANDARD.replace(name="convert-block-64", block_size=64),
    _STANDARD.replace(name="convert-fp32", dtype=torch.float32),
    _STANDARD.replace(name="convert-fp8", kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario(
        "convert-mla", seq_lens=(35, 17, 4), query_lens=(1, 17, 2), num_heads=8,
        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        dtype=torch.float16, block_size=16, seed=11,
    ),
)  # fmt: skip


def _runs(backend: AttentionBackend, scenario: Scenario, device: str) -> bool:
    return not backend.validate(scenario.spec(), device)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conversion_case" not in metafunc.fixturenames:
        return
    run = get_run(metafunc.config)
    targets = run.available_targets
    params = []
    for src, dst in itertools.permutations(targets, 2):
        # the first layer both take, and the fp8 one when both take it
        shared = [
            s
            for s in _CANDIDATES
            if _runs(src.backend, s, run.device) and _runs(dst.backend, s, run.device)
        ]
        chosen = shared[:1] + [s for s in shared[1:] if s.kv_cache_dtype != "auto"][:1]
        for scenario in chosen:
            params.append(
                pytest.param((src, dst, scenario), id=f"{src.label}->{dst.label}:{scenario.name}")
            )
    if not params:
        params = [
            pytest.param(
                None,
                id="no-pair",
                marks=pytest.mark.skip(reason="conversion needs two backends sharing a layer"),
            )
        ]
    metafunc.parametrize("conversion_case", params)


def test_conversion(conversion_case, conformance_run) -> None:
    """A written cache converts into the other layout bit for bit, and attends the same."""
    src, dst, scenario = conversion_case
    problems = conversion_problems(src.backend, dst.backend, scenario, conformance_run.device)
    if problems:
        pytest.fail(
            f"[{src.label} -> {dst.label}] {scenario.repro()}\n"
            + "\n".join(f"  - {p}" for p in problems),
            pytrace=False,
        )


def test_latent_caches_convert_only_to_latent_caches(conformance_run) -> None:
    """Conversion between an MLA backend and a standard one is refused with the reason."""
    device = conformance_run.device
    mla = _CANDIDATES[-1]
    latent = [t for t in conformance_run.available_targets if _runs(t.backend, mla, device)]
    standard = [t for t in conformance_run.available_targets if t not in latent]
    if not latent or not standard:
        pytest.skip("needs an MLA backend and a standard one under test")
    src, dst = latent[0].backend, standard[0].backend
    cache = src.allocate_kv_cache(4, mla.spec(), device)
    with pytest.raises(UnsupportedError, match="MLA latent caches convert only to latent caches"):
        convert_kv_cache(src, cache, dst, mla.spec())
