"""StepAssembler: rows, ordering, metadata; and manager -> metadata -> backend end to end."""

from __future__ import annotations

import pytest
import torch
from pagedkv import AttentionSpec, select_backend
from pagedkv.errors import KVCacheUsageError, MetadataError
from pagedkv.kv import KVCacheManager, Request, ScheduledRequest, StepAssembler, copies_to_tensors
from pagedkv.reference import reference_attention


def test_build_orders_rows_and_validates():
    asm = StepAssembler(block_size=4, max_num_reqs=4, max_model_len=32)
    md = asm.build(
        [ScheduledRequest("a", 0, 6, [5, 9]), ScheduledRequest("b", 0, 3, [2])], num_tokens=12
    )
    md.validate(num_blocks=16)
    assert md.seq_lens_cpu.tolist() == [6, 3] and md.query_start_loc_cpu.tolist() == [0, 6, 9]
    assert md.slot_mapping.tolist() == [20, 21, 22, 23, 36, 37, 8, 9, 10, -1, -1, -1]
    # next step: b first, a decodes into a new block, a third request c is resident
    asm.add_request("c", [11])
    md = asm.build([ScheduledRequest("b", 3, 1), ScheduledRequest("a", 6, 3, [4])])
    md.validate(num_blocks=16)
    assert md.block_table[:, :3].tolist() == [[2, 0, 0], [5, 9, 4]]
    assert md.slot_mapping.tolist() == [11, 38, 39, 16]
    assert md.max_query_len == 3 and md.max_seq_len == 9 and md.num_reqs == 2
    asm.remove_request("b")  # the last row moves into the hole
    assert asm.num_resident == 2
    md = asm.build([ScheduledRequest("c", 0, 2)])
    assert md.block_table[0, :1].tolist() == [11] and md.slot_mapping.tolist() == [44, 45]


def test_build_errors():
    asm = StepAssembler(block_size=4, max_num_reqs=2, max_model_len=16)
    with pytest.raises(
        MetadataError, match="'a': seq_len 5 needs 2 blocks of 4, its row would hold 1"
    ):
        asm.build([ScheduledRequest("a", 0, 5, [1])])
    with pytest.raises(KVCacheUsageError, match="scheduled twice"):
        asm.build([ScheduledRequest("a", 0, 1), ScheduledRequest("a", 0, 1)])
    with pytest.raises(KVCacheUsageError, match="num_new_tokens=-1"):
        asm.build([ScheduledRequest("a", 0, -1)])
    assert asm.num_resident == 0  # the failed builds added no row
    asm.add_request("b", [2])
    with pytest.raises(KVCacheUsageError, match="2 new requests need rows, but 1 of 2"):
        asm.build([ScheduledRequest("d", 0, 1, [4]), ScheduledRequest("e", 0, 1, [5])])
    assert asm.num_resident == 1
    with pytest.raises(KVCacheUsageError, match="'d': new_block_ids: block id 0 at position 1"):
        asm.build([ScheduledRequest("d", 0, 5, [4, 0])])  # block 0 is the null block
    assert asm.num_resident == 1
    asm.add_request("c", [3])
    with pytest.raises(KVCacheUsageError, match="no free block-table row for 'd'"):
        asm.add_request("d", [4])
    with pytest.raises(KVCacheUsageError, match="'x' has no block-table row"):
        asm.remove_request("x")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for device metadata")
def test_build_on_cuda_validates():
    asm = StepAssembler(block_size=16, max_num_reqs=4, max_model_len=256, device="cuda")
    md = asm.build([ScheduledRequest("a", 0, 40, [3, 1, 2]), ScheduledRequest("b", 0, 1, [5])])
    torch.cuda.synchronize()
    assert md.block_table.is_cuda and md.slot_mapping.is_cuda and not md.seq_lens_cpu.is_cuda
    md.validate(num_blocks=8)
    assert md.slot_mapping.tolist()[-1] == 5 * 16


# -- end to end: manager + assembler + torch backend vs the float64 reference ---------------

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=4)


