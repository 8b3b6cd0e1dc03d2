"""The scenario matrix of one backend, drawn from its declared capabilities.

A covering design, not a cross product: one base layer (the backend's most common
dtype, a small head size, its usual block size, GQA ratio 4) runs every batch
shape; then one axis or feature is varied at a time on a mixed batch. Kernel
libraries compile one variant per (dtype, head size, feature set), so the full
level keeps the number of such combinations near a dozen (``jit_combinations``).

Batch shapes are written in units of the block size ``B`` so every shape holds
lengths that are and are not multiples of it, whatever block size is under test.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.capabilities import sizes_match
from pagedkv.conformance.scenario import Scenario
from pagedkv.errors import PagedKVError
from pagedkv.features import Feature

LEVELS = ("quick", "full")

# dtypes in order of preference for the base layer
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = {"fp8_e4m3": (0.5, 2.0), "fp8_e5m2": (0.25, 1.5)}  # non-unit (k_scale, v_scale)
# the DeepSeek-V2/V3 MLA dims: kv_lora_rank, rope, nope, v
DEEPSEEK_MLA = (512, 64, 128, 128)
# smaller latent dims for the quick level, tried in order when the backend takes them
_SMALL_MLA = ((64, 16, 32, 32), (128, 32, 64, 64), (256, 64, 128, 128))
# a pool whose K (or V) spans more than 2**31 elements: offsets need 64 bits
_OVERFLOW_ELEMENTS = 2**31 + 2**24
_MIN_OVERFLOW_BLOCKS = 32768 + 1024


@dataclass(frozen=True)
class _Level:
    num_heads: int
    num_kv_heads: int
    head_sizes: tuple[int, ...]  # base head size preference
    gqa: tuple[tuple[str, int, int], ...]  # (name, num_heads, num_kv_heads)
    alt_head_sizes: int  # how many other head sizes to cover
    alt_block_sizes: int  # how many other block sizes to cover
    mla_heads: tuple[int, ...]


_LEVELS = {
    "quick": _Level(
        num_heads=8,
        num_kv_heads=2,
        head_sizes=(64, 32, 128, 16, 256),
        gqa=(("gqa-1", 4, 4), ("gqa-5", 10, 2), ("mqa", 8, 1)),
        alt_head_sizes=1,
        alt_block_sizes=2,
        mla_heads=(8,),
    ),
    "full": _Level(
        num_heads=32,
        num_kv_heads=8,
        head_sizes=(128, 64, 256, 96, 80),
        gqa=(("gqa-1", 8, 8), ("gqa-5", 40, 8), ("mqa", 16, 1)),
        alt_head_sizes=2,
        alt_block_sizes=3,
        mla_heads=(16, 128),
    ),
}


@dataclass
class Plan:
    """What one backend runs at one level."""

    scenarios: list[Scenario] = field(default_factory=list)
    # scenarios of the design this backend does not take, with validate's reasons
    not_applicable: list[tuple[Scenario, list[str]]] = field(default_factory=list)
    # why no base layer could be found (then ``scenarios`` is empty)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    base: Scenario | None = None


def scenario_problems(
    backend: AttentionBackend, scenario: Scenario, device: torch.device | str
) -> list[str]:
    """validate()'s reasons for the layer of ``scenario`` (empty: the backend takes it)."""
    try:
        spec = scenario.spec()
    except PagedKVError as exc:
        return [str(exc)]
    try:
        return backend.validate(spec, device)
    except Exception as exc:  # a backend bug; the plan check reports it
        return [f"validate() raised {type(exc).__name__}: {exc}"]


