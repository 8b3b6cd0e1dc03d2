"""Per-layer AttentionSpec of a Hugging Face model, read from its attention modules.

What each attention module hands its attention function (``scaling``, the sliding
window, the soft cap, sinks) is read from the module itself, so the spec is what the
model computes: ``module.scaling`` (DeepSeek: qk head dim ** -0.5 times yarn
``mscale**2``; Gemma: ``query_pre_attn_scalar ** -0.5``), ``module.sliding_window``
(per layer from ``config.layer_types``), ``module.attn_logit_softcapping``,
``module.sinks`` (gpt-oss), ``module.is_causal``. Head counts come from the config.
"""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.models.errors import ModelSupportError
from pagedkv.models.mla import is_mla_attention
from pagedkv.serving import AttentionLayer
from pagedkv.spec import AttentionSpec


def attention_modules(model: Any) -> list[Any]:
    """The model's attention modules, one per layer, by ``layer_idx``."""
    config = model.config.get_text_config()
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or not hasattr(module, "scaling"):
            continue
        if idx in found:
            raise ModelSupportError(f"two attention modules claim layer_idx {idx} ({name})")
        found[idx] = module
    num_layers = config.num_hidden_layers
    if sorted(found) != list(range(num_layers)):
        raise ModelSupportError(
            f"{type(model).__name__}: expected one attention module (with layer_idx and "
            f"scaling) per layer 0..{num_layers - 1}, found layers {sorted(found)}"
        )
    return [found[i] for i in range(num_layers)]


def attention_layer(
    module: Any, config: Any, dtype: torch.dtype, block_size: int
) -> AttentionLayer:
    """The pagedkv layer (spec, sinks) of one HF attention module."""
    text = config.get_text_config()
    num_heads = text.num_attention_heads
    scale = float(module.scaling) if module.scaling is not None else None
    if is_mla_attention(module):
        lora, rope = module.kv_lora_rank, module.qk_rope_head_dim
        spec = AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=1,
            head_size=lora + rope,
            head_size_v=lora,
            dtype=dtype,
            block_size=block_size,
            scale=scale,
            kv_lora_rank=lora,
            qk_rope_head_dim=rope,
        )
        return AttentionLayer(spec)
    sinks = getattr(module, "sinks", None)
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_size=module.head_dim,
        dtype=dtype,
        block_size=block_size,
        scale=scale,
        sliding_window=_sliding_window(module, text),
        logits_soft_cap=getattr(module, "attn_logit_softcapping", None) or None,
        use_sinks=sinks is not None,
        causal=bool(getattr(module, "is_causal", True)),
    )
    return AttentionLayer(spec, None if sinks is None else sinks.detach())


def _sliding_window(module: Any, text_config: Any) -> int | None:
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    # modules that leave the window to HF's mask: the config's per-layer types
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types and layer_types[module.layer_idx] == "sliding_attention":
        return text_config.sliding_window
    if layer_types is None and getattr(text_config, "use_sliding_window", False):
        return text_config.sliding_window
    return None
