"""Regional compilation of a Hugging Face model: its decoder layers under
``torch.compile``, one by one, instead of its whole forward.

Dynamo inlines a layer's submodules with their parameters as graph inputs, so
identical layers share one compiled graph: compile time stays that of one layer
however deep the model is (a whole-model compile traces and generates code for
every layer). What differs between layers must not be a constant of the compiled
code: the attention op takes the layer index as a tensor
(``pagedkv.models.attention.index_layer``). Layers that differ in code or in their
constants (sliding and global attention, dense and MoE blocks) compile one graph per
kind.
"""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.models.attention import STEP_IN_CONTEXT
from torch.torch_version import TorchVersion


def shares_layer_graphs() -> bool:
    """Whether dynamo inlines nn modules with their parameters as graph inputs (from
    torch 2.5 on), so identical layers share one compiled graph. Before, every layer
    would compile its own graph (up to dynamo's recompile limit, then run eagerly):
    ``HFModel`` then compiles the whole forward instead."""
    return TorchVersion(torch.__version__) >= (2, 5)


def decoder_layers(model: torch.nn.Module, attention: list[Any]) -> torch.nn.ModuleList | None:
    """The ``nn.ModuleList`` of ``model``'s repeated blocks: the one whose items hold
    every module of ``attention`` (one per layer) between them, the longest if
    several do (a list around the blocks holds them too). None when no list does."""
    wanted = {id(m) for m in attention}
    found = None
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList):
            continue
        held = {id(m) for item in module for m in item.modules()} & wanted
        if held == wanted and (found is None or len(module) > len(found)):
            found = module
    return found


def compile_layers(layers: torch.nn.ModuleList, backend: str) -> None:
    """Compile each layer's forward with ``backend`` (dynamic shapes), in place. The
    compiled forward runs in pagedkv's steps only (``pagedkv_step`` is
    ``STEP_IN_CONTEXT``); any other call, e.g. HF's own attention inside
    ``reference_attention``, runs the layer eagerly."""
    for layer in layers:
        # forward, not the module's __call__ (nn.Module.compile): the token dims are
        # marked on the call's inputs, outside the compiled code
        layer.forward = _CompiledForward(layer.forward, backend)


class _CompiledForward:
    def __init__(self, forward: Any, backend: str) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=True, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pagedkv_step") is not STEP_IN_CONTEXT:
            return self.eager(*args, **kwargs)
        mark_tokens_unbacked(args, kwargs)
        return self.compiled(*args, **kwargs)


def mark_tokens_unbacked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Mark the token dim of a decoder layer's inputs unbacked: the hidden states
    ``[1, T, D]``, the rotary ``(cos, sin)`` ``[1, T, d]``, the positions ``[1, T]``
    (every tensor, also inside a tuple, that starts ``[1, T]``; T is the first
    tensor's, the hidden states'). A dynamic dim is specialized when it is 0 or 1, so
    a lone decode would compile a second graph; an unbacked one is not, so one graph
    serves prefill chunks, decode batches of any size and a lone decode."""
    tensors = []
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                tensors.append(item)
    if not tensors or tensors[0].dim() < 2:
        return
    tokens = tensors[0].shape[1]
    for t in tensors:
        if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == tokens:
            torch._dynamo.decorators.mark_unbacked(t, 1)
