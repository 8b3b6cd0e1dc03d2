"""KVCacheManager: prefix-cache scenarios, fork / copy-on-write, hashing, misuse errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagedkv.errors import DoubleFreeError, KVCacheUsageError, UnknownRequestError
from pagedkv.kv import BlockCopy, KVCacheManager, MultiModalSpan, Request
from pagedkv.kv.hashing import BlockHasher, encode, encode_token_ids, get_hash_fn
from pagedkv.kv.invariants import check_manager

B = 16


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """Prefix lookup, allocation and a (pretend) prefill of the whole prompt."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = num_hit
    manager.mark_computed(request, request.num_tokens - num_hit)  # the step ran
    check_manager(manager, {request.request_id: request})
    return manager.get_block_ids(request.request_id)


def decode(manager: KVCacheManager, request: Request, token: int) -> None:
    request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    manager.mark_computed(request, 1)
    check_manager(manager)


SYSTEM = list(range(100, 140))  # 40 tokens: 2 full blocks + 8


# -- prefix caching --------------------------------------------------------------------------


def test_shared_system_prompt_hits_full_blocks():
    m = KVCacheManager(32, B, 256)
    a = Request("a", [*SYSTEM, 1, 2, 3])
    a_blocks = admit(m, a)
    b = Request("b", [*SYSTEM, 7, 8])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 32 and [h.block_id for h in hits] == a_blocks[:2]
    b_blocks = admit(m, b)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert [m.block_pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 1]
    assert m.prefix_cache_stats.num_hit_tokens == 2 * 32  # b's lookup twice (test + admit)
    # both gone: the blocks stay cached in the free queue and a third request revives them
    m.free(a)
    m.free(b)
    assert m.get_num_free_blocks() == 31
    c = Request("c", [*SYSTEM, 9])
    assert admit(m, c)[:2] == a_blocks[:2]
    assert m.block_pool.stats.num_evictions == 0


def test_last_prompt_token_is_always_recomputed():
    m = KVCacheManager(16, B, 256)
    admit(m, Request("a", list(range(32))))  # two full blocks, both cached
    same = Request("b", list(range(32)))
    _, num_hit = m.get_computed_blocks(same)
    assert num_hit == 16  # the second block holds the last token: recomputed
    longer = Request("c", list(range(33)))
    assert m.get_computed_blocks(longer)[1] == 32


@pytest.mark.parametrize(
    "other",
    [
        dict(cache_salt="tenant-2"),
        dict(lora_name="sql-adapter"),
        dict(mm_spans=[MultiModalSpan("img-digest-B", 4, 8)]),
    ],
)
def test_extra_keys_isolate_the_cache(other):
    base = dict(cache_salt="tenant-1", mm_spans=[MultiModalSpan("img-digest-A", 4, 8)])
    m = KVCacheManager(32, B, 256)
    admit(m, Request("a", SYSTEM, **base))
    assert m.get_computed_blocks(Request("same", SYSTEM, **base))[1] == 32
    assert m.get_computed_blocks(Request("other", SYSTEM, **{**base, **other}))[1] == 0


def test_salt_only_enters_the_first_block_but_changes_the_chain():
    hasher = BlockHasher(B)
    plain, salted = Request("p", SYSTEM), Request("s", SYSTEM, cache_salt="x")
    hp, hs = hasher.update(plain), hasher.update(salted)
    assert len(hp) == len(hs) == 2 and hp[0] != hs[0] and hp[1] != hs[1]


def test_multimodal_span_keys_only_the_blocks_it_touches():
    hasher = BlockHasher(4)
    tokens = list(range(12))
    a = Request("a", tokens, mm_spans=[MultiModalSpan("imgA", 5, 2)])
    b = Request("b", tokens, mm_spans=[MultiModalSpan("imgB", 5, 2)])
    ha, hb = hasher.update(a), hasher.update(b)
    assert ha[0] == hb[0]  # block 0 (tokens 0-3) holds no image token
    assert ha[1] != hb[1] and ha[2] != hb[2]


