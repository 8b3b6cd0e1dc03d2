"""Step inputs: token ids in batch order, positions, logits rows, padding; the plan a
scheduler output becomes."""

from __future__ import annotations

import pickle

import torch
from pagedkv.kv import BlockCopy, KVCacheManager
from pagedkv.serving import (
    EngineConfig,
    PlannedSeq,
    SamplingParams,
    Scheduler,
    StepPlan,
    build_step_inputs,
)


def test_ids_positions_and_sampled_rows():
    scheduled = [
        PlannedSeq("decode", 3, (13,), (), True),
        PlannedSeq("chunk", 4, tuple(range(104, 110)), (), False),  # does not sample
        PlannedSeq("prefill", 0, (50, 51, 52), (), True),
    ]
    inputs = build_step_inputs(scheduled, torch.device("cpu"), num_tokens=12)
    assert inputs.input_ids.tolist() == [13, *range(104, 110), 50, 51, 52, 0, 0]
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 0, 0]
    assert inputs.logits_indices.tolist() == [0, 9]
    assert inputs.num_actual_tokens == 10


def test_a_scheduler_output_becomes_a_plan_of_plain_values():
    config = EngineConfig(block_size=4, num_blocks=16, max_model_len=32, max_num_batched_tokens=8)
    manager = KVCacheManager(config.resolved_num_blocks, config.block_size, config.max_model_len)
    s = Scheduler(config, manager, torch.device("cpu"))
    s.add_request("a", list(range(10, 22)), SamplingParams(max_tokens=2))
    plan = s.schedule().plan()
    (seq,) = plan.seqs
    assert seq.token_ids == tuple(range(10, 18)) and not seq.samples  # an 8-token chunk
    assert seq.new_block_ids == tuple(manager.get_block_ids(seq.seq_id))
    assert plan.num_tokens == 8 and not plan.is_pure_decode
    copy = StepPlan(plan.seqs, ("gone",), (BlockCopy("x", 0, 1, 2),))
    assert pickle.loads(pickle.dumps(copy)) == copy  # what tensor parallelism broadcasts
