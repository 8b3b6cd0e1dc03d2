"""Hugging Face models on any pagedkv backend (docs/serving.md).

- ``HFModel(model)``: a transformers causal LM as a ``pagedkv.serving.PagedModel``,
  its attention routed through ``"pagedkv"`` in transformers' AttentionInterface.
- ``load_model(name_or_path)``: a built-in tiny config (random weights) or a local
  model directory; ``builtin_names()``.
- ``attention_layer`` / ``attention_modules``: per-layer AttentionSpec from the model.
- ``split_kv_b_proj``: W_UK / W_UV of an MLA layer from ``kv_b_proj.weight``.

transformers is an optional extra (``pip install 'pagedkv[models]'``); it is imported
when first needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_exports

if TYPE_CHECKING:
    from pagedkv.models.attention import ATTENTION_NAME, paged_attention_forward, register
    from pagedkv.models.errors import ModelSupportError
    from pagedkv.models.hf import HFModel, reference_attention
    from pagedkv.models.loader import builtin_config, builtin_names, load_model, random_model
    from pagedkv.models.mla import split_kv_b_proj
    from pagedkv.models.specs import attention_layer, attention_modules
    from pagedkv.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

_EXPORTS = {
    "ATTENTION_NAME": "pagedkv.models.attention",
    "ByteTokenizer": "pagedkv.models.tokenizer",
    "HFModel": "pagedkv.models.hf",
    "ModelSupportError": "pagedkv.models.errors",
    "Tokenizer": "pagedkv.models.tokenizer",
    "attention_layer": "pagedkv.models.specs",
    "attention_modules": "pagedkv.models.specs",
    "builtin_config": "pagedkv.models.loader",
    "builtin_names": "pagedkv.models.loader",
    "load_model": "pagedkv.models.loader",
    "load_tokenizer": "pagedkv.models.tokenizer",
    "paged_attention_forward": "pagedkv.models.attention",
    "random_model": "pagedkv.models.loader",
    "reference_attention": "pagedkv.models.hf",
    "register": "pagedkv.models.attention",
    "split_kv_b_proj": "pagedkv.models.mla",
}


__getattr__, __dir__ = lazy_exports("pagedkv.models", _EXPORTS, globals())


__all__ = [
    "ATTENTION_NAME",
    "ByteTokenizer",
    "HFModel",
    "ModelSupportError",
    "Tokenizer",
    "attention_layer",
    "attention_modules",
    "builtin_config",
    "builtin_names",
    "load_model",
    "load_tokenizer",
    "paged_attention_forward",
    "random_model",
    "reference_attention",
    "register",
    "split_kv_b_proj",
]
