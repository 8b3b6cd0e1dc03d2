"""split(decode=..., prefill=...): each part attends over its own rows of one shared cache."""

from __future__ import annotations

import pytest
import torch
from pagedkv import AttentionSpec, ConfigError, NoUsableBackendError, select_backend
from pagedkv.conformance import Scenario, run_scenario
from pagedkv.phase_split import PhaseSplitBackend

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16, block_size=16)
MIXED = Scenario(
    "split-mixed", seq_lens=(37, 129, 300, 64, 80, 18), query_lens=(1, 1, 48, 4, 80, 1),
    num_heads=8, num_kv_heads=2, head_size=32, num_padding_tokens=3,
)  # fmt: skip


def test_selected_from_a_config_string_and_routes_every_row():
    backend = select_backend("split(decode=torch, prefill='torch')", SPEC, "cpu")
    assert isinstance(backend, PhaseSplitBackend)
    assert repr(backend) == "split(decode=torch, prefill=torch)"
    result = run_scenario(backend, MIXED, "cpu")  # decodes are not contiguous: gathered rows
    assert result.passed, result.report()
    decode_first = MIXED.replace(name="split-decode-first", seq_lens=(37, 129, 18, 300, 64, 80),
                                 query_lens=(1, 1, 1, 48, 4, 80))  # fmt: skip
    assert run_scenario(backend, decode_first, "cpu").passed


def test_parts_must_share_a_layout():
    with pytest.raises(
        NoUsableBackendError, match="both parts read one cache, so they must share a layout"
    ):
        select_backend("split(decode=torch, prefill=pallas)", SPEC, "cpu")


@pytest.mark.parametrize(
    "config, message",
    [
        ("split(decode=torch)", "needs decode= and prefill="),
        ("split(decode='torch,pallas', prefill=torch)", "expected one backend"),
        ("split(decode=auto, prefill=torch)", "expected one backend"),
    ],
)
def test_malformed_splits_are_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        select_backend(config, SPEC, "cpu")


def test_capabilities_are_the_intersection():
    backend = PhaseSplitBackend(decode="torch", prefill="pallas")
    caps = backend.capabilities
    assert (
        caps.features
        == backend.decode.capabilities.features & backend.prefill.capabilities.features
    )
    assert caps.head_sizes[0].matches(64) and not caps.head_sizes[0].matches(512)