def kv_of(tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of the last of ``tokens``: like a model's, a function of the whole prefix."""
    g = torch.Generator().manual_seed(hash(tokens) % (2**31))
    return (
        torch.randn(SPEC.num_kv_heads, SPEC.head_size, generator=g),
        torch.randn(SPEC.num_kv_heads, SPEC.head_size, generator=g),
    )


class Worker:
    """A model-runner stand-in: schedules through the manager, runs the torch backend."""

    def __init__(self) -> None:
        self.manager = KVCacheManager(24, SPEC.block_size, 64)
        self.asm = StepAssembler(SPEC.block_size, 8, 64)
        self.backend = select_backend("torch", SPEC, "cpu")
        self.kv_cache = self.backend.allocate_kv_cache(24, SPEC, "cpu")
        self.impl = self.backend.make_impl(SPEC)
        self.builder = self.backend.make_builder(SPEC, "cpu")
        self.num_copies = 0

    def step(self, plan: list[tuple[Request, int]]) -> None:
        scheduled = []
        for request, num_new in plan:
            if request.request_id not in self.manager.req_to_blocks:
                blocks, num_hit = self.manager.get_computed_blocks(request)
                num_new -= num_hit
                assert self.manager.allocate_slots(request, num_new, num_hit, blocks) is not None
            else:
                assert self.manager.allocate_slots(request, num_new) is not None
            new_ids = self.manager.take_new_block_ids(request.request_id)
            scheduled.append(
                ScheduledRequest(request.request_id, request.num_computed_tokens, num_new, new_ids)
            )
        common = self.asm.build(scheduled, num_tokens=sum(s.num_new_tokens for s in scheduled) + 3)
        common.validate(num_blocks=24)
        queries, keys, values, dense_k, dense_v = [], [], [], [], []
        g = torch.Generator().manual_seed(common.num_actual_tokens)
        for request, s in zip([r for r, _ in plan], scheduled, strict=True):
            tokens = tuple(request.all_token_ids)
            seq_len = s.num_computed_tokens + s.num_new_tokens
            kv = [kv_of(tokens[: p + 1]) for p in range(seq_len)]
            dense_k.append(torch.stack([k for k, _ in kv]))
            dense_v.append(torch.stack([v for _, v in kv]))
            keys += [k for k, _ in kv[s.num_computed_tokens :]]
            values += [v for _, v in kv[s.num_computed_tokens :]]
            queries.append(
                torch.randn(s.num_new_tokens, SPEC.num_heads, SPEC.head_size, generator=g)
            )
        pad = common.num_tokens - common.num_actual_tokens
        q = torch.cat([*queries, torch.zeros(pad, SPEC.num_heads, SPEC.head_size)])
        k = torch.cat([torch.stack(keys), torch.zeros(pad, SPEC.num_kv_heads, SPEC.head_size)])
        v = torch.cat([torch.stack(values), torch.zeros(pad, SPEC.num_kv_heads, SPEC.head_size)])
        out = self.impl.forward(q, k, v, self.kv_cache, self.builder.build(common))
        ref = reference_attention(
            q[: common.num_actual_tokens],
            dense_k,
            dense_v,
            [s.num_new_tokens for s in scheduled],
            SPEC,
        )
        torch.testing.assert_close(
            out[: common.num_actual_tokens].double(), ref, atol=2e-5, rtol=2e-5
        )
        for request, s in zip([r for r, _ in plan], scheduled, strict=True):
            self.manager.mark_computed(request, s.num_new_tokens)

    def fork(self, parent: Request, child_id: str) -> Request:
        fork = self.manager.fork(parent, child_id)
        assert fork is not None
        if fork.copies:  # copy-on-write: before the next step writes any K/V
            self.num_copies += len(fork.copies)
            self.backend.copy_blocks(self.kv_cache, *copies_to_tensors(fork.copies, "cpu"))
        return fork.child


def test_prefix_hit_and_copy_on_write_give_reference_attention():
    w = Worker()
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    w.step([(a, 10)])
    # b shares a's first two blocks (8 tokens): only its last 3 tokens are computed
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 40, 41, 42])
    a.append_output_token_ids(11)
    w.step([(a, 1), (b, 11)])
    assert w.manager.get_block_ids("b")[:2] == w.manager.get_block_ids("a")[:2]
    assert b.num_computed_tokens == 11
    # parallel sampling: a2 shares a's two full blocks and gets a copy of the partial
    # third (positions 8-10)
    a2 = w.fork(a, "a2")
    a.append_output_token_ids(12)
    a2.append_output_token_ids(99)
    w.step([(a2, 1), (a, 1), (b, 0)])
    assert w.num_copies == 1
    assert w.manager.get_block_ids("a")[2] != w.manager.get_block_ids("a2")[2]
    for r, t in ((a, 13), (a2, 98), (b, 43)):
        r.append_output_token_ids(t)
    w.step([(b, 1), (a, 1), (a2, 1)])
