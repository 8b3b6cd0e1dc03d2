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

from collections.abc import Iterator
from contextlib import contextmanager
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


class _StepInContext:
    """The ``pagedkv_step`` of a compiled model's forward: the step is read at run
    time from ``step_context`` by the ``pagedkv::hf_attention`` op, which a compiler
    treats as opaque (``HFModel(compile=...)``)."""

    def __repr__(self) -> str:
        return "STEP_IN_CONTEXT"


STEP_IN_CONTEXT = _StepInContext()
LAYER_INDEX = "pagedkv_layer_index"  # the attention modules' attribute (index_layer)
_steps: list[HFStep] = []  # the steps being run, innermost last


@contextmanager
def step_context(step: HFStep) -> Iterator[None]:
    """The step that ``pagedkv::hf_attention`` calls inside the block run on."""
    _steps.append(step)
    try:
        yield
    finally:
        _steps.pop()


def paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    pagedkv_step: HFStep | _StepInContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` (MLA: key the latent
    ``[1, 1, T, L + R]``, value None). Returns ``([1, T, H, Dv], None)``."""
    if pagedkv_step is None:
        raise ModelSupportError(
            "the pagedkv attention runs inside pagedkv's engine only (the model's forward "
            "needs pagedkv_step=...); use another attn_implementation elsewhere"
        )
    checked = _CheckedArgs(
        scaling,
        kwargs.get("sliding_window"),
        kwargs.get("softcap"),
        kwargs.get("s_aux") is not None,
    )
    if query.shape[0] != 1:
        raise ModelSupportError(
            f"layer {module.layer_idx}: batch dimension {query.shape[0]}, expected 1 (the "
            "step is flattened)"
        )
    # HF's [1, H, T, D] to the contract's [T, H, D], outside the op: in a compiled model
    # the compiler writes these layouts from the kernels that make q, k and v (the
    # rotary embedding's, the projection's) instead of copying them in the op
    k = _token_major(key)
    if value is None:  # MLA: the query is absorbed next (a new tensor): no copy of it here
        q, v = query[0].transpose(0, 1), None
    else:
        q, v = _token_major(query), _token_major(value)
    if pagedkv_step is STEP_IN_CONTEXT:
        out_dim = module.v_head_dim if value is None else value.shape[-1]
        out = torch.ops.pagedkv.hf_attention(
            q,
            k,
            v,
            getattr(module, LAYER_INDEX),
            out_dim,
            checked.scaling,
            checked.sliding_window,
            checked.softcap,
            checked.has_sinks,
        )
        return out, None
    assert isinstance(pagedkv_step, HFStep)
    return _attend(pagedkv_step, module.layer_idx, q, k, v, checked), None


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> ``[T, H, D]``, contiguous."""
    return x[0].transpose(0, 1).contiguous()


@dataclass(frozen=True)
class _CheckedArgs:
    """What an attention module passes besides tensors, checked against its spec."""

    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool


def index_layer(module: Any) -> None:
    """Give an attention module its ``layer_idx`` as a tensor (0-d int64 on the CPU,
    a plain attribute, so it stays on the CPU when the model moves), for the compiled
    op. An int attribute would be a constant of the compiled code, guarded on: every
    layer of a regionally compiled model would compile its own graph. As a tensor it is
    an input of the graph, read by the op at run time."""
    setattr(module, LAYER_INDEX, torch.tensor(module.layer_idx))


def _attend(
    step: HFStep,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    checked: _CheckedArgs,
) -> torch.Tensor:
    """query ``[T, H, D]``, key/value ``[T, Hkv, D]`` (MLA: key the latent
    ``[T, 1, L + R]``, value None), contiguous (MLA's query a view: it is absorbed).
    Returns ``[1, T, H, Dv]``."""
    attention = step.attention
    _check_call(layer, attention.cache.layers[layer].spec, checked)
    weights = step.mla_weights.get(layer)
    if weights is not None:  # absorbed MLA through the contract: any MLA backend
        w_uk, w_uv = weights
        nope = w_uk.shape[-1]
        absorbed = torch.cat((absorb_query(query[..., :nope], w_uk), query[..., nope:]), dim=-1)
        out = up_project(attention.forward(layer, absorbed, key, None), w_uv)
    else:
        assert value is not None
        out = attention.forward(layer, query, key, value)
    return out.unsqueeze(0)


@torch.library.custom_op("pagedkv::hf_attention", mutates_args=())
def _hf_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    layer: torch.Tensor,
    out_dim: int,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    has_sinks: bool,
) -> torch.Tensor:
    """One layer's paged attention in a compiled model: opaque to the compiler (it
    writes the layer's cache and reads the step's metadata, neither of which the
    compiler sees), run on the step of the innermost ``step_context``. Tensors as
    ``_attend`` takes them (``[T, H, D]``); ``layer``: the layer index, 0-d
    (``index_layer``)."""
    if not _steps:
        raise ModelSupportError("pagedkv::hf_attention ran outside step_context")
    checked = _CheckedArgs(scaling, sliding_window, softcap, has_sinks)
    # contiguous, as the fake below: the compiled graph views the output by its strides
    # (MLA's up-projection returns another layout)
    return _attend(_steps[-1], int(layer), query, key, value, checked).contiguous()


@_hf_attention_op.register_fake
def _(query: torch.Tensor, key: Any, value: Any, layer: Any, out_dim: int, *checks: Any) -> Any:
    """The output's shape: [1, T, H, out_dim], contiguous (as the op's)."""
    return query.new_empty((1, query.shape[0], query.shape[1], out_dim))


def _check_call(layer: int, spec: Any, checked: _CheckedArgs) -> None:
    """What the module passes at run time must be what its spec was built from."""
    problems = []
    if checked.scaling is not None and checked.scaling != spec.scale:
        problems.append(f"scaling {checked.scaling} but the spec has {spec.scale}")
    window = checked.sliding_window
    if window is not None and window != spec.sliding_window:
        problems.append(f"sliding_window {window} but the spec has {spec.sliding_window}")
    softcap = checked.softcap
    if softcap is not None and softcap != spec.logits_soft_cap:
        problems.append(f"softcap {softcap} but the spec has {spec.logits_soft_cap}")
    if checked.has_sinks != spec.use_sinks:
        problems.append(f"sinks passed: {checked.has_sinks}, spec: {spec.use_sinks}")
    if problems:
        raise ModelSupportError(f"layer {layer}: " + "; ".join(problems))


def register() -> None:
    """Register ``"pagedkv"`` with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
