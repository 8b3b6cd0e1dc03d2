"""Sampling: greedy, temperature, top-k, top-p; per-row seeds; parameter checks."""

from __future__ import annotations

import pytest
import torch
from pagedkv.serving import RequestError, SamplingParams, sample
from pagedkv.serving.sequence import make_generator


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    rows = logits.expand(n, -1)
    generators = [make_generator(seed + i, "cpu") for i in range(n)]
    return sample(rows, [params] * n, generators)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    tokens = sample(logits, [SamplingParams()] * 5, [None] * 5)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_draws_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.7)
    counts = torch.bincount(_draws(logits, params, 20000), minlength=4).float() / 20000
    expected = (logits[0] / 0.7).softmax(-1)
    # 20000 draws: standard error <= 0.0036 per entry
    assert torch.allclose(counts, expected, atol=0.015), (counts, expected)


def test_top_k_and_top_p_drop_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = _draws(logits, SamplingParams(temperature=1.0, top_k=2), 4000)
    assert set(top_k.tolist()) == {0, 1}
    # mass before token 2 is 0.8: top_p 0.8 keeps tokens 0 and 1, top_p 0.81 also token 2
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.8), 4000).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.81), 4000).tolist()) == {
        0,
        1,
        2,
    }
    assert set(_draws(logits, SamplingParams(temperature=5.0, top_k=1), 200).tolist()) == {0}


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    logits = torch.randn(6, 100)
    params = SamplingParams(temperature=1.0, seed=11)
    alone = [sample(logits[i : i + 1], [params], [make_generator(11, "cpu")]) for i in range(6)]
    batch_params = [params if i % 2 else SamplingParams(temperature=0.5) for i in range(6)]
    generators = [make_generator(11, "cpu") if i % 2 else None for i in range(6)]
    batched = sample(logits, batch_params, generators)
    assert all(batched[i] == alone[i][0] for i in range(1, 6, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an int >= 1"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"seed": -3}, "seed must be an int >= 0"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids must be ints >= 0"),
    ],
)
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)
