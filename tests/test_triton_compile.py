"""Every kernel variant the Triton backend launches compiles for sm_90, without a GPU.

The interpreter does not check what the GPU compiler checks (tl.dot shapes, layouts,
shared memory, registers), so the launches the backend plans are compiled for sm_90
here, argument for argument. The matrix: the tiles the rule (configs.plan_tiles)
picks on an H200 for decode, speculative-decode, long-context (split), mixed and
prefill steps of layers with head sizes 64/128/256, GQA groups 1/4/8/16, block sizes
16/32/64, 16-bit, fp8 and fp32 caches, and the batch-invariant plan of each; then
each score modifier, padded head sizes, odd block sizes, split widths and the KV
write. Identical compiles (same constants and argument specialisation) run once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

import numpy as np
import pagedkv
import pytest
import torch
from pagedkv import GraphBounds
from pagedkv.backends.triton.attention_kernel import DEPENDENTS_AFTER_KEYS, DEPENDENTS_AT_START
from pagedkv.backends.triton.configs import (
    REDUCE_MIN_WIDTH,
    SPILL_SLACK_BYTES,
    LaunchForm,
    LayerShape,
    StepShape,
    TileConfig,
    plan_tiles,
)
from pagedkv.backends.triton.occupancy import CompiledFits
from pagedkv.conformance import Scenario
from pagedkv.conformance.problem import build_problem
from pagedkv.toolkit.launch import KernelLaunch, occupancy
from pagedkv.toolkit.triton_kv_write import plan_write_kv
from triton_compile import CompileResult, compile_launches

triton = pytest.importorskip("triton")
tl = triton.language

H200_SMS = 132
# the shapes of the performance targets: Hq 32, Hkv 8, D 128, block 16
BASE = Scenario(
    "base", seq_lens=(300, 40), query_lens=(1, 1), num_heads=32, num_kv_heads=8, head_size=128
)
PREFILL = dict(seq_lens=(300, 40), query_lens=(200, 40))
# the steps the rule plans for (seq_lens, query_lens)
STEPS = {
    "decode": ([4096] * 64, [1] * 64),
    "spec-decode": ([2048] * 32, [4] * 32),
    "long-decode": ([32768] * 2, [1] * 2),
    "mixed": ([3000] * 48 + [5000], [1] * 48 + [1024]),
    "prefill": ([2048] * 4, [2048] * 4),
}


@dataclass(frozen=True)
class Variant:
    label: str
    scenario: Scenario
    tile: TileConfig | None = None  # None: the builder's own choice on the scenario
    num_splits: int | None = None
    batch_invariant: bool = False
    bounds: GraphBounds | None = None  # built under this CUDA-graph reservation
    num_sms: int | None = None  # the builder's SM count (None: the CPU's stand-in)
    options: tuple[tuple[str, object], ...] = ()  # the backend's options


# layer: (scenario, the steps whose plans it compiles). Every head size meets every GQA
# group; fp8, fp32 and the block sizes meet every head size; the split path (shared by
# the batch-invariant mode) runs for one layer per cache kind.
ALL_BUT_SPLIT = ("decode", "spec-decode", "mixed", "prefill")


def _layers() -> dict[str, tuple[Scenario, tuple[str, ...]]]:
    out = {}
    for d in (64, 128, 256):
        for g in (1, 4, 8, 16):
            steps = (*ALL_BUT_SPLIT, "long-decode") if g == 4 else ALL_BUT_SPLIT
            out[f"d{d}-gqa{g}"] = (BASE.replace(head_size=d, num_heads=8 * g), steps)
        fp8 = BASE.replace(head_size=d, kv_cache_dtype="fp8_e4m3")
        out[f"d{d}-gqa4-fp8"] = (
            fp8,
            ("decode", "prefill", "long-decode") if d == 128 else ("decode", "prefill"),
        )
        fp32 = BASE.replace(head_size=d, dtype=torch.float32)
        out[f"d{d}-gqa4-fp32"] = (fp32, ("decode", "long-decode") if d == 128 else ("decode",))
    # a bfloat16 query over an fp8 cache takes its own path (float16 rows: fp16_rows)
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        scenario = BASE.replace(dtype=torch.bfloat16, kv_cache_dtype=kv)
        steps = ("decode", "prefill", "long-decode") if kv == "fp8_e4m3" else ("decode",)
        out[f"d128-gqa4-{kv.replace('_', '-')}-bfloat16"] = (scenario, steps)
    fp32_fp8 = BASE.replace(dtype=torch.float32, kv_cache_dtype="fp8_e5m2")
    out["d128-gqa4-fp32-fp8"] = (fp32_fp8, ("decode",))
    for d, block in ((64, 32), (128, 32), (128, 64), (256, 64)):
        scenario = BASE.replace(head_size=d, num_heads=64, block_size=block)
        out[f"d{d}-gqa8-block{block}"] = (scenario, ("decode", "prefill"))
    out["d128-gqa4-float16"] = (BASE.replace(dtype=torch.float16), ("decode", "prefill"))
    return out


def _planned_variants() -> list[Variant]:
    """The tiles the rule picks for each layer's steps (and the batch-invariant plan)."""
    out = []
    for name, (scenario, steps) in _layers().items():
        layer = LayerShape.of(scenario.spec())
        seen = set()
        for step in steps:
            seq_lens, query_lens = STEPS[step]
            shape = StepShape(np.asarray(query_lens), np.asarray(seq_lens))
            # the batch-invariant plan with the layers whose split path is compiled
            for invariant in (False, True) if step == "long-decode" else (False,):
                plan = plan_tiles(layer, shape, H200_SMS, batch_invariant=invariant)
                if (plan.tile, plan.split) in seen:
                    continue
                seen.add((plan.tile, plan.split))
                kind = "invariant" if invariant else step
                out.append(
                    Variant(
                        f"{name}-{kind}-{plan.tile}" + ("-split" if plan.split else ""),
                        scenario,
                        tile=plan.tile,
                        num_splits=4 if plan.split and not invariant else None,
                        batch_invariant=invariant,
                    )
                )
    return out


