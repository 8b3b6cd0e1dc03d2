"""A seeded order of the free blocks, so tests see physical blocks far from logical order.

The block pool hands blocks out in queue order and offers no way to seed it; this
takes every free block and frees them again in a shuffled order, through the pool's
public calls. Only on an idle pool (nothing allocated or cached).
"""

from __future__ import annotations

import random

from pagedkv.kv import KVCacheManager
from pagedkv.serving.errors import EngineConfigError


def shuffle_free_blocks(manager: KVCacheManager, seed: int) -> None:
    pool = manager.block_pool
    num_free = pool.get_num_free_blocks()
    if manager.req_to_blocks or num_free != pool.num_blocks - 1:
        raise EngineConfigError("shuffle_free_blocks: the pool must be idle (no block in use)")
    blocks = pool.get_new_blocks(num_free)
    random.Random(seed).shuffle(blocks)
    pool.free_blocks(blocks)  # uncached blocks go to the front: the queue is the reverse
