"""BlockPool: hands out, reference-counts, caches and evicts the blocks of the KV pool."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.errors import DoubleFreeError, KVCacheUsageError, OutOfBlocksError
from pagedkv.kv.block import BlockHash, KVCacheBlock
from pagedkv.kv.free_queue import FreeKVCacheBlockQueue


class BlockHashToBlockMap:
    """hash -> the cached blocks holding it.

    Usually one block per hash. Two requests that fill identical blocks in the same
    step both cache theirs: block tables are append-only, so the duplicate is kept
    rather than swapped for the first. One block is stored bare, several in a dict,
    to spare a dict per entry in the common case.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.num_blocks = 0  # blocks in the map, duplicates counted

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block
        self.num_blocks += 1

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            self.num_blocks -= 1
            return entry
        block = entry.pop(block_id, None)
        if block is not None:
            self.num_blocks -= 1
            if len(entry) == 1:
                self._cache[key] = next(iter(entry.values()))
        return block

    def items(self) -> Iterable[tuple[BlockHash, KVCacheBlock]]:
        """Every (hash, block) pair. Mainly used for testing."""
        for key, entry in self._cache.items():
            if isinstance(entry, KVCacheBlock):
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def clear(self) -> None:
        self._cache.clear()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._cache)


@dataclass
class BlockPoolStats:
    """Counters since the pool was made; block lookups, not tokens."""

    num_cache_hits: int = 0  # get_cached_block found a block
    num_cache_misses: int = 0  # get_cached_block found none
    num_evictions: int = 0  # a cached free block was reused and its hash dropped


class BlockPool:
    """Allocation, reference counting, caching and lazy eviction of ``num_blocks`` blocks.

    Invariants (checked by pagedkv.kv.invariants.check_pool):
    - block 0 is the null block: never handed out, freed, cached or in the free queue;
    - a block is in the free queue iff its ref_cnt is 0, so free + in use = num_blocks - 1;
    - a block has a hash iff it is in the hash map under that hash.

    Freed blocks go back to the free queue in an order that makes it an eviction
    queue: uncached blocks to the front (nothing to lose, reused first), cached ones
    to the back (kept for prefix hits as long as possible). A cached block stays
    findable by its hash until ``get_new_blocks`` hands it out again (lazy eviction).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise KVCacheUsageError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Every block, indexed by block_id.
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks (and, with caching, eviction candidates) in hand-out order.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Cached full blocks, in use or free, by hash.
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Padding entry of block tables; its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.stats = BlockPoolStats()

    # -- lookup and caching ---------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block holding ``block_hash``, or None (counted as hit or miss)."""
        block = self.cached_block_hash_to_block.get_one_block(block_hash)
        if block is None:
            self.stats.num_cache_misses += 1
        else:
            self.stats.num_cache_hits += 1
        return block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]``, just filled, by hash.

        ``block_hashes[i]`` is the chain hash of ``blocks[i]`` (a request's list).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(block_hashes) < num_full_blocks or len(blocks) < num_full_blocks:
            raise KVCacheUsageError(
                f"cache_full_blocks: {num_full_blocks} full blocks need as many blocks and "
                f"hashes, got {len(blocks)} blocks and {len(block_hashes)} hashes"
            )
        cache = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            assert not block.is_null, "the null block is never cached"
            if block.block_hash is not None:
                # shared with a request that registered it first (a fork's parent)
                assert block.block_hash == block_hashes[i], f"{block} cached under another hash"
                continue
            block.block_hash = block_hashes[i]
            cache.insert(block.block_hash, block)

    # -- allocation -----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, ref_cnt 1 each.

        A cached block taken here loses its hash (lazy eviction). Raises
        OutOfBlocksError when fewer are free.
        """
        if num_blocks < 0:
            raise KVCacheUsageError(f"get_new_blocks: num_blocks must be >= 0, got {num_blocks}")
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            raise OutOfBlocksError(
                f"cannot get {num_blocks} free blocks: {num_free} of {self.num_blocks - 1} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"{block} was in the free queue with references"
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a prefix hit); revive those that were free."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 becomes free.

        Order is eviction priority among cached blocks: the first freed is evicted
        first. Uncached blocks go to the front of the queue instead. All or nothing:
        if any block would drop below 0 references (freed twice, or listed more often
        than it is held), DoubleFreeError names it and no reference is dropped.
        """
        blocks = ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks)
        queue = self.free_block_queue
        for i, block in enumerate(blocks):
            if block.ref_cnt > 0:
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    if block.block_hash is None:
                        queue.appendleft(block)
                    else:
                        queue.append(block)
            elif not block.is_null:  # the null block's count is not kept: skipped
                self._undo_free(blocks[:i])
                raise DoubleFreeError(
                    f"free_blocks: block {block.block_id} is already free (listed at "
                    f"position {i} of {len(blocks)}); no block was freed"
                )

    def _undo_free(self, freed: list[KVCacheBlock]) -> None:
        """Take back the references free_blocks dropped from ``freed``, last first."""
        for block in reversed(freed):
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        popped = self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        assert popped is block, f"{block} had a hash but was not in the hash map"
        block.block_hash = None
        self.stats.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only while no block is in use; False otherwise."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for _, block in list(self.cached_block_hash_to_block.items()):
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def shuffle_free_blocks(self, rng: random.Random | int) -> None:
        """Hand out the free, uncached blocks in a random order from now on.

        For tests: a long-running server hands out scattered block ids, a fresh pool
        1, 2, 3, ...; shuffled ids catch a backend or table that assumes neighbours.
        ``rng`` is a ``random.Random`` or a seed. Cached free blocks keep their
        eviction order behind the uncached ones (the queue keeps that split).
        """
        rng = random.Random(rng) if isinstance(rng, int) else rng
        queue = self.free_block_queue
        free = queue.popleft_n(queue.num_free_blocks)
        uncached = [b for b in free if b.block_hash is None]
        rng.shuffle(uncached)
        queue.append_n(uncached + [b for b in free if b.block_hash is not None])

    # -- state ------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks that get_new_blocks can hand out (free or evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (the null block excluded) in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
