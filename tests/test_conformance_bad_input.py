"""The check ``bad-input`` (conformance/bad_input.py): a backend that skips the
contract's step or argument checks is caught, each breakage named."""

from __future__ import annotations

from typing import Any

from pagedkv import AttentionImpl
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.builder import TorchMetadataBuilder
from pagedkv.backends.torch.impl import TorchAttentionImpl
from pagedkv.conformance.bad_input import bad_input_problems
from pagedkv.conformance.design import design_scenarios


class _UncheckedBuilder(TorchMetadataBuilder):
    """Plans every step as given: ``build`` without the contract's ``check_step``."""

    def build(self, common, **overrides):
        return self.build_metadata(common, **overrides)


class _UncheckedImpl(TorchAttentionImpl):
    """Writes and attends without the contract's argument checks."""

    def forward(self, query, key, value, kv_cache, metadata, output=None):
        out = self.new_output(query, output)
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        self.attend(query, kv_cache, metadata, out)
        return out


class _OpenImpl(TorchAttentionImpl, AttentionImpl[Any]):
    """Leaves its metadata class open (M = Any), so nothing names what it was given."""


def _backend(name: str, builder=None, impl=None) -> TorchBackend:
    attributes = {"name": name}
    if builder is not None:
        attributes["get_builder_cls"] = lambda self: builder
    if impl is not None:
        attributes["get_impl_cls"] = lambda self: impl
    return type(name, (TorchBackend,), attributes)()


def _problems(backend) -> list[str]:
    base = design_scenarios(TorchBackend(), "quick", "cpu").base
    return bad_input_problems(backend, base, "cpu")


def test_the_contract_rejects_every_breakage_before_the_cache_changes():
    assert _problems(TorchBackend()) == []


def test_a_builder_that_skips_the_step_check_is_caught():
    problems = _problems(_backend("unchecked_build", builder=_UncheckedBuilder))
    caught = {p.split(":")[0] for p in problems}
    # lengths the torch kernel would read past, accepted or failing deep inside
    assert {"seq_len < query_len", "token rows", "seq_len past its row"} <= caught
    assert not caught & {"query heads", "query dtype", "output rows"}  # forward still checks
    assert any("not a PagedKVError" in p or "accepted" in p for p in problems)


def test_a_forward_that_skips_the_argument_checks_is_caught():
    problems = _problems(_backend("unchecked_forward", impl=_UncheckedImpl))
    caught = {p.split(":")[0] for p in problems}
    assert {"query heads", "output rows", "key rows", "cache shape"} <= caught
    assert any("the cache changed before the error" in p for p in problems)


def test_an_impl_that_does_not_name_its_metadata_is_caught():
    assert TorchAttentionImpl.metadata_class is not None and _OpenImpl.metadata_class is None
    problems = _problems(_backend("open_metadata", impl=_OpenImpl))
    assert [p.split(":")[0] for p in problems] == [
        "the step's CommonAttentionMetadata, not built"
    ] * 2
    assert "AttributeError" in problems[0] and "the cache changed" in problems[1]
