"""A copy of the plugin template that kept the template's backend name."""

import pagedkv
from pagedkv.backends.torch import TorchBackend


class MyBackend(TorchBackend):
    name = "my_backend"


@pagedkv.hookimpl
def pagedkv_backends():
    return [MyBackend]
