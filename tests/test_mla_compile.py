"""Every kernel variant the MLA backend launches compiles for sm_90, without a GPU.

The interpreter does not check what the GPU compiler checks (tl.dot shapes, layouts,
TMA boxes, shared memory), so the launches the backend plans on an H100/H200 are
compiled for sm_90 here, argument for argument: the configuration table's Hopper row
(decode, split-KV with its reduction, prefill, non-causal, fp16, both fp8 caches,
TMA and pointer loads, block-table gathers), the sizing rule's fallbacks (fp32, small
and non-power-of-two latents, no rope) and the latent write for every cache dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pagedkv.backends.mla import MLABackend
from pagedkv.backends.mla.configs import choose_config
from pagedkv.backends.mla.impl import MLAMetadataBuilder
from pagedkv.conformance import Scenario
from pagedkv.conformance.problem import build_problem
from triton_compile import compile_launches

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
    allow_tma: bool = True  # as on Hopper
    allow_gluon: bool = True  # as on sm_90


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
        Variant("no-tma-device", bf16, allow_tma=False, allow_gluon=False),
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


def _launches(variant: Variant) -> list[tuple]:
    scenario = variant.scenario
    problem = build_problem(scenario, "cpu")
    spec = problem.spec
    backend = MLABackend(num_splits=variant.num_splits)
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    builder = MLAMetadataBuilder(spec, "cpu", **backend.options)
    # plan as on an H200: its configuration row (or the sizing rule) and 132 SMs
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    pad = lambda n: max(16, 1 << max(n - 1, 0).bit_length())  # noqa: E731
    builder.config = dataclasses.replace(
        choose_config("sm90", spec.dtype.itemsize, pad(lora), pad(rope)), **variant.overrides
    )
    builder.num_sms = 132
    metadata = builder.build(problem.common)
    if variant.num_splits:
        assert metadata.num_splits > 1  # fewer than asked where a split would be empty
    impl = backend.make_impl(spec)
    query = problem.query
    out = query.new_empty(query.shape[0], spec.num_heads, lora)
    launches = impl.plan_attention(
        query[..., :lora],
        query[..., lora:],
        cache,
        metadata,
        out,
        allow_tma=variant.allow_tma,
        allow_gluon=variant.allow_gluon,
    )
    from pagedkv.backends.mla.kernels import plan_write_latent

    key = problem.new_key[:, 0]
    launches += plan_write_latent(
        key[:, :lora],
        key[:, lora:],
        cache,
        problem.common.slot_mapping,
        spec.k_scale,
    )
    return launches


def _portable(launch: tuple) -> tuple:
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

    kernel, grid, args, kwargs = launch
    return kernel, grid, tuple(described(a) for a in args), kwargs


def _compile_key(launch: tuple) -> tuple:
    """What Triton specialises a launch on: constexprs, dtypes, 16-alignment, ==1 ints."""
    from triton.runtime.jit import mangle_type

    kinds = []
    for a in launch[2]:
        if isinstance(a, torch.Tensor):
            kinds.append((str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            kinds.append("one" if a == 1 else ("d16" if a % 16 == 0 else "int"))
        elif a is None or isinstance(a, float):
            kinds.append(repr(type(a)))
        else:
            kinds.append(mangle_type(a))
    return launch[0].fn.__name__, repr(sorted(launch[3].items())), tuple(kinds)


def test_every_launched_variant_compiles_for_sm90():
    launches, labels, seen = [], [], set()
    for variant in VARIANTS:
        for launch in _launches(variant):
            key = _compile_key(launch)
            if key in seen:  # the same compiled kernel as an earlier variant's
                continue
            seen.add(key)
            launches.append(_portable(launch))
            labels.append(f"{variant.label}:{launch[0].fn.__name__}")
    results = compile_launches(launches, labels=labels)
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n\n".join(failed)
    kernels = {label.split(":")[1] for label in labels}
    assert kernels == {"_mla_attention", "_mla_attention_sm90", "_mla_reduce", "_write_latent"}
    # the Gluon kernel is the default on sm_90 (known when ptxas ran, i.e. not served
    # from Triton's cache): ptxas must not serialise its wgmmas, and only loop
    # invariants (wgmma descriptors, addresses; ~270 B, reloaded from L1) may spill;
    # some Triton variants spill by design (mla.md)
    gluon = [r for r in results if r.label.endswith("_mla_attention_sm90")]
    serialized = [str(r) for r in gluon if r.wgmma_serialized]
    assert not serialized, "wgmma serialized:\n" + "\n".join(serialized)
    spilled = [str(r) for r in gluon if (r.spill_bytes or 0) > 384]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_the_hopper_row_uses_the_gluon_kernel_and_one_split_for_the_headline_decode():
    import pagedkv

    # 64 requests x 4096 tokens x 128 heads: 128 programs for 132 SMs, no split
    spec = Scenario("headline", (1,), (1,), **DEEPSEEK, dtype=torch.bfloat16).spec()
    blocks = [list(range(1 + 64 * i, 1 + 64 * (i + 1))) for i in range(64)]
    common = pagedkv.CommonAttentionMetadata.from_requests([4096] * 64, [1] * 64, blocks, 64)
    builder = MLAMetadataBuilder(spec, "cpu")
    builder.config = choose_config("sm90", 2, 512, 64)
    builder.num_sms = 132
    metadata = builder.build(common)
    assert tuple(metadata.tiles.shape) == (2, 128) and metadata.num_splits == 1
    impl = MLABackend().make_impl(spec)
    cache = MLABackend().allocate_kv_cache(8, spec, "cpu")  # planning reads only its layout
    q = torch.zeros(64, 128, 576, dtype=torch.bfloat16)
    (attention,) = impl.plan_attention(
        q[..., :512], q[..., 512:], cache, metadata, q[..., :512].clone(), allow_tma=True,
        allow_gluon=True,
    )  # fmt: skip
    assert attention[0].fn.__name__ == "_mla_attention_sm90" and attention[3]["ONE_SPLIT"]
    assert attention[1] == (128, 1)
    # asking for the Triton kernel gives it, with TMA loads
    metadata = dataclasses.replace(
        metadata, config=dataclasses.replace(metadata.config, use_gluon=False)
    )
    (attention,) = impl.plan_attention(
        q[..., :512], q[..., 512:], cache, metadata, q[..., :512].clone(), allow_tma=True,
        allow_gluon=True,
    )  # fmt: skip
    assert attention[0].fn.__name__ == "_mla_attention"
    assert attention[3]["USE_TMA"] and attention[3]["ONE_SPLIT"]
