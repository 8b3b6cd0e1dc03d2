"""The FlashAttention backend's declaration: layout, options, adapter choice, capabilities."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pagedkv.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendOption,
    OptionValue,
)
from pagedkv.backends.flash_attn.adapters import (
    ADAPTERS,
    PREFERENCE,
    Adapter,
    Choice,
    combination_problems,
    gpu_major,
    resolve_adapter,
)
from pagedkv.backends.flash_attn.configs import SPLIT_POLICY
from pagedkv.capabilities import Capabilities
from pagedkv.errors import ConfigError
from pagedkv.layout import KV_FIRST
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.split_kv import split_problem


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 4, 3 or 2 over one cache: K and V halves of (2, num_blocks,
    block_size, num_kv_heads, head_size), read through the block table.

    ``impl=fa4|fa3|fa2`` forces a generation; by default the strongest one installed
    for this GPU runs (SM90: fa3, fa4, fa2; SM100: fa4, fa2; others: fa2). What the
    layer may use (window, soft cap, sinks, ALiBi, block sizes, CUDA graphs) is the
    chosen adapter's declaration. Long decodes split KV: FA3 by its own heuristic, FA4
    through its ``num_splits`` where it can (SM100), else through pagedkv's split-KV
    combinator (pagedkv.toolkit.split_kv), which FA4's log-sum-exp makes possible.
    """

    name = "flash_attn"
    priority = 50
    kv_layout = KV_FIRST
    option_specs: ClassVar[Mapping[str, BackendOption]] = {
        "impl": BackendOption(
            None,
            "FlashAttention generation: fa4, fa3 or fa2 (default: the best one installed)",
            choices=tuple(ADAPTERS),
        ),
        "num_splits": BackendOption(
            None,
            "KV splits per long decode; unset or 0 chooses per batch, 1 never splits",
            kind=int,
        ),
    }

    def __init__(self, **options: OptionValue) -> None:
        super().__init__(**options)
        splits = self.options["num_splits"]
        if splits is not None and not 0 <= int(splits) <= SPLIT_POLICY.max_splits:
            raise ConfigError(
                f"option num_splits={splits}: expected 0 (choose) to {SPLIT_POLICY.max_splits}"
            )
        self._choice: Choice | None = None  # resolved on first use, not at construction

    # -- adapter --------------------------------------------------------------------------

    def choice(self) -> Choice:
        """Which adapter runs here (looks at installed files and the GPU, imports nothing)."""
        if self._choice is None:
            forced = self.options["impl"]
            self._choice = resolve_adapter(None if forced is None else str(forced))
        return self._choice

    @property
    def adapter(self) -> Adapter:
        """The adapter that runs, or (when none can) the one that would be tried first:
        its declaration is what validate() reports against."""
        chosen = self.choice().adapter
        if chosen is not None:
            return chosen
        forced = self.options["impl"]
        return ADAPTERS[str(forced)] if forced is not None else ADAPTERS[PREFERENCE[None][0]]

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """The adapter's declaration (a property: the adapter depends on the machine)."""
        return self.adapter.capabilities

    # -- parts ------------------------------------------------------------------------

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.flash_attn.builder import FlashAttnMetadataBuilder

        return FlashAttnMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.flash_attn.impl import FlashAttnImpl

        return FlashAttnImpl

    # -- support ----------------------------------------------------------------------

    def is_available(self) -> tuple[bool, str]:
        """(True, which adapter runs) or (False, why none can)."""
        choice = self.choice()
        if not torch.cuda.is_available():
            would = (
                f"{choice.adapter.describe()} would run on one"
                if choice.adapter is not None
                else choice.reason
            )
            return False, f"no CUDA device (torch.cuda.is_available() is False); {would}"
        if choice.adapter is None:
            return False, choice.reason
        try:
            choice.adapter.load()
        except Exception as exc:  # a broken install must not hide the others
            return False, (
                f"{choice.adapter.describe()} is installed but importing "
                f"{choice.adapter.module}.{choice.adapter.function} failed: "
                f"{type(exc).__name__}: {exc}"
            )
        return True, f"runs {choice.adapter.describe()}"

    def validate_extra(self, spec: AttentionSpec) -> list[str]:
        adapter = self.adapter
        out = combination_problems(adapter, spec)
        splits = int(self.options["num_splits"] or 0)
        if splits > 1 and not adapter.native_split_majors and not adapter.returns_lse:
            out.append(
                f"num_splits={splits} is not supported by flash_attn ({adapter.name}): its "
                "paged call neither splits KV nor returns the log-sum-exp to merge slices by"
            )
        problem = split_problem(spec)
        if splits > 1 and problem and gpu_major() not in adapter.native_split_majors:
            out.append(
                f"num_splits={splits}: flash_attn ({adapter.name}) splits through pagedkv's "
                f"combinator here, which cannot split this layer: {problem}"
            )
        return out