def design_scenarios(
    backend: AttentionBackend,
    level: str,
    device: torch.device | str,
    extra: Iterable[Scenario] = (),
) -> Plan:
    """The scenarios ``backend`` runs at ``level`` on ``device``, plus ``extra`` ones
    (from plugins), each kept only when ``backend.validate`` accepts its layer."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    plan = Plan()
    caps = backend.capabilities
    base = _find_base(backend, level, device, plan)
    candidates: list[Scenario] = []
    if base is not None:
        plan.base = base
        if Feature.MLA in caps.features:
            candidates = _mla_scenarios(base, backend, level)
            unexercised = sorted(
                caps.features
                - {Feature.MLA, Feature.FP8_KV, Feature.NON_CAUSAL, Feature.CUDA_GRAPH}
            )
            if unexercised:
                plan.notes.append(
                    "declared but not exercised on MLA layers (the un-absorbed reference has "
                    f"no such modifier): {', '.join(map(str, unexercised))}"
                )
        else:
            candidates = _standard_scenarios(base, backend, level, device)
    seen: set[str] = set()
    for scenario in [*candidates, *extra]:
        if scenario.name in seen:
            plan.problems.append(f"two conformance scenarios are named {scenario.name!r}")
            continue
        seen.add(scenario.name)
        reasons = scenario_problems(backend, scenario, device)
        if reasons:
            plan.not_applicable.append((scenario, reasons))
        else:
            plan.scenarios.append(scenario)
    return plan


def jit_combinations(scenarios: Iterable[Scenario]) -> set[tuple[object, ...]]:
    """Distinct (dtype, head size, feature set, kv cache dtype) among ``scenarios``:
    what a kernel library compiles one variant for."""
    return {
        (s.dtype, s.spec().head_size, s.spec().required_features(), s.kv_cache_dtype)
        for s in scenarios
    }


# -- the base layer ----------------------------------------------------------------------


def _find_base(
    backend: AttentionBackend, level: str, device: torch.device | str, plan: Plan
) -> Scenario | None:
    """The first candidate base layer ``backend`` accepts."""
    caps = backend.capabilities
    lv = _LEVELS[level]
    dtypes = [d for d in _DTYPES if d in caps.dtypes]
    block_sizes = _preferred_block_sizes(caps.block_sizes)
    tried: list[str] = []
    if Feature.MLA in caps.features:
        dims = (*_SMALL_MLA, DEEPSEEK_MLA) if level == "quick" else (DEEPSEEK_MLA, *_SMALL_MLA)
        candidates = (
            Scenario(
                "base",
                (1,),
                (1,),
                num_heads=lv.mla_heads[0],
                num_kv_heads=1,
                dtype=dtype,
                block_size=bs,
                kv_lora_rank=lora,
                qk_rope_head_dim=rope,
                qk_nope_head_dim=nope,
                v_head_dim=v,
            )
            for dtype in dtypes
            for lora, rope, nope, v in dims
            for bs in block_sizes
        )
    else:
        head_sizes = _preferred_head_sizes(caps.head_sizes, lv.head_sizes)
        candidates = (
            Scenario(
                "base",
                (1,),
                (1,),
                num_heads=lv.num_heads,
                num_kv_heads=lv.num_kv_heads,
                head_size=d,
                dtype=dtype,
                block_size=bs,
            )
            for dtype in dtypes
            for d in head_sizes
            for bs in block_sizes
        )
    for candidate in candidates:
        reasons = scenario_problems(backend, candidate, device)
        if not reasons:
            return candidate
        if len(tried) < 3:
            tried.append(f"{candidate.repro()}: {'; '.join(reasons)}")
    plan.problems.append(
        "no base layer this backend accepts (tried the declared dtypes, head sizes and block "
        "sizes); first rejections: " + " | ".join(tried or ["no declared dtype"])
    )
    return None


def _preferred_head_sizes(rules: tuple, preference: tuple[int, ...]) -> list[int]:
    sizes = [d for d in preference if sizes_match(rules, d)]
    sizes += [d for d in range(8, 513, 8) if d not in sizes and sizes_match(rules, d)]
    return sizes


def _preferred_block_sizes(rules: tuple) -> list[int]:
    # a small power of two first (the common case), then odd ones that catch
    # kernels assuming a power of two
    preference = (16, 32, 64, 8, 128, 256, 5, 1, 12, 48, 80, 512, 1024)
    sizes = [b for b in preference if sizes_match(rules, b)]
    return sizes or [b for b in range(1, 2049) if sizes_match(rules, b)][:4]


# -- batch shapes (B = block size) ------------------------------------------------------


def _batches(b: int, level: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """name -> (seq_lens, query_lens, padding tokens)."""
    shapes = {
        # pure decode: 1 token, lengths on both sides of block boundaries
        "decode": ((1, max(b - 1, 1), b, b + 1, 3 * b + 5), (1, 1, 1, 1, 1), 0),
        # query_len == seq_len, a multiple and non-multiples of B
        "prefill": ((b, 2 * b + 7, 5), (b, 2 * b + 7, 5), 0),
        # a chunk after a context already in the cache
        "chunked-prefill": ((2 * b + 9, 4 * b), (b + 3, b), 0),
        # prefills only, each filling a 128-row tile of GQA-4 rows (32 tokens): the
        # Triton backend's Gluon prefill kernel takes such steps on sm_90
        "long-prefill": ((2 * b + 3, 3 * b + 9), (2 * b + 3, 2 * b), 0),
        # decodes first, then prefill and a chunk, then -1 padding rows
        "mixed-decodes-first": (
            (b + 5, 2 * b, 3 * b + 1, 9, 2 * b + 2),
            (1, 1, 1, 9, b + 2),
            3,
        ),
        # decodes between prefills, a zero-length padding request, speculative rows
        "mixed-interleaved": (
            (2 * b + 3, 11, 0, 3 * b, b + 1, 5),
            (1, 11, 0, 5, 1, 3),
            5,
        ),
        # speculative decoding: 2-8 query tokens per request
        "spec-decode": ((b + 2, 2 * b, 2 * b + 7, 3 * b + 3), (2, 4, 5, 8), 0),
        # one long sequence beside a short one
        "long-sequence": ((max(333, 3 * b + 13), 7), (6, 1), 0),
        # no token rows at all (a scheduler's empty step, a rank without requests): the
        # builder takes it, forward returns an empty output and writes nothing
        "empty-step": ((0,), (0,), 0),
    }
    if level == "full":
        rng = random.Random(4)
        lens = tuple(rng.randint(1, 40 * b) for _ in range(48))
        shapes["decode-large-batch"] = (lens, (1,) * len(lens), 16)
        shapes["long-decode"] = ((8192 + 7, 4096 + 1, 33), (1, 1, 1), 0)
        shapes["long-chunked-prefill"] = ((6000, 1500), (512, 1500), 0)
    return shapes


def _feature_batch(b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A mixed batch for the one-axis variations: decode, prefill, chunk, speculative."""
    return (b + 1, 2 * b + 5, 4 * b + 5, 2 * b), (1, 2 * b + 5, 7, 3)


