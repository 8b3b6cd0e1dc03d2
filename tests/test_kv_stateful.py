"""Random engine life cycles against KVCacheManager: admission with prefix hits, several
allocations per step, chunked prefill, speculative slots with partial acceptance,
forks, failed forwards, preemption by recompute and aborts at every point, in a pool
small enough that allocations are refused and cached blocks evicted.

Besides the pool's own invariants, the machine keeps a model of the cache *contents*:
every written position holds a value that depends on the request's whole prefix (as
real K/V does); a failed forward leaves junk and rejected drafts leave draft values.
After each rule every running request must read its own computed tokens back through
its block list, and every block in the prefix cache must hold exactly the tokens its
hash names: a hit on a block nobody wrote, a missing copy-on-write or a write into
someone else's block shows up as a wrong value.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from pagedkv.errors import DoubleFreeError, UnknownRequestError
from pagedkv.kv import KVCacheManager, Request
from pagedkv.kv.invariants import check_manager

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 11 usable; one request may take 10: allocations compete and evict
MAX_MODEL_LEN = 40
MAX_DRAFTS = 3
# A few shared prefixes so that prompts hit each other's cached blocks.
PREFIXES = ((), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9, 5), (7,) * 13)
JUNK = "written by a forward that failed"


def content(request: Request, position: int) -> tuple:
    """What the K/V at ``position`` of ``request`` is a function of."""
    return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))


@dataclass(frozen=True)
class Planned:
    """A request's share of the coming step: its slots are allocated, nothing written."""

    num_new: int
    drafts: tuple[int, ...] = ()  # speculative tokens, written into lookahead slots


