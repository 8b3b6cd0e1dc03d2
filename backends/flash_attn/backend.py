"""The FlashAttention backend's layout, adapter choice and declared capabilities."""

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
    choose_adapter,
    combination_problems,
    installed_adapters,
)
from pagedkv.capabilities import Capabilities
from pagedkv.errors import UnsupportedError
from pagedkv.spec import AttentionSpec


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 4, 3 or 2 over one cache: K and V halves of (2, num_blocks,
    block_size, num_kv_heads, head_size), read through the block table.

    ``impl=fa4|fa3|fa2`` forces a generation; by default the strongest one installed
    for this GPU runs (SM90: fa3, fa4, fa2; SM100: fa4, fa2; others: fa2). What the
    layer may use (window, soft cap, sinks, ALiBi, block sizes) is the chosen
    adapter's declaration.
    """

    name = "flash_attn"
    priority = 50
    layout = "(2, num_blocks, block_size, num_kv_heads, head_size)"
    block_axis = 1
    option_specs: ClassVar[Mapping[str, BackendOption]] = {
        "impl": BackendOption(
            None,
            "FlashAttention generation: fa4, fa3 or fa2 (default: the best one installed)",
            choices=tuple(ADAPTERS),
        ),
    }

    def __init__(self, **options: OptionValue) -> None:
        super().__init__(**options)
        self._choice: Choice | None = None  # resolved on first use, not at construction

    # -- adapter --------------------------------------------------------------------------

    def choice(self) -> Choice:
        """Which adapter runs here (looks at installed files and the GPU, imports nothing)."""
        if self._choice is None:
            major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None
            forced = self.options["impl"]
            self._choice = choose_adapter(
                None if forced is None else str(forced), installed_adapters(), major
            )
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
        return self.adapter.capabilities

    # -- layout -----------------------------------------------------------------------

    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def kv_cache_to_logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

    # -- parts ------------------------------------------------------------------------

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.flash_attn.impl import FlashAttnMetadataBuilder

        return FlashAttnMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.flash_attn.impl import FlashAttnImpl

        return FlashAttnImpl

    def make_impl(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None
    ) -> AttentionImpl[Any]:
        self.require(spec)
        choice = self.choice()
        if choice.adapter is None:
            raise UnsupportedError(f"{self!r}: {choice.reason}")
        return self.get_impl_cls()(spec, sinks=sinks, adapter=choice.adapter, **self.options)

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

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        adapter = self.adapter
        reasons = adapter.capabilities.problems(spec, f"{self.name} ({adapter.name})")
        if device is not None and torch.device(device).type != "cuda":
            reasons.append(
                f"device {torch.device(device).type} not supported by {self.name} (supports cuda)"
            )
        return reasons + combination_problems(adapter, spec)
