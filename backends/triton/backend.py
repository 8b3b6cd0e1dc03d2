"""The Triton backend's declaration: layout, capabilities, options, where it runs."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, ClassVar

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagedkv.backends.triton.configs import SPLIT_POLICY, check_forced_splits
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.errors import ConfigError
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport
from pagedkv.layout import KV_FIRST
from pagedkv.options import BackendOption, OptionValue
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.interpreter import interpreter_problem

_CAPABILITIES = Capabilities(
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=(MultipleOf(8, minimum=32, maximum=256),),
    block_sizes=(MultipleOf(16),),
    features=frozenset(
        {
            Feature.SLIDING_WINDOW,
            Feature.LOGITS_SOFT_CAP,
            Feature.ALIBI,
            Feature.SINKS,
            Feature.NON_CAUSAL,
            Feature.FP8_KV,
        }
    ),
    devices=frozenset({"cuda", "cpu"}),
    # the launch geometry comes from the padded step only, for any max_query_len
    cuda_graph=GraphSupport.MIXED,
    notes=("cpu: only in Triton's interpreter (TRITON_INTERPRET=1), float16/float32",),
)


class TritonBackend(AttentionBackend):
    """Our own Triton kernels: one unified paged-attention kernel for mixed batches,
    split-KV decode with a reduction kernel, and the shared Triton KV write."""

    name = "triton"
    priority = 40
    kv_layout = KV_FIRST
    option_specs: ClassVar[dict[str, BackendOption]] = {
        "num_splits": BackendOption(
            default=None,
            help="KV splits per sequence (flash-decoding); unset or 0 chooses per batch, 1 never splits",
            kind=int,
            minimum=0,
            maximum=SPLIT_POLICY.max_splits,
        ),
        "batch_invariant": BackendOption(
            default=False,
            help="a request's output is bitwise the same whatever else is in the batch "
            "(fixed keys per split, a fixed tile per layer, a batch-independent reduction order)",
            kind=bool,
        ),
        "prefill_kernel": BackendOption(
            default="auto",
            help="prefill steps: auto (the Gluon warp-specialized kernel where it runs: "
            "sm_90, 16-bit, D 64/128/256, causal or not, no window/soft cap/ALiBi/sinks), "
            "portable (the unified Triton kernel everywhere)",
            choices=("auto", "portable"),
        ),
        "split_grid": BackendOption(
            default="auto",
            help="split launches: auto (a step of one query block per request launches "
            "one program per split that holds keys, a list of work items), blocks (a "
            "(query blocks, splits) grid everywhere, where a short request's splits past "
            "its keys are empty programs; for comparison)",
            choices=("auto", "blocks"),
        ),
        "split_merge": BackendOption(
            default="auto",
            help="split launches: auto (a launch of one query block per request, decodes "
            "and speculative decodes, merges each block's splits in the program that "
            "writes its last one: no merge launch), separate (a merge kernel after every "
            "split launch; for comparison)",
            choices=("auto", "separate"),
        ),
        "overlap_parts": BackendOption(
            default=True,
            help="a step of decodes and longer requests runs the two launches on two "
            "streams, so that the memory-bound decodes and the compute-bound chunks share "
            "the SMs (false: one after the other)",
            kind=bool,
        ),
    }

    def __init__(self, **options: OptionValue) -> None:
        super().__init__(**options)
        check_forced_splits(self.options["num_splits"])
        if self.options["batch_invariant"] and self.options["num_splits"]:
            raise ConfigError(
                "options num_splits and batch_invariant=true exclude each other: a batch-"
                "invariant backend splits every sequence into a fixed number of keys per split"
            )

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """The declared capabilities; ``batch_invariant`` when the option is set."""
        if self.options["batch_invariant"]:
            return dataclasses.replace(_CAPABILITIES, batch_invariant=True)
        return _CAPABILITIES

    def missing_dependency(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'pagedkv[triton]')"
        return None

    def is_available(self) -> tuple[bool, str]:
        missing = self.missing_dependency()
        if missing:
            return False, missing
        if not torch.cuda.is_available() and interpreter_problem("cpu"):
            return False, (
                "no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 "
                "to run the kernels in Triton's interpreter"
            )
        return True, ""

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        reasons = super().validate(spec, device)
        if device is not None and torch.device(device).type == "cpu":
            problem = interpreter_problem("cpu")
            if problem:
                reasons.append(problem)
            if spec.dtype == torch.bfloat16 or spec.cache_dtype == torch.bfloat16:
                reasons.append(
                    "bfloat16 on cpu: Triton's interpreter computes bfloat16 wrongly "
                    "(triton-lang/triton#11584); run bfloat16 on a GPU"
                )
        return reasons

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.triton.builder import TritonMetadataBuilder

        return TritonMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.triton.impl import TritonAttentionImpl

        return TritonAttentionImpl
