"""`pagedkv bench` on the CPU (and its GPU timers where a GPU is): the tiny matrix through
the contract, checked and reported."""

from __future__ import annotations

import json
import re

import pytest
import torch
from pagedkv.bench import MATRICES, run_bench, select_workloads
from pagedkv.bench.workloads import long_tailed_contexts
from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.toolkit.interpreter import interpreting


def test_the_standard_matrix_covers_the_serving_shapes():
    rows = MATRICES["standard"]
    kinds = {w.kind for w in rows}
    assert {
        "decode",
        "ragged-decode",
        "spec-decode",
        "mixed",
        "prefill",
        "chunked-prefill",
    } <= kinds
    layers = {w.layer for w in rows}
    assert {lay.num_heads // lay.num_kv_heads for lay in layers} >= {1, 4, 8, 16}
    assert {lay.head_size for lay in layers} >= {64, 128, 256}
    assert {lay.block_size for lay in layers} >= {16, 32, 64}
    assert any(lay.kv_cache_dtype != "auto" for lay in layers)
    mixed = next(w for w in rows if w.kind == "mixed")
    assert min(mixed.query_lens) == 1 and max(mixed.query_lens) > 1
    names = [w.name for w in rows]
    assert len(names) == len(set(names))


def test_the_short_matrix_is_decode_steps_far_below_a_32k_reservation():
    """The rows a graph reserved for 32k replays (``--graph-context 32768``): decode
    steps of at most 8k keys, one to 64 requests, uniform and ragged; none is a standard
    row under another name."""
    rows = MATRICES["short"]
    assert {w.kind for w in rows} == {"decode", "ragged-decode"}
    assert all(set(w.query_lens) == {1} and max(w.seq_lens) <= 8192 for w in rows)
    assert {w.num_reqs for w in rows} >= {1, 16, 32, 64}
    names = [w.name for w in rows]
    assert len(set(names)) == len(names)
    assert not set(names) & {w.name for w in MATRICES["standard"]}
    assert [w.name for w in select_workloads("short", ["short-decode-32x*"])] == [
        "short-decode-32x512"
    ]


def test_ragged_lengths_are_seeded_and_long_tailed():
    import random

    a = long_tailed_contexts(random.Random(3), 2000, 1024, 32768)
    assert a == long_tailed_contexts(random.Random(3), 2000, 1024, 32768)
    assert max(a) > 8 * 1024 and min(a) < 300  # a real tail on both sides


# the tiny matrices' Triton kernels on the CPU (a GPU host's runs are the next test's)
NEEDS_INTERPRETER = pytest.mark.skipif(
    not interpreting(),
    reason="runs Triton kernels on the CPU: needs Triton's interpreter (tests/conftest.py "
    "sets it where no GPU is)",
)


@NEEDS_INTERPRETER
def test_tiny_matrix_through_two_backends_checked_against_torch():
    workloads = select_workloads("tiny")
    rows, env = run_bench(["torch", "triton"], workloads, device="cpu", baseline=None,
                          progress=lambda _: None)  # fmt: skip
    assert env["copy_bandwidth"] > 0 and len(rows) == 2 * len(workloads)
    assert 0 < env["host_floor_us"] < 10_000  # the host's own speed, measured in the run
    for row in rows:
        assert not row.error, row.error
        assert row.eager_us > 0 and row.max_abs_diff is not None and row.max_abs_diff < 1e-4
        assert 0 < row.build_us < 100_000  # the step's build, host time
        assert row.graph_us is None and row.graph_flushed_us is None  # no CUDA graphs here
        assert row.host_us is None and row.steady_us is None  # back to back: a GPU's queue


@NEEDS_INTERPRETER
def test_mla_layers_run_through_the_mla_backend_checked_against_the_latent_reference():
    """The tiny MLA matrix (absorbed query, one latent row per token): the mla backend's
    output against the float64 reference over the latent rows, and its plan reported."""
    workloads = select_workloads("tiny-mla")
    assert all(w.layer.spec().is_mla for w in workloads)
    rows, _ = run_bench(["mla"], workloads, device="cpu", baseline=None, progress=lambda _: None)
    for row in rows:
        assert not row.error, row.error
        assert row.eager_us > 0 and row.write_us > 0
        assert row.max_abs_diff is not None and row.max_abs_diff < 1e-4
        assert "range(s) of" in row.config["plan"]
    # the GPU matrix: DeepSeek's latent, 128 heads (16 under 8-way tensor parallelism)
    gpu = select_workloads("mla")
    assert {w.layer.describe() for w in gpu} == {
        "MLA H128 L512+R64 B64 bf16", "MLA H16 L512+R64 B64 bf16"
    }  # fmt: skip
    assert {w.kind for w in gpu} == {"decode", "ragged-decode", "mixed"}


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="times CUDA graphs and back-to-back calls on a GPU"
)
def test_on_a_gpu_every_timing_column_is_measured():
    """The tiny matrix through the triton backend on a GPU: eager, steady (back to back),
    launch, graph and flushed replays, each a positive time."""
    workloads = select_workloads("tiny", ["tiny-decode", "tiny-mixed"])
    rows, _ = run_bench(["triton"], workloads, device="cuda", baseline=None,
                        progress=lambda _: None)  # fmt: skip
    for row in rows:
        assert not row.error, row.error
        for name in (
            "eager_us",
            "steady_us",
            "launch_us",
            "layer_us",
            "build_us",
            "graph_us",
            "graph_flushed_us",
        ):
            assert getattr(row, name) > 0, (row.workload, name)