def test_eviction_order_tail_of_prompt_first_then_least_recent():
    m = KVCacheManager(7, 4, 64)  # 6 usable blocks of 4 tokens
    old = Request("old", list(range(13)))  # 3 full blocks + 1 token
    old_blocks = admit(m, old)
    m.free(old)
    # needs 5 blocks: old's uncached tail block and the 2 never-used ones, then 2 of old's
    # cached blocks, the prompt's tail (block 2) before block 1: block 0 survives
    new = Request("new", list(range(50, 70)))
    admit(m, new)
    assert m.block_pool.stats.num_evictions == 2
    survivors = m.get_computed_blocks(Request("probe", list(range(13))))[0]
    assert [b.block_id for b in survivors] == old_blocks[:1]


def test_free_reverse_order_keeps_shared_head():
    m = KVCacheManager(9, 4, 64)  # 8 usable
    first = Request("first", list(range(9)))  # blocks 0, 1 cached, 2 partial
    admit(m, first)
    m.free(first)
    later = Request("later", list(range(100, 109)))
    admit(m, later)
    m.free(later)
    queue = m.block_pool.free_block_queue.get_all_free_blocks()
    hashed = [b for b in queue if b.block_hash is not None]
    # least recently freed first; within a request its tail block before its head
    order = [
        (b.block_hash == first.block_hashes[1], b.block_hash == first.block_hashes[0])
        for b in hashed[:2]
    ]
    assert order == [(True, False), (False, True)]


# -- fork and copy-on-write ------------------------------------------------------------------


def test_parallel_sampling_shares_the_prompt_like_the_chapter():
    m = KVCacheManager(32, B, 256)
    parent = Request("s1", list(range(48)))  # 3 full blocks, as in the chapter's figure
    prompt_blocks = admit(m, parent)
    samples = [parent]
    for cid in ("s2", "s3"):
        fork = m.fork(parent, cid)
        assert fork.copies == ()  # full blocks are never written: nothing to copy
        samples.append(fork.child)
    assert [m.block_pool.blocks[i].ref_cnt for i in prompt_blocks] == [3, 3, 3]
    for i, s in enumerate(samples):
        decode(m, s, 1000 + i)
    tails = {m.get_block_ids(s.request_id)[3] for s in samples}
    assert len(tails) == 3 and not tails & set(prompt_blocks)
    assert 31 - m.get_num_free_blocks() == 6  # instead of 12 without sharing


def test_fork_copies_the_partly_filled_block_in_one_call():
    m = KVCacheManager(16, B, 256)
    parent = Request("p", list(range(20)))  # block 1 holds 4 computed tokens
    p_blocks = admit(m, parent)
    parent.append_output_token_ids(7)  # sampled, not computed yet: the child inherits it
    free_before = m.get_num_free_blocks()
    fork = m.fork(parent, "c")
    child = fork.child
    assert (child.request_id, child.all_token_ids, child.num_computed_tokens) == (
        "c",
        parent.all_token_ids,
        20,
    )
    c_blocks = m.get_block_ids("c")
    assert fork.copies == (BlockCopy("c", 1, p_blocks[1], c_blocks[1]),)
    assert c_blocks[0] == p_blocks[0] and c_blocks[1] != p_blocks[1]
    assert m.get_num_free_blocks() == free_before - 1
    assert [m.block_pool.blocks[i].ref_cnt for i in p_blocks] == [2, 1]
    # both write their next token in place: no shared block is ever written
    assert m.allocate_slots(parent, 1) == [] and m.allocate_slots(child, 1) == []
    m.mark_computed(parent, 1)
    m.mark_computed(child, 1)
    assert m.get_block_ids("p") == p_blocks and m.get_block_ids("c") == c_blocks
    check_manager(m, {"p": parent, "c": child})
    m.free(child)
    m.free(parent)
    assert m.get_num_free_blocks() == 15


def test_fork_without_a_free_block_changes_nothing():
    m = KVCacheManager(3, 4, 64)  # 2 usable
    parent = Request("p", list(range(6)))
    admit(m, parent)  # both blocks; block 1 partly filled
    before = [(b.ref_cnt, b.block_hash) for b in m.block_pool.blocks]
    assert m.fork(parent, "c") is None
    assert [(b.ref_cnt, b.block_hash) for b in m.block_pool.blocks] == before
    assert "c" not in m.req_to_blocks
    # a parent with only full computed blocks needs no free block
    m2 = KVCacheManager(3, 4, 64)
    full = Request("f", list(range(8)))
    admit(m2, full)
    assert m2.fork(full, "g").copies == ()


