"""Step inputs: token ids in batch order, positions, logits rows, padding."""

from __future__ import annotations

import torch
from pagedkv.kv import Request
from pagedkv.serving import SamplingParams, ScheduledSeq, build_step_inputs
from pagedkv.serving.sequence import Sequence


def _seq(tokens: list[int], computed: int) -> Sequence:
    request = Request("r" + str(tokens[0]), tokens, num_computed_tokens=computed)
    return Sequence(request, "g", 0, SamplingParams(), None)


def test_ids_positions_and_sampled_rows():
    decode = _seq([10, 11, 12, 13], 3)
    chunk = _seq(list(range(100, 120)), 4)  # a middle chunk: does not sample
    prefill = _seq([50, 51, 52], 0)
    scheduled = [
        ScheduledSeq(decode, 3, 1, (), True),
        ScheduledSeq(chunk, 4, 6, (), False),
        ScheduledSeq(prefill, 0, 3, (), True),
    ]
    inputs = build_step_inputs(scheduled, torch.device("cpu"), num_tokens=12)
    assert inputs.input_ids.tolist() == [13, *range(104, 110), 50, 51, 52, 0, 0]
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 0, 0]
    assert inputs.logits_indices.tolist() == [0, 9]
    assert inputs.num_actual_tokens == 10
