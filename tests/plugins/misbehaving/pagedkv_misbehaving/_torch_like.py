"""The torch backend under other names (shared by the modules of this distribution)."""

from pagedkv.backends.torch import TorchBackend


def torch_like(name: str, **attributes: object) -> type[TorchBackend]:
    return type(f"Backend_{name}", (TorchBackend,), {"name": name, **attributes})
