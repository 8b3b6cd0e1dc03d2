"""Gives a working backend, but its scenario hook is misspelt and never runs."""

import pagedkv

from pagedkv_misbehaving._torch_like import torch_like


@pagedkv.hookimpl
def pagedkv_backends():
    return [torch_like("partly_misspelt")]


@pagedkv.hookimpl
def pagedkv_conformance_scenario(backend, level):
    return []
