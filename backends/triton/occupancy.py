"""How the attention kernel's variants fit on this GPU, from the compiled kernels.

The tile rule (``configs.py``) needs the registers a tile takes: they decide how many
programs an SM holds (the makespan of a split decode, the K/V bytes in flight) and
which tiles spill. The register estimate is fitted to unsplit launches and cannot see
what ptxas does near its occupancy steps: at D 128 a split m16-n64 launch took 124
registers (4 programs per SM) where the unsplit one with the request search took 164
(3; 128 without it), and fp8 m16-n128, estimated at 460, compiles to 168-178 without a
spill. So on a CUDA device the rule asks the compiled kernel: each (tile, launch form)
variant it considers is compiled once per builder, for a tiny step planned and completed
by this backend's own builder and impl (the variant is the launch's, constant for
constant). Triton keeps it in its caches; the launch that runs it does not compile it
again.
"""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.backends.triton.configs import LaunchForm, TileConfig
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.launch import KernelFit, KernelLaunch, compiled_fit
from triton.runtime.errors import OutOfResources

# the probe step: two decodes (Triton specialises an int argument equal to 1, such as
# a one-request step's request count), long enough for two splits of any tile: two even
# shares, or two fixed ranges of _PROBE_RANGE_KEYS (a whole number of any tile's keys)
_PROBE_SEQ_LEN = 1024
_PROBE_REQUESTS = 2
_PROBE_RANGE_KEYS = 512


class CompiledFits:
    """``FitSource`` of one layer spec's builder on one CUDA device: ``(tile, form)`` ->
    the compiled attention kernel's ``KernelFit``, compiled on first ask."""

    def __init__(self, spec: AttentionSpec, device: torch.device, options: dict[str, Any]) -> None:
        self.spec = spec
        self.device = device
        # the builder's, but its split count: each probe sets its own
        self.options = {k: v for k, v in options.items() if k != "num_splits"}
        self._fits: dict[tuple[TileConfig, LaunchForm], KernelFit | None] = {}
        self._probe: tuple[Any, Any, CommonAttentionMetadata, tuple[torch.Tensor, ...]] | None = (
            None
        )

    def __call__(self, tile: TileConfig, form: LaunchForm) -> KernelFit | None:
        key = (tile, form)
        if key not in self._fits:
            self._fits[key] = self._compile(tile, form)
        return self._fits[key]

    def probe_launch(self, tile: TileConfig, form: LaunchForm) -> KernelLaunch:
        """The attention launch of the probe step with ``tile`` in ``form`` (planned, not
        run)."""
        builder, impl, common, (query, cache, out) = self._probe_step()
        if form is LaunchForm.KEY_RANGES:
            metadata = builder.build_metadata(common, tile=tile, keys_per_split=_PROBE_RANGE_KEYS)
        else:
            splits = 1 if form is LaunchForm.UNSPLIT else 2
            metadata = builder.build_metadata(common, tile=tile, num_splits=splits)
        return impl.plan(query, cache, metadata, out)[0]

    def _compile(self, tile: TileConfig, form: LaunchForm) -> KernelFit | None:
        attention = self.probe_launch(tile, form)
        try:
            return compiled_fit(attention, self.device)
        except OutOfResources:  # more shared memory than an SM has: no program fits
            return KernelFit(registers=0, spill_bytes=0, shared_bytes=0, programs_per_sm=0)

    def _probe_step(self) -> tuple[Any, Any, CommonAttentionMetadata, tuple[torch.Tensor, ...]]:
        if self._probe is None:
            from pagedkv.backends.triton.backend import TritonBackend
            from pagedkv.backends.triton.builder import TritonMetadataBuilder
            from pagedkv.backends.triton.impl import TritonAttentionImpl

            s, layout = self.spec, TritonBackend.kv_layout
            # compiled, never launched: every page may be block 1, and the cache (two
            # blocks) gives the variant only its dtype and strides
            block_ids = [[1] * -(-_PROBE_SEQ_LEN // s.block_size)] * _PROBE_REQUESTS
            common = CommonAttentionMetadata.from_requests(
                [_PROBE_SEQ_LEN] * _PROBE_REQUESTS, [1] * _PROBE_REQUESTS, block_ids,
                s.block_size, self.device,
            )  # fmt: skip
            cache = torch.empty(layout.shape(2, s), dtype=s.cache_dtype, device=self.device)
            query = torch.empty(
                _PROBE_REQUESTS, s.num_heads, s.head_size, dtype=s.dtype, device=self.device
            )
            builder = TritonMetadataBuilder(s, self.device, **self.options)
            # the probe's own plans take the estimate's fits: its builder's would probe
            # through it again (a launch's MERGE_LAST asks how many programs an SM holds)
            builder.fits = None
            # a layer with sinks compiles its variant with them (their values do not matter)
            sinks = None
            if s.use_sinks:
                sinks = torch.zeros(s.num_heads, dtype=torch.float32, device=self.device)
            impl = TritonAttentionImpl(s, sinks=sinks, cache_layout=layout)
            self._probe = (builder, impl, common, (query, cache, torch.empty_like(query)))
        return self._probe
