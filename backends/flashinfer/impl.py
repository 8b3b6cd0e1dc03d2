"""FlashInfer's metadata builder (plan once per step) and attention (run per layer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from pagedkv.backend import AttentionImpl, AttentionMetadataBuilder
from pagedkv.backends.flashinfer.backend import logical_views
from pagedkv.backends.flashinfer.metadata import RowGroup, split_batch
from pagedkv.errors import MetadataError, UnsupportedError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.kv_write import write_kv_by_slot

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

    def __init__(self, wrapper: Any, capacity: int | None = None) -> None:
        self.wrapper = wrapper
        self.plan_id = 0
        self.capacity = capacity  # CUDA-graph wrappers: page slots of the fixed buffers

    def plan(self, *args: Any, **kwargs: Any) -> int:
        self.wrapper.plan(*args, **kwargs)
        self.plan_id += 1
        return self.plan_id


@dataclass(frozen=True)
class _Launch:
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
class FlashInferMetadata:
    common: CommonAttentionMetadata
    launches: tuple[_Launch, ...]  # at most one decode and one prefill launch
    cuda_graph: bool  # built for capture: fixed-buffer decode wrapper, no gathers


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Converts each step to CSR page lists and plans FlashInfer's wrappers.

    The wrappers and the workspace are created once (lazily, per kind) and re-planned
    every step. ``build(common, cuda_graph=True)`` plans a pure-decode step on a
    decode wrapper made with ``use_cuda_graph=True`` and fixed index buffers (one per
    batch size), so the layer's ``forward`` can be captured and replayed after the
    next ``build(..., cuda_graph=True)`` of the same batch size.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str,
        *,
        kv_layout: str = "NHD",
        prefill_backend: str = "auto",
        **options: Any,
    ) -> None:
        super().__init__(
            spec, device, kv_layout=kv_layout, prefill_backend=prefill_backend, **options
        )
        self.kv_layout = kv_layout
        self.prefill_backend = prefill_backend
        self._fi = load_flashinfer()
        # FlashInfer requires the float workspace zeroed before its first use
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode: _Planned | None = None
        self._prefill: _Planned | None = None
        self._sink: _Planned | None = None
        self._graph_decode: dict[int, _Planned] = {}

    # -- per step ---------------------------------------------------------------------

    def build(
        self, common: CommonAttentionMetadata, *, cuda_graph: bool = False
    ) -> FlashInferMetadata:
        """Plan this step. The returned metadata is valid until the next ``build()``.

        cuda_graph: plan on the fixed-buffer decode wrapper of this batch size; the
        step must be pure decode (every request has exactly one query token).
        """
        if common.block_size != self.spec.block_size:
            raise MetadataError(
                f"block_size: metadata uses {common.block_size}, the layer's spec "
                f"{self.spec.block_size}"
            )
        if self.spec.use_sinks:
            if cuda_graph:
                raise UnsupportedError(
                    "cuda_graph=True with sinks: the AttentionSink wrapper is not planned "
                    "for capture here; build without cuda_graph"
                )
            # one wrapper for every row: the sink variant serves single-token rows too
            split = split_batch(common, self.spec.block_size, decode_max_query_len=0)
            launches = [self._plan_prefill(self._sink_wrapper, split.prefill, sinks=True)]
        else:
            split = split_batch(common, self.spec.block_size)
            if cuda_graph:
                _require_pure_decode(common, split.decode, split.prefill)
            launches = [
                self._plan_decode(split.decode, cuda_graph, common.block_table.shape[1]),
                self._plan_prefill(self._prefill_wrapper, split.prefill, sinks=False),
            ]
        return FlashInferMetadata(
            common, tuple(launch for launch in launches if launch is not None), cuda_graph
        )

    def _plan_options(self) -> dict[str, Any]:
        s = self.spec
        return {
            "pos_encoding_mode": "NONE",
            # FlashInfer's window_left is inclusive: keys k with p - k <= window_left
            "window_left": -1 if s.sliding_window is None else s.sliding_window - 1,
            "logits_soft_cap": s.logits_soft_cap,
            "sm_scale": s.scale,
            "q_data_type": s.dtype,
            "kv_data_type": s.cache_dtype,
            "o_data_type": s.dtype,
            "non_blocking": True,
        }

    def _plan_decode(
        self, group: RowGroup | None, cuda_graph: bool, table_width: int
    ) -> _Launch | None:
        if group is None:
            return None
        s, csr = self.spec, group.csr
        planned = self._graph_wrapper(group, table_width) if cuda_graph else self._decode_wrapper()
        plan_id = planned.plan(
            csr.indptr,
            csr.indices,
            csr.last_page_len,
            s.num_heads,
            s.num_kv_heads,
            s.head_size,
            s.block_size,
            **self._plan_options(),
        )
        return _Launch(planned, plan_id, self._device_rows(group), pass_sinks=False)

    def _plan_prefill(
        self, wrapper: Callable[[], _Planned], group: RowGroup | None, sinks: bool
    ) -> _Launch | None:
        if group is None:
            return None
        planned = wrapper()
        s, csr = self.spec, group.csr
        plan_id = planned.plan(
            group.qo_indptr,
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
        return _Launch(planned, plan_id, self._device_rows(group), pass_sinks=sinks)

    def _device_rows(self, group: RowGroup) -> slice | torch.Tensor:
        if isinstance(group.rows, slice):
            return group.rows
        return group.rows.to(self.device, non_blocking=True)

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
            s = self.spec
            self._sink = _Planned(
                self._fi.BatchAttentionWithAttentionSinkWrapper(
                    self.workspace,
                    self.kv_layout,
                    backend=self.prefill_backend,
                    q_data_type=s.dtype,
                    kv_data_type=s.cache_dtype,
                    head_dim_qk=s.head_size,
                    head_dim_vo=s.head_size_v,
                    window_left=-1 if s.sliding_window is None else s.sliding_window - 1,
                )
            )
        return self._sink

    def _graph_wrapper(self, group: RowGroup, table_width: int) -> _Planned:
        batch = group.num_requests
        planned = self._graph_decode.get(batch)
        if planned is None:
            # the index buffer bounds the pages of every later plan at this batch size
            capacity = max(group.csr.num_pages, batch * table_width)
            planned = _Planned(
                self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace,
                    self.kv_layout,
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=torch.empty(
                        batch + 1, dtype=torch.int32, device=self.device
                    ),
                    paged_kv_indices_buffer=torch.empty(
                        capacity, dtype=torch.int32, device=self.device
                    ),
                    paged_kv_last_page_len_buffer=torch.empty(
                        batch, dtype=torch.int32, device=self.device
                    ),
                ),
                capacity=capacity,
            )
            self._graph_decode[batch] = planned
        elif planned.capacity is not None and group.csr.num_pages > planned.capacity:
            raise UnsupportedError(
                f"cuda_graph=True: this step needs {group.csr.num_pages} pages but the graph "
                f"wrapper for batch size {batch} was sized for {planned.capacity} (its first "
                "step's block_table width times the batch size)"
            )
        return planned


def _require_pure_decode(
    common: CommonAttentionMetadata, decode: RowGroup | None, prefill: RowGroup | None
) -> None:
    if prefill is not None or decode is None or decode.num_requests != common.num_reqs:
        lens = common.query_lens_cpu.tolist()
        raise UnsupportedError(
            "cuda_graph=True needs a pure-decode step (every request has exactly one query "
            f"token), got query lengths {lens}"
        )


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """Writes new K/V by slot mapping, then runs the step's planned wrappers."""

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        sinks: torch.Tensor | None = None,
        kv_layout: str = "NHD",
        **options: Any,
    ) -> None:
        super().__init__(spec, sinks=sinks, kv_layout=kv_layout, **options)
        self.kv_layout = kv_layout
        # FlashInfer folds k_scale into the softmax scale and multiplies the output by
        # v_scale; both only mean something for an fp8 cache
        self._k_scale = spec.k_scale if spec.is_fp8_kv else None
        self._v_scale = spec.v_scale if spec.is_fp8_kv else None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
    ) -> None:
        if value is None:
            raise UnsupportedError("value: expected a tensor, got None")
        k_view, v_view = logical_views(kv_cache, self.kv_layout)
        slots = metadata.common.slot_mapping
        write_kv_by_slot(key, value, k_view, v_view, slots, self.spec.k_scale, self.spec.v_scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        common = metadata.common
        self.check_forward_args(query, key, value, common.num_tokens, output)
        self._check_cache(kv_cache)
        if _capturing() and not metadata.cuda_graph:
            # a wrapper planned without use_cuda_graph has no fixed buffers: a captured
            # run would replay stale page lists (flashinfer#3904)
            raise UnsupportedError(
                "forward is being captured in a CUDA graph but its metadata was built "
                "without cuda_graph=True; use builder.build(common, cuda_graph=True)"
            )
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        out = self.new_output(query, output)
        for launch in metadata.launches:
            launch.check_current()
            self._run(launch, query, kv_cache, out)
        return out

    def _run(
        self, launch: _Launch, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        extra = (self._sinks_on(query.device),) if launch.pass_sinks else ()
        run = launch.planned.wrapper.run
        scales = {"k_scale": self._k_scale, "v_scale": self._v_scale}
        rows = launch.rows
        if isinstance(rows, slice) and out.is_contiguous():
            run(query[rows], kv_cache, *extra, out=out[rows], **scales)
        elif isinstance(rows, slice):
            out[rows] = run(query[rows], kv_cache, *extra, **scales)
        else:
            result = run(query.index_select(0, rows), kv_cache, *extra, **scales)
            out.index_copy_(0, rows, result)

    def _sinks_on(self, device: torch.device) -> torch.Tensor:
        assert self.sinks is not None  # pass_sinks is only set for layers with sinks
        if self.sinks.device != device:
            self.sinks = self.sinks.to(device)
        return self.sinks

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        s = self.spec
        per_block = (
            (2, s.num_kv_heads, s.block_size, s.head_size)
            if self.kv_layout == "HND"
            else (2, s.block_size, s.num_kv_heads, s.head_size)
        )
        if not isinstance(kv_cache, torch.Tensor) or tuple(kv_cache.shape[1:]) != per_block:
            got = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)
            raise UnsupportedError(
                f"kv_cache: expected the {self.kv_layout} shape [num_blocks, {', '.join(map(str, per_block))}], got {got}"
            )
        if kv_cache.dtype != s.cache_dtype:
            raise UnsupportedError(
                f"kv_cache: expected dtype {s.cache_dtype} (kv_cache_dtype "
                f"{s.kv_cache_dtype!r}), got {kv_cache.dtype}"
            )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
