"""FlashInfer's metadata and its builder: CSR page lists and one plan() per wrapper per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.backends.flashinfer.metadata import PagedKVCSR, RowGroup, decode_rows_csr, split_batch
from pagedkv.backends.flashinfer.sinks import sink_module, sink_wrapper
from pagedkv.errors import UnsupportedError
from pagedkv.graph import GraphBounds
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec

# FlashInfer's recommended float workspace (split-KV partial outputs), shared by
# every wrapper of one builder: their runs are ordered on one stream.
WORKSPACE_BYTES = 128 << 20


def load_flashinfer() -> ModuleType:
    """The flashinfer module (imported on first use, never at registration)."""
    import flashinfer

    return flashinfer


class _Planned:
    """One FlashInfer wrapper and a count of its plans.

    A wrapper holds exactly one plan; metadata remembers the plan it was built with,
    so running a layer on metadata whose plan a later ``build()`` replaced raises
    instead of reading another batch's page lists.
    """

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.plan_id = 0

    def plan(self, *args: Any, **kwargs: Any) -> int:
        self.wrapper.plan(*args, **kwargs)
        self.plan_id += 1
        return self.plan_id


@dataclass(frozen=True)
class Launch:
    """One ``run()`` of a step: which planned wrapper, over which token rows."""

    planned: _Planned
    plan_id: int
    rows: slice | torch.Tensor  # contiguous token range, or device int64 row indices
    pass_sinks: bool  # the AttentionSink variant takes the sinks as its first extra arg

    def check_current(self) -> None:
        if self.planned.plan_id != self.plan_id:
            raise UnsupportedError(
                "metadata: stale FlashInfer plan (a later build() re-planned this wrapper); "
                "run every layer of a step before building the next step's metadata"
            )


@dataclass(frozen=True)
class FlashInferMetadata(BackendMetadata):
    launches: tuple[Launch, ...]  # at most one decode and one prefill launch
    cuda_graph: bool  # built under a reservation: fixed-buffer wrappers, no gathers


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Converts each step to CSR page lists and plans FlashInfer's wrappers.

    The wrappers and the workspace are created once (lazily, per kind) and re-planned
    every step. After ``reserve_cuda_graph`` every (pure-decode) step is planned on one
    wrapper made with ``use_cuda_graph=True`` whose index buffers are sized from the
    bounds, so a captured ``forward`` replays any later step within them.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str,
        *,
        prefill_backend: str = "auto",
        **options: Any,
    ) -> None:
        super().__init__(spec, device, **options)
        if self.cache_layout is None:
            raise UnsupportedError(
                "FlashInferMetadataBuilder has no KV layout: create it with backend.make_builder"
            )
        self.kv_layout = self.cache_layout.name  # FlashInfer's own names: NHD, HND
        self.prefill_backend = prefill_backend
        self._fi = load_flashinfer()
        # FlashInfer requires the float workspace zeroed before its first use
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode: _Planned | None = None
        self._prefill: _Planned | None = None
        self._sink: _Planned | None = None
        self._graph_planned: tuple[GraphBounds, _Planned] | None = None

    # -- per step ---------------------------------------------------------------------

    def build_metadata(
        self, common: CommonAttentionMetadata, **overrides: Any
    ) -> FlashInferMetadata:
        """Plan this step. The returned metadata is valid until the next ``build()``."""
        if self.graph_bounds is not None:
            return self._build_graph_step(common)
        if self.spec.use_sinks:
            # one wrapper for every row: the sink variant serves single-token rows too
            split = split_batch(common, self.spec.block_size, decode_max_query_len=0)
            launches = [self._plan_prefill(self._sink_wrapper, split.prefill, sinks=True)]
        else:
            split = split_batch(common, self.spec.block_size)
            launches = [
                self._plan_decode(split.decode),
                self._plan_prefill(self._prefill_wrapper, split.prefill, sinks=False),
            ]
        return FlashInferMetadata(
            common, tuple(launch for launch in launches if launch is not None), cuda_graph=False
        )

    def _plan_options(self) -> dict[str, Any]:
        s = self.spec
        return {
            "pos_encoding_mode": "NONE",
            # FlashInfer's window_left is inclusive: keys k with p - k <= window_left
            "window_left": self._window_left(),
            "logits_soft_cap": s.logits_soft_cap,
            "sm_scale": s.scale,
            "q_data_type": s.dtype,
            "kv_data_type": s.cache_dtype,
            "o_data_type": s.dtype,
            "non_blocking": True,
        }

    def _window_left(self) -> int:
        return -1 if self.spec.sliding_window is None else self.spec.sliding_window - 1

    def _plan_decode(self, group: RowGroup | None) -> Launch | None:
        if group is None:
            return None
        planned = self._decode_wrapper()
        plan_id = self._decode_plan(planned, group.csr)
        return Launch(planned, plan_id, self._device_rows(group), pass_sinks=False)

    def _decode_plan(self, planned: _Planned, csr: PagedKVCSR) -> int:
        s = self.spec
        return planned.plan(
            csr.indptr,
            csr.indices,
            csr.last_page_len,
            s.num_heads,
            s.num_kv_heads,
            s.head_size,
            s.block_size,
            **self._plan_options(),
        )

    def _plan_prefill(
        self, wrapper: Callable[[], _Planned], group: RowGroup | None, sinks: bool
    ) -> Launch | None:
        if group is None:
            return None
        planned = wrapper()
        plan_id = self._prefill_plan(planned, group.qo_indptr, group.csr)
        return Launch(planned, plan_id, self._device_rows(group), pass_sinks=sinks)

    def _prefill_plan(self, planned: _Planned, qo_indptr: torch.Tensor, csr: PagedKVCSR) -> int:
        s = self.spec
        return planned.plan(
            qo_indptr,
            csr.indptr,
            csr.indices,
            csr.last_page_len,
            s.num_heads,
            s.num_kv_heads,
            s.head_size,
            s.block_size,
            causal=s.causal,
            **self._plan_options(),
        )

    def _device_rows(self, group: RowGroup) -> slice | torch.Tensor:
        if isinstance(group.rows, slice):
            return group.rows
        return group.rows.to(self.device, non_blocking=True)

    # -- CUDA graphs --------------------------------------------------------------------

    def _build_graph_step(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """A padded pure-decode step on the fixed-buffer wrapper: one FlashInfer request
        per token row of the first ``min(max_num_reqs, max_num_tokens)`` rows (a
        pure-decode step has at most one row per request), so query and output are
        plain slices and the batch size never changes."""
        bounds = self.graph_bounds
        assert bounds is not None
        rows = min(bounds.max_num_reqs, bounds.max_num_tokens)
        csr = decode_rows_csr(common, rows)
        planned = self._graph_wrapper(bounds, rows)
        if self.spec.use_sinks:
            qo_indptr = torch.arange(rows + 1, dtype=torch.int32)
            plan_id = self._prefill_plan(planned, qo_indptr, csr)
        else:
            plan_id = self._decode_plan(planned, csr)
        launch = Launch(planned, plan_id, slice(0, rows), pass_sinks=self.spec.use_sinks)
        return FlashInferMetadata(common, (launch,), cuda_graph=True)

    def _graph_wrapper(self, bounds: GraphBounds, rows: int) -> _Planned:
        """The wrapper of this reservation, its index buffers sized from the bounds
        (persistent: a captured run reads them on every replay)."""
        if self._graph_planned is not None and self._graph_planned[0] == bounds:
            return self._graph_planned[1]
        i32 = torch.int32
        indptr = self.scratch("flashinfer.indptr", (rows + 1,), i32)
        indices = self.scratch("flashinfer.indices", (rows * bounds.max_blocks_per_req,), i32)
        last_page_len = self.scratch("flashinfer.last_page_len", (rows,), i32)
        if self.spec.use_sinks:
            wrapper = self._new_sink_wrapper(
                use_cuda_graph=True,
                qo_indptr_buf=self.scratch("flashinfer.qo_indptr", (rows + 1,), i32),
                paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=last_page_len,
            )
        else:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                self.kv_layout,
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
        self._graph_planned = (bounds, _Planned(wrapper))
        return self._graph_planned[1]

    # -- wrappers, created once -------------------------------------------------------

    def _decode_wrapper(self) -> _Planned:
        if self._decode is None:
            self._decode = _Planned(
                self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, self.kv_layout, use_tensor_cores=True
                )
            )
        return self._decode

    def _prefill_wrapper(self) -> _Planned:
        if self._prefill is None:
            self._prefill = _Planned(
                self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, self.kv_layout, backend=self.prefill_backend
                )
            )
        return self._prefill

    def _sink_wrapper(self) -> _Planned:
        if self._sink is None:
            self._sink = _Planned(self._new_sink_wrapper())
        return self._sink

    def _new_sink_wrapper(self, **graph_buffers: Any) -> Any:
        module = sink_module(self._fi, self.device, self.spec, self.prefill_backend)
        return sink_wrapper(self._fi, self.workspace, self.kv_layout, module, **graph_buffers)
