"""Full consistency checks of a BlockPool / KVCacheManager. O(num_blocks): for tests
and debugging, never the hot path. Each failure is an AssertionError saying what broke."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.request import Request


def check_pool(pool: BlockPool) -> None:
    """Free list, reference counts and hash map agree with each other."""
    null = pool.null_block
    assert null.block_id == 0 and null.is_null, "block 0 must be the null block"
    assert null.block_hash is None, "the null block must never be cached"
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.free_block_queue.num_free_blocks, (
        f"free queue holds {len(free)} blocks but counts {pool.free_block_queue.num_free_blocks}"
    )
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free), "a block appears twice in the free queue"
    # eviction order: uncached blocks (nothing to lose) before cached ones
    first_cached = next((i for i, b in enumerate(free) if b.block_hash is not None), len(free))
    late = [b for b in free[first_cached:] if b.block_hash is None]
    assert not late, f"uncached free {late[0]} is queued behind a cached block"
    assert 0 not in free_ids, "the null block is in the free queue"
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0, f"{block}: negative ref_cnt"
        in_queue = block.block_id in free_ids
        assert in_queue == (block.ref_cnt == 0), (
            f"{block}: in free queue = {in_queue}, but ref_cnt = {block.ref_cnt}"
        )
    num_in_use = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert num_in_use + len(free) == pool.num_blocks - 1, (
        f"{num_in_use} in use + {len(free)} free != {pool.num_blocks - 1} usable blocks"
    )
    mapped = list(pool.cached_block_hash_to_block.items())
    assert len(mapped) == pool.cached_block_hash_to_block.num_blocks, "hash map count is off"
    mapped_ids = set()
    for key, block in mapped:
        assert block.block_hash == key, f"{block} is mapped under another hash"
        assert block.block_id not in mapped_ids, f"{block} is mapped twice"
        mapped_ids.add(block.block_id)
    hashed_ids = {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert hashed_ids == mapped_ids, (
        f"blocks with a hash {sorted(hashed_ids - mapped_ids)[:5]} are not in the hash map, "
        f"mapped blocks {sorted(mapped_ids - hashed_ids)[:5]} have no hash"
    )
    if not pool.enable_caching:
        assert not mapped_ids, "caching is off but blocks are cached"


def check_manager(manager: KVCacheManager, requests: Mapping[str, Request] | None = None) -> None:
    """check_pool, plus: every reference is held by exactly one request's list entry.

    With ``requests`` (id -> Request), also: each of those requests has the computed
    count the manager gave it, and registered no block past it in the prefix cache.
    """
    pool = manager.block_pool
    check_pool(pool)
    held: Counter[int] = Counter()
    for rid, blocks in manager.req_to_blocks.items():
        request = requests.get(rid) if requests is not None else None
        if request is not None:
            assert request.num_computed_tokens == manager.num_computed_tokens[rid], (
                f"request {rid!r}: num_computed_tokens {request.num_computed_tokens}, the "
                f"manager counted {manager.num_computed_tokens[rid]}"
            )
            num_cached_tokens = manager.num_cached_block[rid] * manager.block_size
            assert num_cached_tokens <= request.num_computed_tokens, (
                f"request {rid!r}: {manager.num_cached_block[rid]} blocks registered in the "
                f"prefix cache, but only {request.num_computed_tokens} tokens computed"
            )
        assert len(blocks) <= manager.max_num_blocks_per_req, (
            f"request {rid!r} holds {len(blocks)} blocks > {manager.max_num_blocks_per_req}"
        )
        assert all(not b.is_null for b in blocks), f"request {rid!r} holds the null block"
        assert 0 <= manager.num_cached_block[rid] <= len(blocks), f"request {rid!r}: cached count"
        assert 0 <= manager.num_reported_block[rid] <= len(blocks), f"request {rid!r}: reported"
        for b in blocks[: manager.num_cached_block[rid]]:
            assert b.block_hash is not None or not manager.enable_caching, (
                f"request {rid!r}: {b} counted as cached but has no hash"
            )
        held.update(b.block_id for b in blocks)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == held[block.block_id], (
            f"{block}: ref_cnt {block.ref_cnt} but held {held[block.block_id]} times"
        )
    assert set(manager.num_cached_block) == set(manager.req_to_blocks)
    assert set(manager.num_reported_block) == set(manager.req_to_blocks)
    assert set(manager.num_computed_tokens) == set(manager.req_to_blocks)
