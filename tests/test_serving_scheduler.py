"""The scheduler on its own (no model): budget, order, chunking, admission with prefix
hits, preemption, fork + copy-on-write, abort, stop conditions."""

from __future__ import annotations

import pytest
import torch
from pagedkv.kv import KVCacheManager
from pagedkv.kv.invariants import check_manager
from pagedkv.serving import EngineConfig, RequestError, SamplingParams, Scheduler, SeqStatus
from pagedkv.serving.sequence import FinishReason


def _scheduler(**changes: object) -> Scheduler:
    values = dict(
        block_size=4, num_blocks=32, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16
    )
    values.update(changes)
    config = EngineConfig(**values)  # type: ignore[arg-type]
    manager = KVCacheManager(
        config.resolved_num_blocks,
        config.block_size,
        config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    return Scheduler(config, manager, torch.device("cpu"))


def _step(s: Scheduler, token: int = 7):
    """Schedule, then feed ``token`` to every sampled sequence (n tokens when it forks)."""
    out = s.schedule()
    samples = {x.seq.seq_id: [token] * len(s.sample_generators(x.seq)) for x in out.sampling}
    finished = s.update(out, samples)
    check_manager(s.manager)
    return out, finished


def test_budget_chunks_a_long_prompt_and_decodes_go_first():
    s = _scheduler()
    s.add_request("short", list(range(6)), SamplingParams(max_tokens=4))
    s.add_request("long", list(range(100, 130)), SamplingParams(max_tokens=4))
    out, _ = _step(s)
    assert [(x.seq.group_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("short", 6, True),
        ("long", 10, False),  # the rest of the budget
    ]
    out, _ = _step(s)
    # the decode comes first in the batch, then the next chunk of the long prompt
    assert [(x.seq.group_id, x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled] == [
        ("short", 6, 1),
        ("long", 10, 15),
    ]
    assert out.num_scheduled_tokens == 16
    out, _ = _step(s)
    assert [(x.seq.group_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("short", 1, True),
        ("long", 5, True),  # the last chunk samples
    ]
    assert s.stats.num_partial_prefills == 2


def test_block_ids_first_all_then_only_new():
    s = _scheduler()
    s.add_request("a", list(range(6)), SamplingParams(max_tokens=8))
    out, _ = _step(s)
    first = out.scheduled[0]
    assert first.block_ids == tuple(s.manager.get_block_ids(first.seq.seq_id))
    assert len(first.block_ids) == 2
    out, _ = _step(s)  # 7th token: still in block 2
    assert out.scheduled[0].block_ids == ()
    out, _ = _step(s)  # 8th
    out, _ = _step(s)  # 9th token opens block 3
    assert out.scheduled[0].block_ids == (s.manager.get_block_ids(first.seq.seq_id)[2],)


def test_admission_uses_prefix_hits():
    s = _scheduler()
    prefix = list(range(200, 212))  # three full blocks of 4
    s.add_request("a", [*prefix, 1, 2], SamplingParams(max_tokens=4))
    _step(s)
    s.add_request("b", [*prefix, 3], SamplingParams(max_tokens=4))
    out, _ = _step(s)
    b = next(x for x in out.scheduled if x.seq.group_id == "b")
    assert (b.num_computed_tokens, b.num_new_tokens) == (12, 1)
    a_blocks = s.manager.get_block_ids(s.groups["a"][0].seq_id)
    assert list(b.block_ids[:3]) == a_blocks[:3]


def test_a_prefix_computed_in_this_step_is_waited_for_not_computed_twice():
    s = _scheduler(max_num_batched_tokens=64)
    prefix = list(range(200, 212))  # three full blocks of 4
    s.add_request("a", [*prefix, 1, 2], SamplingParams(max_tokens=4))
    s.add_request("b", [*prefix, 3], SamplingParams(max_tokens=4))
    s.add_request("c", list(range(300, 305)), SamplingParams(max_tokens=4))
    out, _ = _step(s)
    # b would compute a's blocks again: it waits; c, behind it, goes ahead
    assert [x.seq.group_id for x in out.scheduled] == ["a", "c"]
    assert s.waiting[0].group_id == "b" and s.stats.num_prefix_waits == 1
    out, _ = _step(s)
    b = next(x for x in out.scheduled if x.seq.group_id == "b")
    assert (b.num_computed_tokens, b.num_new_tokens) == (12, 1)
    assert s.manager.prefix_cache_stats.num_hit_tokens == 12


def test_without_prefix_caching_nothing_waits():
    s = _scheduler(max_num_batched_tokens=64, enable_prefix_caching=False)
    prefix = list(range(200, 212))
    s.add_request("a", [*prefix, 1, 2], SamplingParams(max_tokens=4))
    s.add_request("b", [*prefix, 3], SamplingParams(max_tokens=4))
    out, _ = _step(s)
    assert [x.seq.group_id for x in out.scheduled] == ["a", "b"]


def test_preemption_recomputes_the_newest():
    s = _scheduler(num_blocks=6)  # 5 usable blocks of 4 tokens
    s.add_request("old", list(range(8)), SamplingParams(max_tokens=4))
    s.add_request("new", list(range(50, 58)), SamplingParams(max_tokens=4))
    _step(s)  # 2 + 2 blocks; each needs a third for its 9th token
    out, _ = _step(s)  # old takes the last free block; new cannot grow
    new = s.groups["new"][0]
    assert out.preempted == [new]
    assert new.status is SeqStatus.WAITING and s.waiting[0] is new
    assert new.request.num_computed_tokens == 0 and new.num_preemptions == 1
    assert [x.seq.group_id for x in out.scheduled] == ["old"]
    assert out.removed_seq_ids == [new.seq_id]  # its block-table row goes in this step
    for _ in range(10):  # it comes back once old finishes
        if new.status is SeqStatus.RUNNING:
            break
        _step(s)
    out, _ = _step(s)
    assert new.request.num_computed_tokens > 8  # prompt and samples recomputed
    assert s.stats.num_preemptions >= 1


def test_fork_shares_full_blocks_and_copies_the_partly_filled_one():
    s = _scheduler()
    s.add_request("twins", list(range(6)), SamplingParams(n=3, max_tokens=4, temperature=1))
    out, _ = _step(s)
    seqs = s.groups["twins"]
    assert len(seqs) == 3 and s.stats.num_forks == 2
    ids = [s.manager.get_block_ids(q.seq_id) for q in seqs]
    assert ids[0][0] == ids[1][0] == ids[2][0]  # the full block is shared
    assert len({ids[0][1], ids[1][1], ids[2][1]}) == 3  # the partly filled one is copied
    out, _ = _step(s)
    # the copies reach the worker with the next step, before any K/V is written
    assert sorted((c.src, c.dst) for c in out.copies) == sorted(
        (ids[0][1], ids[i][1]) for i in (1, 2)
    )
    children = [x for x in out.scheduled if x.seq.index > 0]
    assert [x.block_ids for x in children] == [tuple(ids[1]), tuple(ids[2])]  # first step: all
    out, _ = _step(s)
    assert out.copies == []


def test_a_fork_gets_its_blocks_before_the_prompt_runs():
    # 4 usable blocks: a 6-token prompt takes 2, its two forks one copy each
    s = _scheduler(num_blocks=5)
    s.add_request("twins", list(range(6)), SamplingParams(n=3, max_tokens=2, temperature=1))
    s.add_request("other", list(range(40, 43)), SamplingParams(max_tokens=2))
    out, _ = _step(s)
    # the other request would take a block the forks need: it waits
    assert [x.seq.group_id for x in out.scheduled] == ["twins"]
    assert len(s.groups["twins"]) == 3 and s.manager.get_num_free_blocks() == 0
    while s.has_unfinished():
        _step(s)
    assert s.is_finished("other") and s.manager.get_num_free_blocks() == 4


def test_a_fork_that_can_never_fit_is_not_scheduled():
    s = _scheduler(num_blocks=4)  # 3 usable: the prompt's 2 blocks and one copy, not two
    s.add_request("twins", list(range(6)), SamplingParams(n=3, max_tokens=2, temperature=1))
    out, _ = _step(s)
    assert out.scheduled == [] and s.manager.get_num_free_blocks() == 3
    assert s.waiting[0].group_id == "twins"


def test_aborting_a_fork_before_its_first_step_drops_its_copy():
    s = _scheduler()
    s.add_request("twins", list(range(6)), SamplingParams(n=2, max_tokens=4, temperature=1))
    _step(s)
    child = s.groups["twins"][1]
    s.abort("twins")
    out = s.schedule()
    assert out.scheduled == [] and out.copies == []
    assert s.manager.get_num_free_blocks() == 31
    # an empty step runs nothing: the rows to drop go with the next step that runs
    s.add_request("next", [7, 8], SamplingParams())
    out = s.schedule()
    assert out.copies == [] and child.seq_id in out.removed_seq_ids


def test_rows_for_all_samples_are_reserved_at_admission():
    s = _scheduler(max_num_seqs=3)
    s.add_request("a", [1, 2], SamplingParams(n=2))
    s.add_request("b", [3, 4], SamplingParams(n=2))
    out, _ = _step(s)
    assert [x.seq.group_id for x in out.scheduled] == ["a"]  # b's two samples would not fit


def test_abort_anywhere_and_finish_reasons():
    s = _scheduler(num_blocks=6)
    s.add_request("a", list(range(8)), SamplingParams(max_tokens=2))
    s.add_request("b", list(range(20, 28)), SamplingParams(max_tokens=9))
    s.add_request("c", [1], SamplingParams(max_tokens=9))
    _, finished = _step(s)
    _, finished = _step(s)
    assert [(q.group_id, q.finish_reason) for q in finished] == [("a", FinishReason.LENGTH)]
    stopped = s.abort("b")
    assert [q.finish_reason for q in stopped] == [FinishReason.ABORTED]
    assert s.is_finished("b")
    s.abort("c")
    assert not s.has_unfinished()
    assert s.manager.get_num_free_blocks() == 5
    with pytest.raises(RequestError, match="unknown request 'zzz'"):
        s.abort("zzz")


def test_add_request_checks():
    s = _scheduler(num_blocks=4)
    with pytest.raises(RequestError, match="the prompt is empty"):
        s.add_request("x", [], SamplingParams())
    with pytest.raises(RequestError, match="needs 4 blocks but the pool has 3"):
        s.add_request("x", list(range(12)), SamplingParams())


def test_a_sequence_preempted_while_its_token_is_in_flight_stops_on_it():
    """Async scheduling: step 2 is scheduled (preempting B) before step 1's tokens are
    resolved; B's token from step 1 is a stop token, so B finishes from the queue."""
    s = _scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    s.add_request("a", [0, 1, 2, 3], SamplingParams(max_tokens=4))
    s.add_request("b", [10, 11, 12, 13], SamplingParams(max_tokens=4, stop_token_ids=(99,)))
    first = s.schedule()
    s.advance(first)  # each now holds a placeholder as its 5th token
    second = s.schedule()  # a's 5th token takes the last block: b is preempted
    (b,) = s.groups["b"]
    assert b.status is SeqStatus.WAITING and [x.seq.group_id for x in second.scheduled] == ["a"]
    finished = s.resolve(first, {s.groups["a"][0].seq_id: [7], b.seq_id: [99]})
    assert finished == [b] and b.finish_reason is FinishReason.STOP
    assert b.status is SeqStatus.FINISHED and b not in s.waiting
    assert b.output_token_ids == [99]
    s.advance(second)
    check_manager(s.manager)
