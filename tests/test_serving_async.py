"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach
the host (placeholders, fed on the device). Everything a synchronous engine produces
must come out the same: tokens, logits, finish reasons, prefix hits, freed blocks,
through preemption, forks, chunked prefill, stop tokens and aborts."""

from __future__ import annotations

import pytest
import torch
from pagedkv.kv import PLACEHOLDER_TOKEN_ID, BlockHasher, KVCacheUsageError, Request
from pagedkv.serving import Engine, FinishReason, SamplingParams
from serving_model import TinyDecoder, one_thread  # noqa: F401
from test_serving_engine import (
    ATOL,
    _assert_same_outputs,
    _check_against_dense,
    _prompts,
    _run_with_failing_forwards,
    _run_workload,
    _tight_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(outputs) -> list[list[list[int]]]:
    return [[s.token_ids for s in out.samples] for out in outputs]


def test_async_equals_sync_through_preemption_forks_and_chunks():
    sync_engine, expected, _ = _run_workload(_tight_config())
    engine, outputs, prompts = _run_workload(_tight_config(async_scheduling=True))
    assert _tokens(outputs) == _tokens(expected)
    s = engine.stats.scheduler
    assert s.num_preemptions > 0 and s.num_partial_prefills > 0 and s.num_forks == 1
    assert engine.stats.prefix_hit_rate == sync_engine.stats.prefix_hit_rate
    for got, want in zip(outputs, expected, strict=True):
        for a, b in zip(got.samples, want.samples, strict=True):
            assert a.finish_reason is b.finish_reason
            for x, y in zip(a.logits, b.logits, strict=True):
                torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.samples:
            _check_against_dense(engine.model, prompt, sample)
    assert engine.stats.blocks_in_use == 0 and not engine.has_unfinished()


def test_steps_run_on_tokens_fed_on_the_device():
    """Decode steps after the first are launched before the host knows their input
    tokens: the plan holds placeholders, the runner takes the values from the feed."""
    engine = Engine(TinyDecoder(), _tight_config(async_scheduling=True, num_blocks=64))
    execute = engine.runner.execute
    fed_steps = []

    def recording(plan, feed=None):
        if any(PLACEHOLDER_TOKEN_ID in s.token_ids for s in plan.seqs):
            assert feed is not None
            fed_steps.append(len(feed.rows))
        return execute(plan, feed)

    engine.runner.execute = recording
    out = engine.generate(_prompts()[:2], SamplingParams(max_tokens=6))
    assert len(fed_steps) >= 4 and max(fed_steps) == 2
    sync = Engine(TinyDecoder(), _tight_config(num_blocks=64)).generate(
        _prompts()[:2], SamplingParams(max_tokens=6)
    )
    assert _tokens(out) == _tokens(sync)


def test_a_stop_token_drops_the_step_already_launched():
    model = TinyDecoder()
    prompt = _prompts()[0]
    tokens = Engine(model, _tight_config()).generate([prompt], SamplingParams(max_tokens=8))
    tokens = tokens[0].samples[0].token_ids
    stop = SamplingParams(max_tokens=8, stop_token_ids=(tokens[2],), return_logits=True)
    engine = Engine(model, _tight_config(async_scheduling=True))
    out = engine.generate([prompt], stop)[0].samples[0]
    first = tokens.index(tokens[2])
    assert out.token_ids == tokens[: first + 1] and out.finish_reason is FinishReason.STOP
    assert len(out.logits) == first + 1  # the dropped step's row is not reported
    assert engine.stats.scheduler.num_generated_tokens == first + 1
    assert engine.stats.blocks_in_use == 0


def test_abort_while_a_step_is_in_flight():
    prompts = _prompts()
    alone = Engine(TinyDecoder(), _tight_config()).generate([prompts[0]])[0]
    engine = Engine(TinyDecoder(), _tight_config(async_scheduling=True))
    engine.add_request("keep", prompts[0], SamplingParams())
    engine.add_request("drop", prompts[1], SamplingParams())
    engine.add_request("forked", prompts[2], SamplingParams(n=3, max_tokens=6, temperature=1))
    outputs = []
    for _ in range(3):
        outputs += engine.step()
    out = engine.abort("drop")  # its last step's token is resolved first
    assert out.samples[0].finish_reason is FinishReason.ABORTED
    assert PLACEHOLDER_TOKEN_ID not in out.samples[0].token_ids
    while len(engine.scheduler.groups["forked"]) < 3:
        outputs += engine.step()
    assert len(engine.abort("forked").samples) == 3
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["keep"]
    assert outputs[0].samples[0].token_ids == alone.samples[0].token_ids
    assert engine.stats.blocks_in_use == 0


def test_a_request_finished_in_the_drain_is_what_abort_returns():
    engine = Engine(TinyDecoder(), _tight_config(async_scheduling=True))
    engine.add_request("a", _prompts()[2], SamplingParams(max_tokens=1))  # one chunk
    assert engine.step() == []  # its one token is in flight
    out = engine.abort("a")
    assert out.samples[0].finish_reason is FinishReason.LENGTH
    assert len(out.samples[0].token_ids) == 1 and not engine.has_unfinished()


def test_placeholders_are_never_hashed_and_block_appends():
    hasher = BlockHasher(4)
    request = Request("r", [1, 2, 3])
    request.append_placeholder()
    assert request.num_tokens == 4 and request.num_known_tokens == 3
    assert hasher.update(request) == []  # the only full block holds the placeholder
    with pytest.raises(KVCacheUsageError, match="placeholder"):
        request.append_output_token_ids(7)
    request.resolve_placeholder(9)
    assert list(request.all_token_ids) == [1, 2, 3, 9]
    assert hasher.update(request) == hasher.update(Request("s", [1, 2, 3, 9]))
    with pytest.raises(KVCacheUsageError, match="no placeholder"):
        request.resolve_placeholder(1)


def test_rows_of_sequences_that_finished_in_the_last_step_are_released():
    """The last step's finished sequences leave with the next plan, also when the
    engine's final call (the drain) scheduled nothing: a full batch runs after it."""
    engine = Engine(TinyDecoder(), _tight_config(async_scheduling=True, max_num_seqs=2))
    prompts = _prompts()
    first = engine.generate(prompts[:2], SamplingParams(max_tokens=3))
    second = engine.generate(prompts[:2], SamplingParams(max_tokens=3))
    assert _tokens(first) == _tokens(second)
    assert engine.stats.blocks_in_use == 0


def test_a_failed_step_runs_again_on_the_tokens_of_the_step_before():
    """A forward that dies with a step in flight: that step's tokens are resolved,
    and the failed step runs again (on known token ids) with the same outcome."""
    _, expected, _ = _run_workload(_tight_config())
    config = _tight_config(async_scheduling=True)
    _, outputs, failures = _run_with_failing_forwards(config, {2, 6, 9})
    assert failures == 3
    _assert_same_outputs(outputs, expected)


def test_outputs_waiting_to_be_returned_survive_a_failed_step():
    model = TinyDecoder()
    forward = model.forward
    engine = Engine(model, _tight_config(async_scheduling=True, num_blocks=64))
    prompts = _prompts()
    engine.add_request("a", prompts[2], SamplingParams(max_tokens=1))
    engine.add_request("b", prompts[0][:8], SamplingParams(max_tokens=4))
    engine.add_request("c", prompts[1][:8], SamplingParams(max_tokens=4))
    assert engine.step() == []  # a's only token is in flight
    engine.abort("b")  # resolves it: a has finished, to be returned by the next step

    def dies(*args):
        raise RuntimeError("the device went away")

    model.forward = dies
    with pytest.raises(RuntimeError):
        engine.step()
    model.forward = forward
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "c"]
