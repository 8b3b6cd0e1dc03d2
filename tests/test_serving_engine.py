"""The engine end to end on a pure-torch decoder: every step's logits equal a dense,
cache-free recomputation, through prefix hits, chunked prefill, preemption, fork +
copy-on-write, shuffled blocks and aborts."""

from __future__ import annotations

import pytest
import torch
from pagedkv.serving import (
    Engine,
    EngineConfig,
    EngineConfigError,
    FinishReason,
    RequestError,
    SamplingParams,
)
from pagedkv.serving.kv_cache import ModelKVCache
from serving_model import TinyDecoder, one_thread  # noqa: F401

ATOL = 1e-4  # float32, paged vs dense attention: summation order only (~1e-6 seen)

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 64, (32,), generator=g).tolist()
    return [
        prefix + torch.randint(0, 64, (5,), generator=g).tolist(),
        prefix + torch.randint(0, 64, (9,), generator=g).tolist(),
        torch.randint(0, 64, (20,), generator=g).tolist(),
        torch.randint(0, 64, (45,), generator=g).tolist(),
    ]


def _tight_config(**changes: object) -> EngineConfig:
    base = dict(
        backend="torch",
        block_size=16,
        num_blocks=11,  # too few for every sequence at once: forces preemption
        max_model_len=96,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # the 45-token prompt is chunked
        block_order_seed=5,
    )
    base.update(changes)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _check_against_dense(model: TinyDecoder, prompt: list[int], sample) -> float:
    tokens = prompt + sample.token_ids[:-1]
    dense = model.dense_logits(tokens)
    worst = 0.0
    for step, logits in enumerate(sample.logits):
        err = float((logits - dense[len(prompt) - 1 + step]).abs().max())
        assert err < ATOL, f"step {step}: logits differ by {err}"
        worst = max(worst, err)
    return worst


def _run_workload(config: EngineConfig) -> tuple[Engine, list, list[list[int]]]:
    model = TinyDecoder()
    engine = Engine(model, config)
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=8, return_logits=True)
    twins = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3, return_logits=True)
    outputs = engine.generate(prompts, [greedy, greedy, twins, greedy])
    return engine, outputs, prompts


def test_every_step_matches_a_dense_recomputation():
    engine, outputs, prompts = _run_workload(_tight_config())
    stats = engine.stats
    s = stats.scheduler
    # the workload exercised what it is for
    assert s.num_preemptions > 0 and s.num_partial_prefills > 0
    assert s.num_forks == 1 and s.num_block_copies > 0
    assert stats.prefix_hit_rate > 0
    twins = outputs[2].samples
    assert twins[0].token_ids != twins[1].token_ids
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.samples:
            assert len(sample.token_ids) == 8 and sample.finish_reason is FinishReason.LENGTH
            _check_against_dense(engine.model, prompt, sample)
    assert stats.blocks_in_use == 0  # every block back


def test_skipping_copy_on_write_is_caught(monkeypatch):
    """The dense comparison sees a fork whose shared block is not copied."""
    monkeypatch.setattr(ModelKVCache, "copy_blocks", lambda self, copies: None)
    engine, outputs, prompts = _run_workload(_tight_config())
    assert engine.stats.scheduler.num_block_copies > 0
    with pytest.raises(AssertionError, match="logits differ"):
        for sample in outputs[2].samples:
            _check_against_dense(engine.model, prompts[2], sample)


def test_greedy_is_independent_of_batching_and_block_order():
    a = _run_workload(_tight_config())[1]
    b = _run_workload(
        _tight_config(num_blocks=200, max_num_batched_tokens=512, block_order_seed=None)
    )[1]
    for x, y in zip(a, b, strict=True):
        assert [s.token_ids for s in x.samples] == [s.token_ids for s in y.samples]


def test_abort_at_every_point_frees_everything():
    model = TinyDecoder()
    engine = Engine(model, _tight_config())
    prompts = _prompts()
    params = SamplingParams(max_tokens=6)
    engine.add_request("waiting", prompts[0], params)
    engine.add_request("chunked", prompts[3], params)
    engine.add_request("forked", prompts[2], SamplingParams(n=3, max_tokens=6, temperature=1))
    engine.step()  # "waiting" and part of "chunked" run; "forked" waits
    assert engine.scheduler.groups["chunked"][0].request.num_computed_tokens < len(prompts[3])
    out = engine.abort("chunked")  # mid chunked prefill
    assert [s.finish_reason for s in out.samples] == [FinishReason.ABORTED]
    while len(engine.scheduler.groups["forked"]) < 3:
        engine.step()
    out = engine.abort("forked")  # right after the fork, children sharing blocks
    assert len(out.samples) == 3
    engine.add_request("late", prompts[1], params)
    out = engine.abort("late")  # still queued
    assert out.samples[0].token_ids == [] and out.samples[0].finish_reason is FinishReason.ABORTED
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.blocks_in_use == 0
    with pytest.raises(RequestError, match="unknown request 'late'"):
        engine.abort("late")


def _run_with_failing_forwards(config: EngineConfig, failing_calls: set[int]) -> tuple:
    """The workload of _run_workload, with the model's forward writing junk K/V into the
    step's slots and raising on the ``failing_calls``-th calls; the caller steps again
    after each failure. Returns (engine, outputs by request id, failures)."""
    model = TinyDecoder()
    forward = model.forward
    calls = 0

    def dies_on_some_steps(input_ids, positions, logits_indices, attention):
        nonlocal calls
        calls += 1
        if calls in failing_calls:
            forward(input_ids.flip(0), positions, logits_indices, attention)  # wrong K/V
            raise RuntimeError("the device went away")
        return forward(input_ids, positions, logits_indices, attention)

    model.forward = dies_on_some_steps
    engine = Engine(model, config)
    greedy = SamplingParams(max_tokens=8, return_logits=True)
    twins = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3, return_logits=True)
    for i, (prompt, params) in enumerate(zip(_prompts(), [greedy, greedy, twins, greedy])):
        engine.add_request(f"prompt{i}", prompt, params)
    outputs, failures = {}, 0
    while engine.has_unfinished():
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except RuntimeError:
            failures += 1
    return engine, outputs, failures


