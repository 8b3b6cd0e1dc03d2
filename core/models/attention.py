"""The attention function registered with transformers' AttentionInterface.

A model whose ``config._attn_implementation`` is ``"pagedkv"`` calls
``paged_attention_forward(module, query, key, value, mask, scaling=..., **kwargs)`` from
every attention module; the step travels in the ``pagedkv_step`` keyword argument of
the model's forward (HF passes unknown keyword arguments down to this function). The
call is routed by ``module.layer_idx`` to that layer's pagedkv impl and cache. HF
builds no mask for a name it does not know: causality, windows and the rest are the
layer spec's. HF's own cache is unused (``use_cache=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pagedkv.backends.mla.absorb import absorb_query, up_project
from pagedkv.models.errors import ModelSupportError
from pagedkv.serving import StepAttention

ATTENTION_NAME = "pagedkv"


@dataclass
class HFStep:
    """One step as the attention function sees it: the step's attention and the MLA
    layers' W_UK / W_UV (``{layer_idx: ([L, H, nope], [L, H, v])}``)."""

    attention: StepAttention
    mla_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    pagedkv_step: HFStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` (MLA: key the latent
    ``[1, 1, T, L + R]``, value None). Returns ``([1, T, H, Dv], None)``."""
    if pagedkv_step is None:
        raise ModelSupportError(
            "the pagedkv attention runs inside pagedkv's engine only (the model's forward "
            "needs pagedkv_step=...); use another attn_implementation elsewhere"
        )
    layer = module.layer_idx
    attention = pagedkv_step.attention
    spec = attention.cache.layers[layer].spec
    _check_call(layer, spec, query, scaling, kwargs)
    q = query[0].transpose(0, 1)  # [T, H, D]
    weights = pagedkv_step.mla_weights.get(layer)
    if weights is not None:  # absorbed MLA through the contract: any MLA backend
        w_uk, w_uv = weights
        nope = w_uk.shape[-1]
        absorbed = torch.cat((absorb_query(q[..., :nope], w_uk), q[..., nope:]), dim=-1)
        latent = key[0].transpose(0, 1).contiguous()  # [T, 1, L + R]
        out = up_project(attention.forward(layer, absorbed, latent, None), w_uv)
    else:
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        out = attention.forward(layer, q.contiguous(), k, v)
    return out.unsqueeze(0), None


def _check_call(layer: int, spec: Any, query: torch.Tensor, scaling: Any, kwargs: Any) -> None:
    """What the module passes at run time must be what its spec was built from."""
    problems = []
    if query.shape[0] != 1:
        problems.append(f"batch dimension {query.shape[0]}, expected 1 (the step is flattened)")
    if scaling is not None and scaling != spec.scale:
        problems.append(f"scaling {scaling} but the spec has {spec.scale}")
    window = kwargs.get("sliding_window")
    if window is not None and window != spec.sliding_window:
        problems.append(f"sliding_window {window} but the spec has {spec.sliding_window}")
    softcap = kwargs.get("softcap")
    if softcap is not None and softcap != spec.logits_soft_cap:
        problems.append(f"softcap {softcap} but the spec has {spec.logits_soft_cap}")
    if (kwargs.get("s_aux") is not None) != spec.use_sinks:
        problems.append(f"sinks passed: {kwargs.get('s_aux') is not None}, spec: {spec.use_sinks}")
    if problems:
        raise ModelSupportError(f"layer {layer}: " + "; ".join(problems))


def register() -> None:
    """Register ``"pagedkv"`` with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
