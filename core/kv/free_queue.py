"""FreeKVCacheBlockQueue: the free blocks, in the order they are handed out."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.kv.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks; O(1) popleft, remove and append.

    Why not a deque: a prefix-cache hit revives a free block from the middle of the
    queue, and the links live in the blocks themselves, so no Python objects are
    allocated per operation.

    Order: the front is handed out (and its stale hash evicted) first. BlockPool
    keeps it least-recently-used first by where it puts freed blocks; this class
    only keeps the links. Two sentinels, never popped, spare every operation the
    empty-list branches.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(-1)  # sentinel after the last free block
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block. Raises ValueError when empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, front first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None and block is not self._tail
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        assert block is not None
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out from anywhere in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back: handed out last."""
        self._insert_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front: handed out next."""
        self._insert_after(self._head, block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        count = 0
        for block in blocks:
            assert block.prev_free_block is None and block.next_free_block is None, block
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front first. O(n): mainly used for testing."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks

    # -- links ------------------------------------------------------------------------

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None and prev.next_free_block is not None
        assert block.prev_free_block is None and block.next_free_block is None, block
        nxt = prev.next_free_block
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
