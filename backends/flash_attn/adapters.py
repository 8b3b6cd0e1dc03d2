"""FlashAttention 4/3/2 behind one paged call: what each declares, which one runs here,
and how the step's tensors map onto each library's arguments.

Every adapter reads the same cache, K and V each [num_blocks, block_size,
num_kv_heads, head_size] (the two halves of the backend's 5-D tensor), through the
step's block table. Detection never imports a library (that costs seconds); only
``load()`` does.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.errors import UnsupportedError
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport
from pagedkv.spec import AttentionSpec

_HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class PagedCall:
    """The step as every adapter needs it; device tensors unless noted."""

    query: torch.Tensor  # [rows, num_heads, head_size]; rows past query_start_loc[-1]: padding
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32, cumulative seq_lens (FA2 only)
    block_table: torch.Tensor  # [B, max_blocks] int32, contiguous
    max_query_len: int  # host bound
    max_seq_len: int  # host bound
    spec: AttentionSpec
    sinks: torch.Tensor | None  # [num_heads] float32
    alibi_slopes: torch.Tensor | None  # [num_heads] float32
    num_splits: int = 1  # the library's split-KV: 1 none, 0 its own heuristic, n > 1 n
    return_lse: bool = False  # also return the log-sum-exp [num_heads, rows] (natural log)

    @property
    def window_size(self) -> tuple[int, int]:
        """FlashAttention's inclusive (left, right) window; -1 is unbounded."""
        w = self.spec.sliding_window
        if w is None:
            return (-1, -1)
        return (w - 1, 0 if self.spec.causal else w - 1)


@dataclass(frozen=True)
class Adapter:
    """One FlashAttention generation."""

    name: str  # the impl= option value
    title: str
    distribution: str  # what pip installs
    module: str  # what load() imports
    function: str  # the paged entry point in ``module``
    probe: str  # a module only this library provides, to detect it without importing
    capabilities: Capabilities
    supported_majors: frozenset[int]  # compute capability majors it runs paged KV on
    arch_note: str
    # (output [rows, num_heads, head_size], log-sum-exp [num_heads, rows] or None)
    run: Callable[[Callable[..., Any], PagedCall], tuple[torch.Tensor, torch.Tensor | None]]
    native_split_majors: frozenset[int] = frozenset()  # where the library splits KV itself
    own_split_heuristic: bool = False  # num_splits=0 lets the library choose
    returns_lse: bool = False  # run() honours PagedCall.return_lse

    def installed(self) -> bool:
        """True when the library's files are on sys.path (nothing is imported)."""
        return _module_present(self.probe)

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def describe(self) -> str:
        version = self.version()
        return f"{self.name} ({self.distribution}{' ' + version if version else ''})"

    def load(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.function)


def _module_present(module: str) -> bool:
    """find_spec without executing any package __init__ on the way down.

    flash_attn is FA2's regular package but only a namespace for FA4's
    flash_attn.cute; importing FA2's __init__ just to look would load its CUDA
    extension.
    """
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    locations = spec.submodule_search_locations or []
    path = rest.replace(".", os.sep)
    return any(
        os.path.isdir(os.path.join(loc, path)) or os.path.isfile(os.path.join(loc, path + ".py"))
        for loc in locations
    )


# -- the three calls -------------------------------------------------------------------