def test_computed_tokens_advance_only_through_the_manager():
    m = KVCacheManager(16, 4, 64)
    a = Request("a", list(range(9)))
    admit(m, a)
    a.append_output_token_ids(1)
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1  # by hand: its blocks would never become hits
    message = "num_computed_tokens is 10, but the manager counted 9 .* mark_computed"
    for call in (lambda: m.allocate_slots(a, 1), lambda: m.mark_computed(a, 1)):
        with pytest.raises(KVCacheUsageError, match=f"request 'a': {message}"):
            call()
    with pytest.raises(KVCacheUsageError, match=f"fork: request 'a': {message}"):
        m.fork(a, "b")
    a.num_computed_tokens = 9
    m.mark_computed(a, 1)
    check_manager(m, {"a": a})


# -- the step's life cycle: what the prefix cache learns, and when ----------------------------


def test_abort_before_the_step_leaves_no_prefix_hit():
    m = KVCacheManager(16, 4, 64)
    a = Request("a", list(range(10)))
    assert m.allocate_slots(a, 10) is not None
    m.free(a)  # aborted (or preempted, or its forward failed) before the step ran
    assert m.get_computed_blocks(Request("b", list(range(10)))) == ([], 0)
    check_manager(m)


def test_only_computed_blocks_become_hits():
    m = KVCacheManager(16, 4, 64)
    a = Request("a", list(range(14)))
    assert m.allocate_slots(a, 6) is not None  # first prefill chunk: tokens 0-5
    assert m.num_cached_block["a"] == 0  # nothing is registered before the step ran
    probe = Request("probe", list(range(14)))
    assert m.get_computed_blocks(probe)[1] == 0
    m.mark_computed(a, 6)
    assert a.num_computed_tokens == 6 and m.get_computed_blocks(probe)[1] == 4
    assert m.allocate_slots(a, 8) is not None  # second chunk, 6-13; then aborted
    m.free(a)
    # the computed block stays a hit; the two blocks the aborted chunk would have filled do not
    assert m.get_computed_blocks(probe)[1] == 4
    check_manager(m)


def test_speculative_slots_register_only_accepted_tokens():
    m = KVCacheManager(16, 4, 64)
    r = Request("r", list(range(7)))
    assert m.allocate_slots(r, 7) is not None
    m.mark_computed(r, 7)
    r.append_output_token_ids(100)  # sampled: position 7
    # verify 1 token + 4 drafts (positions 8-11 in lookahead slots)
    assert len(m.allocate_slots(r, 1, num_lookahead_tokens=4)) == 1
    assert len(m.get_block_ids("r")) == 3
    r.append_output_token_ids([101, 102])  # 2 of 4 drafts accepted
    m.mark_computed(r, 1 + 2)  # positions 7, 8, 9 are right; 10 and 11 held rejected drafts
    assert r.num_computed_tokens == 10 and m.num_cached_block["r"] == 2
    r.append_output_token_ids(103)  # the bonus token
    probe = Request("probe", [*range(7), 100, 101, 102, 103, 0, 0])
    assert m.get_computed_blocks(probe)[1] == 8
    check_manager(m, {"r": r})


def test_mark_computed_misuse():
    m = KVCacheManager(16, 4, 64)
    r = Request("r", list(range(6)))
    with pytest.raises(UnknownRequestError, match="mark_computed: request 'r' holds no blocks"):
        m.mark_computed(r, 1)
    m.allocate_slots(r, 6)
    with pytest.raises(KVCacheUsageError, match="0 \\+ 9 computed tokens exceed the 8 slots"):
        m.mark_computed(r, 9)
    with pytest.raises(KVCacheUsageError, match="num_tokens must be an int >= 0, got -1"):
        m.mark_computed(r, -1)
    assert r.num_computed_tokens == 0
    m.free(r)
    with pytest.raises(DoubleFreeError, match="mark_computed: request 'r' was already freed"):
        m.mark_computed(r, 1)


