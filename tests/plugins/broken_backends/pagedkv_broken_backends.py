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
from pagedkv import Capabilities
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


class _FullLastBlockImpl(TorchAttentionImpl):
    """Takes the last block to be table entry seq_len // block_size: right for a partly
    filled last block, one entry too far for a full one (the table's padding there
    names the null block)."""

    def _gather(self, k_cache, v_cache, table_row, seq_len):
        bs = k_cache.shape[1]
        if seq_len and seq_len % bs == 0:
            row = table_row.clone()
            too_far = seq_len // bs
            row[too_far - 1] = table_row[too_far] if too_far < len(table_row) else 0
            table_row = row
        return super()._gather(k_cache, v_cache, table_row, seq_len)


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


class _DecodeWindowIgnoredImpl(TorchAttentionImpl):
    """A separate decode path (one query row) that forgets the sliding window."""

    def _attend(self, query, k, v, seq_len, out):
        if query.shape[0] != 1 or self.spec.sliding_window is None:
            return super()._attend(query, k, v, seq_len, out)
        windowed, self.spec = self.spec, self.spec.replace(sliding_window=None)
        try:
            super()._attend(query, k, v, seq_len, out)
        finally:
            self.spec = windowed


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


def _broken(
    name: str, impl: type[TorchAttentionImpl], base: type[_BrokenBackend] = _BrokenBackend
) -> type[TorchBackend]:
    return type(f"Broken_{name}", (base,), {"name": name, "priority": -100, "impl_cls": impl})


BROKEN = {
    "broken_block_table": _ContiguousBlocksImpl,
    "broken_full_block": _FullLastBlockImpl,
    "broken_last_token": _LastTokenDroppedImpl,
    "broken_gqa": _HeadModuloImpl,
    "broken_window": _WindowIgnoredImpl,
    "broken_write_offset": _SlotPlusOneImpl,
    "broken_unreferenced_read": _NeighbourBlockImpl,
    "broken_scale": _OwnScaleImpl,
}


class _SmallWindowsRefused(_BrokenBackend):
    """Refuses windows smaller than its block size (a legitimate limit, declared
    through validate_extra): the window scenario with decodes inside a block is then
    not applicable, and only decodes far past a larger window can show the bug."""

    def validate_extra(self, spec):
        if spec.sliding_window is not None and spec.sliding_window < spec.block_size:
            return [f"sliding_window {spec.sliding_window} < block_size {spec.block_size}"]
        return []


class BrokenCopyAxisBackend(TorchBackend):
    """copy_blocks indexes axis 2 of the (2, num_blocks, block_size, H, D) cache (the
    slots) instead of the block axis 1. Its attention is right; it declares little,
    so that the suite spends few scenarios on it."""

    name = "broken_copy_axis"
    priority = -100
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16}), head_sizes=(64,), block_sizes=(16,)
    )

    def copy_blocks(self, kv_cache, src, dst):
        kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))


class VendorMissingBackend(TorchBackend):
    """Correct, but its (imaginary) vendor runtime is absent: the suite must skip it
    with the reason, not fail."""

    name = "vendor_missing"
    priority = -100

    def missing_dependency(self):
        return "vendor runtime libpagedkv_vendor.so not found"


BACKENDS = [
    *(_broken(name, impl) for name, impl in BROKEN.items()),
    _broken("broken_decode_window", _DecodeWindowIgnoredImpl, _SmallWindowsRefused),
    BrokenCopyAxisBackend,
    VendorMissingBackend,
]


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