def _variants() -> list[Variant]:
    out = _planned_variants()
    for head in (80, 192):  # padded with masks
        out.append(Variant(f"decode-d{head}", BASE.replace(head_size=head)))
        out.append(Variant(f"prefill-d{head}", BASE.replace(head_size=head, **PREFILL)))
    # tiles whose variants ptxas compiles near an occupancy step with a small spill, which
    # the rule on a GPU (its compiled fits) accepts within SPILL_SLACK_BYTES: unsplit and
    # split, the spill must stay outside the loops
    for label, changes, tile_n in (("d192", dict(head_size=192), 32),
                                   ("fp8", dict(kv_cache_dtype="fp8_e4m3"), 64),
                                   # the H200's fp8 decode tile (its compiled fit)
                                   ("fp8-bfloat16", dict(kv_cache_dtype="fp8_e4m3",
                                                         dtype=torch.bfloat16), 128)):  # fmt: skip
        for splits in (1, 2):
            out.append(
                Variant(f"slack-{label}-n{tile_n}-s{splits}", BASE.replace(**changes),
                        tile=TileConfig(16, tile_n, 4, 2), num_splits=splits)
            )  # fmt: skip
    features = {
        "everything": dict(sliding_window=100, logits_soft_cap=30.0, alibi=True, use_sinks=True),
        "non-causal-window": dict(causal=False, sliding_window=100),
    }
    for name, changes in features.items():
        out.append(Variant(f"decode-{name}", BASE.replace(**changes)))
        out.append(Variant(f"prefill-{name}", BASE.replace(**changes, **PREFILL)))
    decode_only = {
        "non-causal": dict(causal=False),
        "window": dict(sliding_window=100),
        "softcap": dict(logits_soft_cap=30.0),
        "alibi": dict(alibi=True),
        "sinks": dict(use_sinks=True),
        "fp8-e5m2": dict(kv_cache_dtype="fp8_e5m2", v_scale=0.5),
    }
    for name, changes in decode_only.items():
        out.append(Variant(f"decode-{name}", BASE.replace(**changes)))
    for block in (48, 128):  # a non-power-of-two page; a page wider than the key tile
        out.append(Variant(f"decode-block{block}", BASE.replace(block_size=block)))
    # split-KV: the reduction at several widths and with sinks
    for splits, changes in (
        (2, {}),
        (64, {}),
        (17, dict(head_size=64)),
        (5, dict(use_sinks=True)),
        (6, dict(sliding_window=100, logits_soft_cap=30.0, alibi=True, use_sinks=True)),
    ):
        label = f"split{splits}" + "".join(f"-{k}" for k in changes)
        out.append(Variant(label, BASE.replace(seq_lens=(4000, 40), **changes), num_splits=splits))
    # a CUDA-graph decode plan: the split count read on the device (its grid the most
    # splits the bounds allow), with and without sinks
    decode_bounds = GraphBounds(max_num_reqs=2, max_num_tokens=2, max_blocks_per_req=256)
    for changes in ({}, dict(use_sinks=True)):
        label = "graph-decode-dynamic-splits" + "".join(f"-{k}" for k in changes)
        scenario = BASE.replace(seq_lens=(4000, 40), **changes)
        out.append(Variant(label, scenario, bounds=decode_bounds))
    # ... unlisted (split_grid=blocks): a program per (KV head, request, split) of the
    # bounds, on one axis (the variant on three axes took 156 registers, its probe 126)
    scenario = BASE.replace(seq_lens=(4000, 40))
    out.append(
        Variant(
            "graph-decode-by-request",
            scenario,
            bounds=decode_bounds,
            num_sms=H200_SMS,
            options=(("split_grid", "blocks"),),
        )
    )
    # a graph reserved for 32k keys on the H200's SMs: 64 splits at most, so the merge
    # compiles every tile width from REDUCE_MIN_WIDTH to 64 (D 128 and 256, with sinks)
    long_bounds = GraphBounds(max_num_reqs=2, max_num_tokens=2, max_blocks_per_req=2048)
    for head_size in (128, 256):
        scenario = BASE.replace(seq_lens=(4000, 40), head_size=head_size, use_sinks=True)
        label = f"graph-32k-reservation-d{head_size}"
        out.append(Variant(label, scenario, bounds=long_bounds, num_sms=H200_SMS))
    # a mixed CUDA-graph step: its decodes' launch (dynamic splits, partials from the
    # decodes' first token) and its longer requests' (GQA 4, D 128)
    # (the bounds' tokens: the scenario's, whose query the launches take)
    mixed_bounds = GraphBounds(max_num_reqs=4, max_num_tokens=42, max_blocks_per_req=256,
                               max_query_len=40)  # fmt: skip
    out.append(
        Variant(
            "graph-mixed-parts",
            BASE.replace(seq_lens=(4000, 40, 300), query_lens=(1, 1, 40)),
            bounds=mixed_bounds,
        )
    )
    # a chunk of a long context beside decodes, eager (two parts) and in a mixed
    # reservation: its split launch lets the reduction start after its keys
    # (``DEPENDENTS_AFTER_KEYS``), where the decodes' lets it start at once
    chunk_beside = BASE.replace(seq_lens=(4000, 40, 8000), query_lens=(1, 1, 40))
    out.append(Variant("mixed-parts-split-chunk", chunk_beside, num_sms=H200_SMS))
    out.append(
        Variant(
            "graph-mixed-parts-split-chunk",
            chunk_beside,
            bounds=dataclasses.replace(mixed_bounds, max_blocks_per_req=500),
            num_sms=H200_SMS,
        )
    )
    # fixed key ranges (a ragged batch, which the rule cuts so on the CPU's stand-in SM
    # count): the trimmed kernels, causal and not, with sinks
    # (GQA 4, D 128: the H200's ragged-decode tile, m16-n64)
    ragged = dict(seq_lens=(3000, 40, 100, 70), query_lens=(1, 1, 3, 1), num_heads=8,
                  num_kv_heads=2)  # fmt: skip
    for changes in ({}, dict(causal=False), dict(use_sinks=True, logits_soft_cap=30.0)):
        label = "ranges" + "".join(f"-{k}" for k in changes)
        out.append(Variant(label, BASE.replace(**ragged, **changes)))
    # one-wave split launches that merge in their last program of each block (MERGE_LAST,
    # no merge kernel), on the H200's SM count: a by-request grid of even shares, and a
    # list of fixed key ranges with sinks
    long_decodes = BASE.replace(seq_lens=(32768,) * 4, query_lens=(1,) * 4)
    out.append(Variant("merge-last-by-request", long_decodes, num_sms=H200_SMS))
    ragged_decodes = BASE.replace(seq_lens=(1500, 40, 100, 70), query_lens=(1,) * 4)
    out.append(
        Variant("merge-last-ranges-sinks", ragged_decodes.replace(use_sinks=True), num_sms=H200_SMS)
    )
    # past the 64 splits of the default merge's widths: the ordered merge takes any count
    out.append(
        Variant("invariant-65-splits", BASE.replace(seq_lens=(33000, 40)), batch_invariant=True)
    )
    out.append(
        Variant(
            "invariant-sinks",
            BASE.replace(use_sinks=True, seq_lens=(1100, 40)),
            batch_invariant=True,
        )
    )
    return out


