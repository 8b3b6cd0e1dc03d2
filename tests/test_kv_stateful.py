"""Random allocate / step / fork / free / prefix-hit sequences against KVCacheManager.

Besides the pool's own invariants, the machine keeps a model of the cache
*contents*: every computed position holds a value that depends on the request's
whole prefix (as real K/V does). After each step every running request must read
its own tokens back through its block list, so a wrong prefix hit, a missing
copy-on-write or a write into someone else's block shows up as a wrong value.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from pagedkv.errors import DoubleFreeError, UnknownRequestError
from pagedkv.kv import KVCacheManager, Request
from pagedkv.kv.invariants import check_manager

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_MODEL_LEN = 40
# A few shared prefixes so that prompts hit each other's cached blocks.
PREFIXES = ((), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9, 5), (7,) * 13)


def content(request: Request, position: int) -> tuple:
    """What the K/V at ``position`` of ``request`` is a function of."""
    return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))


class KVManagerMachine(RuleBasedStateMachine):
    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(
            NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, enable_prefix_caching=self.enable_caching
        )
        self.running: dict[str, Request] = {}
        self.cache: dict[int, list] = {}  # block id -> value at each offset
        self.next_id = 0
        self.freed: list[str] = []

    @initialize()
    def start(self) -> None:
        assert self.manager.get_num_free_blocks() == NUM_BLOCKS - 1

    # -- the worker: apply copies, then write this step's K/V --------------------------------

    def execute(self, request: Request, num_new: int) -> None:
        for copy in self.manager.take_copies():
            event("copy-on-write")
            assert self.manager.block_pool.blocks[copy.src].ref_cnt >= 1, "copy from a freed block"
            self.cache[copy.dst] = list(self.cache.get(copy.src, [None] * BLOCK_SIZE))
        blocks = self.manager.get_block_ids(request.request_id)
        start = request.num_computed_tokens
        for p in range(start, start + num_new):
            row = self.cache.setdefault(blocks[p // BLOCK_SIZE], [None] * BLOCK_SIZE)
            row[p % BLOCK_SIZE] = content(request, p)
        request.num_computed_tokens += num_new

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # -- rules -----------------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=10),
        salt=st.sampled_from([None, None, "tenant-b"]),
        chunk=st.integers(1, 16),
    )
    def add_request(self, prefix: tuple, tail: list, salt: str | None, chunk: int) -> None:
        tokens = list(prefix) + tail
        if not tokens:
            tokens = [0]
        request = Request(self.new_id(), tokens, cache_salt=salt)
        hits, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit % BLOCK_SIZE == 0 and num_hit < request.num_tokens
        for i, block in enumerate(hits):
            assert block.block_hash == request.block_hashes[i]
        if num_hit:
            event("prefix hit")
        num_new = min(request.num_tokens - num_hit, chunk)
        before = self.manager.get_num_free_blocks()
        new = self.manager.allocate_slots(request, num_new, num_hit, hits)
        if new is None:
            event("allocation refused")
            assert self.manager.get_num_free_blocks() == before
            assert request.request_id not in self.manager.req_to_blocks
            return
        request.num_computed_tokens = num_hit
        self.running[request.request_id] = request
        self.execute(request, num_new)

    # Rules draw their target themselves and do nothing on an empty state: preconditions
    # that are often false make hypothesis abandon examples.
    @rule(data=st.data(), lookahead=st.integers(0, 3))
    def step(self, data: st.DataObject, lookahead: int) -> None:
        if not self.running:
            return
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                return
            request.append_output_token_ids(data.draw(st.integers(0, 3)))  # the sampled token
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        before = [list(b) for b in self.manager.req_to_blocks.values()]
        new = self.manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
        if new is None:
            assert [list(b) for b in self.manager.req_to_blocks.values()] == before
            assert not self.manager.take_copies()
            return
        self.execute(request, num_new)

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        if not self.running:
            return
        parent = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        child = parent.fork(self.new_id())
        free_before = self.manager.get_num_free_blocks()
        self.manager.fork(parent.request_id, child.request_id)
        assert self.manager.get_num_free_blocks() == free_before, "fork must not allocate"
        assert self.manager.get_block_ids(child.request_id) == self.manager.get_block_ids(
            parent.request_id
        )
        self.running[child.request_id] = child

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.running:
            return
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(self.running.pop(rid))
        self.freed.append(rid)

    @rule(data=st.data())
    def misuse_double_free(self, data: st.DataObject) -> None:
        if not self.freed:
            return
        rid = data.draw(st.sampled_from(self.freed))
        free_before = self.manager.get_num_free_blocks()
        with pytest.raises(DoubleFreeError, match="already freed"):
            self.manager.free(rid)
        with pytest.raises(UnknownRequestError, match="never allocated"):
            self.manager.free("never-seen")
        assert self.manager.get_num_free_blocks() == free_before

    # -- checks after every step ------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        check_manager(self.manager)
        assert set(self.manager.req_to_blocks) == set(self.running)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for rid, request in self.running.items():
            blocks = self.manager.get_block_ids(rid)
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
            for p in range(request.num_computed_tokens):
                got = self.cache[blocks[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                assert got == content(request, p), f"{rid} position {p}: {got}"

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
