"""Hints computed from a failure name the bug they were built for, and only that one:
each kernel below ignores one score modifier (the end-to-end bugs live in
tests/plugins/broken_backends and test_conformance_selftest.py)."""

from __future__ import annotations

import pytest
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.impl import TorchAttentionImpl
from pagedkv.conformance import run_scenario
from pagedkv.conformance.design import design_scenarios

PLAN = {sc.name: sc for sc in design_scenarios(TorchBackend(), "quick", "cpu").scenarios}


def _ignoring(**changes):
    """A torch impl that runs its layer with ``changes`` applied (a modifier dropped)."""

    class Impl(TorchAttentionImpl):
        def __init__(self, spec, **kwargs):
            super().__init__(spec, **kwargs)
            self.spec = spec.replace(**changes)

    return Impl


class _SinksIgnored(TorchAttentionImpl):
    def __init__(self, spec, **kwargs):
        super().__init__(spec, **kwargs)
        self.sinks = None


CASES = {
    "logits-soft-cap": (_ignoring(logits_soft_cap=None), "without the logits soft cap"),
    "alibi": (_ignoring(alibi_slopes=None), "without the ALiBi bias"),
    "sinks": (_SinksIgnored, "without the sink logits"),
    "non-causal": (_ignoring(causal=True), "the kernel's causal flag is inverted"),
    "custom-scale": (_ignoring(scale=64**-0.5), "the kernel derives its own scale"),
}


@pytest.mark.parametrize("scenario", CASES)
def test_the_hint_names_the_ignored_modifier(scenario):
    impl, claim = CASES[scenario]
    backend = type("B", (TorchBackend,), {"name": "b", "get_impl_cls": lambda self: impl})()
    result = run_scenario(backend, PLAN[scenario], "cpu")
    assert not result.passed
    assert len(result.hints) == 1 and claim in result.hints[0], result.hints
