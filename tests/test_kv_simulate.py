"""Traces (synthetic, CSV, JSONL), the allocator replay, and ``pagedkv simulate``."""

from __future__ import annotations

import sys

import pytest
from pagedkv.cli import main
from pagedkv.errors import KVCacheUsageError, TraceFormatError
from pagedkv.kv.simulate import ContiguousAllocator, PagedAllocator, plot, replay, simulate
from pagedkv.kv.trace import TraceRequest, load_trace, sharegpt_like


def test_sharegpt_like_is_seeded_and_clipped():
    a = sharegpt_like(500, max_model_len=512, seed=3)
    assert a == sharegpt_like(500, max_model_len=512, seed=3) != sharegpt_like(500, seed=4)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.total_len <= 512 for r in a)


def test_load_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("input_len,output_tokens,extra\n10,5,x\n3,7,y\n")
    assert load_trace(csv_path) == [TraceRequest(10, 5), TraceRequest(3, 7)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        '{"prompt_len": 4, "output_len": 2}\n\n{"prompt_tokens": 1, "completion_tokens": 9}\n'
    )
    assert load_trace(jsonl) == [TraceRequest(4, 2), TraceRequest(1, 9)]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.csv", "prompt_len\n4\n", "a.csv:2: missing a column named one of output_len"),
        (
            "b.csv",
            "prompt_len,output_len\n4,2.5\n",
            "b.csv:2: output_len = '2.5' is not an integer",
        ),
        ("c.csv", "prompt_len,output_len\n0,2\n", "c.csv:2: prompt_len = 0, expected >= 1"),
        (
            "d.jsonl",
            '{"prompt_len": 1, "output_len": 1}\n[1]\n',
            "d.jsonl:2: expected a JSON object",
        ),
        ("e.jsonl", "{nope\n", "e.jsonl:1: not JSON"),
        ("f.csv", "prompt_len,output_len\n60,10\n", "f.csv:2: prompt 60 + output 10 tokens exceed"),
        ("g.csv", "prompt_len,output_len\n", "holds no requests"),
    ],
)
def test_trace_errors_name_file_line_and_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message.replace("+", r"\+").replace("[", r"\[")):
        load_trace(path, max_model_len=64)


def test_contiguous_max_len_by_hand():
    # pool of 16 slots, max_model_len 8: two requests of 4 + 4 tokens run while the third waits
    alloc = ContiguousAllocator("max", 16, "max", 8)
    result = replay(alloc, [TraceRequest(4, 4)] * 3)
    assert result.num_bound_steps == 4  # lengths 4, 5, 6, 7 while the third waits
    assert result.tokens == pytest.approx((8 + 10 + 12 + 14) / 4 / 16)
    assert result.reserved == pytest.approx((8 + 6 + 4 + 2) / 4 / 16)
    assert result.internal == 0 and result.free == 0
    assert result.num_steps == 8 and result.num_preemptions == 0


def test_first_fit_leaves_external_fragmentation():
    # 10-slot pool: 4-token a and 6-token b placed, a leaves a 4-slot hole; c (5) waits on it
    alloc = ContiguousAllocator("oracle", 10, "oracle", 10)
    trace = [TraceRequest(2, 2), TraceRequest(3, 3), TraceRequest(4, 1)]
    result = replay(alloc, trace)
    assert result.free > 0 and result.num_bound_steps > 0


def test_grow_allocator_moves_or_preempts():
    alloc = ContiguousAllocator("grow", 32, "grow", 32, granule=4)
    result = replay(alloc, [TraceRequest(3, 9)] * 4)
    assert result.num_moves + result.num_preemptions > 0
    assert alloc._range == {}  # everything released


def test_paged_replay_uses_the_manager_and_preempts():
    alloc = PagedAllocator("paged", 16, 4, 8)  # 3 usable blocks
    result = replay(alloc, [TraceRequest(4, 4)] * 3)
    assert result.num_preemptions > 0
    assert alloc.manager.get_num_free_blocks() == 3 and not alloc.manager.req_to_blocks


def test_simulate_paged_wastes_far_less():
    results = {r.allocator: r for r in simulate(sharegpt_like(80, max_model_len=512), 4096, 512)}
    for r in results.values():
        assert r.tokens + r.reserved + r.internal + r.free == pytest.approx(1.0)
        assert r.num_bound_steps > 0
    assert results["contiguous max-len"].waste > 0.4  # mean request ~300 of 512 tokens
    assert results["paged B=16"].waste < 0.1
    assert results["paged B=8"].waste <= results["paged B=128"].waste
    assert results["contiguous max-len"].mean_batch < results["paged B=16"].mean_batch


def test_paged_pool_too_small_for_one_request_is_an_error():
    # 16 slots at B=8: 2 blocks, one of them the null block, for a 12-token request
    with pytest.raises(KVCacheUsageError, match="does not fit the pool of 16 token slots"):
        replay(PagedAllocator("paged B=8", 16, 8, 16), [TraceRequest(4, 8)])


def test_simulate_rejects_impossible_setups():
    with pytest.raises(KVCacheUsageError, match="exceed max_model_len"):
        simulate([TraceRequest(600, 10)], 4096, 512)
    with pytest.raises(KVCacheUsageError, match="cannot hold one max_model_len"):
        simulate([TraceRequest(6, 10)], 100, 512)


def test_cli_writes_table_and_plot(tmp_path, capsys):
    out = tmp_path / "sim"
    argv = ["simulate", "--num-requests", "40", "--pool-tokens", "4096"]
    argv += ["--max-model-len", "512", "--block-sizes", "16,128", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "paged B=16" in printed and "contiguous max-len" in printed
    table = (tmp_path / "sim.md").read_text()
    assert table.count("\n| ") == 7  # header + 6 allocators
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_trace_file_and_bad_block_sizes(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_len,output_len\n" + "30,40\n" * 20)
    argv = ["simulate", "--trace", str(trace), "--pool-tokens", "1024", "--max-model-len", "128"]
    argv += ["--no-plot", "--output", str(tmp_path / "x"), "--block-sizes", "16"]
    assert main(argv) == 0
    assert f"trace {trace}" in capsys.readouterr().out
    assert main([*argv[:-1], "8,zero"]) == 2
    assert "--block-sizes" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(KVCacheUsageError, match="needs matplotlib"):
        plot([], tmp_path / "x.png")
