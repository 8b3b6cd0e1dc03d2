"""Lowering the kernel without a GPU or TPU, and a small problem to run it on.

``export_kernel(cfg, platform)`` lowers one kernel variant through ``jax.export``
for ``cuda`` (the Pallas Triton form; compiles to PTX only on a GPU) or ``tpu``
(Mosaic). ``VARIANTS`` covers every static branch of the kernel. ``smoke(target)``
runs a small paged problem under one target and says whether it compiles and matches
a NumPy reference (tests/test_pallas_lowering.py in interpret mode,
tests/test_pallas_gpu.py under each Pallas GPU lowering).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh
from pagedkv.backends.pallas.builder import num_tiles_bound, plan_tiles
from pagedkv.backends.pallas.kernel import KernelConfig, StepArrays, jitted, paged_attention

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
TPU_KIND = "TPU v5e"  # any kind jax's tpu_info knows; the block-shape rules are shared

_BASE = KernelConfig(
    num_heads=8,
    num_kv_heads=2,
    head_size=128,
    block_size=16,
    scale=128**-0.5,
    block_q=4,
    block_n=64,
    target="triton",
)
# Every static branch: masking modes, score modifiers, fp8 widening, padded head
# sizes and group sizes, odd block sizes, split-KV with and without sinks.
VARIANTS: dict[str, tuple[KernelConfig, str, str]] = {
    # name: (config, model dtype, cache dtype)
    "causal-bf16": (_BASE, "bfloat16", "bfloat16"),
    "causal-fp16-decode": (replace(_BASE, block_q=4), "float16", "float16"),
    "fp32-gqa5-d80": (
        replace(_BASE, num_heads=10, head_size=80, scale=80**-0.5, block_q=2),
        "float32",
        "float32",
    ),
    "noncausal-window-bs5": (
        replace(_BASE, causal=False, sliding_window=9, block_size=5),
        "float16",
        "float16",
    ),
    "softcap-alibi-sinks-window": (
        replace(_BASE, logits_soft_cap=30.0, use_alibi=True, use_sinks=True, sliding_window=100),
        "bfloat16",
        "bfloat16",
    ),
    "split4-sinks": (replace(_BASE, split_slots=4, use_sinks=True), "bfloat16", "bfloat16"),
    "fp8-e4m3": (replace(_BASE, k_scale=0.5, v_scale=2.0), "bfloat16", "float8_e4m3fn"),
    # a 1-byte cache's default key step (configs.default_block_n), decode and prefill tiles
    "fp8-e4m3-bn128-decode": (
        replace(_BASE, k_scale=0.5, v_scale=2.0, block_n=128, split_slots=4),
        "bfloat16",
        "float8_e4m3fn",
    ),
    "fp8-e4m3-bn128-bm64": (
        replace(_BASE, k_scale=0.5, v_scale=2.0, block_n=128, block_q=16),
        "bfloat16",
        "float8_e4m3fn",
    ),
    "fp8-e5m2-split2": (
        replace(_BASE, k_scale=0.5, v_scale=2.0, split_slots=2),
        "float16",
        "float8_e5m2",
    ),
    "mqa-d256-bm64": (
        replace(_BASE, num_kv_heads=1, head_size=256, scale=256**-0.5, block_q=8, block_n=32),
        "bfloat16",
        "bfloat16",
    ),
}

# shapes of the exported problem: tokens, requests, table width, pool size
_T, _B, _W, _N = 64, 8, 32, 512


def abstract_args(cfg: KernelConfig, dtype: str, cache_dtype: str) -> tuple:
    """ShapeDtypeStructs of every kernel input for ``cfg``."""
    i32, f32 = jnp.int32, jnp.float32
    tiles = num_tiles_bound(_T, _B, cfg.block_q)
    s = jax.ShapeDtypeStruct
    step = StepArrays(
        tile_req=s((tiles,), i32),
        tile_qstart=s((tiles,), i32),
        query_start_loc=s((_B + 1,), i32),
        seq_lens=s((_B,), i32),
        block_table=s((_B, _W), i32),
        split_steps=s((1,), i32),
    )
    return (
        s((_T, cfg.num_heads, cfg.head_size), jnp.dtype(dtype)),
        s((_N, cfg.block_size, 2 * cfg.num_kv_heads, cfg.head_size), jnp.dtype(cache_dtype)),
        step,
        s((cfg.num_heads,), f32),
        s((cfg.num_heads,), f32),
    )


def export_kernel(
    cfg: KernelConfig,
    platform: str,
    dtype: str = "bfloat16",
    cache_dtype: str = "bfloat16",
    *,
    tpu_kind: str = TPU_KIND,
    args: tuple | None = None,
) -> export.Exported:
    """Lower ``cfg`` for ``platform`` ("cuda": Pallas Triton, "tpu": Mosaic) without a
    device, for inputs ``args`` (ShapeDtypeStructs; default: a small problem's,
    ``abstract_args``). Raises what the lowering raises.

    Mosaic reads the chip's tiling rules from the device; off-TPU an abstract device
    of kind ``tpu_kind`` stands in for it.
    """
    cfg = replace(cfg, target={"cuda": "triton", "tpu": "mosaic_tpu"}[platform])
    disabled = (
        [export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)] if platform == "cuda" else []
    )

    def fn(*args):
        return jitted(cfg.target)(*args, cfg=cfg)

    lower = export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)
    args = args if args is not None else abstract_args(cfg, dtype, cache_dtype)
    if platform != "tpu":
        return lower(*args)
    device = AbstractDevice(device_kind=tpu_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        return lower(*args)


# -- a small problem ----------------------------------------------------------------------


def _small_problem(rng: np.random.Generator, cfg: KernelConfig):
    seq_lens = np.array([1, 37, 200, 64], np.int32)
    query_lens = np.array([1, 37, 3, 1], np.int32)
    bs = cfg.block_size
    blocks = -(-seq_lens // bs)
    width = int(blocks.max())
    num_blocks = 1 + int(blocks.sum())
    perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    table = np.zeros((len(seq_lens), width), np.int32)
    taken = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[taken : taken + n]
        taken += n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    tokens = int(qsl[-1])
    q = rng.standard_normal((tokens, cfg.num_heads, cfg.head_size)).astype(np.float32)
    cache = rng.standard_normal((num_blocks, bs, 2 * cfg.num_kv_heads, cfg.head_size)).astype(
        np.float32
    )
    return q, cache, qsl, seq_lens, table


def _reference(q, cache, qsl, seq_lens, table, cfg: KernelConfig) -> np.ndarray:
    out = np.zeros_like(q)
    group = cfg.group
    for r in range(len(seq_lens)):
        rows = cache[table[r]].reshape(-1, *cache.shape[2:])[: seq_lens[r]]
        q_len = qsl[r + 1] - qsl[r]
        for j in range(q_len):
            pos = seq_lens[r] - q_len + j
            for h in range(cfg.num_heads):
                k = rows[: pos + 1, 2 * (h // group)]
                v = rows[: pos + 1, 2 * (h // group) + 1]
                s = k @ q[qsl[r] + j, h] * cfg.scale
                w = np.exp(s - s.max())
                out[qsl[r] + j, h] = (w / w.sum()) @ v
    return out


def smoke(target: str) -> str:
    """Run a small problem on the default device under ``target``; one line of verdict."""
    cfg = replace(_BASE, target=target)
    rng = np.random.default_rng(0)
    q, cache, qsl, seq_lens, table = _small_problem(rng, cfg)
    tile_req, tile_qstart = plan_tiles(np.diff(qsl), q.shape[0], cfg.block_q)
    zeros = jnp.zeros(cfg.num_heads, jnp.float32)
    step = StepArrays(
        *(jnp.asarray(a) for a in (tile_req, tile_qstart, qsl, seq_lens, table)),
        split_steps=jnp.ones(1, jnp.int32),
    )
    try:
        out = paged_attention(
            jnp.asarray(q, jnp.bfloat16),
            jnp.asarray(cache, jnp.bfloat16),
            step,
            zeros,
            zeros,
            cfg=cfg,
        )
        out = np.asarray(out.astype(jnp.float32))
    except Exception as exc:  # report, do not crash: the point is to learn which works
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return f"{target}: FAILS ({type(exc).__name__}: {first_line[:300]})"
    q32 = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    c32 = np.asarray(jnp.asarray(cache, jnp.bfloat16).astype(jnp.float32))
    err = float(np.abs(out - _reference(q32, c32, qsl, seq_lens, table, cfg)).max())
    verdict = "WORKS" if err < 3e-2 else "WRONG RESULTS"
    return f"{target}: {verdict} (bf16, max abs error {err:.3g} vs NumPy)"