def _make(base: Scenario, name: str, tags: Iterable[str], **changes: object) -> Scenario:
    """``base`` renamed and changed, with a seed of its own."""
    seed = zlib.crc32(name.encode())
    return base.replace(name=name, seed=seed, tags=frozenset(tags), **changes)


def _mixed(base: Scenario, name: str, tags: Iterable[str], **changes: object) -> Scenario:
    """A one-axis variation of ``base`` on the mixed batch of its block size."""
    b = changes.get("block_size", base.block_size)
    seq, query = _feature_batch(b)  # type: ignore[arg-type]
    return _make(base, name, tags, seq_lens=seq, query_lens=query, **changes)


# -- shared by standard and MLA layers --------------------------------------------------


def _shape_scenarios(base: Scenario, level: str, skip: Iterable[str] = ()) -> list[Scenario]:
    return [
        _make(base, shape, {"shape"}, seq_lens=seq, query_lens=query, num_padding_tokens=pad)
        for shape, (seq, query, pad) in _batches(base.block_size, level).items()
        if shape not in skip
    ]


def _axis_scenarios(base: Scenario, backend: AttentionBackend, level: str) -> list[Scenario]:
    """The other declared dtypes and block sizes (a non power of two among them)."""
    caps = backend.capabilities
    out = [
        _mixed(base, f"dtype-{_dtype_name(dtype)}", {"dtype"}, dtype=dtype)
        for dtype in _DTYPES
        if dtype != base.dtype and dtype in caps.dtypes
    ]
    sizes = _alternatives(
        _preferred_block_sizes(caps.block_sizes),
        base.block_size,
        _LEVELS[level].alt_block_sizes,
        odd=True,
    )
    out += [_mixed(base, f"block-size-{b}", {"block_size"}, block_size=b) for b in sizes]
    return out


