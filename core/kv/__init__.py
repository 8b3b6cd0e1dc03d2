"""The memory side of PagedAttention: blocks, prefix caching, block tables, capacity.

Pure Python / numpy on the hot paths; no backend imports. The worker applies the
manager's copy-on-write copies with ``AttentionBackend.copy_blocks``.
"""

from __future__ import annotations

from pagedkv.errors import (
    DoubleFreeError,
    KVCacheUsageError,
    OutOfBlocksError,
    UnknownRequestError,
)
from pagedkv.kv.block import BlockHash, KVCacheBlock
from pagedkv.kv.block_pool import BlockPool, BlockPoolStats
from pagedkv.kv.block_table import BlockTable
from pagedkv.kv.capacity import CapacityEstimate, KVShape, estimate_capacity, kv_budget_bytes
from pagedkv.kv.free_queue import FreeKVCacheBlockQueue
from pagedkv.kv.hashing import BlockHasher, get_hash_fn
from pagedkv.kv.manager import BlockCopy, ForkResult, KVCacheManager, PrefixCacheStats
from pagedkv.kv.presets import PRESETS, ModelPreset
from pagedkv.kv.request import PLACEHOLDER_TOKEN_ID, MultiModalSpan, Request
from pagedkv.kv.step import ScheduledRequest, StepAssembler, copies_to_tensors

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "PRESETS",
    "BlockCopy",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockPoolStats",
    "BlockTable",
    "CapacityEstimate",
    "DoubleFreeError",
    "ForkResult",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheUsageError",
    "KVShape",
    "ModelPreset",
    "MultiModalSpan",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "Request",
    "ScheduledRequest",
    "StepAssembler",
    "UnknownRequestError",
    "copies_to_tensors",
    "estimate_capacity",
    "get_hash_fn",
    "kv_budget_bytes",
]
