"""Backends with one deliberate bug each, registered like any third-party plugin.

Each is the torch backend (same layout, same declared capabilities) with one
realistic kernel bug injected. The conformance suite must fail every one of them,
and its failure output must point at the bug. The plugin also contributes one
scenario through ``pagedkv_conformance_scenarios``, and one correct backend that
is unavailable (its runtime is missing).
"""

from __future__ import annotations

import pagedkv
import torch
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.impl import TorchAttentionImpl
from pagedkv.conformance import Scenario
from pagedkv.toolkit.kv_write import write_rows_by_slot


class _BrokenBackend(TorchBackend):
    impl_cls: type[TorchAttentionImpl]

    def get_impl_cls(self):
        return self.impl_cls


# -- reads ------------------------------------------------------------------------------


class _ContiguousBlocksImpl(TorchAttentionImpl):
    """Ignores the block table past its first entry: assumes a request's blocks are
    contiguous in the pool (reads first, first + 1, ...)."""

    def _gather(self, k_cache, v_cache, table_row, seq_len):
        num_blocks = -(-seq_len // k_cache.shape[1])
        pool = k_cache.shape[0]
        row = (table_row[0].long() + torch.arange(num_blocks, device=table_row.device)) % pool
        return super()._gather(k_cache, v_cache, row, seq_len)


class _LastTokenDroppedImpl(TorchAttentionImpl):
    """Takes the context length for the sequence length: attends to one key too few."""

    def _gather(self, k_cache, v_cache, table_row, seq_len):
        self._short = max(seq_len - 1, 1)
        return super()._gather(k_cache, v_cache, table_row, self._short)

    def _attend(self, query, k, v, seq_len, out):
        super()._attend(query, k, v, self._short, out)


class _NeighbourBlockImpl(TorchAttentionImpl):
    """Reads a request's last block from the physically next block (pointer
    arithmetic off by one block): a block the table does not name."""

    def _gather(self, k_cache, v_cache, table_row, seq_len):
        num_blocks = -(-seq_len // k_cache.shape[1])
        row = table_row[:num_blocks].clone()
        row[num_blocks - 1] = (row[num_blocks - 1] + 1) % k_cache.shape[0]
        return super()._gather(k_cache, v_cache, row, seq_len)


class _HeadModuloImpl(TorchAttentionImpl):
    """Maps query head h to KV head h % num_kv_heads instead of h // group."""

    def _attend(self, query, k, v, seq_len, out):
        hkv, group = self.spec.num_kv_heads, self.spec.num_queries_per_kv
        # slot kv * group + g of the torch kernel holds query head g * hkv + kv
        perm = torch.tensor([g * hkv + kv for kv in range(hkv) for g in range(group)])
        staged = torch.empty_like(out)
        super()._attend(query[:, perm], k, v, seq_len, staged)
        out[:, perm] = staged


class _WindowIgnoredImpl(TorchAttentionImpl):
    """Declares sliding window (inherited) but attends to the whole sequence."""

    def __init__(self, spec, **kwargs):
        super().__init__(spec, **kwargs)
        self.spec = spec.replace(sliding_window=None)


class _OwnScaleImpl(TorchAttentionImpl):
    """Derives the softmax scale from head_size instead of using spec.scale."""

    def __init__(self, spec, **kwargs):
        super().__init__(spec, **kwargs)
        self.spec = spec.replace(scale=spec.head_size**-0.5)


# -- writes -----------------------------------------------------------------------------


class _SlotPlusOneImpl(TorchAttentionImpl):
    """Writes each token's K/V one slot after its slot."""

    def write_kv(self, key, value, kv_cache, metadata):
        slots = metadata.common.slot_mapping
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        shifted = torch.where((slots >= 0) & (slots + 1 < num_slots), slots + 1, -1)
        write_rows_by_slot(key, kv_cache[0], shifted, self.spec.k_scale)
        write_rows_by_slot(value, kv_cache[1], shifted, self.spec.v_scale)


def _broken(name: str, impl: type[TorchAttentionImpl]) -> type[TorchBackend]:
    return type(
        f"Broken_{name}", (_BrokenBackend,), {"name": name, "priority": -100, "impl_cls": impl}
    )


BROKEN = {
    "broken_block_table": _ContiguousBlocksImpl,
    "broken_last_token": _LastTokenDroppedImpl,
    "broken_gqa": _HeadModuloImpl,
    "broken_window": _WindowIgnoredImpl,
    "broken_write_offset": _SlotPlusOneImpl,
    "broken_unreferenced_read": _NeighbourBlockImpl,
    "broken_scale": _OwnScaleImpl,
}


class VendorMissingBackend(TorchBackend):
    """Correct, but its (imaginary) vendor runtime is absent: the suite must skip it
    with the reason, not fail."""

    name = "vendor_missing"
    priority = -100

    def missing_dependency(self):
        return "vendor runtime libpagedkv_vendor.so not found"


BACKENDS = [*(_broken(name, impl) for name, impl in BROKEN.items()), VendorMissingBackend]


@pagedkv.hookimpl
def pagedkv_backends():
    return BACKENDS


@pagedkv.hookimpl
def pagedkv_conformance_scenarios(backend, level):
    """One extra scenario for every backend: a batch of tiny requests."""
    return [
        Scenario(
            f"plugin-tiny-requests-{level}",
            seq_lens=(2, 3, 1, 4),
            query_lens=(2, 1, 1, 3),
            num_heads=4,
            num_kv_heads=2,
            head_size=32,
            block_size=2,
            seed=7,
        )
    ]