def _fp8_scenarios(base: Scenario, backend: AttentionBackend) -> list[Scenario]:
    """Both fp8 formats, with non-unit scales (MLA caches only K: its V is K's prefix),
    and a bfloat16 layer over an fp8 cache where the base is another dtype: serving's
    usual pair, which a kernel may convert by another path (the triton backend's
    float16 rows)."""
    out = [
        _mixed(
            base,
            kv_dtype.replace("_", "-"),
            {"fp8_kv"},
            kv_cache_dtype=kv_dtype,
            k_scale=k_scale,
            v_scale=1.0 if base.is_mla else v_scale,
        )
        for kv_dtype, (k_scale, v_scale) in _FP8.items()
    ]
    if base.dtype != torch.bfloat16 and torch.bfloat16 in backend.capabilities.dtypes:
        e4m3 = out[0]  # (the first of _FP8)
        out.append(_make(e4m3, "fp8-e4m3-bfloat16", {"fp8_kv", "dtype"}, dtype=torch.bfloat16))
    return out


def _many_blocks(base: Scenario) -> Scenario:
    """More than 32k blocks, and a pool whose element offsets pass 2**31 (the problem
    hands out the pool's highest blocks)."""
    spec = base.spec()
    per_block = base.block_size * spec.num_kv_heads * spec.head_size
    blocks = max(_MIN_OVERFLOW_BLOCKS, math.ceil(_OVERFLOW_ELEMENTS / per_block))
    return _make(
        base,
        "many-blocks",
        {"many_blocks"},
        seq_lens=(4096 + 3, 700, 1),
        query_lens=(1, 64, 1),
        min_num_blocks=blocks,
    )


# -- standard layers --------------------------------------------------------------------


def _standard_scenarios(
    base: Scenario, backend: AttentionBackend, level: str, device: torch.device | str
) -> list[Scenario]:
    caps = backend.capabilities
    lv = _LEVELS[level]
    out = _shape_scenarios(base, level)
    # a scale that is not head_size ** -0.5 (e.g. query_pre_attn_scalar models)
    out.append(_mixed(base, "custom-scale", {"scale"}, scale=round(1.7 * base.head_size**-0.5, 6)))
    # k_scale / v_scale on a cache that is not fp8: only fp8 caches store x / scale
    # (docs/contract.md), so the scales must change nothing here
    out.append(_mixed(base, "kv-scales-unquantized", {"kv_scales"}, k_scale=0.5, v_scale=2.0))
    out += [_mixed(base, name, {"gqa"}, num_heads=hq, num_kv_heads=hkv) for name, hq, hkv in lv.gqa]
    out += _axis_scenarios(base, backend, level)
    sizes = _alternatives(
        _preferred_head_sizes(caps.head_sizes, (64, 128, 256, 32, 96)),
        base.head_size,
        lv.alt_head_sizes,
    )
    out += [_mixed(base, f"head-size-{d}", {"head_size"}, head_size=d) for d in sizes]
    out += _feature_scenarios(base, backend, level)
    combinations = _combinations(base, backend, device)
    out += combinations
    if level == "full":
        out += _modifiers_at_another_head_size(base, backend, device, combinations, sizes)
        out.append(_many_blocks(base))
    return out