def _assert_same_outputs(got: dict, expected: list) -> None:
    for i, want in enumerate(expected):
        out = got[f"prompt{i}"]
        assert [s.token_ids for s in out.samples] == [s.token_ids for s in want.samples]
        for a, b in zip(out.samples, want.samples, strict=True):
            for x, y in zip(a.logits, b.logits, strict=True):
                torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def test_a_step_whose_forward_raised_can_be_run_again():
    """A forward that dies after writing junk K/V into the step's slots: none of its
    blocks became prefix hits (mark_computed never ran), and stepping again recomputes
    the same tokens over the junk, so every output equals an undisturbed run."""
    _, expected, _ = _run_workload(_tight_config())
    # a prefill, a step with hits and chunks, a decode step
    engine, outputs, failures = _run_with_failing_forwards(_tight_config(), {1, 3, 6})
    assert failures == 3 and engine.stats.prefix_hit_rate > 0
    _assert_same_outputs(outputs, expected)


def test_abort_after_a_failed_forward_leaves_no_junk_in_the_prefix_cache():
    model = TinyDecoder()
    forward = model.forward

    def writes_junk_then_dies(input_ids, positions, logits_indices, attention):
        forward(input_ids.flip(0), positions, logits_indices, attention)
        raise RuntimeError("the device went away")

    model.forward = writes_junk_then_dies
    engine = Engine(model, _tight_config())
    prompt = _prompts()[0]  # two full blocks of shared prefix, then 5 tokens
    engine.add_request("a", prompt)
    with pytest.raises(RuntimeError):
        engine.step()
    engine.abort("a")
    model.forward = forward
    late = [*prompt[:32], 1, 2, 3]
    engine.add_request("b", late, SamplingParams(max_tokens=4, return_logits=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (out,) = outputs
    assert engine.manager.prefix_cache_stats.num_hit_tokens == 0  # the junk is no hit
    _check_against_dense(model, late, out.samples[0])


def test_abort_leaves_the_others_unchanged():
    alone = Engine(TinyDecoder(), _tight_config()).generate([_prompts()[0]])[0]
    engine = Engine(TinyDecoder(), _tight_config())
    engine.add_request("keep", _prompts()[0], SamplingParams())
    engine.add_request("drop", _prompts()[1], SamplingParams())
    engine.step()
    engine.abort("drop")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[0].samples[0].token_ids == alone.samples[0].token_ids


def test_stop_tokens_and_max_model_len():
    model = TinyDecoder()
    prompt = _prompts()[0]
    free_run = Engine(model, _tight_config()).generate([prompt], SamplingParams(max_tokens=8))
    tokens = free_run[0].samples[0].token_ids
    stop = SamplingParams(max_tokens=8, stop_token_ids=(tokens[2],))
    out = Engine(model, _tight_config()).generate([prompt], stop)[0].samples[0]
    first = tokens.index(tokens[2])
    assert out.token_ids == tokens[: first + 1] and out.finish_reason is FinishReason.STOP
    short = Engine(model, _tight_config(max_model_len=len(prompt) + 3))
    out = short.generate([prompt], SamplingParams(max_tokens=8))[0].samples[0]
    assert len(out.token_ids) == 3 and out.finish_reason is FinishReason.MAX_MODEL_LEN


def test_request_errors_name_the_problem():
    engine = Engine(TinyDecoder(), _tight_config())
    with pytest.raises(RequestError, match=r"token ids must be ints in \[0, 64\)"):
        engine.add_request("a", [1, 64])
    with pytest.raises(RequestError, match="leaves no room"):
        engine.add_request("a", [1] * 96)
    engine.add_request("a", [1, 2])
    with pytest.raises(RequestError, match="already exists"):
        engine.add_request("a", [3])
    with pytest.raises(RequestError, match="the pool has 2; it could never run"):
        Engine(TinyDecoder(), _tight_config(num_blocks=3)).add_request("b", [1] * 40)
    # arguments in the wrong places: named, not a TypeError from iterating them
    with pytest.raises(RequestError, match="request_id: expected a str, got list"):
        engine.add_request([1, 2], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="prompt_token_ids must be a sequence .* got str"):
        engine.add_request("c", "hello")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="params must be SamplingParams, got dict"):
        engine.add_request("c", [1], {"max_tokens": 2})  # type: ignore[arg-type]


def test_a_sequence_that_outgrows_the_pool_is_reported():
    """One sequence needs more blocks than exist: preempting everything cannot help."""
    engine = Engine(TinyDecoder(), _tight_config(num_blocks=3))  # 2 usable: 32 tokens
    engine.add_request("long", [1] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="cannot be scheduled: it needs 3 blocks"):
        while engine.has_unfinished():
            engine.step()


def test_config_errors():
    with pytest.raises(EngineConfigError, match="block_size must be an int >= 1"):
        EngineConfig(block_size=0)
    with pytest.raises(EngineConfigError, match="needs enable_chunked_prefill=True"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=64)
    with pytest.raises(EngineConfigError, match="cuda_graph=True, but device cpu is not CUDA"):
        Engine(TinyDecoder(), _tight_config(cuda_graph=True))
    assert EngineConfig(max_num_seqs=12).graph_batch_sizes == (1, 2, 4, 8, 12)
