"""ModelKVCache: per-layer specs grouped, caches allocated together, copies to every layer."""

from __future__ import annotations

import pagedkv
import pytest
import torch
from pagedkv.errors import UnsupportedError
from pagedkv.kv import BlockCopy
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.serving import AttentionLayer, EngineConfigError, ModelKVCache


def _spec(**changes: object) -> pagedkv.AttentionSpec:
    values = dict(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=16)
    values.update(changes)
    return pagedkv.AttentionSpec(**values)  # type: ignore[arg-type]


def _layers() -> list[AttentionLayer]:
    sinks = torch.zeros(4)
    return [
        AttentionLayer(_spec(sliding_window=8)),
        AttentionLayer(_spec()),
        AttentionLayer(_spec(sliding_window=8)),
        AttentionLayer(_spec(use_sinks=True), sinks),
    ]


def test_layers_with_one_spec_share_a_group():
    kv = ModelKVCache(_layers(), num_blocks=9, backend="torch", device="cpu")
    assert kv.group_of == [0, 1, 0, 2]
    assert [g.layer_ids for g in kv.groups] == [(0, 2), (1,), (3,)]
    assert len(kv.caches) == 4 and all(c.shape == (2, 9, 16, 2, 16) for c in kv.caches)
    assert kv.impls[3].sinks is not None and kv.impls[0].sinks is None
    common = CommonAttentionMetadata.from_requests([5], [5], [[3]], 16)
    step = kv.build(common)
    assert len(step.metadata) == 3 and step.num_tokens == 5
    assert ModelKVCache.bytes_per_block(_layers()) == 4 * 16 * 2 * 2 * 16 * 4
    assert "layers 0,2: torch" in kv.describe()[0] and "window 8" in kv.describe()[0]


def test_copy_blocks_reaches_every_layer():
    kv = ModelKVCache(_layers(), num_blocks=9, backend="torch", device="cpu")
    for i, cache in enumerate(kv.caches):
        cache.normal_(generator=torch.Generator().manual_seed(i))
    before = [c.clone() for c in kv.caches]
    kv.copy_blocks([BlockCopy("r", 0, src=2, dst=5), BlockCopy("r", 1, src=5, dst=7)])
    for old, new in zip(before, kv.caches, strict=True):
        assert torch.equal(new[:, 5], old[:, 2])
        assert torch.equal(new[:, 7], old[:, 5])  # sources read before any write
        untouched = [b for b in range(9) if b not in (5, 7)]
        assert torch.equal(new[:, untouched], old[:, untouched])


def test_a_backend_object_must_run_every_layer():
    mla = _spec(num_kv_heads=1, head_size=48, scale=0.1, kv_lora_rank=32, qk_rope_head_dim=16)
    layers = [AttentionLayer(_spec()), AttentionLayer(mla)]
    with pytest.raises(UnsupportedError, match=r"torch cannot run layers 1: MLA layers"):
        ModelKVCache(layers, 9, pagedkv.get_backend("torch"), "cpu")
    with pytest.raises(EngineConfigError, match="one block_size"):
        ModelKVCache(
            [AttentionLayer(_spec()), AttentionLayer(_spec(block_size=32))], 9, "torch", "cpu"
        )
