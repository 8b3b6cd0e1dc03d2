"""Every kernel variant the MLA backend launches compiles for sm_90, without a GPU.

The interpreter does not check what the GPU compiler checks (tl.dot shapes, layouts,
TMA boxes, shared memory), so the launches the backend plans on an H100/H200 are
compiled for sm_90 here, argument for argument: the configuration table's Hopper row
(decode, split-KV with its reduction, prefill, non-causal, fp16, both fp8 caches,
TMA and pointer loads, block-table gathers), the sizing rule's fallbacks (fp32, small
and non-power-of-two latents, no rope), a CUDA-graph step (padded tiles, every row
reduced) and the latent write (the shared writer) for every cache dtype.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from pagedkv.backends.mla import MLABackend
from pagedkv.backends.mla.builder import MLAMetadataBuilder
from pagedkv.backends.mla.configs import choose_config, pad_dim
from pagedkv.conformance import Scenario
from pagedkv.conformance.problem import build_problem
from pagedkv.graph import GraphBounds
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.triton_kv_write import plan_write_kv
from triton_compile import SM90_MAX_SHARED, compile_launches

pytest.importorskip("triton")

DEEPSEEK = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_heads=128, block_size=64)
DECODE = dict(seq_lens=(300, 40), query_lens=(1, 1))
PREFILL = dict(seq_lens=(300, 40), query_lens=(100, 40))


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    scenario: Scenario
    overrides: dict = dataclasses.field(default_factory=dict)  # KernelConfig fields
    num_splits: int | None = None
    capability: tuple[int, int] = (9, 0)  # the device planned for
    graph: bool = False  # built under a CUDA-graph reservation of this step's size


def _variants() -> list[Variant]:
    bf16 = Scenario("bf16", **DECODE, **DEEPSEEK, dtype=torch.bfloat16)
    triton = {"use_gluon": False}
    out = [
        # the Gluon sm_90 kernel (16-bit, rope 64, blocks of 64k rows)
        Variant("decode", bf16),
        Variant("decode-split4", bf16, num_splits=4),
        Variant("prefill", bf16.replace(**PREFILL)),
        Variant("non-causal", bf16.replace(causal=False, **PREFILL)),
        Variant("float16", bf16.replace(dtype=torch.float16)),
        Variant("block128", bf16.replace(block_size=128)),
        Variant("heads16", bf16.replace(num_heads=16)),
        Variant("latent-256", bf16.replace(kv_lora_rank=256)),
        # the Triton kernel: where the Gluon one does not apply, or asked for
        Variant("fp8-e4m3", bf16.replace(kv_cache_dtype="fp8_e4m3", k_scale=0.5)),
        Variant("fp8-e5m2-split2", bf16.replace(kv_cache_dtype="fp8_e5m2"), num_splits=2),
        Variant("triton-decode", bf16, triton),
        Variant("triton-split4", bf16, triton, num_splits=4),
        Variant("triton-prefill", bf16.replace(**PREFILL), triton),
        Variant("triton-non-causal", bf16.replace(causal=False, **PREFILL), triton),
        Variant("triton-float16", bf16.replace(dtype=torch.float16), triton),
        Variant("lazy-rescale", bf16, {"lazy_rescale": True, **triton}),
        Variant("lazy-split3", bf16.replace(**PREFILL), {"lazy_rescale": True, **triton}, 3),
        Variant("pointer-loads", bf16, {"use_tma": False, **triton}),
        Variant("no-tma-device", bf16, capability=(8, 0)),
        Variant("graph-decode-split4", bf16, num_splits=4, graph=True),
        Variant("triton-graph-prefill", bf16.replace(**PREFILL), triton, 3, graph=True),
        Variant("block16-gather", bf16.replace(block_size=16)),
        Variant("triton-block128", bf16.replace(block_size=128), triton),
        Variant("triton-heads16", bf16.replace(num_heads=16), triton),
        Variant("block-n32-stages3", bf16, {"block_n": 32, "num_stages": 3, **triton}),
        # the sizing rule's fallbacks
        Variant("float32", bf16.replace(dtype=torch.float32)),
        Variant("small-latent", bf16.replace(kv_lora_rank=64, qk_rope_head_dim=16)),
        Variant("odd-latent", bf16.replace(kv_lora_rank=48, qk_rope_head_dim=8)),
        Variant("no-rope", bf16.replace(kv_lora_rank=256, qk_rope_head_dim=0)),
    ]
    return out


VARIANTS = _variants()


def _launches(variant: Variant) -> list[KernelLaunch]:
    scenario = variant.scenario
    problem = build_problem(scenario, "cpu")
    spec = problem.spec
    backend = MLABackend(num_splits=variant.num_splits)
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    builder = MLAMetadataBuilder(
        spec, "cpu", graph_support=backend.capabilities.graph_support, **backend.options
    )
    # plan as on an H200: its configuration row (or the sizing rule), SMs and capability
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    builder.config = dataclasses.replace(
        choose_config("sm90", spec.dtype.itemsize, pad_dim(lora), pad_dim(rope)),
        **variant.overrides,
    )
    builder.num_sms = 132
    builder.capability = variant.capability
    common = problem.common
    if variant.graph:
        query_lens = scenario.query_lens
        builder.reserve_cuda_graph(
            GraphBounds(
                max_num_reqs=len(query_lens) + 1,
                max_num_tokens=common.num_tokens + 3,
                max_blocks_per_req=common.block_table.shape[1],
                max_query_len=max(query_lens),
            )
        )
    metadata = builder.build(common)
    if variant.num_splits:
        assert metadata.num_splits > 1  # fewer than asked where a split would be empty
    impl = backend.make_impl(spec)
    query = problem.query
    if variant.graph:  # the padded step's rows
        query = torch.cat([query, query[:3]])
    out = query.new_empty(query.shape[0], spec.num_heads, lora)
    launches = impl.plan_attention(query[..., :lora], query[..., lora:], cache, metadata, out)
    key = problem.new_key[:, 0]
    operands = impl.latent_write_operands(key[:, :lora], key[:, lora:], cache)
    slots = common.slot_mapping
    launches.append(plan_write_kv(*operands, slots, spec.k_scale, spec.k_scale))
    return launches


def _name(launch: KernelLaunch) -> str:
    return launch.kernel.fn.__name__


def _portable(launch: KernelLaunch) -> KernelLaunch:
    """TMA descriptors compile from their dtype, box (and Gluon's, its shared layout)
    only; tensors travel to the compile subprocess as descriptions (fp8 tensors do not
    even pickle in torch 2.13), so each descriptor gets a described base."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor
    from triton_compile import _FakeTensor, _TensorArg

    def described(arg):
        if not isinstance(arg, (TensorDescriptor, GluonDescriptor)):
            return arg
        shape, strides = list(arg.shape), list(arg.strides)
        base = _FakeTensor(_TensorArg(arg.base.dtype, tuple(shape), tuple(strides), 0))
        if isinstance(arg, GluonDescriptor):
            return GluonDescriptor(base, shape, strides, list(arg.block_shape), arg.layout)
        return TensorDescriptor(base, shape, strides, list(arg.block_shape))

    kwargs = {name: described(value) for name, value in launch.kwargs.items()}
    return KernelLaunch(launch.kernel, launch.grid, kwargs)


def _compile_key(launch: KernelLaunch) -> tuple:
    """What Triton specialises a launch on: constexprs, dtypes, 16-alignment, ==1 ints."""
    from triton.runtime.jit import mangle_type

    parameters = inspect.signature(getattr(launch.kernel, "fn", launch.kernel)).parameters
    constexprs = {name for name, p in parameters.items() if "constexpr" in str(p.annotation)}
    kinds = []
    for name, a in sorted(launch.kwargs.items()):
        if name in constexprs or name in ("num_warps", "num_stages"):
            kinds.append((name, repr(a)))
        elif isinstance(a, torch.Tensor):
            kinds.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            kinds.append((name, "one" if a == 1 else ("d16" if a % 16 == 0 else "int")))
        elif a is None or isinstance(a, float):
            kinds.append((name, repr(type(a))))
        else:
            kinds.append((name, mangle_type(a)))
    return _name(launch), tuple(kinds)


def test_every_launched_variant_compiles_for_sm90():
    launches, labels, seen = [], [], set()
    for variant in VARIANTS:
        for launch in _launches(variant):
            key = _compile_key(launch)
            if key in seen:  # the same compiled kernel as an earlier variant's
                continue
            seen.add(key)
            launches.append(_portable(launch))
            labels.append(f"{variant.label}:{_name(launch)}")
    results = compile_launches(launches, labels=labels)
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n\n".join(failed)
    kernels = {label.split(":")[1] for label in labels}
    assert kernels == {"_mla_attention", "_mla_attention_sm90", "_mla_reduce", "write_kv_kernel"}
    # the Gluon kernel is the default on sm_90 (known when ptxas ran, i.e. not served
    # from Triton's cache): ptxas must not serialise its wgmmas, and only loop
    # invariants (wgmma descriptors, addresses; ~270 B, reloaded from L1) may spill;
    # some Triton variants spill by design (mla.md)
    gluon = [r for r in results if r.label.endswith("_mla_attention_sm90")]
    serialized = [str(r) for r in gluon if r.wgmma_serialized]
    assert not serialized, "wgmma serialized:\n" + "\n".join(serialized)
    spilled = [str(r) for r in gluon if (r.spill_bytes or 0) > 384]
    assert not spilled, "register spills:\n" + "\n".join(spilled)
    # on sm_90 the reduction is the attention's programmatic dependent: a split attention
    # variant lets it launch early, the reduction waits before it reads a partial, a
    # one-split variant has no dependent
    for launch, result in zip(launches, results, strict=True):
        if _name(launch) == "_mla_reduce":
            assert result.grid_dependency == ("wait",), result.label
        elif _name(launch) != "write_kv_kernel":
            split = not launch.kwargs["ONE_SPLIT"]
            assert launch.kwargs["LAUNCH_DEPENDENTS"] == split, result.label
            assert result.grid_dependency == (("launch_dependents",) if split else ()), result.label


def test_the_hopper_row_uses_the_gluon_kernel_and_one_split_for_the_headline_decode():
    import pagedkv

    # 64 requests x 4096 tokens x 128 heads: 128 programs for 132 SMs, no split
    spec = Scenario("headline", (1,), (1,), **DEEPSEEK, dtype=torch.bfloat16).spec()
    blocks = [list(range(1 + 64 * i, 1 + 64 * (i + 1))) for i in range(64)]
    common = pagedkv.CommonAttentionMetadata.from_requests([4096] * 64, [1] * 64, blocks, 64)
    impl = MLABackend().make_impl(spec)
    cache = MLABackend().allocate_kv_cache(8, spec, "cpu")  # planning reads only its layout
    q = torch.zeros(64, 128, 576, dtype=torch.bfloat16)
    for use_gluon, kernel in ((True, "_mla_attention_sm90"), (False, "_mla_attention")):
        builder = MLAMetadataBuilder(spec, "cpu")
        builder.config = dataclasses.replace(choose_config("sm90", 2, 512, 64), use_gluon=use_gluon)
        builder.num_sms, builder.capability = 132, (9, 0)
        metadata = builder.build(common)
        assert tuple(metadata.items.shape) == (4, 128) and metadata.num_splits == 1
        (attention,) = impl.plan_attention(
            q[..., :512], q[..., 512:], cache, metadata, q[..., :512].clone()
        )
        assert _name(attention) == kernel and attention.kwargs["ONE_SPLIT"]
        assert attention.grid == (128,)
    # asking for the Triton kernel gives it with TMA loads
    assert attention.kwargs["USE_TMA"] and metadata.plan.kind == "tma"


def test_the_timeline_probe_patches_the_kernel_and_compiles(tmp_path, monkeypatch):
    """benchmarks/mla_timeline.py stamps a copy of the Gluon kernel at fixed anchors of
    its source: every anchor must still be there, and the copy must compile for sm_90
    (registers and shared memory as the kernel's, the stamps' stores beside them)."""
    import runpy
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "path", list(sys.path))  # stamped_module adds its folder
    monkeypatch.setitem(sys.modules, "mla_timeline_kernel", None)  # removed afterwards
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "mla_timeline.py"
    timeline = runpy.run_path(str(script), run_name="mla_timeline")
    with pytest.raises(RuntimeError, match="occurs 0 times"):
        timeline["stamped_source"]("no kernel here")
    module = timeline["stamped_module"](str(tmp_path))
    (launch,) = [lau for lau in _launches(VARIANTS[0]) if _name(lau) == "_mla_attention_sm90"]
    programs = launch.grid[0]
    kwargs = dict(
        launch.kwargs, Stamps=torch.zeros(programs * timeline["SLOTS"], dtype=torch.int64)
    )
    stamped = _portable(KernelLaunch(module._mla_attention_sm90, launch.grid, kwargs))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    (result,) = compile_launches([stamped], labels=["stamped"])
    assert result.ok, str(result)
    assert result.shared <= SM90_MAX_SHARED and not result.wgmma_serialized
