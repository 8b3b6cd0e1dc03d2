"""A copy of the plugin template that kept the template's backend name."""

import pagedkv

from pagedkv_misbehaving._torch_like import torch_like


@pagedkv.hookimpl
def pagedkv_backends():
    return [torch_like("my_backend")]
