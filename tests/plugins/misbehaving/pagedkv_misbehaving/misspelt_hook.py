"""The hook's name is misspelt (singular): pluggy registers it as an unknown hook."""

import pagedkv

from pagedkv_misbehaving._torch_like import torch_like


@pagedkv.hookimpl
def pagedkv_backend():
    return [torch_like("misspelt")]