def test_take_new_block_ids_is_one_pattern_for_every_step():
    m = KVCacheManager(32, 4, 64)
    a = Request("a", list(range(10)))
    m.allocate_slots(a, 10)
    assert m.take_new_block_ids("a") == m.get_block_ids("a")  # first time: all
    m.mark_computed(a, 10)
    b = Request("b", list(range(10)))
    hits, num_hit = m.get_computed_blocks(b)
    m.allocate_slots(b, 10 - num_hit, num_hit, hits)
    assert m.take_new_block_ids("b") == m.get_block_ids("b")  # prefix hits included
    assert m.take_new_block_ids("b") == []
    a.append_output_token_ids([1, 2, 3])
    before = m.get_block_ids("a")
    m.allocate_slots(a, 3)  # grows into a new block
    assert m.take_new_block_ids("a") == m.get_block_ids("a")[len(before) :] != []
    m.mark_computed(a, 3)
    fork = m.fork(a, "a2")
    assert m.take_new_block_ids("a2") == m.get_block_ids("a2")  # a fork's first time: all
    m.free(a)  # preempted; re-admitted later: all again
    a.num_computed_tokens = 0
    hits, num_hit = m.get_computed_blocks(a)
    m.allocate_slots(a, a.num_tokens - num_hit, num_hit, hits)
    assert m.take_new_block_ids("a") == m.get_block_ids("a")
    check_manager(m, {"a": a, "b": b, "a2": fork.child})


# -- allocation ------------------------------------------------------------------------------


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(6, 4, 64)  # 5 usable
    a = Request("a", list(range(12)))
    admit(m, a)  # 3 blocks, all cached
    m.free(a)
    b = Request("b", list(range(12)) + list(range(50, 62)))  # hits 2 blocks, needs 4 more
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 12  # 3 cached blocks revived + 3 new > 5 usable blocks
    before = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in m.block_pool.blocks]
    queue = [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is None
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in m.block_pool.blocks] == before
    assert [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()] == queue
    assert "b" not in m.req_to_blocks
    check_manager(m)


def test_lookahead_slots_are_allocated_but_never_cached():
    m = KVCacheManager(16, 4, 20)
    r = Request("r", list(range(6)))
    new = m.allocate_slots(r, 6, num_lookahead_tokens=5)
    assert len(new) == 3  # 11 slots
    m.mark_computed(r, 6)
    assert m.num_cached_block["r"] == 1  # only block 0 is full of computed tokens
    r.append_output_token_ids(list(range(13)))  # 19 tokens
    new = m.allocate_slots(r, 13, num_lookahead_tokens=5)
    assert len(m.get_block_ids("r")) == 5  # capped at max_model_len 20
    check_manager(m)


def test_prefix_caching_disabled():
    m = KVCacheManager(16, 4, 64, enable_prefix_caching=False)
    admit(m, Request("a", list(range(12))))
    assert m.get_computed_blocks(Request("b", list(range(12)))) == ([], 0)
    assert not any(b.block_hash for b in m.block_pool.blocks)


# -- misuse ----------------------------------------------------------------------------------


def test_misuse_errors_name_the_problem():
    m = KVCacheManager(16, 4, 32)
    r = Request("r", list(range(8)))
    with pytest.raises(UnknownRequestError, match="'ghost' holds no blocks"):
        m.free("ghost")
    with pytest.raises(UnknownRequestError):
        m.get_block_ids("ghost")
    with pytest.raises(KVCacheUsageError, match="num_new_tokens must be >= 0, got -1"):
        m.allocate_slots(r, -1)
    with pytest.raises(KVCacheUsageError, match="num_lookahead_tokens must be >= 0, got -2"):
        m.allocate_slots(r, 1, num_lookahead_tokens=-2)
    with pytest.raises(KVCacheUsageError, match="33 exceed max_model_len 32"):
        m.allocate_slots(Request("long", list(range(33))), 33)
    with pytest.raises(KVCacheUsageError, match="expected 0 new_computed_blocks x block_size 4"):
        m.allocate_slots(r, 4, num_new_computed_tokens=4)
    r.num_computed_tokens = 4
    with pytest.raises(KVCacheUsageError, match="num_computed_tokens = 4 but it holds 0 blocks"):
        m.allocate_slots(r, 4)
    r.num_computed_tokens = 0
    assert m.allocate_slots(r, 8) is not None
    m.mark_computed(r, 8)
    hits, n = m.get_computed_blocks(Request("r2", list(range(8))))
    with pytest.raises(KVCacheUsageError, match="only accepted on its first allocation"):
        m.allocate_slots(r, 0, n, hits)
    with pytest.raises(KVCacheUsageError, match="fork: request 'r' already holds blocks"):
        m.fork(r, "r")
    with pytest.raises(UnknownRequestError, match="fork: request 'ghost'"):
        m.fork(Request("ghost", [1]), "c")
    with pytest.raises(KVCacheUsageError, match="request_id must be a non-empty str"):
        m.fork(r, "")
    assert m.block_pool.blocks[m.get_block_ids("r")[0]].ref_cnt == 1  # no failed fork touched it
    m.free(r)
    with pytest.raises(DoubleFreeError, match="'r' was already freed"):
        m.free(r)
    with pytest.raises(KVCacheUsageError, match="block_size must be a positive int"):
        KVCacheManager(16, 0, 32)
    with pytest.raises(KVCacheUsageError, match="request_id must be a non-empty str"):
        Request("", [1])
    check_manager(m)


