"""Phase-split routing: one backend for decode rows, another for the rest, over one cache.

``split(decode=triton, prefill=flash_attn)`` in a config string is a backend whose
builder cuts each step into its decode requests (one query token) and the others
(prefills, chunks, speculative steps), builds each part's metadata with that part's
builder, and whose impl writes the step's K/V once and runs each part's attention over
its rows — the way vLLM's FlashInfer backend splits a step, between any two backends.
Both parts read the same cache, so they must declare the same layout (same bytes);
the composite declares the intersection of their capabilities.

Sub-configs with options are quoted: ``split(decode='triton(num_splits=1)', prefill=flash_attn)``.
Under a CUDA-graph reservation (pure decode only) every row is a decode row: the
decode part's own graph path runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pagedkv.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendMetadata,
)
from pagedkv.capabilities import Capabilities
from pagedkv.errors import ConfigError
from pagedkv.graph import GraphBounds, GraphSupport
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.options import BackendOption
from pagedkv.spec import AttentionSpec
from pagedkv.transfer import to_device

NAME = "split"  # pagedkv.registry.PHASE_SPLIT
PARTS = ("decode", "prefill")


def _part(config: str, role: str) -> AttentionBackend:
    from pagedkv.config import parse_config
    from pagedkv.registry import get_backend

    choices = parse_config(config)
    if len(choices) != 1 or choices[0].name in ("auto", NAME):
        raise ConfigError(
            f"split({role}={config!r}): expected one backend (with options, quoted), not a list, "
            "'auto' or another split"
        )
    return get_backend(choices[0].name, **choices[0].options)


class PhaseSplitBackend(AttentionBackend):
    """Decode rows to one backend, every other row to another, one shared cache."""

    name = NAME
    priority = -1000  # never picked by `auto`: it is only ever named
    option_specs: ClassVar[Mapping[str, BackendOption]] = {
        "decode": BackendOption(None, "backend config for one-token (decode) rows"),
        "prefill": BackendOption(None, "backend config for prefill, chunked and speculative rows"),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        missing = [p for p in PARTS if not self.options[p]]
        if missing:
            raise ConfigError(
                f"split: needs decode= and prefill= backends (missing {', '.join(missing)})"
            )
        self.decode = _part(str(self.options["decode"]), "decode")
        self.prefill = _part(str(self.options["prefill"]), "prefill")

    def __repr__(self) -> str:
        return f"split(decode={self.decode!r}, prefill={self.prefill!r})"

    @property
    def parts(self) -> tuple[AttentionBackend, AttentionBackend]:
        return self.decode, self.prefill

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        caps = self.decode.capabilities.intersect(self.prefill.capabilities)
        decode_graphs = self.decode.capabilities.graph_support
        # captured steps are pure decode, run by the decode part alone
        graphs = (
            GraphSupport.NEVER if decode_graphs is GraphSupport.NEVER else GraphSupport.PURE_DECODE
        )
        return dataclasses.replace(caps, cuda_graph=graphs)

    def get_kv_layout(self):  # type: ignore[override]
        return self.decode.get_kv_layout()

    def layout_problem(self) -> str | None:
        a, b = self.decode.get_kv_layout(), self.prefill.get_kv_layout()
        same = getattr(a, "same_bytes", None)
        if same is not None and same(b):
            return None
        return (
            f"split: decode={self.decode.name} keeps {a.describe()}, prefill={self.prefill.name} "
            f"keeps {b.describe()}: both parts read one cache, so they must share a layout"
        )

    def is_available(self) -> tuple[bool, str]:
        for role, part in zip(PARTS, self.parts, strict=True):
            ok, why = part.is_available()
            if not ok:
                return False, f"{role} part {part.name}: {why}"
        problem = self.layout_problem()
        return (False, problem) if problem else (True, "")

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        reasons = [] if self.layout_problem() is None else [str(self.layout_problem())]
        for role, part in zip(PARTS, self.parts, strict=True):
            reasons += [f"{role} part {part.name}: {r}" for r in part.validate(spec, device)]
        return reasons

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        return PhaseSplitBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        return PhaseSplitImpl

    def make_builder(self, spec: AttentionSpec, device: torch.device | str) -> PhaseSplitBuilder:
        self.require(spec, device)
        return PhaseSplitBuilder(
            spec,
            device,
            cache_layout=self.get_kv_layout(),
            graph_support=self.capabilities.graph_support,
            parts=(self.decode.make_builder(spec, device), self.prefill.make_builder(spec, device)),
        )

    def make_impl(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None
    ) -> PhaseSplitImpl:
        self.require(spec)
        return PhaseSplitImpl(
            spec,
            sinks=sinks,
            cache_layout=self.get_kv_layout(),
            parts=(
                self.decode.make_impl(spec, sinks=sinks),
                self.prefill.make_impl(spec, sinks=sinks),
            ),
        )


@dataclass(frozen=True)
class PartStep:
    """One part's share of a step."""

    metadata: Any  # the part's own metadata
    rows: slice | torch.Tensor  # the step's token rows it owns (a slice when contiguous)