VARIANTS = _variants()


def _launches(variant: Variant) -> list[KernelLaunch]:
    problem = build_problem(variant.scenario, "cpu")
    spec = problem.spec
    backend = pagedkv.get_backend(
        "triton", batch_invariant=variant.batch_invariant, **dict(variant.options)
    )
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    # the classes directly: make_builder refuses bfloat16 on a CPU (the interpreter's)
    builder = backend.get_builder_cls()(
        spec,
        "cpu",
        cache_layout=backend.get_kv_layout(),
        graph_support=backend.capabilities.graph_support,
        **backend.options,
    )
    # compiled for sm_90, where a split launch's reduction is a programmatic dependent
    builder.programmatic = True
    if variant.num_sms is not None:
        builder.num_sms = variant.num_sms
    if variant.bounds is not None:
        builder.reserve_cuda_graph(variant.bounds)
    metadata = builder.build(problem.common, tile=variant.tile, num_splits=variant.num_splits)
    impl = backend.get_impl_cls()(spec, sinks=problem.sinks, cache_layout=backend.get_kv_layout())
    launches = impl.plan(problem.query, cache, metadata, torch.empty_like(problem.query))
    k_view, v_view = backend.kv_cache_to_logical(cache, spec)
    write = plan_write_kv(
        problem.new_key, problem.new_value, k_view, v_view, metadata.slot_mapping,
        spec.k_scale, spec.v_scale,
    )  # fmt: skip
    return [*launches, write]


