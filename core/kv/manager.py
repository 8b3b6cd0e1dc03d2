"""KVCacheManager: which blocks each request holds; prefix hits, growth, fork and copy-on-write."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import DoubleFreeError, KVCacheUsageError, UnknownRequestError
from pagedkv.intmath import cdiv
from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import BlockHasher
from pagedkv.kv.request import Request

# How many freed request ids to remember so a second free says "already freed".
_FREED_IDS_REMEMBERED = 4096


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the worker copies block ``src`` into ``dst`` before the step runs.

    ``dst`` replaced ``src`` at ``block_index`` of ``request_id``'s block list.
    """

    request_id: str
    block_index: int
    src: int
    dst: int


@dataclass
class PrefixCacheStats:
    """get_computed_blocks lookups, in tokens."""

    num_requests: int = 0
    num_query_tokens: int = 0  # tokens that could have hit (prompt minus the last token)
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


def _raise_negative(rid: str, **counts: int) -> None:
    name, value = next((k, v) for k, v in counts.items() if v < 0)
    raise KVCacheUsageError(f"request {rid!r}: {name} must be >= 0, got {value}")


class KVCacheManager:
    """The blocks of every running request, over one BlockPool.

    A request's block list maps its logical block ``i`` (tokens ``i*B .. i*B+B-1``)
    to a physical block. Lists only grow, except that copy-on-write replaces a
    shared block the request is about to write into (reported by ``take_copies``).
    The caller (a scheduler) owns ``request.num_computed_tokens`` and advances it
    after each step; fork only between steps.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        *,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
    ) -> None:
        for name, value in (("block_size", block_size), ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value <= 0:
                raise KVCacheUsageError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = cdiv(max_model_len, block_size)
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        # request id -> its blocks, logical order
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are registered in the hash map
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._pending_copies: list[BlockCopy] = []
        self._recently_freed: OrderedDict[str, None] = OrderedDict()

    # -- prefix cache -----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks matching the request's prefix.

        Returns (blocks, num_computed_tokens), a multiple of block_size. Capped below
        ``request.num_tokens`` so the last token is always computed (its logits are
        needed). Takes no references: pass the result to allocate_slots right away.
        """
        if not self.enable_caching or request.num_tokens == 0:
            return [], 0
        hashes = self.hasher.update(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        pool = self.block_pool
        for i in range(min(max_hit_blocks, len(hashes))):
            block = pool.get_cached_block(hashes[i])
            if block is None:
                break
            blocks.append(block)
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.num_query_tokens += request.num_tokens - 1
        stats.num_hit_tokens += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for this step's tokens of ``request``; return the blocks appended.

        After the call the request holds blocks for ``num_computed_tokens +
        num_new_computed_tokens + num_new_tokens + num_lookahead_tokens`` tokens
        (capped at max_model_len). ``new_computed_blocks`` (prefix hits from
        get_computed_blocks, ``num_new_computed_tokens`` tokens) are only accepted on
        a request's first allocation. Returns None, changing nothing, when the pool
        cannot supply the blocks. Shared blocks this step writes into are replaced
        by copies: see take_copies.
        """
        rid = request.request_id
        if min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens) < 0 or (
            request.num_computed_tokens < 0
        ):
            _raise_negative(
                rid,
                num_new_tokens=num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
                num_computed_tokens=request.num_computed_tokens,
            )
        B = self.block_size
        req_blocks = self.req_to_blocks.get(rid)
        num_held = len(req_blocks) if req_blocks is not None else 0
        if new_computed_blocks or num_new_computed_tokens:
            new_computed_blocks = list(new_computed_blocks)
            self._check_new_computed(
                request, req_blocks, new_computed_blocks, num_new_computed_tokens
            )
        if request.num_computed_tokens > num_held * B:
            raise KVCacheUsageError(
                f"request {rid!r}: num_computed_tokens = {request.num_computed_tokens} but it "
                f"holds {num_held} blocks ({num_held * B} slots)"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_written_end = num_computed + num_new_tokens
        if num_written_end > self.max_model_len:
            raise KVCacheUsageError(
                f"request {rid!r}: {num_computed} computed + {num_new_tokens} new tokens = "
                f"{num_written_end} exceed max_model_len {self.max_model_len}"
            )
        num_slots = min(num_written_end + num_lookahead_tokens, self.max_model_len)
        num_required = cdiv(num_slots, B)
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # Copy-on-write: a held block this step writes into that someone else holds too.
        cow_indices: list[int] = []
        if req_blocks and num_slots > num_computed:
            for j in range(num_computed // B, min(num_held, num_required)):
                if req_blocks[j].ref_cnt > 1:
                    cow_indices.append(j)
        pool = self.block_pool
        # Prefix hits with ref_cnt 0 sit in the free queue; touching them removes them.
        num_revived = 0
        if new_computed_blocks:
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(cow_indices) > pool.get_num_free_blocks() - num_revived:
            return None

        # -- from here on nothing can fail ---------------------------------------------------
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_block[rid] = 0
            self._recently_freed.pop(rid, None)
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = len(new_computed_blocks)
        if cow_indices:
            self._copy_on_write(rid, req_blocks, cow_indices)
        if num_new_blocks:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
        if self.enable_caching:
            # Blocks whose tokens are all known and scheduled by the end of this step;
            # draft (lookahead) tokens are not known yet, so they never count.
            num_full = min(num_written_end, request.num_tokens) // B
            num_cached = self.num_cached_block[rid]
            if num_full > num_cached:
                hashes = self.hasher.update(request)
                pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
                self.num_cached_block[rid] = num_full
        return new_blocks

    def _check_new_computed(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        new_computed_blocks: list[KVCacheBlock],
        num_new_computed_tokens: int,
    ) -> None:
        rid = request.request_id
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise KVCacheUsageError(
                f"request {rid!r}: num_new_computed_tokens = {num_new_computed_tokens}, expected "
                f"{len(new_computed_blocks)} new_computed_blocks x block_size {self.block_size}"
            )
        if req_blocks is not None:
            raise KVCacheUsageError(
                f"request {rid!r}: new_computed_blocks are only accepted on its first "
                f"allocation, and it already holds {len(req_blocks)} blocks"
            )
        hashes = self.hasher.update(request)
        for i, block in enumerate(new_computed_blocks):
            if i >= len(hashes) or block.is_null or block.block_hash != hashes[i]:
                raise KVCacheUsageError(
                    f"request {rid!r}: new_computed_blocks[{i}] (block {block.block_id}) no "
                    "longer caches this request's prefix (evicted since get_computed_blocks? "
                    "call allocate_slots right after it)"
                )

    def _copy_on_write(
        self, rid: str, req_blocks: list[KVCacheBlock], cow_indices: list[int]
    ) -> None:
        pool = self.block_pool
        fresh = pool.get_new_blocks(len(cow_indices))
        for j, dst in zip(cow_indices, fresh, strict=True):
            src = req_blocks[j]
            req_blocks[j] = dst
            pool.free_blocks([src])  # another holder keeps it alive (ref_cnt was > 1)
            self._pending_copies.append(BlockCopy(rid, j, src.block_id, dst.block_id))
        # a replaced block that was cached is registered again (dst) when full
        self.num_cached_block[rid] = min(self.num_cached_block[rid], cow_indices[0])

    def take_copies(self) -> list[BlockCopy]:
        """Copies the worker must apply (``backend.copy_blocks``) before the next forward.

        Drains the list. Apply them before any K/V write of the step: a source block
        may be freed and handed to another request in the same step.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- fork and free -----------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref_cnt + 1 each).

        For parallel sampling: call between steps, with a child Request made by
        ``parent.fork(child_id)``. The first of them to write into a shared,
        partially filled block gets a copy of it (see take_copies).
        """
        if child_id in self.req_to_blocks:
            raise KVCacheUsageError(f"fork: request {child_id!r} already holds blocks")
        blocks = self._blocks_of(parent_id, "fork")
        self.block_pool.touch(blocks)
        self.req_to_blocks[child_id] = list(blocks)
        self.num_cached_block[child_id] = self.num_cached_block[parent_id]
        self._recently_freed.pop(child_id, None)

    def free(self, request: Request | str) -> None:
        """Release the request's blocks, last block first, so a cached prompt's tail
        is evicted before its head (the head is the part other prompts share)."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self._blocks_of(rid, "free")
        del self.req_to_blocks[rid]
        del self.num_cached_block[rid]
        self.block_pool.free_blocks(reversed(blocks))
        if any(c.request_id == rid for c in self._pending_copies):
            self._pending_copies = [c for c in self._pending_copies if c.request_id != rid]
        self._recently_freed[rid] = None
        if len(self._recently_freed) > _FREED_IDS_REMEMBERED:
            self._recently_freed.popitem(last=False)

    def _blocks_of(self, request_id: str, action: str) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is not None:
            return blocks
        if request_id in self._recently_freed:
            raise DoubleFreeError(f"{action}: request {request_id!r} was already freed")
        raise UnknownRequestError(
            f"{action}: request {request_id!r} holds no blocks (never allocated); "
            f"{len(self.req_to_blocks)} requests hold blocks"
        )

    # -- queries -----------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """Physical block ids of the request, logical order."""
        return [b.block_id for b in self._blocks_of(request_id, "get_block_ids")]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds blocks."""
        return self.block_pool.reset_prefix_cache()
