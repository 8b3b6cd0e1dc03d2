"""A step's host values reach the device without a blocking copy or a device read: a
blocking host-to-device copy waits for everything queued on the stream, so an async
engine would wait for the step in flight before planning the next (measured on the
H200 through flashinfer: the async step 0.7 ms longer than its graph replay, where
triton's was 0.1 ms). The meta device stands in for a GPU here: every copy to it is a
device copy, and reading one of its values raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedkv.backends.flashinfer.metadata import decode_rows_csr, split_batch
from pagedkv.kv.manager import BlockCopy
from pagedkv.kv.step import copies_to_tensors
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.phase_split import sub_step
from pagedkv.serving.params import SamplingParams
from pagedkv.serving.sampler import _filtered_probs
from pagedkv.toolkit.split_kv import plan_decode_slices
from pagedkv.transfer import to_device


@pytest.fixture
def host_to_device(monkeypatch) -> list[bool]:
    """The non_blocking flag of every copy from the CPU to another device."""
    flags: list[bool] = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type != "cpu":
            flags.append(bool(kwargs.get("non_blocking", False)))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    return flags


def _step(query_lens: list[int], seq_lens: list[int], block_size: int = 4):
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    width = max(-(-s // block_size) for s in seq_lens)
    table = torch.arange(len(seq_lens) * width, dtype=torch.int32).reshape(len(seq_lens), width)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to("meta"),
        seq_lens=seq.to("meta"),
        block_table=table.to("meta"),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device="meta"),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        block_size=block_size,
    )


def test_mixed_step_page_lists_copy_without_blocking(host_to_device):
    # decodes and a prefill, interleaved: both groups select rows of the block table
    step = _step([1, 5, 1, 1], [9, 5, 13, 3])
    host_to_device.clear()  # the test's own copies
    split = split_batch(step, page_size=4)
    assert split.decode is not None and split.prefill is not None
    assert split.decode.csr.indices.device.type == "meta"
    assert host_to_device and all(host_to_device), host_to_device


def test_graph_decode_page_lists_copy_without_blocking(host_to_device):
    step = _step([1, 1, 1], [9, 5, 13])
    host_to_device.clear()
    csr = decode_rows_csr(step, num_rows=8)
    assert csr.indices.device.type == "meta"
    assert host_to_device and all(host_to_device), host_to_device


def test_split_backend_sub_steps_copy_without_blocking(host_to_device):
    step = _step([1, 5, 1, 1], [9, 5, 13, 3])
    host_to_device.clear()
    sub, rows = sub_step(step, np.array([0, 2, 3]))  # not contiguous: an index tensor
    assert isinstance(rows, torch.Tensor) and sub.block_table.device.type == "meta"
    assert host_to_device and all(host_to_device), host_to_device


def test_split_kv_slices_copy_without_blocking(host_to_device):
    step = _step([1, 1], [40, 6])
    host_to_device.clear()
    slices = plan_decode_slices(step, keys_per_split=8)
    assert slices.common.block_table.device.type == "meta" and slices.num_cut == 1
    assert host_to_device and all(host_to_device), host_to_device


def test_block_copies_copy_without_blocking(host_to_device):
    src, dst = copies_to_tensors([BlockCopy("a", 0, 3, 7), BlockCopy("a", 1, 4, 8)], "meta")
    assert src.device.type == dst.device.type == "meta"
    assert host_to_device == [True, True]


def test_sampling_filters_decide_on_the_host(host_to_device):
    # top-k and top-p rows: whether to filter is known on the host, so no device value
    # is read (on the meta device a read raises)
    logits = torch.empty(2, 10, device="meta")
    params = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.9)]
    probs = _filtered_probs(logits, params)
    assert probs.shape == (2, 10) and host_to_device and all(host_to_device)


def test_to_device_keeps_values_and_dtype():
    out = to_device([1, 2, 3], "cpu", torch.int64)
    assert out.dtype == torch.int64 and out.tolist() == [1, 2, 3]
    array = np.arange(4, dtype=np.int32)
    assert to_device(array, "cpu").data_ptr() == array.ctypes.data  # no copy on the CPU
    assert to_device(array, "cpu", torch.int64).tolist() == [0, 1, 2, 3]
    assert to_device(torch.ones(2), "meta").device.type == "meta"
