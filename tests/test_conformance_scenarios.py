"""The window and feature-combination scenarios: decodes far past the window at both
levels, and every pair of declared score modifiers combined (not every subset)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from pagedkv import Capabilities, Feature, MultipleOf
from pagedkv.backends.torch import TorchBackend
from pagedkv.conformance import run_scenario
from pagedkv.conformance.design import design_scenarios

BROKEN_BACKENDS = Path(__file__).parent / "plugins" / "broken_backends"
MODIFIERS = ("sliding_window", "logits_soft_cap", "alibi", "sinks")


@pytest.fixture(scope="module")
def broken():
    """The deliberately broken backends by name (their module imported, not registered)."""
    sys.path.insert(0, str(BROKEN_BACKENDS))
    try:
        import pagedkv_broken_backends

        yield {cls.name: cls for cls in pagedkv_broken_backends.BACKENDS}
    finally:
        sys.path.remove(str(BROKEN_BACKENDS))
        sys.modules.pop("pagedkv_broken_backends", None)


@pytest.mark.parametrize("level", ["quick", "full"])
def test_window_decodes_reach_far_past_the_window(level):
    plan = design_scenarios(TorchBackend(), level, "cpu")
    far = [
        sc
        for sc in plan.scenarios
        if sc.sliding_window
        and sc.sliding_window >= sc.block_size  # runs where small windows are refused
        and set(sc.query_lens) == {1}
        and min(sc.seq_lens) >= sc.sliding_window + sc.block_size
    ]
    assert [sc.name for sc in far] == ["sliding-window-decode"]
    assert any(s % far[0].block_size == 0 for s in far[0].seq_lens)  # a full last block too


@pytest.mark.parametrize("level", ["quick", "full"])
def test_a_decode_path_without_the_window_fails_at_both_levels(broken, level):
    """It refuses windows smaller than its block size, so the window scenario whose
    decodes sit inside one block is not applicable; the far decodes still catch it."""
    backend = broken["broken_decode_window"]()
    plan = design_scenarios(backend, level, "cpu")
    assert "window-smaller-than-block" in {sc.name for sc, _ in plan.not_applicable}
    failed = {
        sc.name
        for sc in plan.scenarios
        if "sliding_window" in sc.tags and not run_scenario(backend, sc, "cpu").passed
    }
    assert failed == {"sliding-window-decode"}


def _combinations(plan) -> list:
    return [
        sc
        for sc in [*plan.scenarios, *(s for s, _ in plan.not_applicable)]
        if len(sc.tags & set(MODIFIERS)) >= 2
    ]


def test_a_backend_taking_every_combination_runs_one():
    (combined,) = _combinations(design_scenarios(TorchBackend(), "quick", "cpu"))
    assert combined.name == "window-softcap-alibi-sinks"
    assert set(MODIFIERS) <= combined.tags


class _WindowAlibi(TorchBackend):
    name = "window_alibi"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16}),
        head_sizes=(64,),
        block_sizes=(MultipleOf(16),),
        features=frozenset({Feature.SLIDING_WINDOW, Feature.ALIBI}),
    )


def test_window_and_alibi_without_softcap_are_combined():
    plan = design_scenarios(_WindowAlibi(), "quick", "cpu")
    (combined,) = _combinations(plan)
    assert combined in plan.scenarios and combined.name == "window-alibi"
    assert combined.tags == {"sliding_window", "alibi"}
    assert combined.sliding_window and combined.alibi and not combined.logits_soft_cap
    assert run_scenario(_WindowAlibi(), combined, "cpu").passed


class _NoSoftcapWithAlibi(TorchBackend):
    """Declares all four modifiers but cannot combine the soft cap with ALiBi."""

    name = "no_softcap_with_alibi"

    def validate_extra(self, spec):
        if spec.logits_soft_cap is not None and spec.alibi_slopes is not None:
            return ["logits_soft_cap with alibi_slopes is not supported"]
        return []


def test_pairs_are_covered_around_a_combination_validate_refuses():
    plan = design_scenarios(_NoSoftcapWithAlibi(), "quick", "cpu")
    combined = [sc for sc in _combinations(plan) if sc in plan.scenarios]
    covered = {p for sc in combined for p in itertools.combinations(sorted(sc.tags), 2)}
    refused = ("alibi", "logits_soft_cap")
    assert covered == set(itertools.combinations(sorted(MODIFIERS), 2)) - {refused}
    assert len(combined) <= 3  # a covering of the pairs, not every subset
    reasons = {sc.name: r for sc, r in plan.not_applicable}
    assert reasons == {"softcap-alibi": ["logits_soft_cap with alibi_slopes is not supported"]}
