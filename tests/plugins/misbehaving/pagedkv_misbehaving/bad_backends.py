"""Backend classes with one mistake each in their declaration, and one without."""

import pagedkv
import torch
from pagedkv import AttentionBackend, Capabilities
from pagedkv.backends.torch import TorchBackend

from pagedkv_misbehaving._torch_like import torch_like


class MisspeltCapabilities(AttentionBackend):
    """Every method implemented, but ``capabilities`` is misspelt."""

    name = "misspelt_capabilities"
    layout = TorchBackend.layout
    capabilites = Capabilities(dtypes=frozenset({torch.float16}))
    get_kv_cache_shape = TorchBackend.get_kv_cache_shape
    kv_cache_to_logical = TorchBackend.kv_cache_to_logical
    get_builder_cls = TorchBackend.get_builder_cls
    get_impl_cls = TorchBackend.get_impl_cls


class Unfinished(AttentionBackend):
    """Declares itself but implements none of the abstract methods."""

    name = "unfinished"
    layout = "(num_blocks, block_size, num_kv_heads, head_size)"
    capabilities = Capabilities(dtypes=frozenset({torch.float16}))


@pagedkv.hookimpl
def pagedkv_backends():
    return [
        torch_like("auto"),  # would hijack "auto"
        torch_like("split"),  # reserved for split(decode=..., prefill=...)
        torch_like("../x"),  # cannot be written in a config string
        torch_like("my backend"),
        torch_like(42),
        torch_like("word_priority", priority="high"),
        torch_like("bad_option_name", option_specs={"num splits": None}),
        MisspeltCapabilities,
        Unfinished,
        torch_like("well_behaved"),
    ]
