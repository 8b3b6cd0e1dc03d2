"""Backends that raise, or answer with the wrong types, when asked whether they can run.

Their priority is above every built-in backend's, so ``auto`` asks them first.
"""

import pagedkv
from pagedkv import ConfigError

from pagedkv_misbehaving._torch_like import torch_like

HIGH = 10_000


def _raise(message, error=RuntimeError):
    def method(self, *args, **kwargs):
        raise error(message)

    return method


@pagedkv.hookimpl
def pagedkv_backends():
    return [
        torch_like("raises_in_init", priority=HIGH, __init__=_raise("driver handle missing")),
        torch_like(
            "config_error_in_init", priority=HIGH, __init__=_raise("bad default", ConfigError)
        ),
        torch_like("raises_in_is_available", priority=HIGH, is_available=_raise("probe crashed")),
        torch_like("raises_in_validate", priority=HIGH, validate=_raise("validate crashed")),
        torch_like("junk_is_available", priority=HIGH, is_available=lambda self: "yes"),
        torch_like("junk_validate", priority=HIGH, validate=lambda self, spec, device=None: None),
    ]
