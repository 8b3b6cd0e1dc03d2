"""HFModel: a Hugging Face causal LM as a pagedkv PagedModel.

The vLLM transformers-backend pattern: register an attention function with
transformers' AttentionInterface, set the model's attention implementation to it,
call the model on the step's flattened tokens (``[1, T]``, positions as
``position_ids``, ``use_cache=False``) with the step in a keyword argument, and keep
only the sampled rows' logits (``logits_to_keep`` as indices).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pagedkv.distributed import shard_spec
from pagedkv.models import attention as attn
from pagedkv.models.deps import require_transformers
from pagedkv.models.errors import ModelSupportError
from pagedkv.models.mla import is_mla_attention, pass_latent_through, split_kv_b_proj
from pagedkv.models.regional import compile_layers, decoder_layers, shares_layer_graphs
from pagedkv.models.specs import attention_layer, attention_modules
from pagedkv.models.tensor_parallel import shard_model
from pagedkv.serving import AttentionLayer, StepAttention, TensorParallel


class HFModel:
    """Wraps ``model`` (a transformers ``*ForCausalLM``) in place: its attention
    implementation becomes ``"pagedkv"`` (``reference_attention`` switches it back
    for HF's own runs), MLA modules pass their latent through, parameters stop
    requiring gradients.

    tp: this rank's tensor-parallel group; the model (full weights on every rank) is
    sharded in place (``pagedkv.models.tensor_parallel``) and its attention layers
    are this rank's heads.
    compile: a ``torch.compile`` backend (``"inductor"``), dynamic token counts, for
    the model's decoder layers (regional compilation, ``pagedkv.models.regional``):
    each layer of the ``nn.ModuleList`` that holds the attention modules is compiled,
    embedding, final norm and head stay eager. Identical layers share one compiled
    graph, so the first step's compile time does not grow with depth. The compiler
    fuses what surrounds attention (norms, rotary embeddings, activations, residuals);
    each layer's paged attention is one opaque op (``pagedkv::hf_attention``) that runs
    the step's impl. A model without such a list has its whole forward compiled. A
    CUDA-graph decode step then replays the fused kernels. None: eager.
    ``compiled_layers``: the compiled list, None when eager or compiled whole.
    """

    def __init__(
        self, model: Any, *, tp: TensorParallel | None = None, compile: str | None = None
    ) -> None:
        require_transformers()
        if not hasattr(model, "config") or not hasattr(model, "named_modules"):
            raise ModelSupportError(f"expected a transformers model, got {type(model).__name__}")
        if not type(model)._can_set_attn_implementation():
            raise ModelSupportError(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface, so pagedkv cannot take it over"
            )
        attn.register()
        self.model = model.eval().requires_grad_(False)
        self.config = model.config.get_text_config()
        self.vocab_size: int = self.config.vocab_size
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.modules = attention_modules(model)
        self.mla_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for module in self.modules:
            attn.index_layer(module)
            if is_mla_attention(module):
                pass_latent_through(module, attn.ATTENTION_NAME)
                self.mla_weights[module.layer_idx] = split_kv_b_proj(
                    module.kv_b_proj.weight,
                    self.config.num_attention_heads,
                    module.qk_nope_head_dim,
                    module.v_head_dim,
                )
        self.tp = tp
        if tp is not None:
            shard_model(model, tp)
        model.set_attn_implementation(attn.ATTENTION_NAME)
        self.compile = compile
        self.compiled_layers: torch.nn.ModuleList | None = (
            decoder_layers(model, self.modules)
            if compile is not None and shares_layer_graphs()
            else None
        )
        self._compiled = None
        if self.compiled_layers is not None:
            compile_layers(self.compiled_layers, compile)
        elif compile is not None:  # no list of layers: the whole forward
            self._compiled = torch.compile(self._run, dynamic=True, backend=compile)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def attention_layers(self, block_size: int) -> list[AttentionLayer]:
        layers = [
            attention_layer(m, self.model.config, self.dtype, block_size) for m in self.modules
        ]
        if self.tp is None:
            return layers
        sharded = []
        for layer in layers:
            shard = shard_spec(layer.spec, self.tp.size, self.tp.rank)
            sinks = None if layer.sinks is None else shard.query_slice(layer.sinks, dim=0)
            sharded.append(AttentionLayer(shard.spec, sinks))
        return sharded

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attention: StepAttention,
    ) -> torch.Tensor:
        if self.model.config._attn_implementation != attn.ATTENTION_NAME:
            raise ModelSupportError(
                f"the model's attention implementation is "
                f"{self.model.config._attn_implementation!r}, not {attn.ATTENTION_NAME!r} "
                "(restore it, e.g. leave reference_attention's block)"
            )
        step = attn.HFStep(attention, self.mla_weights)
        if self.compile is None:
            return self._run(input_ids, positions, logits_indices, step)
        with attn.step_context(step):
            if self._compiled is None:  # the layers are compiled
                return self._run(input_ids, positions, logits_indices, attn.STEP_IN_CONTEXT)
            # token and row counts unbacked: no specialization of the counts 0 and 1, so
            # one compiled graph serves prefills, decode batches of any size and a lone
            # decode
            for t in (input_ids, positions, logits_indices):
                torch._dynamo.decorators.mark_unbacked(t, 0)
            return self._compiled(input_ids, positions, logits_indices, attn.STEP_IN_CONTEXT)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        step: attn.HFStep | Any,
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=logits_indices,
            pagedkv_step=step,
        )
        return out.logits[0]


@contextmanager
def reference_attention(model: HFModel, implementation: str = "eager") -> Iterator[Any]:
    """Run HF's own attention (``implementation``) on the wrapped model inside the
    block, e.g. ``generate`` as a reference; pagedkv's comes back after it."""
    model.model.set_attn_implementation(implementation)
    try:
        yield model.model
    finally:
        model.model.set_attn_implementation(attn.ATTENTION_NAME)