def _compile_key(launch: KernelLaunch) -> tuple:
    """What Triton compiles a launch for: the constexprs and options, and for the other
    arguments their dtypes, 16-byte alignment, and ints that are 1 or multiples of 16
    (except the parameters marked do_not_specialize)."""
    fn = getattr(launch.kernel, "fn", launch.kernel)
    params = inspect.signature(fn).parameters
    options = getattr(launch.kernel, "kwargs", None) or {}  # an interpreted kernel's jit options
    fixed = set(options.get("do_not_specialize") or ())
    fixed |= {p.name for p in getattr(launch.kernel, "params", ()) if p.do_not_specialize}
    key = []
    for name, value in sorted(launch.kwargs.items()):
        if name not in params or "constexpr" in str(params[name].annotation):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in fixed:
            key.append((name, "one" if value == 1 else ("d16" if value % 16 == 0 else "int")))
        else:
            key.append((name, type(value).__name__))
    return (fn.__name__, tuple(key))


def _probed_form(launch: KernelLaunch) -> LaunchForm:
    """The launch form whose compiled fit the rule planned an attention launch with
    (``CompiledFits``): a list of work items (a CUDA-graph step's even shares included,
    ``step_splits``) and fixed key ranges are probed as key ranges."""
    kw = launch.kwargs
    if not kw["SPLIT"]:
        return LaunchForm.UNSPLIT
    if kw["RANGE_LIST"] or kw["tiles_per_split"] > 0:
        return LaunchForm.KEY_RANGES
    return LaunchForm.EVEN_SHARES


@dataclass(frozen=True)
class _Compiled:
    launches: list[KernelLaunch]  # one per compiled kernel
    results: list[CompileResult]  # each labelled "variant:kernel"
    # (launched attention kernel, its probe's) as indices into ``results``
    probed: list[tuple[int, int]]


