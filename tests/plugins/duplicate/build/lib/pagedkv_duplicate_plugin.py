"""Claims the name "torch", which pagedkv itself provides."""

import pagedkv
from pagedkv.backends.torch import TorchBackend


class ImpostorBackend(TorchBackend):
    name = "torch"


@pagedkv.hookimpl
def pagedkv_backends():
    return [ImpostorBackend]