@dataclass(frozen=True)
class PhaseSplitMetadata(BackendMetadata):
    decode: PartStep | None
    prefill: PartStep | None


def sub_step(
    common: CommonAttentionMetadata, requests: np.ndarray
) -> tuple[CommonAttentionMetadata, slice | torch.Tensor]:
    """The requests ``requests`` (ascending) of ``common`` as a step of their own, and
    the token rows they own in ``common`` (a slice when contiguous)."""
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    lens = qsl[requests + 1] - qsl[requests]
    new_qsl = np.zeros(requests.size + 1, dtype=np.int64)
    np.cumsum(lens, out=new_qsl[1:])
    # token t of the sub-step is row qsl[r] + (t - new_qsl[i]) of the step, r = requests[i]
    tokens = np.repeat(qsl[requests] - new_qsl[:-1], lens) + np.arange(int(new_qsl[-1]))
    device = common.device
    if tokens.size and tokens[-1] - tokens[0] + 1 == tokens.size:
        rows: slice | torch.Tensor = slice(int(tokens[0]), int(tokens[-1]) + 1)
        slots = common.slot_mapping[rows]
    else:
        rows = to_device(tokens, device)
        slots = common.slot_mapping.index_select(0, rows)
    index = to_device(requests, device)
    seq_cpu = common.seq_lens_cpu.index_select(0, torch.from_numpy(requests))
    qsl_cpu = torch.from_numpy(new_qsl.astype(np.int32))
    sub = CommonAttentionMetadata(
        query_start_loc=to_device(qsl_cpu, device),
        seq_lens=common.seq_lens.index_select(0, index),
        block_table=common.block_table.index_select(0, index),
        slot_mapping=slots,
        num_actual_tokens=int(tokens.size),
        max_query_len=int(lens.max(initial=0)),
        max_seq_len=int(seq_cpu.max()) if requests.size else 0,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_cpu,
        block_size=common.block_size,
    )
    return sub, rows


class PhaseSplitBuilder(AttentionMetadataBuilder[PhaseSplitMetadata]):
    def __init__(
        self, spec: AttentionSpec, device: torch.device | str, *, parts: tuple, **kw: Any
    ) -> None:
        super().__init__(spec, device, **kw)
        self.parts = parts

    def build(self, common: CommonAttentionMetadata, **overrides: Any) -> PhaseSplitMetadata:
        if self.graph_bounds is not None:
            # the decode part checks and stages the (pure-decode) step itself
            md = self.parts[0].build(common, **overrides)
            return PhaseSplitMetadata(md.common, PartStep(md, slice(0, md.num_tokens)), None)
        return super().build(common, **overrides)

    def build_metadata(
        self, common: CommonAttentionMetadata, **overrides: Any
    ) -> PhaseSplitMetadata:
        qsl = common.query_start_loc_cpu.numpy()
        query_lens = np.diff(qsl)
        steps: list[PartStep | None] = []
        for builder, mask in zip(self.parts, (query_lens == 1, query_lens > 1), strict=True):
            requests = np.flatnonzero(mask).astype(np.int64)
            if not requests.size:
                steps.append(None)
                continue
            sub, rows = sub_step(common, requests)
            steps.append(PartStep(builder.build(sub), rows))
        return PhaseSplitMetadata(common, steps[0], steps[1])

    def reserve_cuda_graph(self, bounds: GraphBounds) -> None:
        self.check_graph_support(bounds)  # pure decode: every row is the decode part's
        self.parts[0].reserve_cuda_graph(bounds)

    @property
    def graph_bounds(self) -> GraphBounds | None:
        return self.parts[0].graph_bounds


class PhaseSplitImpl(AttentionImpl[PhaseSplitMetadata]):
    def __init__(self, spec: AttentionSpec, *, parts: tuple, **kw: Any) -> None:
        super().__init__(spec, **kw)
        self.parts = parts

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PhaseSplitMetadata,
        output: torch.Tensor,
    ) -> None:
        # the step's K/V are already written (once, by the shared forward): each part
        # attends over its own rows, with key=None
        for impl, step in zip(self.parts, (metadata.decode, metadata.prefill), strict=True):
            if step is None:
                continue
            if isinstance(step.rows, slice):
                rows = step.rows
                impl.forward(query[rows], None, None, kv_cache, step.metadata, output[rows])
            else:
                out = impl.forward(
                    query.index_select(0, step.rows), None, None, kv_cache, step.metadata
                )
                output.index_copy_(0, step.rows, out[: step.rows.numel()])
