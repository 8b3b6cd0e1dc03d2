"""FlashInfer backend on the CPU: CSR conversion, batch split, options, layouts, the
write path and the reasons validate() and is_available() give."""

from __future__ import annotations

import importlib.util

import numpy as np
import pagedkv
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import AttentionSpec, CommonAttentionMetadata, ConfigError, MetadataError
from pagedkv.backends.flashinfer import backend as fi_backend
from pagedkv.backends.flashinfer.backend import FlashInferBackend, jit_toolchain_problem
from pagedkv.backends.flashinfer.metadata import decode_rows_csr, paged_kv_csr, split_batch
from pagedkv.layout import BLOCK_HND
from pagedkv.selection import parse_config


def naive_csr(table: list[list[int]], seq_lens: list[int], page_size: int):
    indptr, indices, last = [0], [], []
    for row, seq_len in zip(table, seq_lens, strict=True):
        pages = 0
        while pages * page_size < seq_len:
            indices.append(row[pages])
            pages += 1
        indptr.append(indptr[-1] + pages)
        last.append(seq_len - (pages - 1) * page_size if pages else 0)
    return indptr, indices, last


@st.composite
def batches(draw):
    page_size = draw(st.integers(1, 9))
    seq_lens = draw(st.lists(st.integers(0, 5 * page_size), min_size=1, max_size=6))
    width = max([-(-s // page_size) for s in seq_lens] + [1]) + draw(st.integers(0, 2))
    table = [draw(st.lists(st.integers(0, 99), min_size=width, max_size=width)) for _ in seq_lens]
    return table, seq_lens, page_size


@settings(max_examples=150, deadline=None)
@given(batches())
def test_csr_matches_a_naive_loop(batch):
    table, seq_lens, page_size = batch
    csr = paged_kv_csr(torch.tensor(table, dtype=torch.int32), np.array(seq_lens), page_size)
    indptr, indices, last = naive_csr(table, seq_lens, page_size)
    assert csr.indptr.tolist() == indptr and csr.indptr.dtype == torch.int32
    assert csr.indices.tolist() == indices and csr.indices.dtype == torch.int32
    assert csr.last_page_len.tolist() == last and csr.last_page_len.dtype == torch.int32


def test_csr_edge_cases():
    table = torch.tensor([[7, 8, 9], [4, 5, 6], [1, 2, 3], [0, 0, 0]], dtype=torch.int32)
    csr = paged_kv_csr(table, np.array([16, 17, 0, 1]), 16)
    assert csr.indptr.tolist() == [0, 1, 3, 3, 4]
    assert csr.indices.tolist() == [7, 4, 5, 0]
    # an exact multiple fills its last page; an empty request has no page at all
    assert csr.last_page_len.tolist() == [16, 1, 0, 1]
    empty = paged_kv_csr(torch.zeros(0, 1, dtype=torch.int32), np.array([], dtype=np.int64), 4)
    assert empty.indptr.tolist() == [0] and empty.indices.numel() == 0


def test_csr_rejects_a_table_too_narrow():
    with pytest.raises(MetadataError, match=r"2 blocks wide but request 1 \(seq_len 9"):
        paged_kv_csr(torch.zeros(2, 2, dtype=torch.int32), np.array([8, 9]), 4)


def test_split_keeps_token_order_and_uses_slices_when_contiguous():
    # requests: decode, prefill(3), empty, decode, prefill(2)
    common = CommonAttentionMetadata.from_requests(
        [5, 9, 4, 7, 6], [1, 3, 0, 1, 2], [[1, 2], [3, 4, 5], [6], [7, 8], [9, 10]], 4
    )
    split = split_batch(common, 4)
    assert split.decode.requests.tolist() == [0, 3]
    assert split.decode.rows.tolist() == [0, 4]  # token 0 and token 4: gathered
    assert split.prefill.requests.tolist() == [1, 4]
    assert split.prefill.rows.tolist() == [1, 2, 3, 5, 6]
    assert split.prefill.qo_indptr.tolist() == [0, 3, 5]
    assert split.prefill.csr.indices.tolist() == [3, 4, 5, 9, 10]
    assert split.prefill.max_query_len == 3

    ordered = CommonAttentionMetadata.from_requests(
        [5, 7, 9, 4], [1, 1, 0, 3], [[1, 2], [7, 8], [3, 4, 5], [6]], 4, num_tokens=8
    )
    split = split_batch(ordered, 4)
    assert split.decode.rows == slice(0, 2) and split.prefill.rows == slice(2, 5)
    everything = split_batch(ordered, 4, decode_max_query_len=0)
    assert everything.decode is None and everything.prefill.rows == slice(0, 5)
    assert everything.prefill.qo_indptr.tolist() == [0, 1, 2, 5]


def test_graph_decode_rows_pad_with_the_null_page():
    # requests: decode, no query token this step, decode over an exact page multiple
    common = CommonAttentionMetadata.from_requests(
        [5, 9, 8], [1, 0, 1], [[1, 2], [3, 4, 5], [6, 7]], 4, num_tokens=4
    )
    csr = decode_rows_csr(common, 5)
    # one FlashInfer request per token row: rows 0 and 1 are requests 0 and 2
    assert csr.indptr.tolist() == [0, 2, 4, 5, 6, 7]
    assert csr.indices.tolist() == [1, 2, 6, 7, 0, 0, 0]
    assert csr.last_page_len.tolist() == [1, 4, 1, 1, 1]
    with pytest.raises(MetadataError, match="2 query rows exceed the 1 rows"):
        decode_rows_csr(common, 1)
    prefill = CommonAttentionMetadata.from_requests([5, 9], [1, 3], [[1, 2], [3, 4, 5]], 4)
    with pytest.raises(MetadataError, match="request 1 has 3 query tokens"):
        decode_rows_csr(prefill, 4)


# -- options and layouts -------------------------------------------------------------

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=4)


def test_options_parse_from_a_config_string():
    choice = parse_config("flashinfer(kv_layout=HND, prefill_backend=fa2)")[0]
    backend = pagedkv.get_backend(choice.name, **choice.options)
    assert backend.options["kv_layout"] == "HND" and backend.options["prefill_backend"] == "fa2"
    assert backend.kv_layout is BLOCK_HND
    assert backend.layout == "(num_blocks, 2, num_kv_heads, block_size, head_size)"
    assert FlashInferBackend().layout == "(num_blocks, 2, block_size, num_kv_heads, head_size)"
    with pytest.raises(ConfigError, match=r"kv_layout='NCHW': expected one of NHD, HND"):
        FlashInferBackend(kv_layout="NCHW")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) layout"):
        FlashInferBackend(layout="HND")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_logical_views_address_the_physical_layout(layout):
    backend = FlashInferBackend(kv_layout=layout)
    cache = torch.arange(6 * 2 * 4 * 2 * 64, dtype=torch.float32).reshape(
        backend.get_kv_cache_shape(6, 4, 2, 64)
    )
    k, v = backend.kv_cache_to_logical(cache, SPEC.replace(dtype=torch.float32))
    assert k.shape == v.shape == (6, 4, 2, 64)
    assert k.data_ptr() == cache.data_ptr() and k.untyped_storage().data_ptr() == cache.data_ptr()
    block, slot, head = 3, 1, 1
    physical = (block, 1, slot, head) if layout == "NHD" else (block, 1, head, slot)
    assert torch.equal(v[block, slot, head], cache[physical])
    with pytest.raises(pagedkv.UnsupportedError, match=f"kv_cache: expected the {layout} layout"):
        backend.kv_cache_to_logical(cache.transpose(2, 3), SPEC.replace(dtype=torch.float32))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_kv_lands_at_slots_and_skips_padding(layout):
    backend = FlashInferBackend(kv_layout=layout)
    cache = backend.allocate_kv_cache(4, SPEC, "cpu")
    assert not cache.any()
    md = CommonAttentionMetadata.from_requests([6], [6], [[3, 1]], 4, num_tokens=8)
    key, value = torch.randn(8, 2, 64).half(), torch.randn(8, 2, 64).half()

    # the shared writer reads only the metadata's slot mapping
    backend.make_impl(SPEC).write_kv(key, value, cache, pagedkv.BackendMetadata(md))
    k, v = backend.kv_cache_to_logical(cache, SPEC)
    assert torch.equal(k[3], key[:4]) and torch.equal(v[1, :2], value[4:6])
    # past the sequence's end, the other blocks and the padded rows: untouched zeros
    assert not k[1, 2:].any() and not k[[0, 2]].any() and not v[[0, 2]].any()


def test_copy_blocks_moves_whole_blocks():
    backend = FlashInferBackend(kv_layout="HND")
    cache = torch.randn(backend.get_kv_cache_shape(5, 4, 2, 64))
    before = cache.clone()
    backend.copy_blocks(cache, torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert torch.equal(cache[3], before[1]) and torch.equal(cache[4], before[2])
    assert torch.equal(cache[:3], before[:3])


# -- declared support ----------------------------------------------------------------


def test_validate_reasons():
    fi = FlashInferBackend()
    assert fi.validate(SPEC) == []
    assert fi.validate(SPEC, "cpu") == ["device cpu not supported by flashinfer (supports cuda)"]
    assert (
        "dtype float32 not supported by flashinfer"
        in fi.validate(SPEC.replace(dtype=torch.float32))[0]
    )
    assert fi.validate(SPEC.replace(head_size=96)) == [
        "head_size 96 not supported by flashinfer (supports 64, 128, 256)"
    ]
    assert fi.validate(SPEC.replace(alibi_slopes=(0.5, 0.25, 0.125, 0.0625))) == [
        "alibi is not supported by flashinfer"
    ]
    (reason,) = fi.validate(SPEC.replace(causal=False, sliding_window=8))
    assert reason.startswith("non-causal sliding window is not supported by flashinfer")
    (reason,) = fi.validate(SPEC.replace(use_sinks=True, logits_soft_cap=30.0))
    assert reason.startswith("sinks with logits_soft_cap are not supported")
    (reason,) = fi.validate(SPEC.replace(use_sinks=True, kv_cache_dtype="fp8_e4m3"))
    assert reason.startswith("sinks with an fp8 KV cache are not supported")
    (reason,) = FlashInferBackend(prefill_backend="fa3").validate(
        SPEC.replace(kv_cache_dtype="fp8_e5m2")
    )
    assert "fa3 kernels read fp8 K/V only with fp8 queries" in reason
    for ok in (
        SPEC.replace(sliding_window=8, logits_soft_cap=30.0),
        SPEC.replace(use_sinks=True, sliding_window=8),
        SPEC.replace(causal=False),
        SPEC.replace(kv_cache_dtype="fp8_e4m3", k_scale=0.5),
        SPEC.replace(head_size=256, dtype=torch.bfloat16, block_size=1),
    ):
        assert fi.validate(ok) == [], ok


def test_is_available_says_why_not(monkeypatch):
    fi = FlashInferBackend()
    if importlib.util.find_spec("flashinfer") is None:
        assert fi.is_available() == (
            False,
            "flashinfer-python is not installed (pip install 'pagedkv[flashinfer]')",
        )
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        fi_backend.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flashinfer" else real_find_spec(name, *a),
    )

    def broken(name):
        raise ImportError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(fi_backend.importlib, "import_module", broken)
    available, why = fi.is_available()
    assert not available
    assert why == (
        "flashinfer-python is installed but `import flashinfer` failed: ImportError: "
        "libcuda.so.1: cannot open shared object file"
    )


def test_jit_toolchain_problem_names_the_missing_nvcc(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHINFER_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    problem = jit_toolchain_problem()
    if importlib.util.find_spec("flashinfer_jit_cache") is None:
        assert problem is not None and f"{tmp_path}/bin/nvcc does not exist" in problem
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert jit_toolchain_problem() is None
