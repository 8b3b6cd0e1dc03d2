"""Per-layer AttentionSpec of the built-in tiny models, read from their modules."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

from pagedkv.models import (
    HFModel,
    ModelSupportError,
    attention_layer,
    builtin_config,
    builtin_names,
    load_model,
    random_model,
)
from serving_model import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _layers(name: str):
    return load_model(name).attention_layers(block_size=16)


def test_builtins():
    assert builtin_names() == [
        "tiny-deepseek-v3",
        "tiny-gemma2",
        "tiny-gpt-oss",
        "tiny-llama",
        "tiny-qwen3",
    ]
    with pytest.raises(ModelSupportError, match="unknown built-in model 'tiny-x'"):
        builtin_config("tiny-x")


def test_llama_gqa():
    specs = [layer.spec for layer in _layers("tiny-llama")]
    assert len(specs) == 2 and specs[0] == specs[1]
    s = specs[0]
    assert (s.num_heads, s.num_kv_heads, s.head_size, s.scale) == (4, 2, 64, 64**-0.5)
    assert s.sliding_window is None and s.logits_soft_cap is None and not s.use_sinks


def test_gemma2_windows_soft_cap_and_scale():
    first, second = (layer.spec for layer in _layers("tiny-gemma2"))
    assert first.sliding_window == 12 and second.sliding_window is None
    assert first.logits_soft_cap == second.logits_soft_cap == 2.0
    assert first.scale == 64**-0.5  # query_pre_attn_scalar ** -0.5


def test_gpt_oss_sinks_are_the_modules_parameters():
    model = load_model("tiny-gpt-oss")
    layers = model.attention_layers(16)
    assert [layer.spec.sliding_window for layer in layers] == [12, None]
    for layer, module in zip(layers, model.modules, strict=True):
        assert layer.spec.use_sinks
        assert torch.equal(layer.sinks, module.sinks)


def test_deepseek_mla_scale_includes_yarn_mscale():
    model = load_model("tiny-deepseek-v3")
    s = model.attention_layers(16)[0].spec
    assert s.is_mla and (s.kv_lora_rank, s.qk_rope_head_dim, s.head_size_v) == (32, 16, 32)
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0  # yarn: factor 4
    assert s.scale == pytest.approx((32 + 16) ** -0.5 * mscale**2)
    assert s.scale == model.modules[0].scaling
    assert set(model.mla_weights) == {0, 1}


def test_window_from_the_config_when_the_module_has_none():
    model = random_model(builtin_config("tiny-gemma2"), dtype=torch.float32, device="cpu", seed=0)
    module = model.model.layers[0].self_attn
    del module.sliding_window
    layer = attention_layer(module, model.config, torch.float32, 16)
    assert layer.spec.sliding_window == 12


def test_not_a_model():
    with pytest.raises(ModelSupportError, match="expected a transformers model"):
        HFModel(object())