def test_host_share_is_eager_minus_graph():
    """``host`` = eager - graph (the issue's measure of what a graph saves); the flushed
    replay is its own column, not subtracted (a replay right after the flush is no
    eager call: on the H200 it ran up to 45 us slower)."""
    from pagedkv.bench.report import HEADERS, row_cells
    from pagedkv.bench.runners import Row

    row = Row("w", "triton", eager_us=130.0, graph_us=110.0, graph_flushed_us=125.0,
              steady_us=121.0)  # fmt: skip
    assert row.host_us == pytest.approx(20.0)
    cells = dict(zip(HEADERS, row_cells(row), strict=True))
    assert (cells["graph us"], cells["flushed us"], cells["host us"]) == ("110.0", "125.0", "20.0")
    assert cells["steady us"] == "121.0"  # its own column, subtracted from nothing
    assert Row("w", "triton", eager_us=130.0).host_us is None


def test_launch_is_also_given_as_a_multiple_of_the_host_floor():
    # the launch microseconds move with the host; their multiple of the run's floor (one
    # trivial torch op) compares across machines
    from pagedkv.bench.report import HEADERS, row_cells
    from pagedkv.bench.runners import Row

    row = Row("w", "mla", eager_us=80.0, launch_us=79.5)
    assert dict(zip(HEADERS, row_cells(row, 10.6), strict=True))["launch us"] == "79.5 (7.5x)"
    assert dict(zip(HEADERS, row_cells(row), strict=True))["launch us"] == "79.5"
    assert dict(zip(HEADERS, row_cells(Row("w", "mla"), 10.6), strict=True))["launch us"] == "-"


