"""KVCacheManager: prefix-cache scenarios, fork / copy-on-write, hashing, misuse errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagedkv.errors import DoubleFreeError, KVCacheUsageError, UnknownRequestError
from pagedkv.kv import KVCacheManager, MultiModalSpan, Request
from pagedkv.kv.hashing import BlockHasher, encode, encode_token_ids, get_hash_fn
from pagedkv.kv.invariants import check_manager

B = 16


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """Prefix lookup, allocation and a (pretend) prefill of the whole prompt."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    check_manager(manager)
    return manager.get_block_ids(request.request_id)


def decode(manager: KVCacheManager, request: Request, token: int) -> None:
    request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
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
        samples.append(parent.fork(cid))
        m.fork("s1", cid)
    assert [m.block_pool.blocks[i].ref_cnt for i in prompt_blocks] == [3, 3, 3]
    for i, s in enumerate(samples):
        decode(m, s, 1000 + i)
    tails = {m.get_block_ids(s.request_id)[3] for s in samples}
    assert len(tails) == 3 and not tails & set(prompt_blocks)
    assert m.take_copies() == []  # full blocks are never written: nothing to copy
    assert 31 - m.get_num_free_blocks() == 6  # instead of 12 without sharing


def test_copy_on_write_of_a_partial_shared_block():
    m = KVCacheManager(16, B, 256)
    parent = Request("p", list(range(20)))  # block 1 holds 4 tokens
    p_blocks = admit(m, parent)
    child = parent.fork("c")
    m.fork("p", "c")
    decode(m, child, 7)
    copies = m.take_copies()
    assert len(copies) == 1
    (copy,) = copies
    c_blocks = m.get_block_ids("c")
    assert (copy.request_id, copy.block_index, copy.src) == ("c", 1, p_blocks[1])
    assert copy.dst == c_blocks[1] != p_blocks[1] and c_blocks[0] == p_blocks[0]
    assert m.block_pool.blocks[p_blocks[1]].ref_cnt == 1
    # the parent is now the only holder of its block: it writes in place, no copy
    decode(m, parent, 8)
    assert m.take_copies() == [] and m.get_block_ids("p") == p_blocks
    m.free(child)
    m.free(parent)
    assert m.get_num_free_blocks() == 15


def test_pending_copies_of_a_freed_request_are_dropped():
    m = KVCacheManager(16, B, 256)
    parent = Request("p", list(range(20)))
    admit(m, parent)
    child = parent.fork("c")
    m.fork("p", "c")
    decode(m, child, 1)
    m.free(child)
    assert m.take_copies() == []


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
    assert m.num_cached_block["r"] == 1  # only block 0 holds known tokens
    r.num_computed_tokens = 6
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
    r.num_computed_tokens = 8
    hits, n = m.get_computed_blocks(Request("r2", list(range(8))))
    with pytest.raises(KVCacheUsageError, match="only accepted on its first allocation"):
        m.allocate_slots(r, 0, n, hits)
    with pytest.raises(KVCacheUsageError, match="fork: request 'r' already holds blocks"):
        m.fork("r", "r")
    with pytest.raises(UnknownRequestError, match="fork: request 'ghost'"):
        m.fork("ghost", "c")
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
    # evicts both and caches x's own blocks in them, under other hashes
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
