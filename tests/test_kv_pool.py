"""FreeKVCacheBlockQueue and BlockPool: order, references, lazy eviction, counters, misuse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.errors import DoubleFreeError, KVCacheUsageError, OutOfBlocksError
from pagedkv.kv import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedkv.kv.invariants import check_pool


def ids(blocks):
    return [b.block_id for b in blocks]


# -- free queue ------------------------------------------------------------------------------


def test_queue_order_and_o1_operations():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5]
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[3])
    assert ids(q.get_all_free_blocks()) == [3, 1, 2, 4, 5, 0]
    assert ids(q.popleft_n(4)) == [3, 1, 2, 4]
    assert ids(q.get_all_free_blocks()) == [5, 0] and len(q) == 2
    assert ids(q.popleft_n(2)) == [5, 0]
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("pral"), st.integers(0, 7)), max_size=40))
def test_queue_matches_a_list_model(ops):
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        if op == "p" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "r" and i in model:
            q.remove(blocks[i])
            model.remove(i)
        elif op == "a" and i not in model:
            q.append(blocks[i])
            model.append(i)
        elif op == "l" and i not in model:
            q.appendleft(blocks[i])
            model.insert(0, i)
        assert ids(q.get_all_free_blocks()) == model and len(q) == len(model)


# -- block pool ------------------------------------------------------------------------------


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert 0 not in ids(got) and all(b.ref_cnt == 1 for b in got)
    with pytest.raises(OutOfBlocksError, match="cannot get 1 free blocks: 0 of 4 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # a padding entry: ignored, not freed
    pool.touch([pool.null_block])
    assert pool.get_num_free_blocks() == 0
    check_pool(pool)


def test_free_order_uncached_first_cached_last():
    pool = BlockPool(8)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)
    pool.free_blocks([a, b, c, d])
    free = ids(pool.free_block_queue.get_all_free_blocks())
    # uncached c, d go to the front (d last in, so first); cached a, b to the back in order
    assert free[:2] == [d.block_id, c.block_id]
    assert free[-2:] == [a.block_id, b.block_id]
    check_pool(pool)


def test_lazy_eviction_and_touch_revives():
    pool = BlockPool(4)  # 3 usable blocks
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"h0", b"h1", b"h2"], 0, 3)
    pool.free_blocks(blocks)
    # freed but still findable: eviction happens only when the block is reused
    assert pool.get_cached_block(b"h1") is blocks[1]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.get_num_free_blocks() == 2
    taken = pool.get_new_blocks(2)  # evicts h0 and h2
    assert ids(taken) == [blocks[0].block_id, blocks[2].block_id]
    assert pool.get_cached_block(b"h0") is None and pool.get_cached_block(b"h2") is None
    assert pool.get_cached_block(b"h1") is blocks[1]
    assert pool.stats.num_evictions == 2
    assert pool.stats.num_cache_hits == 2 and pool.stats.num_cache_misses == 2
    check_pool(pool)


def test_touch_shared_block_counts_references():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 3
    pool.free_blocks([a, a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(DoubleFreeError, match=f"block {a.block_id} is already free"):
        pool.free_blocks([a])
    check_pool(pool)


def test_free_blocks_is_all_or_nothing():
    pool = BlockPool(5)
    held, gone, twice = pool.get_new_blocks(3)
    pool.free_blocks([gone])
    queue = ids(pool.free_block_queue.get_all_free_blocks())
    with pytest.raises(DoubleFreeError, match=f"block {gone.block_id} is already free"):
        pool.free_blocks([held, gone])
    # listed more often than held: the second entry is the double free
    with pytest.raises(DoubleFreeError, match=f"block {twice.block_id} is already free"):
        pool.free_blocks([held, twice, twice])
    assert held.ref_cnt == 1 and twice.ref_cnt == 1 and gone.ref_cnt == 0
    assert ids(pool.free_block_queue.get_all_free_blocks()) == queue
    check_pool(pool)


def test_shuffle_free_blocks_is_seeded_and_keeps_cached_blocks_last():
    def order(seed):
        pool = BlockPool(12)
        cached = pool.get_new_blocks(2)
        pool.cache_full_blocks(cached, [b"x", b"y"], 0, 2)
        pool.free_blocks(cached)
        pool.shuffle_free_blocks(seed)
        check_pool(pool)
        free = ids(pool.free_block_queue.get_all_free_blocks())
        assert free[-2:] == ids(cached)  # still evicted last, in their order
        return free[:-2]

    assert order(1) == order(1) != order(2)
    assert sorted(order(1)) == list(range(3, 12))
    assert order(1) != sorted(order(1))


def test_duplicate_hashes_are_kept_and_evicted_one_by_one():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)
    assert pool.cached_block_hash_to_block.num_blocks == 2
    assert pool.get_cached_block(b"same") in (a, b)
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # the free block first, then a
    assert pool.get_cached_block(b"same") is b
    check_pool(pool)


def test_usage_and_reset_prefix_cache():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.cache_full_blocks(blocks, [b"x", b"y"], 0, 2)
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is None and len(pool.cached_block_hash_to_block) == 0
    check_pool(pool)


def test_caching_disabled_never_caches():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"x", b"y"], 0, 2)
    assert all(b.block_hash is None for b in blocks)
    check_pool(pool)


def test_pool_misuse_errors():
    with pytest.raises(KVCacheUsageError, match="num_blocks must be an int >= 2"):
        BlockPool(1)
    pool = BlockPool(3)
    with pytest.raises(KVCacheUsageError, match="num_blocks must be >= 0, got -1"):
        pool.get_new_blocks(-1)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(KVCacheUsageError, match="2 full blocks need as many blocks and hashes"):
        pool.cache_full_blocks(blocks, [b"only-one"], 0, 2)