def test_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main([
        "bench", "--device", "cpu", "--backends", "torch", "--workloads", "tiny-decode,tiny-spec",
        "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png",
    ])  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["workload"] for r in data["rows"]] == ["tiny-decode", "tiny-spec"]
    report = (tmp_path / "bench.md").read_text()
    assert "copy bandwidth" in report and "us to enqueue a one-element torch op" in report
    assert data["environment"]["host_floor_us"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert "tiny-spec" in capsys.readouterr().out


def test_bad_selections_are_config_errors():
    with pytest.raises(ConfigError, match="unknown matrix 'huge'"):
        select_workloads("huge")
    with pytest.raises(ConfigError, match="no workload of 'tiny' matches nope"):
        select_workloads("tiny", ["nope"])


def test_a_config_typo_fails_before_anything_is_timed(capsys):
    base = ["bench", "--device", "cpu", "--workloads", "tiny-decode", "--no-graph"]
    assert main([*base, "--backends", "torch,tritn"]) != 0
    captured = capsys.readouterr()
    assert "unknown attention backend 'tritn'" in captured.err
    assert "tiny-decode" not in captured.out  # no row ran
    assert main([*base, "--backends", "torch(,triton"]) != 0
    assert "malformed backend config" in capsys.readouterr().err


def test_profile_lists_what_one_call_runs(tmp_path):
    """--profile: each row's kernels (on a CPU, the torch operators) per call, longest
    first, in the progress lines, the JSON and the markdown."""
    lines: list[str] = []
    workloads = select_workloads("tiny", ["tiny-decode"])
    rows, _ = run_bench(["torch"], workloads, device="cpu", baseline=None, profile=2,
                        progress=lines.append)  # fmt: skip
    kernels = rows[0].kernels
    assert kernels and all(k.calls > 0 and k.us > 0 for k in kernels)
    assert [k.us for k in kernels] == sorted((k.us for k in kernels), reverse=True)
    # the torch backend's attention is batched matmuls: they ran, once per call at least
    assert any("bmm" in k.name or "einsum" in k.name for k in kernels)
    assert any(kernels[0].name[:40] in line for line in lines)
    # and the Python functions of a call, by own host time
    assert rows[0].host_functions and any("impl.py" in f.name for f in rows[0].host_functions)
    out = tmp_path / "bench"
    assert main([
        "bench", "--device", "cpu", "--backends", "torch", "--workloads", "tiny-decode",
        "--profile", "1", "--json", f"{out}.json", "--markdown", f"{out}.md",
    ]) == 0  # fmt: skip
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["kernels"]
    assert "Kernels of one eager call" in (tmp_path / "bench.md").read_text()


def _run(rows, device="gpu-a"):
    env = {"gpu": device, "torch": "t", "triton": "tr", "flashinfer": "fi", "command": "cmd"}
    return {"environment": env, "rows": [dict(r, error="") for r in rows]}


def test_merge_compares_each_config_with_the_reference_of_its_own_run(tmp_path, capsys):
    """Runs merged into one table: a config's speed is against the reference measured in
    the same run, or (marked *) the latest run's; a later run's row replaces an earlier."""
    first = _run([
        {"workload": "w1", "impl": "triton", "eager_us": 120.0, "graph_us": 100.0, "pct_copy": 90.0},
        {"workload": "w1", "impl": "flashinfer", "eager_us": 110.0, "graph_us": 105.0, "pct_copy": 86.0},
        {"workload": "w2", "impl": "triton", "eager_us": 50.0, "graph_us": None, "pct_copy": 40.0},
    ])  # fmt: skip
    second = _run([
        {"workload": "w1", "impl": "pallas", "eager_us": 210.0, "graph_us": None, "pct_copy": 45.0},
        {"workload": "w1", "impl": "flashinfer", "eager_us": 90.0, "graph_us": 84.0, "pct_copy": 99.0},
        {"workload": "w2", "impl": "flashinfer", "eager_us": 60.0, "graph_us": None, "pct_copy": 30.0},
    ], device="gpu-b")  # fmt: skip
    second["environment"]["host_floor_us"] = 4.25  # a later run's host speed; the first has none
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    md = tmp_path / "merged.md"
    assert main(["bench", "--merge", *map(str, paths), "--markdown", str(md)]) == 0
    text = md.read_text()
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    # w1: triton against its own run's flashinfer (105 / 100), pallas against its run's
    # (84 / 210); the flashinfer column shows the latest run's; configs in order of appearance
    assert lines["w1"] == (
        "| w1 | 120.0 / 100.0 (90%) | 1.05x | 90.0 / 84.0 (99%) | 210.0 / - (45%) | 0.40x |"
    )
    # w2: triton's run had no flashinfer row: the latest run's, marked
    assert "| 50.0 / - (40%) | 1.20x* |" in lines["w2"]
    assert "gpu-a" in text and "gpu-b" in text
    assert "host: not measured" in text and "host: 4.2 us to enqueue" in text
    assert "w2" in capsys.readouterr().out
    assert main(["bench", "--merge", str(tmp_path / "nope.json")]) != 0
    assert "nope.json: not a pagedkv bench --json file" in capsys.readouterr().err


def test_graph_context_reserves_graphs_for_longer_contexts_than_the_step(capsys):
    """--graph-context: each row's CUDA graph is reserved as an engine reserves it, for
    the model's longest context (replayed on a shorter step); never below the step's own."""
    from pagedkv.bench.problem import build_problem
    from pagedkv.bench.runners import _bounds

    workload = select_workloads("tiny", ["tiny-decode"])[0]
    problem = build_problem(workload, "cpu")
    own = _bounds(problem)
    assert own.max_blocks_per_req == -(-max(workload.seq_lens) // problem.spec.block_size)
    served = _bounds(problem, 4096)
    assert served.max_blocks_per_req == 4096 // problem.spec.block_size
    assert (served.max_num_reqs, served.max_num_tokens) == (own.max_num_reqs, own.max_num_tokens)
    assert _bounds(problem, 1) == own  # shorter than the step: the step's own
    assert main(["bench", "--device", "cpu", "--graph-context", "0", "--workloads", "tiny-decode"])
    assert "--graph-context 0: expected a positive token count" in capsys.readouterr().err


def test_layer_time_runs_every_layer_over_each_steps_own_build():
    """``layer_us``: a warm-up step, then each timed step one new build whose metadata
    every layer's call gets, per layer the host's time."""
    from pagedkv.bench.timing import layer_us

    builds, calls = [], []

    def build():
        builds.append(object())
        return builds[-1]

    layers = [lambda md, i=i: calls.append((i, md)) for i in range(3)]
    us = layer_us(build, layers, torch.device("cpu"), steps=4)
    assert us > 0
    # the warm-up builds once a layer; each of the 4 steps builds once for all 3 layers
    assert len(builds) == 3 + 4 and len(calls) == 3 * 5
    timed = calls[3:]
    for step in range(4):
        got = timed[3 * step : 3 * step + 3]
        assert [i for i, _ in got] == [0, 1, 2]
        assert all(md is builds[3 + step] for _, md in got)


def test_before_and_after_runs_are_compared_against_their_own_noise(tmp_path, capsys):
    """--before/--after: each time of each (workload, config) both sides measured, its
    median change, and a verdict only where the runs' ranks pass the rank test (three
    runs a side at least) and the change is at least MIN_CHANGE."""

    def row(workload, impl, eager, graph=None, **more):
        return {"workload": workload, "impl": impl, "eager_us": eager, "graph_us": graph, **more}

    before = [
        _run([row("w1", "triton", 100.0, 90.0, write_us=5.0, build_us=100.0),
              row("w2", "triton", 50.0), row("w1", "flashinfer", 99.0)]),
        _run([row("w1", "triton", 102.0, 91.0, write_us=5.2, build_us=100.2),
              row("w2", "triton", 51.0)]),
        _run([row("w1", "triton", 101.0, 90.2, write_us=5.1, build_us=100.1)]),
    ]  # fmt: skip
    after = [
        _run([row("w1", "triton", 95.0, 92.0, write_us=6.0, build_us=100.3),
              row("w2", "triton", 52.0), row("w3", "triton", 10.0)], device="gpu-b"),
        _run([row("w1", "triton", 96.0, 90.5, write_us=6.1, build_us=100.4),
              row("w2", "triton", 53.0)], device="gpu-b"),
        _run([row("w1", "triton", 94.0, 90.1, write_us=6.2, build_us=100.5)], device="gpu-b"),
    ]  # fmt: skip
    paths = {}
    for side, runs in (("before", before), ("after", after)):
        paths[side] = []
        for i, run in enumerate(runs):
            paths[side].append(str(tmp_path / f"{side}{i}.json"))
            (tmp_path / f"{side}{i}.json").write_text(json.dumps(run))
    md = tmp_path / "ab.md"
    argv = ["bench", "--before", *paths["before"], "--after", *paths["after"]]
    assert main([*argv, "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    cells = {
        tuple(c[:3]): c[3:]
        for c in (re.split(r"\s{2,}", line) for line in out.splitlines() if re.match(r"w\d", line))
    }
    # every after run faster than every before run: p = 2 / C(6, 3)
    assert cells[("w1", "triton", "eager")] == [
        "101.0 (100.0-102.0)", "95.0 (94.0-96.0)", "-6.0 us (-5.9%)", "0.100", "faster"
    ]  # fmt: skip
    # the graph runs interleave: no change beyond their noise
    assert cells[("w1", "triton", "graph")][-1] == "no change"
    assert cells[("w1", "triton", "write")][-1] == "slower"
    # separated, but by less than MIN_CHANGE of the before median
    assert cells[("w1", "triton", "build")][-2:] == ["0.100", "no change"]
    # eager - graph, per run: before 10, 11, 10.8; after 3, 5.5, 3.9
    assert cells[("w1", "triton", "host")][:2] == ["10.8 (10.0-11.0)", "3.9 (3.0-5.5)"]
    # w2 has two runs a side: no outcome of them could pass the test
    assert cells[("w2", "triton", "eager")] == [
        "50.5 (50.0-51.0)", "52.5 (52.0-53.0)", "+2.0 us (+4.0%)", "0.333", "too few runs"
    ]  # fmt: skip
    assert "eager: 1 faster, 1 with too few runs for a verdict" in out
    assert "write: 1 slower" in out and "graph: 1 no change beyond the runs' noise" in out
    assert "only after: w3, triton" in out and "only before: w1, flashinfer" in out
    assert "before: " in out and "after: " in out and "gpu-b" in out
    text = md.read_text()
    assert "| w1 | triton | eager | 101.0 (100.0-102.0) | 95.0 (94.0-96.0) |" in text
    # a regression gate: the write got slower
    assert main([*argv, "--fail-on-slower"]) == 1
    assert main([*argv, "--fail-on-slower", "--times", "eager,graph"]) == 0
    capsys.readouterr()
    # only the times asked for
    assert main([*argv, "--times", "graph"]) == 0
    assert {line.split()[2] for line in capsys.readouterr().out.splitlines()
            if re.match(r"w\d", line)} == {"graph"}  # fmt: skip
    # misuse: named errors
    assert main(["bench", "--before", *paths["before"]]) != 0
    assert "expected both" in capsys.readouterr().err
    assert main([*argv, "--times", "eager,speed"]) != 0
    assert "--times speed: expected some of eager, graph, host" in capsys.readouterr().err
    lone = tmp_path / "lone.json"
    lone.write_text(json.dumps(_run([row("w9", "triton", 1.0)])))
    assert main(["bench", "--before", str(lone), "--after", *paths["after"]]) != 0
    assert "no (workload, config) with a time on both sides" in capsys.readouterr().err


def test_the_rank_test_is_exact_ties_included():
    """Mann-Whitney's exact two-sided p: complete separation of 3 against 3 runs is 2 of
    the 20 splits, one swap 4 of 20; ties take their mean rank; the count by rank sums
    agrees with listing every split, and with scipy where there are no ties."""
    import itertools

    from pagedkv.bench.compare import least_p_value, rank_p_value

    assert rank_p_value((3.0, 4.0, 5.0), (0.0, 1.0, 2.0)) == pytest.approx(0.1)
    assert rank_p_value((0.0, 1.0, 2.0), (3.0, 4.0, 5.0)) == pytest.approx(0.1)
    assert rank_p_value((2.0, 4.0, 5.0), (0.0, 1.0, 3.0)) == pytest.approx(0.2)
    assert rank_p_value((1.0, 1.0), (1.0, 1.0)) == 1.0
    assert least_p_value(2, 2) == pytest.approx(1 / 3) and least_p_value(4, 4) == 2 / 70

    def listed(before, after):  # every split of the pooled runs, U by pairs
        pooled, m = (*before, *after), len(after)

        def u(side):
            rest = [v for i, v in enumerate(pooled) if i not in side]
            return sum((a < b) + 0.5 * (a == b) for a in (pooled[i] for i in side) for b in rest)

        center = len(before) * m / 2
        observed = abs(u(range(len(before), len(pooled))) - center)
        splits = [abs(u(c) - center) for c in itertools.combinations(range(len(pooled)), m)]
        return sum(d >= observed - 1e-9 for d in splits) / len(splits)

    for before, after in [
        ((10.0, 11.0, 11.0, 12.5), (9.0, 11.0, 10.0)),
        ((5.0, 5.0, 6.0, 7.0, 7.0), (4.0, 5.0, 7.0, 3.0, 3.0, 8.0)),
        ((1.0, 2.0, 3.0), (2.0, 2.0, 2.0)),
    ]:
        assert rank_p_value(before, after) == pytest.approx(listed(before, after))
    # 8 against 8 runs, no ties (12,870 splits): scipy 1.17.1's
    # mannwhitneyu(after, before, method="exact") gives 0.160528
    before = (5.0, 7.0, 9.0, 11.0, 12.0, 14.0, 15.0, 17.0)
    after = (1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 13.0, 16.0)
    assert rank_p_value(before, after) == pytest.approx(0.160528, abs=1e-6)
