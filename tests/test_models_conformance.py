"""Model-level conformance fails when attention is wrong: each layer feature broken on
purpose (past the run-time guard that would refuse it first) moves the logits far
outside the float32 tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

import pagedkv.models.attention as attention
import pagedkv.models.hf as hf
from pagedkv.conformance.models import run_model_check
from pagedkv.serving import AttentionLayer
from serving_model import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _drop_window(layer: AttentionLayer) -> AttentionLayer:
    return dataclasses.replace(layer, spec=layer.spec.replace(sliding_window=None))


def _drop_soft_cap(layer: AttentionLayer) -> AttentionLayer:
    return dataclasses.replace(layer, spec=layer.spec.replace(logits_soft_cap=None))


def _zero_sinks(layer: AttentionLayer) -> AttentionLayer:
    return dataclasses.replace(layer, sinks=torch.zeros_like(layer.sinks))


def _scale_up(layer: AttentionLayer) -> AttentionLayer:
    return dataclasses.replace(layer, spec=layer.spec.replace(scale=layer.spec.scale * 1.05))


@pytest.mark.parametrize(
    ("model", "breakage"),
    [
        ("tiny-gemma2", _drop_window),
        ("tiny-gemma2", _drop_soft_cap),
        ("tiny-gpt-oss", _zero_sinks),
        ("tiny-llama", _scale_up),
    ],
)
def test_a_broken_layer_fails(model, breakage, monkeypatch):
    original = hf.attention_layer
    monkeypatch.setattr(hf, "attention_layer", lambda *a, **k: breakage(original(*a, **k)))
    monkeypatch.setattr(attention, "_check_call", lambda *a, **k: None)
    result = run_model_check(model, "torch")
    assert not result.passed
    assert any("logits differ" in p for p in result.problems), result.report()
    assert result.max_abs_error > 1e-2  # 100x the tolerance
