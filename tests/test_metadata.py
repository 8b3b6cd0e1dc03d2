import numpy as np
import pytest
import torch
from pagedkv import CommonAttentionMetadata, MetadataError
from pagedkv.slots import compute_slot_mapping


def sample(**kw):
    args = dict(
        seq_lens=[5, 20, 1], query_lens=[5, 3, 1], block_ids=[[7], [2, 4], [9]], block_size=16
    )
    args.update(kw)
    return CommonAttentionMetadata.from_requests(**args)


def test_from_requests_fields():
    md = sample(num_tokens=12, max_blocks_per_req=4)
    assert md.query_start_loc.tolist() == [0, 5, 8, 9]
    assert md.seq_lens.tolist() == [5, 20, 1]
    assert md.block_table.shape == (3, 4) and md.block_table.dtype == torch.int32
    assert md.num_actual_tokens == 9 and md.num_tokens == 12
    assert md.max_query_len == 5 and md.max_seq_len == 20
    # request 1: positions 17, 18, 19 -> block 4, offsets 1..3
    assert md.slot_mapping.tolist() == [112, 113, 114, 115, 116, 65, 66, 67, 144, -1, -1, -1]
    assert md.context_lens_cpu.tolist() == [0, 17, 0]
    md.validate(num_blocks=10)


def replace(md, **changes):
    import dataclasses

    return dataclasses.replace(md, **changes)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda md: replace(md, query_start_loc=md.query_start_loc.long()),
            "query_start_loc: expected dtype torch.int32",
        ),
        (
            lambda md: replace(md, slot_mapping=md.slot_mapping.int()),
            "slot_mapping: expected dtype torch.int64",
        ),
        (lambda md: replace(md, block_table=md.block_table[0]), "block_table: expected 2-D"),
        (
            lambda md: replace(
                md,
                query_start_loc_cpu=torch.tensor([1, 5, 8, 9], dtype=torch.int32),
                query_start_loc=torch.tensor([1, 5, 8, 9], dtype=torch.int32),
            ),
            r"query_start_loc\[0\] must be 0",
        ),
        (
            lambda md: replace(
                md,
                query_start_loc_cpu=torch.tensor([0, 5, 4, 9], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 5, 4, 9], dtype=torch.int32),
            ),
            "non-decreasing: request 1",
        ),
        (
            lambda md: replace(
                md,
                seq_lens_cpu=torch.tensor([4, 20, 1], dtype=torch.int32),
                seq_lens=torch.tensor([4, 20, 1], dtype=torch.int32),
            ),
            r"seq_lens\[0\] = 4 < query_len 5 \(request 0\)",
        ),
        (
            lambda md: replace(md, seq_lens=torch.tensor([5, 21, 1], dtype=torch.int32)),
            "seq_lens: device tensor differs from seq_lens_cpu",
        ),
        (
            lambda md: replace(md, num_actual_tokens=8),
            "num_actual_tokens = 8, expected query_start_loc",
        ),
        (lambda md: replace(md, max_query_len=2), "max_query_len = 2 < query_len 5 of request 0"),
        (lambda md: replace(md, max_seq_len=10), r"max_seq_len = 10 < seq_lens\[1\] = 20"),
        (
            lambda md: replace(md, block_table=md.block_table[:, :1].contiguous()),
            "block_table is 1 blocks wide but request 1 .* needs 2",
        ),
        (
            lambda md: replace(
                md, block_table=torch.tensor([[7, 0], [2, 40], [9, 0]], dtype=torch.int32)
            ),
            r"block_table\[1, 1\] = 40 \(request 1\) is out of range: expected a block id in \[0, 10\)",
        ),
        (
            lambda md: replace(
                md,
                slot_mapping=torch.tensor(
                    [112, 113, 114, 115, 116, 65, 66, 67, 5000, -1], dtype=torch.int64
                ),
            ),
            r"slot_mapping\[8\] = 5000 \(request 2\) is out of range",
        ),
        (
            lambda md: replace(
                md,
                slot_mapping=torch.tensor(
                    [112, 113, 114, 115, 116, 65, 66, 68, 144, -1], dtype=torch.int64
                ),
            ),
            r"slot_mapping\[7\] = 68 \(request 1\) disagrees with block_table: expected 67",
        ),
        (
            lambda md: replace(
                md,
                slot_mapping=torch.tensor(
                    [112, 113, 114, 115, 116, 65, 66, 67, 144, 3], dtype=torch.int64
                ),
            ),
            r"slot_mapping\[9\] = 3 is a padding token",
        ),
        (
            lambda md: replace(
                md,
                slot_mapping=torch.tensor(
                    [112, 113, 114, 115, 116, 65, -1, 67, 144, -1], dtype=torch.int64
                ),
            ),
            r"slot_mapping\[6\] = -1 \(request 1\) is out of range",
        ),
        (
            lambda md: replace(md, query_start_loc=md.query_start_loc[:3]),
            "query_start_loc: expected 4 rows for 3 requests",
        ),
    ],
)
def test_each_invariant_is_checked(mutate, message):
    md = mutate(sample(num_tokens=10))
    with pytest.raises(MetadataError, match=message):
        md.validate(num_blocks=10)


def test_scheduled_tokens_in_the_null_block_are_refused():
    # request 1's only block is 0, the null block: its 3 scheduled tokens would write
    # real K/V into the padding block of every table
    md = CommonAttentionMetadata.from_requests([5, 3], [2, 3], [[4, 6], [0]], block_size=4)
    with pytest.raises(MetadataError, match=r"slot_mapping\[2\] = 0 \(request 1\) is in block 0"):
        md.validate(num_blocks=8)
    # the slot mapping is right but the table maps the token to block 0
    md = CommonAttentionMetadata.from_requests([5], [1], [[4, 6]], block_size=4)
    bad_table = replace(md, block_table=torch.tensor([[4, 0]], dtype=torch.int32))
    with pytest.raises(MetadataError, match=r"block_table\[0, 1\] = 0 \(request 0\) is the null"):
        bad_table.validate(num_blocks=8)
    # context (not scheduled) entries may be 0: only writes are refused
    CommonAttentionMetadata.from_requests([9], [1], [[0, 0, 5]], block_size=4).validate(8)


def test_from_requests_rejects_bad_input():
    with pytest.raises(MetadataError, match="request 0: need 0 <= query_len <= seq_len"):
        sample(seq_lens=[3, 20, 1])
    with pytest.raises(
        MetadataError, match=r"block_ids\[1\]: seq_len 20 needs 2 blocks of 16, got 1"
    ):
        sample(block_ids=[[7], [2], [9]])
    with pytest.raises(MetadataError, match="one entry per request"):
        sample(query_lens=[5, 3])
    for block_size in (0, -16, 16.0):  # 0 divided by zero inside the slot arithmetic
        with pytest.raises(MetadataError, match="block_size must be a positive int"):
            CommonAttentionMetadata.from_requests([4], [1], [[1]], block_size)


def test_slot_mapping_matches_naive_loop():
    rng = np.random.default_rng(0)
    bs, num_reqs = 16, 37
    seq = rng.integers(1, 300, num_reqs)
    ql = np.minimum(seq, rng.integers(0, 40, num_reqs))
    table = rng.permutation(5000)[: num_reqs * 20].reshape(num_reqs, 20).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(ql)])
    got = compute_slot_mapping(table, qsl, seq, bs, num_tokens=int(qsl[-1]) + 5)
    want = []
    for r in range(num_reqs):
        for p in range(seq[r] - ql[r], seq[r]):
            want.append(table[r, p // bs] * bs + p % bs)
    assert got.tolist() == want + [-1] * 5