@functools.cache
def _compiled(cache_dir: str) -> _Compiled:
    """Every launched variant, once per compiled kernel, with the occupancy probe's
    launch of each attention launch's (tile, form), compiled for sm_90 in a fresh
    Triton cache (``cache_dir``): ptxas then reports every variant's registers."""
    launches, labels, index = [], [], {}

    def add(launch: KernelLaunch, label: str) -> int:
        key = _compile_key(launch)
        if key not in index:  # the same compiled kernel as an earlier launch's
            index[key] = len(launches)
            launches.append(launch)
            labels.append(f"{label}:{key[0]}")
        return index[key]

    probes: dict[tuple, KernelLaunch] = {}
    probed = []
    for variant in VARIANTS:
        spec = build_problem(variant.scenario, "cpu").spec
        for launch in _launches(variant):
            launched = add(launch, variant.label)
            # the batch-invariant mode plans without compiled fits
            if "RANGE_LIST" not in launch.kwargs or variant.batch_invariant:
                continue
            kw = launch.kwargs
            tile = TileConfig(kw["BLOCK_M"], kw["TILE_N"], kw["num_warps"], kw["num_stages"])
            key = (spec, tile, _probed_form(launch))
            if key not in probes:
                probes[key] = CompiledFits(spec, "cpu", {}).probe_launch(*key[1:])
            probed.append((launched, add(probes[key], f"probe-{variant.label}")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", cache_dir)
        results = compile_launches(launches, labels=labels)
    return _Compiled(launches, results, probed)


def test_every_launched_variant_compiles_for_sm90(tmp_path_factory):
    compiled = _compiled(str(tmp_path_factory.getbasetemp() / "triton-sm90"))
    launches, results = compiled.launches, compiled.results
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n\n".join(failed)
    kernels = {r.label.split(":")[1] for r in results}
    assert {"unified_attention_kernel", "reduce_splits_kernel", "write_kv_kernel"} <= kernels
    # both split forms of fixed key ranges: a static plan's and a CUDA-graph step's
    trimmed = {
        bool(launch.kwargs["DYNAMIC_SPLITS"])
        for launch in launches
        if launch.kwargs.get("TRIM_SPLITS") and "SPLIT" in launch.kwargs
    }
    assert trimmed == {False, True}, trimmed
    # and both grids: (query blocks, splits) and a list of work items
    listed = {launch.kwargs["RANGE_LIST"] for launch in launches if "RANGE_LIST" in launch.kwargs}
    assert listed == {False, True}, listed
    # and a (requests, splits) grid beside the (query blocks, splits) one
    by_request = {
        launch.kwargs["BLOCK_PER_REQUEST"]
        for launch in launches
        if "BLOCK_PER_REQUEST" in launch.kwargs and not launch.kwargs["RANGE_LIST"]
    }
    assert by_request == {False, True}, by_request
    # register spills: none inside a loop, at most the rule's slack in all (a value
    # parked for the whole kernel)
    assert all(r.spill_bytes is not None for r in results), "a variant came from a cache"
    spilled = [
        str(r)
        for r in results
        if r.spill_bytes and (r.spill_bytes > SPILL_SLACK_BYTES or r.loop_spills != 0)
    ]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_every_launch_fits_an_sm_as_the_variant_its_plan_probed(tmp_path_factory):
    """On a GPU the rule plans with the compiled fit of a probe launch per (tile, form)
    (``occupancy.CompiledFits``): two eager decodes, the reduction launched at the
    attention's start. A launch compiles its own variant (a CUDA-graph step's dynamic
    splits, a list of work items, a reduction launched after the keys, sinks, ...),
    whose registers may differ: it must fit as many programs an SM as its probe did, or
    the plan's waves are not the GPU's."""
    compiled = _compiled(str(tmp_path_factory.getbasetemp() / "triton-sm90"))
    results = compiled.results

    def programs(i: int) -> int:
        r = results[i]
        assert r.ok and r.registers is not None, r
        return occupancy(r.registers, r.shared, r.num_warps)

    assert len(compiled.probed) > 50, len(compiled.probed)
    unlike = [
        f"{results[launched].label}: {results[launched].registers} registers "
        f"({programs(launched)} an SM), its probe {results[probe].registers} "
        f"({programs(probe)})"
        for launched, probe in compiled.probed
        if programs(launched) != programs(probe)
    ]
    assert not unlike, "\n".join(unlike)


def test_the_matrix_covers_the_rule():
    """Every head size, GQA group, block size and cache kind, and both split forms."""
    labels = " ".join(v.label for v in VARIANTS)
    for part in (
        "d64-",
        "d128-",
        "d256-",
        "gqa1-",
        "gqa4-",
        "gqa8-",
        "gqa16-",
        "block32",
        "block64",
    ):
        assert part in labels, part
    for part in ("fp8", "fp32", "-split", "invariant", "m16-", "m32-", "m64-", "dynamic-splits"):
        assert part in labels, part
    graph = [v for v in VARIANTS if v.bounds is not None]
    assert graph and all(_launches(v)[0].kwargs["DYNAMIC_SPLITS"] for v in graph)
    # the merge's every width: a launch of 64 splits at most whose rows may take fewer
    long = _launches(next(v for v in VARIANTS if v.label == "graph-32k-reservation-d128"))
    assert long[1].kwargs["SPLIT_PAD"] == 64 and long[1].kwargs["MIN_WIDTH"] == REDUCE_MIN_WIDTH
    # both merges: each one-wave block's last program, and a graph's choice of either
    for label in ("merge-last-by-request", "merge-last-ranges-sinks"):
        (attention, _write) = _launches(next(v for v in VARIANTS if v.label == label))
        assert attention.kwargs["MERGE_LAST"] and not attention.kwargs["DYNAMIC_SPLITS"], label
    graph = _launches(next(v for v in VARIANTS if v.label == "graph-32k-reservation-d128"))
    assert graph[0].kwargs["MERGE_LAST"] and graph[1].kwargs["SKIP_MERGED"]
    split = _launches(next(v for v in VARIANTS if v.label == "split2"))
    assert split[0].kwargs["LAUNCH_DEPENDENTS"] == DEPENDENTS_AT_START
    for label in ("mixed-parts-split-chunk", "graph-mixed-parts-split-chunk"):
        decodes, _, chunk, *_ = _launches(next(v for v in VARIANTS if v.label == label))
        assert decodes.kwargs["LAUNCH_DEPENDENTS"] == DEPENDENTS_AT_START, label
        assert chunk.kwargs["LAUNCH_DEPENDENTS"] == DEPENDENTS_AFTER_KEYS, label
    assert split[1].kwargs["WAIT_FOR_PRIMARY"] and split[1].kwargs["launch_pdl"]


@triton.jit
def _tiny_dot_kernel(A, Out):
    # an 8x8x8 dot: the interpreter runs it, the sm_90 compiler rejects it (K < 16)
    offs = tl.arange(0, 8)
    a = tl.load(A + offs[:, None] * 8 + offs[None, :])
    tl.store(Out + offs[:, None] * 8 + offs[None, :], tl.dot(a, a))


def test_a_broken_kernel_is_reported():
    launch = (_tiny_dot_kernel, (torch.zeros(8, 8), torch.zeros(8, 8)), {})
    (result,) = compile_launches([launch], labels=["tiny-dot"])
    assert not result.ok and "tiny-dot: FAILED" in str(result)


def test_a_spill_inside_a_loop_is_told_from_one_outside(monkeypatch, tmp_path):
    """The spill check reads the SASS: the unsplit decode variant's one parked value sits
    outside every loop; squeezed to 96 registers, the same kernel spills inside them."""
    # a fresh Triton cache: a cached kernel reports no ptxas log (the matrix test above
    # may have compiled the same variant)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    scenario = BASE.replace(seq_lens=(1024,) * 4, query_lens=(1,) * 4)
    tile = TileConfig(16, 64, 4, 2)
    (attention, *_rest) = _launches(Variant("unsplit", scenario, tile=tile, num_splits=1))
    assert attention.kwargs["BLOCK_PER_REQUEST"] and not attention.kwargs["SPLIT"]
    squeezed = (attention.kernel, (), {**attention.kwargs, "maxnreg": 96})
    parked, looped = compile_launches([attention, squeezed], labels=["parked", "squeezed"])
    if parked.loop_spills is None:
        pytest.skip("no cuobjdump beside Triton's ptxas")
    assert parked.loop_spills == 0 and parked.spill_bytes <= SPILL_SLACK_BYTES, parked
    assert looped.loop_spills > 0, looped
