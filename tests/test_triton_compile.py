"""Every kernel variant the Triton backend launches compiles for sm_90, without a GPU.

The interpreter does not check what the GPU compiler checks (tl.dot shapes, layouts,
shared memory), so the launches the backend plans are compiled for sm_90 here,
argument for argument. The matrix: every row of the tile table (decode and
prefill, every padded head size, 16- and 32-bit dtypes), non-power-of-two heads,
each score modifier, fp8 caches, GQA groups 1 to 32, several block sizes, the
split-KV path with its reduction, and the KV write for every cache dtype.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pagedkv
import pytest
import torch
from pagedkv.backends.triton.builder import TritonMetadataBuilder
from pagedkv.backends.triton.configs import SPLIT_POLICY, TILES
from pagedkv.conformance import Scenario
from pagedkv.conformance.problem import build_problem
from triton_compile import compile_launches

triton = pytest.importorskip("triton")
tl = triton.language

BACKEND = pagedkv.get_backend("triton")
# the shapes of the performance targets: Hq 32, Hkv 8, D 128, block 16
BASE = Scenario(
    "base", seq_lens=(300, 40), query_lens=(1, 1), num_heads=32, num_kv_heads=8, head_size=128
)
PREFILL = dict(seq_lens=(300, 40), query_lens=(200, 40))
# a layer whose tiles are each TILES row's
DOT_INPUTS = {
    "16-bit": dict(dtype=torch.bfloat16),
    "16-bit-fp8": dict(dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3"),
    "fp32": dict(dtype=torch.float32),
    "fp32-fp8": dict(dtype=torch.float32, kv_cache_dtype="fp8_e5m2"),
}


@dataclass(frozen=True)
class Variant:
    label: str
    scenario: Scenario
    num_splits: int | None = None


def _variants() -> list[Variant]:
    out = []
    for kind, pad, inputs in sorted(TILES):
        lens = PREFILL if kind == "prefill" else {}
        out.append(
            Variant(
                f"{kind}-d{pad}-{inputs}",
                BASE.replace(head_size=pad, **DOT_INPUTS[inputs], **lens),
                num_splits=4 if kind == "decode-split" else None,
            )
        )
    for head in (48, 80, 96, 192):  # padded with masks
        out.append(Variant(f"decode-d{head}", BASE.replace(head_size=head)))
        out.append(Variant(f"prefill-d{head}", BASE.replace(head_size=head, **PREFILL)))
    features = {
        "non-causal": dict(causal=False),
        "window": dict(sliding_window=100),
        "non-causal-window": dict(causal=False, sliding_window=100),
        "softcap": dict(logits_soft_cap=30.0),
        "alibi": dict(alibi=True),
        "sinks": dict(use_sinks=True),
        "fp8-e4m3": dict(kv_cache_dtype="fp8_e4m3", k_scale=0.5),
        "fp8-e5m2": dict(kv_cache_dtype="fp8_e5m2", v_scale=0.5),
        "everything": dict(sliding_window=100, logits_soft_cap=30.0, alibi=True, use_sinks=True),
    }
    for name, changes in features.items():
        out.append(Variant(f"decode-{name}", BASE.replace(**changes)))
        out.append(Variant(f"prefill-{name}", BASE.replace(**changes, **PREFILL)))
    for dtype in (torch.float16, torch.float32):
        out.append(
            Variant(
                f"decode-fp8-{str(dtype)[6:]}", BASE.replace(dtype=dtype, kv_cache_dtype="fp8_e4m3")
            )
        )
    out.append(Variant("decode-float16", BASE.replace(dtype=torch.float16)))
    out.append(Variant("prefill-float16", BASE.replace(dtype=torch.float16, **PREFILL)))
    for heads, kv_heads in ((8, 8), (40, 8), (64, 8), (32, 1)):  # groups 1, 5, 8, 32
        group = heads // kv_heads
        out.append(
            Variant(f"decode-gqa{group}", BASE.replace(num_heads=heads, num_kv_heads=kv_heads))
        )
        out.append(
            Variant(
                f"prefill-gqa{group}",
                BASE.replace(num_heads=heads, num_kv_heads=kv_heads, **PREFILL),
            )
        )
    for block in (48, 128):  # a non-power-of-two page; a page wider than the key tile
        out.append(Variant(f"decode-block{block}", BASE.replace(block_size=block)))
    # split-KV: the attention kernel's SPLIT form and the reduction, at several widths
    for splits, changes in (
        (2, {}),
        (SPLIT_POLICY.max_splits, {}),
        (17, dict(head_size=64)),
        (8, dict(head_size=256)),
        (5, dict(use_sinks=True)),
        (4, dict(dtype=torch.float32)),
        (3, dict(kv_cache_dtype="fp8_e4m3")),
        (6, dict(sliding_window=100, logits_soft_cap=30.0, alibi=True, use_sinks=True)),
    ):
        label = f"split{splits}" + "".join(f"-{k}" for k in changes)
        out.append(Variant(label, BASE.replace(**changes), num_splits=splits))
    return out


VARIANTS = _variants()


def _launches(variant: Variant) -> list[tuple]:
    problem = build_problem(variant.scenario, "cpu")
    spec = problem.spec
    cache = BACKEND.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    builder = TritonMetadataBuilder(spec, "cpu")
    metadata = builder.build(problem.common, num_splits=variant.num_splits)
    impl = BACKEND.get_impl_cls()(spec, sinks=problem.sinks)
    output = torch.empty_like(problem.query)
    launches = list(impl.plan(problem.query, cache, metadata, output))
    # the KV write, as forward launches it
    from pagedkv.toolkit.triton_kv_write import plan_write_kv

    write = plan_write_kv(
        problem.new_key, problem.new_value, cache[0], cache[1], metadata.slot_mapping,
        spec.k_scale, spec.v_scale,
    )  # fmt: skip
    return [*launches, (write.kernel, write.grid, (), write.kwargs)]


def test_every_launched_variant_compiles_for_sm90():
    launches, labels, seen = [], [], set()
    for variant in VARIANTS:
        for launch in _launches(variant):
            name = getattr(launch[0], "fn", launch[0]).__name__
            key = (name, repr(sorted(launch[-1].items())), _arg_kinds(launch[0], launch[-2]))
            if key in seen:  # the same compiled kernel as an earlier variant
                continue
            seen.add(key)
            launches.append(launch)
            labels.append(f"{variant.label}:{name}")
    results = compile_launches(launches, labels=labels)
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n\n".join(failed)
    kernels = {label.split(":")[1] for label in labels}
    assert {"unified_attention_kernel", "reduce_splits_kernel", "write_kv_kernel"} <= kernels
    # register spills (known when ptxas ran, i.e. not served from Triton's cache)
    spilled = [str(r) for r in results if r.spill_bytes]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def _arg_kinds(kernel, args: tuple) -> tuple:
    """What Triton specialises a launch on besides constexprs: dtypes, and ints that are
    1 or multiples of 16 (except the parameters marked do_not_specialize)."""
    fn = getattr(kernel, "fn", kernel)
    names = list(inspect.signature(fn).parameters)
    options = getattr(kernel, "kwargs", None) or {}  # an interpreted kernel's jit options
    fixed = set(options.get("do_not_specialize") or ())
    fixed |= {p.name for p in getattr(kernel, "params", ()) if p.do_not_specialize}
    kinds = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            kinds.append(str(a.dtype))
        elif isinstance(a, int) and not isinstance(a, bool) and name not in fixed:
            kinds.append("one" if a == 1 else ("d16" if a % 16 == 0 else "int"))
        else:
            kinds.append(type(a).__name__)
    return tuple(kinds)


def test_the_matrix_covers_the_tile_table():
    labels = {v.label for v in VARIANTS}
    for kind, pad, inputs in TILES:
        assert f"{kind}-d{pad}-{inputs}" in labels


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