def _run_fa4(fn: Callable[..., Any], c: PagedCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    # FA4 splits on SM100 only; with splits its scheduler also wants the real max_seqlen_k
    # (without it, the pool's size)
    split = {"num_splits": c.num_splits, "max_seqlen_k": c.max_seq_len} if c.num_splits > 1 else {}
    result = fn(
        c.query,
        c.key_cache,
        c.value_cache,
        cu_seqlens_q=c.query_start_loc,
        max_seqlen_q=c.max_query_len,
        seqused_k=c.seq_lens,
        page_table=c.block_table,
        softmax_scale=c.spec.scale,
        causal=c.spec.causal,
        window_size=tuple(None if x < 0 else x for x in c.window_size),
        learnable_sink=c.sinks,
        softcap=c.spec.logits_soft_cap or 0.0,
        return_lse=c.return_lse,
        **split,
    )
    if isinstance(result, tuple):
        return result[0], result[1] if c.return_lse else None
    return result, None


def _run_fa3(fn: Callable[..., Any], c: PagedCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = fn(
        c.query,
        c.key_cache,
        c.value_cache,
        cache_seqlens=c.seq_lens,
        page_table=c.block_table,
        cu_seqlens_q=c.query_start_loc,
        max_seqlen_q=c.max_query_len,
        softmax_scale=c.spec.scale,
        causal=c.spec.causal,
        window_size=c.window_size,
        softcap=c.spec.logits_soft_cap or 0.0,
        num_splits=c.num_splits,
    )
    return out, None


def _run_fa2(fn: Callable[..., Any], c: PagedCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = fn(
        c.query,
        c.key_cache,
        c.value_cache,
        cu_seqlens_q=c.query_start_loc,
        cu_seqlens_k=c.cu_seqlens_k,
        max_seqlen_q=c.max_query_len,
        max_seqlen_k=c.max_seq_len,
        softmax_scale=c.spec.scale,
        causal=c.spec.causal,
        window_size=c.window_size,
        softcap=c.spec.logits_soft_cap or 0.0,
        alibi_slopes=c.alibi_slopes,
        block_table=c.block_table,
    )
    return out, None


FA4 = Adapter(
    name="fa4",
    title="FlashAttention-4",
    distribution="flash-attn-4",
    module="flash_attn.cute",
    function="flash_attn_varlen_func",
    probe="flash_attn.cute",
    capabilities=Capabilities(
        dtypes=_HALF,
        # its fp8 path is SM100-only and needs fp8 queries with descales
        kv_cache_dtypes=frozenset({"auto"}),
        # what SM90 and SM100 both accept (SM90 alone takes any multiple of 8 to 256)
        head_sizes=(MultipleOf(8, minimum=8, maximum=128), 256),
        block_sizes=(MultipleOf(1),),
        features=frozenset(
            {Feature.SLIDING_WINDOW, Feature.LOGITS_SOFT_CAP, Feature.SINKS, Feature.NON_CAUSAL}
        ),
        devices=frozenset({"cuda"}),
        # its Python entry reads no device data (no .item()/.tolist()/sync), and under a
        # reservation every host number it takes is the bounds' (docs/flash_attn.md)
        cuda_graph=GraphSupport.MIXED,
    ),
    supported_majors=frozenset({9, 10, 11}),
    arch_note="paged KV on SM90 and SM100/SM110 only",
    run=_run_fa4,
    # SM90: "SplitKV not supported on SM 9.0" (flash-attn-4 4.0.0b36); pagedkv splits there
    native_split_majors=frozenset({10, 11}),
    returns_lse=True,
)
FA3 = Adapter(
    name="fa3",
    title="FlashAttention-3",
    distribution="flash_attn_3",
    module="flash_attn_interface",
    function="flash_attn_with_kvcache",
    probe="flash_attn_interface",
    capabilities=Capabilities(
        dtypes=_HALF,
        # fp8 needs fp8 queries with descales: not a cache-only format there
        kv_cache_dtypes=frozenset({"auto"}),
        head_sizes=(MultipleOf(8, minimum=8, maximum=256),),
        block_sizes=(MultipleOf(1),),
        features=frozenset({Feature.SLIDING_WINDOW, Feature.LOGITS_SOFT_CAP, Feature.NON_CAUSAL}),
        devices=frozenset({"cuda"}),
    ),
    supported_majors=frozenset({9}),
    arch_note="Hopper (SM90) only",
    run=_run_fa3,
    native_split_majors=frozenset({9}),
    own_split_heuristic=True,
)
FA2 = Adapter(
    name="fa2",
    title="FlashAttention-2",
    distribution="flash-attn",
    module="flash_attn",
    function="flash_attn_varlen_func",
    # flash_attn alone may be FA4's namespace package
    probe="flash_attn_2_cuda",
    capabilities=Capabilities(
        dtypes=_HALF,
        kv_cache_dtypes=frozenset({"auto"}),
        head_sizes=(MultipleOf(8, minimum=8, maximum=256),),
        # flash_api.cpp: "Paged KV cache block size must be divisible by 256"
        block_sizes=(MultipleOf(256),),
        features=frozenset(
            {
                Feature.SLIDING_WINDOW,
                Feature.LOGITS_SOFT_CAP,
                Feature.ALIBI,
                Feature.NON_CAUSAL,
            }
        ),
        devices=frozenset({"cuda"}),
    ),
    supported_majors=frozenset({8, 9, 10, 11, 12}),
    arch_note="SM80 and newer",
    run=_run_fa2,
)
ADAPTERS: dict[str, Adapter] = {a.name: a for a in (FA4, FA3, FA2)}

# auto: the strongest kernel for the GPU generation first
PREFERENCE: dict[int | None, tuple[str, ...]] = {
    9: ("fa3", "fa4", "fa2"),
    10: ("fa4", "fa2"),
    11: ("fa4", "fa2"),
    None: ("fa4", "fa3", "fa2"),  # no GPU to ask: by generation
}


def combination_problems(adapter: Adapter, spec: AttentionSpec) -> list[str]:
    """Combinations an adapter's declared features cannot express."""
    out = []
    if adapter is FA2 and spec.alibi_slopes is not None and not spec.causal:
        out.append(
            "alibi with non-causal attention is not supported by flash_attn (fa2): its bias "
            "is -slope*|q-k|, which equals the contract's slope*(k-q) only under a causal mask"
        )
    return out


@dataclass(frozen=True)
class Choice:
    """The adapter that runs here, or None and why not."""

    adapter: Adapter | None
    reason: str  # why none can run ("" when one does)


def choose_adapter(
    forced: str | None,
    installed: Mapping[str, bool],
    major: int | None,
) -> Choice:
    """Pick the adapter for ``impl=forced`` (None: auto) given what is installed and
    the GPU's compute capability major (None: unknown, no GPU)."""
    if forced is not None:
        adapter = ADAPTERS[forced]
        problem = _unusable(adapter, installed, major)
        return Choice(None, f"impl={forced}: {problem}") if problem else Choice(adapter, "")
    order = PREFERENCE.get(major, ("fa2",))
    problems = []
    for name in order:
        problem = _unusable(ADAPTERS[name], installed, major)
        if problem is None:
            return Choice(ADAPTERS[name], "")
        problems.append(f"{name}: {problem}")
    return Choice(None, "no FlashAttention adapter can run: " + "; ".join(problems))


def _unusable(adapter: Adapter, installed: Mapping[str, bool], major: int | None) -> str | None:
    if not installed.get(adapter.name, False):
        return (
            f"{adapter.title} is not installed (pip distribution {adapter.distribution!r}, "
            f"module {adapter.module})"
        )
    if major is not None and major not in adapter.supported_majors:
        return f"{adapter.title} runs {adapter.arch_note}; this GPU is SM{major}x"
    return None


def installed_adapters(names: Sequence[str] = tuple(ADAPTERS)) -> dict[str, bool]:
    return {name: ADAPTERS[name].installed() for name in names}


def gpu_major(device: torch.device | str | None = None) -> int | None:
    """The compute-capability major of ``device`` (None: the current CUDA device), or
    None without one."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)[0]


def resolve_adapter(forced: str | None, device: torch.device | str | None = None) -> Choice:
    """The choice for the ``impl`` option here: installed files and the GPU (no import)."""
    return choose_adapter(forced, installed_adapters(), gpu_major(device))


def require_adapter(forced: str | None, device: torch.device | str | None = None) -> Adapter:
    """The adapter that runs here, or UnsupportedError saying why none can."""
    choice = resolve_adapter(forced, device)
    if choice.adapter is None:
        raise UnsupportedError(f"flash_attn: {choice.reason}")
    return choice.adapter