def _modifiers_at_another_head_size(
    base: Scenario,
    backend: AttentionBackend,
    device: torch.device | str,
    combinations: list[Scenario],
    sizes: list[int],
) -> list[Scenario]:
    """Each set of score modifiers the backend takes again at another head size, run
    after it in the same process. A library that keeps its compiled variants under a
    key without the head size hands such a layer the kernel built for the first one:
    FlashInfer 0.7.2 names its attention-sink module by dtype and window only
    (docs/flashinfer.md, thirty-seventh session), and each level alone runs sinks at
    one head size."""
    declared = [f for f in _COMBINABLE if f in backend.capabilities.features]
    if not sizes or not declared:
        return []
    sets = combinations or [_modifiers(base, (declared[0],))]
    d = sizes[0]
    return [
        _make(mods, f"{mods.name}-head-size-{d}", mods.tags | {"head_size"}, head_size=d)
        for mods in sets
        if not scenario_problems(backend, mods, device)
    ]


def _feature_scenarios(base: Scenario, backend: AttentionBackend, level: str) -> list[Scenario]:
    """One scenario per feature (tagged with it)."""
    b = base.block_size
    out = [
        _mixed(base, "sliding-window", {"sliding_window"}, sliding_window=b + 3),
        # pure decodes far past a window no smaller than a block: a kernel whose decode
        # path ignores the window fails here even when it (legitimately) refuses
        # windows smaller than its block size
        _make(
            base,
            "sliding-window-decode",
            {"sliding_window"},
            seq_lens=(8 * b + 3, 5 * b + 7, 12 * b, 2 * b + 9),
            query_lens=(1, 1, 1, 1),
            sliding_window=b + 3,
        ),
    ]
    if b > 2:
        out.append(
            _mixed(
                base, "window-smaller-than-block", {"sliding_window"}, sliding_window=max(2, b // 3)
            )
        )
    # scores of random data are ~N(0, 1): a cap of 2 bends most of them
    out.append(_mixed(base, "logits-soft-cap", {"logits_soft_cap"}, logits_soft_cap=2.0))
    out.append(_mixed(base, "alibi", {"alibi"}, alibi=True))
    out.append(_mixed(base, "sinks", {"sinks"}, use_sinks=True))
    out.append(_mixed(base, "non-causal", {"non_causal"}, causal=False))
    out += _fp8_scenarios(base, backend)
    if level == "full":
        out.append(
            _make(
                base,
                "non-causal-window",
                {"non_causal", "sliding_window"},
                seq_lens=(3 * b + 2, 40),
                query_lens=(3 * b + 2, 40),
                causal=False,
                sliding_window=b + 1,
            )
        )
    return out


# score modifiers that combine on one causal layer: (short name, changes for block size b)
_COMBINABLE = {
    Feature.SLIDING_WINDOW: ("window", lambda b: {"sliding_window": 2 * b + 1}),
    Feature.LOGITS_SOFT_CAP: ("softcap", lambda b: {"logits_soft_cap": 2.0}),
    Feature.ALIBI: ("alibi", lambda b: {"alibi": True}),
    Feature.SINKS: ("sinks", lambda b: {"use_sinks": True}),
}


def _modifiers(base: Scenario, subset: tuple[Feature, ...]) -> Scenario:
    """``base``'s mixed batch with the score modifiers of ``subset`` together."""
    changes: dict[str, object] = {}
    for feature in subset:
        changes.update(_COMBINABLE[feature][1](base.block_size))
    name = "-".join(_COMBINABLE[f][0] for f in subset)
    return _mixed(base, name, {str(f) for f in subset}, **changes)


def _combinations(
    base: Scenario, backend: AttentionBackend, device: torch.device | str
) -> list[Scenario]:
    """The declared score modifiers combined: every pair of them runs together in some
    scenario (a covering design of pairs, not every subset). Greedy: the set that
    ``validate`` accepts and that covers the most pairs not yet covered, larger sets
    first; a backend that takes every combination runs one scenario. A pair no
    accepted set covers is planned on its own, so the report lists it as not
    applicable with validate's reason."""
    declared = [f for f in _COMBINABLE if f in backend.capabilities.features]
    uncovered = set(itertools.combinations(declared, 2))
    candidates = [
        subset
        for size in range(len(declared), 1, -1)
        for subset in itertools.combinations(declared, size)
    ]
    out: list[Scenario] = []

    while uncovered:
        best, gain = None, set()
        for subset in candidates:
            covers = uncovered & set(itertools.combinations(subset, 2))
            if len(covers) > len(gain) and not scenario_problems(
                backend, _modifiers(base, subset), device
            ):
                best, gain = subset, covers
        if best is None:  # what is left, validate refuses: one n/a scenario per pair
            order = {f: i for i, f in enumerate(declared)}
            left = sorted(uncovered, key=lambda pair: (order[pair[0]], order[pair[1]]))
            out += [_modifiers(base, pair) for pair in left]
            break
        out.append(_modifiers(base, best))
        uncovered -= gain
    return out


# -- MLA layers -------------------------------------------------------------------------


def _mla_scenarios(base: Scenario, backend: AttentionBackend, level: str) -> list[Scenario]:
    b = base.block_size
    # one long MLA sequence is enough: the reference up-projects every head
    out = _shape_scenarios(base, level, skip={"long-chunked-prefill"})
    # DeepSeek's yarn mscale**2 on top of the qk head dim: scale is never derived
    qk_dim = base.qk_nope_head_dim + (base.qk_rope_head_dim or 0)
    out.append(_mixed(base, "mla-yarn-scale", {"scale"}, scale=round(1.3 * qk_dim**-0.5, 6)))
    if level == "quick" and (base.kv_lora_rank, base.qk_rope_head_dim) != DEEPSEEK_MLA[:2]:
        lora, rope, nope, v = DEEPSEEK_MLA
        out.append(
            _make(
                base,
                "mla-deepseek-dims",
                {"mla_dims"},
                seq_lens=(b + 3, 2 * b, 9),
                query_lens=(1, 4, 9),
                kv_lora_rank=lora,
                qk_rope_head_dim=rope,
                qk_nope_head_dim=nope,
                v_head_dim=v,
            )
        )
    out += [
        _mixed(base, f"mla-heads-{heads}", {"gqa"}, num_heads=heads)
        for heads in _LEVELS[level].mla_heads[1:]
    ]
    out += _axis_scenarios(base, backend, level)
    out.append(_mixed(base, "non-causal", {"non_causal"}, causal=False))
    out += _fp8_scenarios(base, backend)
    if level == "full":
        out.append(_many_blocks(base))
        if sizes_match(backend.capabilities.block_sizes, 64):
            # the page size MLA kernels are tuned for (FlashMLA's): a kernel that takes
            # only whole 64-row pages (a Hopper one, say) runs here with 128 heads,
            # decodes, a chunk and a prefill, and odd and even page counts per request
            out.append(
                _make(
                    base,
                    "mla-block-64-heads-128",
                    {"block_size", "gqa"},
                    block_size=64,
                    num_heads=128,
                    seq_lens=(160, 128, 300, 70),
                    query_lens=(1, 1, 9, 70),
                )
            )
    return out


def _alternatives(sizes: list[int], base: int, count: int, odd: bool = False) -> list[int]:
    """``count`` sizes other than ``base``, in preference order; with ``odd``, a non power
    of two comes second when there is one (kernels that assume powers of two fail it)."""
    others = [s for s in sizes if s != base]
    if odd:
        others = others[:1] + [s for s in others if s & (s - 1)][:1] + others[1:]
    return list(dict.fromkeys(others))[:count]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