def test_evicted_hit_is_rejected():
    m = KVCacheManager(4, 4, 32)  # 3 usable
    a = Request("a", list(range(9)))
    admit(m, a)
    m.free(a)
    b = Request("b", list(range(9)))
    hits, n = m.get_computed_blocks(b)
    # evicts both (x's own tokens will be written there)
    m.allocate_slots(Request("x", list(range(50, 62))), 12)
    with pytest.raises(KVCacheUsageError, match="no longer caches this request's prefix"):
        m.allocate_slots(b, b.num_tokens - n, n, hits)


# -- hashing ---------------------------------------------------------------------------------

HASH_SCRIPT = """
from pagedkv.kv import BlockHasher, Request, MultiModalSpan
for algo in ("sha256", "xxhash"):
    h = BlockHasher(4, algo)
    r = Request("x", list(range(10)), cache_salt="s", lora_name="l",
                mm_spans=[MultiModalSpan("i", 1, 2)])
    print(algo, h.none_hash.hex(), *[x.hex() for x in h.update(r)])
"""


def test_hashes_are_equal_across_processes():
    pytest.importorskip("xxhash")
    # another process, with another str-hash seed than this one
    out = subprocess.run(
        [sys.executable, "-c", HASH_SCRIPT],
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    here = []
    for algo in ("sha256", "xxhash"):
        h = BlockHasher(4, algo)
        r = Request(
            "x",
            list(range(10)),
            cache_salt="s",
            lora_name="l",
            mm_spans=[MultiModalSpan("i", 1, 2)],
        )
        here.append(" ".join([algo, h.none_hash.hex(), *[x.hex() for x in h.update(r)]]))
    assert out.splitlines() == here
    assert len({line.split()[1] for line in here}) == 2  # the two algos differ


def test_known_digest_pins_the_encoding():
    # Changing the byte layout silently invalidates hashes shared between processes
    # or versions: this digest must only change on purpose.
    h = BlockHasher(4, "sha256", seed="")
    assert h.none_hash.hex() == _sha256_hex(encode(("pagedkv-none-hash", "")))
    expected = _sha256_hex(
        h.none_hash + (4).to_bytes(4, "little") + encode_token_ids([1, 2, 3, 4]) + encode(())
    )
    assert h.update(Request("x", [1, 2, 3, 4, 5]))[0].hex() == expected
    assert encode(("lora", 1, None, True, b"\x00")) == (
        b"L\x05\x00\x00\x00S\x04\x00\x00\x00loraI\x01\x00\x00\x00\x01NTB\x01\x00\x00\x00\x00"
    )


def _sha256_hex(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_seed_changes_every_hash(monkeypatch):
    r1, r2 = Request("a", list(range(8))), Request("b", list(range(8)))
    assert BlockHasher(4, seed="one").update(r1) != BlockHasher(4, seed="two").update(r2)
    monkeypatch.setenv("PAGEDKV_HASH_SEED", "one")
    assert BlockHasher(4).seed == "one"


def test_encoding_distinguishes_types_and_rejects_others():
    assert len({encode(1), encode("1"), encode(True), encode(b"1"), encode((1,))}) == 5
    assert encode(-(2**70)) != encode(2**70)
    with pytest.raises(KVCacheUsageError, match="cannot hash a float"):
        encode(1.5)
    with pytest.raises(KVCacheUsageError, match="unknown hash algo 'md5'"):
        get_hash_fn("md5")
    with pytest.raises(KVCacheUsageError, match="int64 range"):
        encode_token_ids([2**63])
