"""FlashInfer's attention: the step's planned wrappers' ``run()`` per layer."""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.backend import AttentionImpl
from pagedkv.backends.flashinfer.builder import FlashInferMetadata, Launch
from pagedkv.errors import UnsupportedError
from pagedkv.spec import AttentionSpec


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """Runs the step's planned wrappers (the shared forward has written the new K/V)."""

    def __init__(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None, **options: Any
    ) -> None:
        super().__init__(spec, sinks=sinks, **options)
        # FlashInfer folds k_scale into the softmax scale and multiplies the output by
        # v_scale; both only mean something for an fp8 cache
        self._k_scale = spec.k_scale if spec.is_fp8_kv else None
        self._v_scale = spec.v_scale if spec.is_fp8_kv else None

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        output: torch.Tensor,
    ) -> None:
        if _capturing() and not metadata.cuda_graph:
            # a wrapper planned without use_cuda_graph has no fixed buffers: a captured
            # run would replay stale page lists (flashinfer#3904)
            raise UnsupportedError(
                "forward is being captured in a CUDA graph but its metadata was built "
                "without a reservation; call builder.reserve_cuda_graph(GraphBounds(...)) "
                "before building the steps a graph replays"
            )
        for launch in metadata.launches:
            launch.check_current()
            self._run(launch, query, kv_cache, output)

    def _run(
        self, launch: Launch, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor
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


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
