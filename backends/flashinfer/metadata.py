"""Host-side batch conversion for FlashInfer: block tables to CSR page lists, the
decode/prefill split of one step, and the padded decode batch of a CUDA-graph step.

Nothing here imports FlashInfer, so it runs (and is tested) on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.errors import MetadataError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.transfer import to_device


@dataclass(frozen=True)
class PagedKVCSR:
    """FlashInfer's paged-KV description of a batch (one row per request).

    Request i owns pages ``indices[indptr[i]:indptr[i+1]]`` in logical order; its
    last page holds ``last_page_len[i]`` tokens (1..page_size, 0 for an empty request).
    """

    indptr: torch.Tensor  # [B+1] int32, CPU
    indices: torch.Tensor  # [indptr[-1]] int32, on the block table's device
    last_page_len: torch.Tensor  # [B] int32, CPU

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])


def paged_kv_csr(block_table: torch.Tensor, seq_lens: np.ndarray, page_size: int) -> PagedKVCSR:
    """CSR page lists of ``seq_lens`` tokens per row of ``block_table``.

    block_table: [B, max_blocks] int32 (any device; only its first cdiv(seq_len,
    page_size) entries per row are read). seq_lens: [B] host integers. The index
    arithmetic runs on the host; the gather of page ids runs where the table lives,
    so a device table costs one host-to-device copy and no device-to-host sync.
    """
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    num_reqs = seq.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise MetadataError(
            f"block_table: expected shape [{num_reqs}, max_blocks] for {num_reqs} requests, "
            f"got {list(block_table.shape)}"
        )
    if (seq < 0).any():
        i = int(np.flatnonzero(seq < 0)[0])
        raise MetadataError(f"seq_lens[{i}] = {seq[i]}: expected a length >= 0")
    num_pages = -(-seq // page_size)
    too_wide = np.flatnonzero(num_pages > block_table.shape[1])
    if too_wide.size:
        i = int(too_wide[0])
        raise MetadataError(
            f"block_table is {block_table.shape[1]} blocks wide but request {i} (seq_len "
            f"{seq[i]}, page_size {page_size}) needs {num_pages[i]}"
        )
    indptr = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_pages, out=indptr[1:])
    total = int(indptr[-1])
    # flat position of page j of request r in the row-major table
    rows = np.repeat(np.arange(num_reqs, dtype=np.int64), num_pages)
    cols = np.arange(total, dtype=np.int64) - indptr[rows]
    flat = to_device(rows * block_table.shape[1] + cols, block_table.device)
    indices = block_table.reshape(-1).index_select(0, flat).to(torch.int32)
    # a length that is an exact multiple of the page size fills its last page
    last = np.where(seq > 0, seq - (num_pages - 1) * page_size, 0)
    return PagedKVCSR(
        indptr=torch.from_numpy(indptr.astype(np.int32)),
        indices=indices,
        last_page_len=torch.from_numpy(last.astype(np.int32)),
    )


@dataclass(frozen=True)
class RowGroup:
    """Requests of one kind (decode or multi-token) and where their tokens are.

    ``rows`` is a slice when the group's tokens are one contiguous range of the
    step's tokens (no copy needed), else a host int64 index tensor.
    """

    requests: np.ndarray  # [n] int64 request indices, in batch order
    rows: slice | torch.Tensor  # token rows of these requests, in order
    qo_indptr: torch.Tensor  # [n+1] int32, CPU; cumulative query lengths
    csr: PagedKVCSR
    max_query_len: int

    @property
    def num_requests(self) -> int:
        return int(self.requests.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


@dataclass(frozen=True)
class BatchSplit:
    """One step cut into single-token (decode) and multi-token (prefill/extend) rows.

    Requests with no query tokens this step are in neither group.
    """

    decode: RowGroup | None
    prefill: RowGroup | None


def split_batch(
    common: CommonAttentionMetadata, page_size: int, *, decode_max_query_len: int = 1
) -> BatchSplit:
    """Group the step's requests by query length, with CSR page lists per group.

    Requests with 1..decode_max_query_len query tokens are decode rows; longer ones
    are prefill rows. ``decode_max_query_len=0`` puts every non-empty request in the
    prefill group.
    """
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    seq = common.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(qsl)
    is_decode = (query_lens >= 1) & (query_lens <= decode_max_query_len)
    is_prefill = query_lens > decode_max_query_len
    groups = []
    for mask in (is_decode, is_prefill):
        reqs = np.flatnonzero(mask).astype(np.int64)
        groups.append(_group(common, reqs, qsl, seq, page_size) if reqs.size else None)
    return BatchSplit(decode=groups[0], prefill=groups[1])


def _group(
    common: CommonAttentionMetadata,
    reqs: np.ndarray,
    qsl: np.ndarray,
    seq: np.ndarray,
    page_size: int,
) -> RowGroup:
    lens = qsl[reqs + 1] - qsl[reqs]
    indptr = np.zeros(reqs.size + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    first, total = int(qsl[reqs[0]]), int(indptr[-1])
    tokens = np.repeat(qsl[reqs] - indptr[:-1], lens) + np.arange(total, dtype=np.int64)
    rows: slice | torch.Tensor
    if tokens[-1] - first + 1 == total:  # strictly increasing, so contiguous
        rows = slice(first, first + total)
    else:
        rows = torch.from_numpy(tokens)
    table = common.block_table
    if reqs.size != table.shape[0]:
        table = table.index_select(0, to_device(reqs, table.device))
    return RowGroup(
        requests=reqs,
        rows=rows,
        qo_indptr=torch.from_numpy(indptr.astype(np.int32)),
        csr=paged_kv_csr(table, seq[reqs], page_size),
        max_query_len=int(lens.max()),
    )


def decode_rows_csr(common: CommonAttentionMetadata, num_rows: int) -> PagedKVCSR:
    """Page lists for a pure-decode step as ``num_rows`` FlashInfer requests, one per
    token row: row t < num_actual_tokens reads the pages of the request that owns it,
    every later row is a padding request of one page, the null block 0, holding one
    token (``last_page_len`` 1).

    Why not an empty request: FlashInfer's kernels count no keys for a request without
    pages, but its host planners take lengths from ``last_page_len`` (the sm90 scheduler
    keeps them per work tile), and 0 reads as a full page in places (vLLM pads decode
    batches with ``last_page_len`` 1 for that reason). A request of one real page means
    the same length, 1, to every reader and reads only a valid block. The padding rows'
    outputs land in padding rows, which the contract leaves unspecified.
    """
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    seq = common.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(qsl)
    if (query_lens > 1).any():
        i = int(np.flatnonzero(query_lens > 1)[0])
        raise MetadataError(
            f"request {i} has {query_lens[i]} query tokens: a CUDA-graph step of this "
            "backend is pure decode (at most one query token per request)"
        )
    owner = np.repeat(np.arange(seq.size, dtype=np.int64), query_lens)
    real = owner.size
    if real > num_rows:
        raise MetadataError(
            f"{real} query rows exceed the {num_rows} rows of the CUDA-graph decode batch"
        )
    table = common.block_table
    owner_rows = to_device(np.pad(owner, (0, num_rows - real)), table.device)
    rows_table = table.index_select(0, owner_rows)
    rows_table[real:] = 0  # the null block
    rows_seq = np.pad(seq[owner], (0, num_rows - real), constant_values=1)
    return paged_kv_csr(rows_table, rows_seq, common.block_size)
