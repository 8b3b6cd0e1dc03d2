"""BlockTable row operations and commit; vectorised slot mapping against a naive loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.errors import KVCacheUsageError
from pagedkv.kv import BlockTable
from pagedkv.slots import PAD_SLOT_ID, compute_slot_mapping


def test_row_operations_and_commit():
    t = BlockTable(4, 5, "cpu")
    t.add_row([7, 3, 12], 0)
    t.append_row([25], 0)
    t.add_row([1, 9], 1)
    assert t.block_table_np[0].tolist() == [7, 3, 12, 25, 0]
    t.swap_row(0, 1)
    assert t.block_table_np[:2].tolist() == [[1, 9, 0, 0, 0], [7, 3, 12, 25, 0]]
    assert t.num_blocks_per_row[:2].tolist() == [2, 4]
    t.move_row(1, 0)  # over a shorter row
    assert t.block_table_np[0].tolist() == [7, 3, 12, 25, 0] and t.num_blocks_per_row[0] == 4
    t.add_row([5], 1)  # replacing clears the old tail: unused entries are the null block
    assert t.block_table_np[1].tolist() == [5, 0, 0, 0, 0]
    # the device table only changes on commit, and only the committed rows
    assert t.block_table.abs().sum() == 0
    view = t.commit(1)
    assert view.shape == (1, 5) and view.dtype == torch.int32
    assert t.block_table[0].tolist() == [7, 3, 12, 25, 0] and t.block_table[1].sum() == 0
    t.clear_row(0)
    assert t.block_table_np[0].sum() == 0 and t.num_blocks_per_row[0] == 0


def test_block_table_errors():
    t = BlockTable(2, 3)
    with pytest.raises(KVCacheUsageError, match=r"2 \+ 2 blocks exceed max_num_blocks_per_req 3"):
        t.add_row([1, 2], 0)
        t.append_row([3, 4], 0)
    with pytest.raises(KVCacheUsageError, match=r"row 2 is out of range \[0, 2\)"):
        t.append_row([1], 2)
    with pytest.raises(
        KVCacheUsageError, match="row 1: block id 0 at position 1: .* block 0 is the null block"
    ):
        t.add_row([4, 0], 1)
    with pytest.raises(KVCacheUsageError, match="block id -3 at position 0"):
        t.append_row([-3], 1)
    assert t.num_blocks_per_row[1] == 0  # nothing was written
    with pytest.raises(KVCacheUsageError, match="commit: num_reqs must be in"):
        t.commit(3)
    with pytest.raises(KVCacheUsageError, match="max_num_reqs must be a positive int"):
        BlockTable(0, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned, async commit")
def test_commit_to_cuda_is_pinned():
    t = BlockTable(4, 8, "cuda")
    assert t.block_table_cpu.is_pinned()
    t.add_row([3, 4], 0)
    t.commit(1)
    torch.cuda.synchronize()
    assert t.block_table[0, :2].tolist() == [3, 4]


def naive_slot_mapping(table, query_lens, seq_lens, block_size, num_tokens):
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for p in range(s - q, s):
            slots.append(int(table[r][p // block_size]) * block_size + p % block_size)
    return slots + [PAD_SLOT_ID] * (num_tokens - len(slots))


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_reqs = draw(st.integers(0, 6))
    seq_lens = draw(st.lists(st.integers(1, 70), min_size=num_reqs, max_size=num_reqs))
    query_lens = [draw(st.integers(0, s)) for s in seq_lens]
    width = max([-(-s // block_size) for s in seq_lens] + [1])
    table = draw(
        st.lists(
            st.lists(st.integers(0, 500), min_size=width, max_size=width),
            min_size=num_reqs,
            max_size=num_reqs,
        )
    )
    pad = draw(st.integers(0, 5))
    return block_size, seq_lens, query_lens, table, pad


@settings(max_examples=150, deadline=None)
@given(batches())
def test_slot_mapping_matches_naive_loop(batch):
    block_size, seq_lens, query_lens, table, pad = batch
    num_tokens = sum(query_lens) + pad
    width = len(table[0]) if table else 1
    table_np = np.array(table, dtype=np.int32).reshape(len(seq_lens), width)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    got = compute_slot_mapping(table_np, qsl, np.array(seq_lens, np.int32), block_size, num_tokens)
    assert got.dtype == np.int64
    assert got.tolist() == naive_slot_mapping(table, query_lens, seq_lens, block_size, num_tokens)


def test_slot_mapping_example_from_the_chapter():
    # request A: 50 tokens computed, the 51st scheduled; table [7, 3, 12, 25], B = 16
    t = BlockTable(1, 4)
    t.add_row([7, 3, 12, 25], 0)
    slots = t.compute_slot_mapping(np.array([0, 1]), np.array([51]), 16)
    assert slots.tolist() == [402]
