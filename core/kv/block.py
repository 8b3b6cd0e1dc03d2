"""KVCacheBlock: the bookkeeping record of one physical block of the KV pool."""

from __future__ import annotations

BlockHash = bytes  # a digest from pagedkv.kv.hashing; the key of the prefix cache


class KVCacheBlock:
    """Metadata of one physical block; the K/V data itself lives in the backend's cache.

    A block is in exactly one of three states: in use (``ref_cnt > 0``, held by one
    or more requests), free and cached (``ref_cnt == 0`` with a hash: an eviction
    candidate a prefix hit may revive), or free (``ref_cnt == 0``, no hash).
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        # Block ID, in [0, num_blocks); also the index of the block in the backend's cache.
        self.block_id = block_id
        # Number of requests whose block list holds this block. Owned by BlockPool.
        self.ref_cnt = 0
        # Hash of the full block's contents and its prefix, set once the block is full
        # and cached; cleared when the block is evicted. Owned by BlockPool.
        self.block_hash: BlockHash | None = None
        # Links of the free list; only FreeKVCacheBlockQueue reads or writes them.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        # The null block (id 0) pads block tables; its ref_cnt is not maintained.
        self.is_null = False

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest})"
