"""Switching a running engine to another backend keeps every cached K/V: generation
continues token for token, and later requests still hit the cached prefixes."""

from __future__ import annotations

import pagedkv
import pytest
import torch
from pagedkv.errors import NoUsableBackendError
from pagedkv.serving import Engine, EngineConfig, SamplingParams
from serving_model import TinyDecoder, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4  # float32 logits, as in test_serving_engine.py


def _config(backend: str, async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(
        backend=backend,
        async_scheduling=async_scheduling,
        block_size=16,
        num_blocks=24,
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=32,  # the 40-token prompt is chunked
        block_order_seed=3,
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 64, (32,), generator=g).tolist()  # two full blocks
    return [
        prefix + torch.randint(0, 64, (3,), generator=g).tolist(),
        torch.randint(0, 64, (40,), generator=g).tolist(),
    ]


PARAMS = SamplingParams(max_tokens=6, return_logits=True)


def _finish(engine: Engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_switching_torch_to_pallas_mid_run_keeps_tokens_and_prefix_hits(async_scheduling):
    """Under async scheduling the switch first resolves the step in flight."""
    model = TinyDecoder()
    prompts = _prompts()
    reference = Engine(model, _config("torch"))
    expected = reference.generate(prompts, PARAMS)

    engine = Engine(model, _config("torch", async_scheduling))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prompt{i}", prompt, PARAMS)
    for _ in range(3):  # prompt 0 decoding, prompt 1 past its chunked prefill
        engine.step()
    running = engine.scheduler.running
    assert all(0 < s.num_output_tokens < PARAMS.max_tokens for s in running)
    old_caches = list(engine.runner.kv.caches)

    engine.switch_backend("pallas")

    kv = engine.runner.kv
    assert [g.backend.name for g in kv.groups] == ["pallas", "pallas"]
    pallas = pagedkv.get_backend("pallas")
    for old, new, layer in zip(old_caches, kv.caches, kv.layers, strict=True):
        assert new is not old  # another layout: converted, not shared
        assert new.shape == pallas.allocate_kv_cache(24, layer.spec, "cpu").shape
        k_old, _ = pagedkv.get_backend("torch").get_kv_layout().logical(old, layer.spec)
        k_new, _ = pallas.get_kv_layout().logical(new, layer.spec)
        held = [b for s in running for b in engine.manager.get_block_ids(s.seq_id)]
        assert torch.equal(k_new[held], k_old[held])
    outputs = _finish(engine)
    for i, want in enumerate(expected):
        got = outputs[f"prompt{i}"].samples[0]
        assert got.token_ids == want.samples[0].token_ids
        for a, b in zip(got.logits, want.samples[0].logits, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)

    # a later request hits the prefix cached before the switch, and reads it right
    late = [*prompts[0][:32], 5, 6, 7]
    hits_before = engine.manager.prefix_cache_stats.num_hit_tokens
    engine.add_request("late", late, SamplingParams(max_tokens=2, return_logits=True))
    out = _finish(engine)["late"].samples[0]
    assert engine.manager.prefix_cache_stats.num_hit_tokens - hits_before == 32
    dense = model.dense_logits(late + out.token_ids[:-1])
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, dense[len(late) - 1 + step], atol=ATOL, rtol=0)


@pytest.mark.parametrize("target", ["torch", "triton"])
def test_layouts_that_share_bytes_switch_without_a_copy(target):
    """torch's (2, N, B, H, D) cache is triton's (and flash_attn's) as it is."""
    backend = pagedkv.get_backend(target)
    if backend.kv_layout is None:
        pytest.skip(f"{target} declares no KVLayout yet (first contract): caches are copied")
    engine = Engine(TinyDecoder(head_size=32), _config("torch"))  # triton: head size >= 32
    engine.add_request("a", _prompts()[0], PARAMS)
    engine.step()
    caches, impls = list(engine.runner.kv.caches), list(engine.runner.kv.impls)
    engine.switch_backend(backend)
    kv = engine.runner.kv
    assert all(a is b for a, b in zip(caches, kv.caches, strict=True))
    assert all(g.backend is backend for g in kv.groups) and engine.config.backend is backend
    assert not any(a is b for a, b in zip(impls, kv.impls, strict=True))


def test_a_backend_that_cannot_run_the_layers_changes_nothing():
    engine = Engine(TinyDecoder(), _config("torch"))
    engine.add_request("a", _prompts()[0], PARAMS)
    engine.step()
    caches = list(engine.runner.kv.caches)
    with pytest.raises(NoUsableBackendError, match="mla runs MLA layers only"):
        engine.switch_backend("mla")
    assert all(a is b for a, b in zip(caches, engine.runner.kv.caches, strict=True))
    assert [g.backend.name for g in engine.runner.kv.groups] == ["torch", "torch"]
    assert engine.config.backend == "torch"
    _finish(engine)
