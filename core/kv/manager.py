"""KVCacheManager: which blocks each request holds; prefix hits, growth, fork and copy-on-write."""

from __future__ import annotations

import random
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
    """Copy-on-write: the worker copies block ``src`` into ``dst`` before the next step.

    ``dst`` holds ``request_id``'s logical block ``block_index``; ``src`` is the block
    it shares that block's tokens with.
    """

    request_id: str
    block_index: int
    src: int
    dst: int


@dataclass(frozen=True)
class ForkResult:
    """What ``KVCacheManager.fork`` made: the child request and the copies to apply.

    The worker applies ``copies`` (``backend.copy_blocks`` on every layer's cache)
    before the next step writes any K/V.
    """

    child: Request
    copies: tuple[BlockCopy, ...]


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
    to a physical block. Lists only grow; an entry never changes once made. A request
    never writes into a block another request holds: prefix hits and the blocks a
    fork shares are full of computed tokens, and fork copies a partly filled one.

    Life cycle of one step: ``allocate_slots`` (room for the step's tokens),
    ``take_new_block_ids`` (what the step assembler needs), the forward, then
    ``mark_computed`` (the step's tokens are in the cache: their full blocks become
    prefix-cache hits for other requests). ``free`` at any point in between (abort,
    preemption, a failed forward) leaves nothing behind in the prefix cache that was
    not computed.
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
        # request id -> how many of its leading block ids take_new_block_ids returned
        self.num_reported_block: dict[str, int] = {}
        # request id -> its num_computed_tokens as the manager last set it
        self.num_computed_tokens: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
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
        """Make room for this step's tokens of ``request``; return the blocks it took.

        After the call the request holds blocks for ``num_computed_tokens +
        num_new_computed_tokens + num_new_tokens + num_lookahead_tokens`` tokens
        (capped at max_model_len). ``new_computed_blocks`` (prefix hits from
        get_computed_blocks, ``num_new_computed_tokens`` tokens) are only accepted on
        a request's first allocation; on success they count in
        ``request.num_computed_tokens``. Returns the blocks taken from the pool (prefix
        hits not included; ``take_new_block_ids`` gives the assembler's view), or
        None, changing nothing, when the pool cannot supply them.

        Registers nothing in the prefix cache: the step's blocks become hits only
        when ``mark_computed`` says their tokens were written.
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
        if req_blocks is not None:
            self._check_computed(request, "allocate_slots")
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
        # prefix hits and a fork's shared blocks lie below num_computed: never written
        assert not req_blocks or all(b.ref_cnt == 1 for b in req_blocks[num_computed // B :]), (
            f"request {rid!r}: this step would write into a block another request holds"
        )
        pool = self.block_pool
        # Prefix hits with ref_cnt 0 sit in the free queue; touching them removes them.
        num_revived = 0
        if new_computed_blocks:
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > pool.get_num_free_blocks() - num_revived:
            return None

        # -- from here on nothing can fail ---------------------------------------------------
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_block[rid] = 0
            self.num_reported_block[rid] = 0
            self.num_computed_tokens[rid] = request.num_computed_tokens
            self._recently_freed.pop(rid, None)
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = len(new_computed_blocks)
            request.num_computed_tokens = num_computed  # the hits are computed tokens
            self.num_computed_tokens[rid] = num_computed
        if num_new_blocks:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
        return new_blocks

    def _check_computed(self, request: Request, action: str) -> None:
        counted = self.num_computed_tokens[request.request_id]
        if request.num_computed_tokens != counted:
            raise KVCacheUsageError(
                f"{action}: request {request.request_id!r}: num_computed_tokens is "
                f"{request.num_computed_tokens}, but the manager counted {counted} (prefix hits "
                "and mark_computed): advance it only with mark_computed(request, n) after the "
                "step, which also makes its blocks prefix-cache hits"
            )

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` more tokens of ``request`` are in the cache: the step ran.

        Call it after the forward that wrote them (for speculative decoding: the
        scheduled tokens that were accepted). Advances ``request.num_computed_tokens``
        and registers the blocks now full of computed tokens in the prefix cache,
        as far as the request's token ids are known (placeholders are not).
        """
        rid = request.request_id
        blocks = self._blocks_of(rid, "mark_computed")
        self._check_computed(request, "mark_computed")
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise KVCacheUsageError(
                f"mark_computed: request {rid!r}: num_tokens must be an int >= 0, got {num_tokens!r}"
            )
        num_computed = request.num_computed_tokens + num_tokens
        if num_computed > len(blocks) * self.block_size:
            raise KVCacheUsageError(
                f"mark_computed: request {rid!r}: {request.num_computed_tokens} + {num_tokens} "
                f"computed tokens exceed the {len(blocks) * self.block_size} slots of its "
                f"{len(blocks)} blocks (allocate_slots before the step)"
            )
        request.num_computed_tokens = self.num_computed_tokens[rid] = num_computed
        if not self.enable_caching:
            return
        num_full = min(num_computed, request.num_known_tokens) // self.block_size
        num_cached = self.num_cached_block[rid]
        if num_full > num_cached:
            hashes = self.hasher.update(request)
            self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
            self.num_cached_block[rid] = num_full

    def take_new_block_ids(self, request_id: str) -> list[int]:
        """Block ids added to the request's list since the last call; all of them on the
        first call (after admission, a fork, or re-admission after preemption).

        This is ``ScheduledRequest.new_block_ids``: call it once per step for each
        scheduled request, after ``allocate_slots``.
        """
        blocks = self._blocks_of(request_id, "take_new_block_ids")
        start = self.num_reported_block[request_id]
        self.num_reported_block[request_id] = len(blocks)
        return [b.block_id for b in blocks[start:]]

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

    # -- fork and free -----------------------------------------------------------------------

    def fork(self, parent: Request, child_id: str) -> ForkResult | None:
        """A parallel sample: ``child_id`` continues from ``parent``'s computed tokens.

        Call between steps. The child is ``parent.fork(child_id)`` (same tokens and
        progress); it shares the parent's full computed blocks (ref_cnt + 1 each) and
        gets its own copy of a partly filled last one, since both will write their
        next tokens there. Returns the child and the copy to apply, or None, changing
        nothing, when no block is free for the copy.
        """
        pid = parent.request_id
        blocks = self._blocks_of(pid, "fork")
        if child_id in self.req_to_blocks:
            raise KVCacheUsageError(f"fork: request {child_id!r} already holds blocks")
        self._check_computed(parent, "fork")
        num_computed = parent.num_computed_tokens
        num_full, num_partial = divmod(num_computed, self.block_size)
        pool = self.block_pool
        if num_partial and pool.get_num_free_blocks() < 1:
            return None
        child = parent.fork(child_id)  # validates child_id before anything changes
        shared = blocks[:num_full]
        pool.touch(shared)
        child_blocks = list(shared)
        copies: tuple[BlockCopy, ...] = ()
        if num_partial:
            (dst,) = pool.get_new_blocks(1)
            child_blocks.append(dst)
            copies = (BlockCopy(child_id, num_full, blocks[num_full].block_id, dst.block_id),)
        self.req_to_blocks[child_id] = child_blocks
        self.num_cached_block[child_id] = min(self.num_cached_block[pid], num_full)
        self.num_reported_block[child_id] = 0
        self.num_computed_tokens[child_id] = num_computed
        self._recently_freed.pop(child_id, None)
        return ForkResult(child, copies)

    def free(self, request: Request | str) -> None:
        """Release the request's blocks, last block first, so a cached prompt's tail
        is evicted before its head (the head is the part other prompts share).

        Safe at any point of the request's life: only blocks ``mark_computed``
        registered stay findable. Free only when no forward in flight still writes the
        request's blocks: they can be handed to another request at once.
        """
        rid = request if isinstance(request, str) else request.request_id
        blocks = self._blocks_of(rid, "free")
        self.block_pool.free_blocks(reversed(blocks))
        del self.req_to_blocks[rid]
        del self.num_cached_block[rid]
        del self.num_reported_block[rid]
        del self.num_computed_tokens[rid]
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

    def shuffle_free_blocks(self, rng: random.Random | int) -> None:
        """Hand out free blocks in a random order (tests); see BlockPool.shuffle_free_blocks."""
        self.block_pool.shuffle_free_blocks(rng)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds blocks."""
        return self.block_pool.reset_prefix_cache()