class KVManagerMachine(RuleBasedStateMachine):
    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(
            NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, enable_prefix_caching=self.enable_caching
        )
        self.running: dict[str, Request] = {}  # requests holding blocks
        self.batch: dict[str, Planned] = {}  # allocated for the coming step
        self.reported: dict[str, list[int]] = {}  # block ids the assembler was given
        self.preempted: list[Request] = []  # freed, waiting to be recomputed
        self.never_ran: set[str] = set()  # forked children before their first step
        self.cache: dict[int, list] = {}  # block id -> value at each offset
        self.seen: list[Request] = []  # every request made: the sources of every hash
        self.expected: dict[bytes, list] = {}  # hash -> the contents it names
        self.num_hashes_seen: dict[str, int] = {}
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------------------------

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def pick(self, data: st.DataObject, candidates: list[str]) -> Request | None:
        if not candidates:
            return None
        return self.running[data.draw(st.sampled_from(sorted(candidates)))]

    def report(self, request: Request) -> None:
        """What a scheduler hands the step assembler, checked against the block list."""
        rid = request.request_id
        self.reported.setdefault(rid, []).extend(self.manager.take_new_block_ids(rid))
        assert self.reported[rid] == self.manager.get_block_ids(rid)

    def write(self, block_id: int, position: int, value: object) -> None:
        assert self.manager.block_pool.blocks[block_id].ref_cnt == 1, (
            f"a step writes into block {block_id}, which another request holds"
        )
        row = self.cache.setdefault(block_id, [None] * BLOCK_SIZE)
        row[position % BLOCK_SIZE] = value

    def admit(self, request: Request, chunk: int) -> bool:
        """Prefix lookup and allocation of the first chunk; False when refused."""
        hits, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit % BLOCK_SIZE == 0 and num_hit < request.num_tokens
        for i, block in enumerate(hits):
            assert block.block_hash == request.block_hashes[i]
        num_new = min(request.num_tokens - num_hit, chunk)
        before = self.manager.get_num_free_blocks()
        if self.manager.allocate_slots(request, num_new, num_hit, hits) is None:
            event("allocation refused (admission)")
            assert self.manager.get_num_free_blocks() == before
            assert request.request_id not in self.manager.req_to_blocks
            assert request.num_computed_tokens == 0
            return False
        if num_hit:
            event("prefix hit")
        assert request.num_computed_tokens == num_hit
        self.running[request.request_id] = request
        self.batch[request.request_id] = Planned(num_new)
        self.report(request)
        return True

    def release(self, rid: str) -> Request:
        request = self.running.pop(rid)
        self.manager.free(request)
        self.batch.pop(rid, None)
        self.reported.pop(rid, None)
        self.never_ran.discard(rid)
        return request

    # -- admission ------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=10),
        salt=st.sampled_from([None, None, "tenant-b"]),
        chunk=st.integers(1, 16),
        abort_after_lookup=st.integers(0, 5),
    )
    def add_request(
        self,
        data: st.DataObject,
        prefix: tuple,
        tail: list,
        salt: str | None,
        chunk: int,
        abort_after_lookup: int,
    ) -> None:
        """A new request, or (when one waits) a preempted one, recomputed."""
        if self.preempted and data.draw(st.booleans()):
            request = self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1)))
            if self.admit(request, chunk):
                event("preempted request re-admitted")
            else:
                self.preempted.append(request)
            return
        request = Request(self.new_id(), list(prefix) + tail or [0], cache_salt=salt)
        self.seen.append(request)
        if abort_after_lookup == 0:
            event("abort: after the prefix lookup, before allocation")
            before = self.manager.get_num_free_blocks()
            self.manager.get_computed_blocks(request)
            assert self.manager.get_num_free_blocks() == before  # a lookup holds nothing
            return
        self.admit(request, chunk)

    # -- building a step: several allocations ------------------------------------------------------

    @rule(data=st.data())
    def schedule_running(self, data: st.DataObject) -> None:
        request = self.pick(data, [r for r in self.running if r not in self.batch])
        if request is None:
            return
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                return
            request.append_output_token_ids(data.draw(st.integers(0, 3)))  # the sampled token
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = data.draw(st.integers(1, remaining))
        drafts: tuple[int, ...] = ()
        if num_new == remaining:  # the step reaches the last known token: it may speculate
            room = min(MAX_DRAFTS, MAX_MODEL_LEN - request.num_tokens)
            drafts = tuple(data.draw(st.lists(st.integers(0, 3), max_size=room)))
        rid = request.request_id
        before = {r: list(b) for r, b in self.manager.req_to_blocks.items()}
        if self.manager.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts)) is None:
            event("allocation refused (running request)")
            assert {r: list(b) for r, b in self.manager.req_to_blocks.items()} == before
            return
        self.batch[rid] = Planned(num_new, drafts)
        self.report(request)

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data, [r for r in self.running if r not in self.batch])
        if parent is None:
            return
        free_before = self.manager.get_num_free_blocks()
        result = self.manager.fork(parent, self.new_id())
        if result is None:
            event("fork refused: no block for the copy")
            assert self.manager.get_num_free_blocks() == free_before
            return
        event(f"fork with {len(result.copies)} copies")
        for copy in result.copies:  # the worker, before the next step writes anything
            assert self.manager.block_pool.blocks[copy.src].ref_cnt >= 1, "copy from a free block"
            self.cache[copy.dst] = list(self.cache.get(copy.src, [None] * BLOCK_SIZE))
        assert self.manager.get_num_free_blocks() == free_before - len(result.copies)
        child = result.child
        assert child.num_computed_tokens == parent.num_computed_tokens
        assert child.all_token_ids == parent.all_token_ids
        self.running[child.request_id] = child
        self.never_ran.add(child.request_id)
        self.seen.append(child)
        self.report(child)

    # -- the step: it runs, or its forward fails ------------------------------------------------

    @rule(data=st.data(), fails=st.integers(0, 4))
    def step(self, data: st.DataObject, fails: int) -> None:
        """The forward of every allocated request; one in five fails."""
        if not self.batch:
            return
        if fails == 0:
            self.failed_step(data)
            return
        event(f"step of {min(len(self.batch), 3)}{'+' * (len(self.batch) > 3)} requests")
        for rid, planned in self.batch.items():
            request = self.running[rid]
            blocks = self.manager.get_block_ids(rid)
            start = request.num_computed_tokens
            known = tuple(request.all_token_ids[: start + planned.num_new])
            for p in range(start, start + planned.num_new):
                self.write(blocks[p // BLOCK_SIZE], p, content(request, p))
            for j in range(len(planned.drafts)):
                p = start + planned.num_new + j
                draft_value = (request.cache_salt, known + planned.drafts[: j + 1])
                self.write(blocks[p // BLOCK_SIZE], p, draft_value)
        for rid, planned in self.batch.items():
            request = self.running[rid]
            accepted = data.draw(st.integers(0, len(planned.drafts)))
            if planned.drafts:
                event(
                    f"speculation: {'all' if accepted == len(planned.drafts) else 'part'} accepted"
                )
                request.append_output_token_ids(list(planned.drafts[:accepted]))
            self.manager.mark_computed(request, planned.num_new + accepted)
            if planned.drafts and request.num_tokens < MAX_MODEL_LEN:
                request.append_output_token_ids(data.draw(st.integers(0, 3)))  # the bonus token
            self.never_ran.discard(rid)
        self.batch.clear()

    def failed_step(self, data: st.DataObject) -> None:
        """The forward raised after writing some of the step's slots: nothing computed."""
        event("failed forward")
        for rid, planned in self.batch.items():
            request = self.running[rid]
            blocks = self.manager.get_block_ids(rid)
            start = request.num_computed_tokens
            for p in range(start, start + planned.num_new + len(planned.drafts)):
                self.write(blocks[p // BLOCK_SIZE], p, JUNK)
        failed = list(self.batch)
        self.batch.clear()
        for rid in failed:
            if data.draw(st.booleans()):
                event("abort: after a failed forward")
                self.release(rid)

    # -- leaving: abort and preemption at any point ----------------------------------------------

    @rule(data=st.data(), preempt=st.booleans())
    def leave(self, data: st.DataObject, preempt: bool) -> None:
        """Abort (the request is gone), or preempt (freed, recomputed later)."""
        request = self.pick(data, list(self.running))
        if request is None:
            return
        rid = request.request_id
        if rid in self.batch:
            when = "allocated, before the step ran"
        elif rid in self.never_ran:
            when = "forked, before its first step"
        elif request.num_computed_tokens < request.num_prompt_tokens:
            when = "between prefill chunks"
        else:
            when = "between decode steps"
        event(f"{'preempt' if preempt else 'abort'}: {when}")
        self.release(rid)
        if preempt:
            request.num_computed_tokens = 0
            self.preempted.append(request)
            return
        free_before = self.manager.get_num_free_blocks()
        with pytest.raises(DoubleFreeError, match="already freed"):
            self.manager.free(rid)
        with pytest.raises(UnknownRequestError, match="never allocated"):
            self.manager.free("never-seen")
        assert self.manager.get_num_free_blocks() == free_before

    @initialize(seed=st.integers(0, 2**16))
    def shuffle_free_blocks(self, seed: int) -> None:
        """Scattered block ids, as a long-running server hands out."""
        free_before = self.manager.get_num_free_blocks()
        self.manager.shuffle_free_blocks(seed)
        assert self.manager.get_num_free_blocks() == free_before

    # -- checks after every rule ------------------------------------------------------------------

    @invariant()
    def count_evictions(self) -> None:
        if self.manager.block_pool.stats.num_evictions:
            event("eviction of a cached block")

    @invariant()
    def pool_is_consistent(self) -> None:
        check_manager(self.manager, self.running)
        assert set(self.manager.req_to_blocks) == set(self.running)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for rid, request in self.running.items():
            blocks = self.manager.get_block_ids(rid)
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
            for p in range(request.num_computed_tokens):
                got = self.cache[blocks[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                assert got == content(request, p), f"{rid} position {p}: {got}"

    @invariant()
    def cached_blocks_hold_what_their_hash_names(self) -> None:
        """No prefix-cache entry points at a block whose tokens were never computed."""
        for request in self.seen:  # block_hashes only grow: add the new ones
            rid = request.request_id
            for i in range(self.num_hashes_seen.get(rid, 0), len(request.block_hashes)):
                self.expected.setdefault(
                    request.block_hashes[i],
                    [content(request, p) for p in range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)],
                )
            self.num_hashes_seen[rid] = len(request.block_hashes)
        for block_hash, block in self.manager.block_pool.cached_block_hash_to_block.items():
            got = self.cache.get(block.block_id)
            assert got == self.expected[block_hash], (
                f"block {block.block_id} is cached under a hash of other tokens: holds {got}"
            )

    def teardown(self) -> None:
        for rid in list(self.running):
            self.manager.free(rid)
        pool = self.manager.block_pool
        assert self.manager.get_num_free_blocks() == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        check_manager(self.manager)


class KVManagerNoCachingMachine(KVManagerMachine):
    enable_caching = False


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVManagerStateful = KVManagerMachine.TestCase
TestKVManagerStateful.settings = SETTINGS
TestKVManagerNoCachingStateful = KVManagerNoCachingMachine.TestCase
TestKVManagerNoCachingStateful.settings = settings(SETTINGS, max_examples=20)
