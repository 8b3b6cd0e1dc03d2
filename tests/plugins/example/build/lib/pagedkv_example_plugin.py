"""A third-party plugin as a vendor would write it: two backends from one hook."""

import pagedkv
from pagedkv.backends.torch import TorchBackend


class ExampleBackend(TorchBackend):
    name = "example"
    priority = 1


class ExampleBackendTwo(TorchBackend):
    name = "example_two"
    priority = 1


@pagedkv.hookimpl
def pagedkv_backends():
    return [ExampleBackend, ExampleBackendTwo]
