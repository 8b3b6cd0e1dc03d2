"""The checks every builder runs on every step before planning it.

Cheap and host-side only: they read the metadata's CPU copies and tensor attributes,
never device data, so they cost no synchronisation (``benchmarks/build_overhead.py``
measures them). What they catch is what otherwise becomes an out-of-bounds access or
a silent wrong answer in a kernel: metadata built for another block size, query rows
past the token rows, a sequence wider than its block-table row, decreasing
``query_start_loc``, ``seq_len < query_len``, wrong dtypes. Non-contiguous metadata
tensors are made contiguous (kernels index them with unit stride).

``PAGEDKV_VALIDATE=1`` adds the full ``CommonAttentionMetadata.validate()``: here
without the pool size (block ids are range-checked against the cache in ``forward``).
It syncs the device: a debugging switch, not for production.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import numpy as np
import torch
from pagedkv.errors import MetadataError
from pagedkv.metadata import CommonAttentionMetadata

VALIDATE_ENV = "PAGEDKV_VALIDATE"

_TENSORS = (
    # field, dtype, rank
    ("query_start_loc", torch.int32, 1),
    ("seq_lens", torch.int32, 1),
    ("block_table", torch.int32, 2),
    ("slot_mapping", torch.int64, 1),
)


def _env_enabled() -> bool:
    return os.environ.get(VALIDATE_ENV, "").lower() in ("1", "true", "yes", "on")


# read from the environment once: every layer's forward asks (a lookup in os.environ
# was a tenth of a forward's checks); ``full_validation`` switches it in a process
_VALIDATE = [_env_enabled()]


def full_validation_enabled() -> bool:
    """Whether ``PAGEDKV_VALIDATE`` was on when pagedkv was imported, or
    ``full_validation(True)`` is in force."""
    return _VALIDATE[0]


@contextlib.contextmanager
def full_validation(enabled: bool) -> Iterator[None]:
    """The full validation on or off for the block, whatever it was (restored after):
    to show that a bad step is caught by the cheap checks alone, or only with the
    debug validation. ``PAGEDKV_VALIDATE`` follows, for processes started inside."""
    old, old_env = _VALIDATE[0], os.environ.pop(VALIDATE_ENV, None)
    _VALIDATE[0] = enabled
    if enabled:
        os.environ[VALIDATE_ENV] = "1"
    try:
        yield
    finally:
        _VALIDATE[0] = old
        os.environ.pop(VALIDATE_ENV, None)
        if old_env is not None:
            os.environ[VALIDATE_ENV] = old_env


def check_step(common: CommonAttentionMetadata, block_size: int) -> CommonAttentionMetadata:
    """Raise MetadataError naming the field when ``common`` cannot be run by a layer of
    ``block_size``; return it (with contiguous tensors) otherwise."""
    if not isinstance(common, CommonAttentionMetadata):
        raise MetadataError(
            f"build() expects a CommonAttentionMetadata, got {type(common).__name__}"
        )
    fixes = {}
    for name, dtype, rank in _TENSORS:
        t = getattr(common, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != rank:
            _explain_tensor(name, t, dtype, rank)
        if not t.is_contiguous():
            fixes[name] = t.contiguous()
    qsl = common.query_start_loc_cpu.numpy()
    seq = common.seq_lens_cpu.numpy()
    num_reqs = seq.shape[0]
    # the common case in a few vectorised tests; the slow path finds and names the problem
    ok = (
        common.block_size == block_size
        and qsl.shape == (num_reqs + 1,)
        and common.query_start_loc.shape[0] == num_reqs + 1
        and common.seq_lens.shape[0] == num_reqs
        and common.block_table.shape[0] == num_reqs
        and int(qsl[-1]) == common.num_actual_tokens <= common.num_tokens
    )
    if ok and num_reqs:
        query_lens = qsl[1:] - qsl[:-1]
        ok = (
            qsl[0] == 0
            and query_lens.min() >= 0
            and (seq >= query_lens).all()
            and -(-int(seq.max()) // block_size) <= common.block_table.shape[1]
            and common.max_query_len >= query_lens.max()
            and common.max_seq_len >= seq.max()
        )
    if not ok:
        _explain(common, block_size)
    if full_validation_enabled():
        common.validate(None)  # the pool's size is not known to a builder
    return dataclasses.replace(common, **fixes) if fixes else common


def _explain_tensor(name: str, t: object, dtype: torch.dtype, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise MetadataError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    raise MetadataError(f"{name}: expected a {rank}-D {dtype} tensor, got {t.dim()}-D {t.dtype}")


def _explain(common: CommonAttentionMetadata, block_size: int) -> None:
    """Raise the MetadataError that names what check_step's fast test found wrong."""
    if common.block_size != block_size:
        raise MetadataError(
            f"block_size: the metadata was built for blocks of {common.block_size} tokens, the "
            f"layer's spec has block_size {block_size} (slots and block-table entries would "
            "address the wrong blocks)"
        )
    qsl = common.query_start_loc_cpu.numpy()
    seq = common.seq_lens_cpu.numpy()
    num_reqs = seq.shape[0]
    if qsl.shape != (num_reqs + 1,):
        raise MetadataError(
            f"query_start_loc_cpu: expected {num_reqs + 1} entries for {num_reqs} requests, "
            f"got {qsl.shape[0]}"
        )
    for name in ("query_start_loc", "seq_lens", "block_table"):
        rows = getattr(common, name).shape[0]
        want = num_reqs + 1 if name == "query_start_loc" else num_reqs
        if rows != want:
            raise MetadataError(f"{name}: expected {want} rows for {num_reqs} requests, got {rows}")
    query_lens = np.diff(qsl)
    if num_reqs:
        if qsl[0] != 0:
            raise MetadataError(f"query_start_loc[0] must be 0, got {qsl[0]}")
        bad = np.flatnonzero(query_lens < 0)
        if bad.size:
            i = int(bad[0])
            raise MetadataError(
                f"query_start_loc must be non-decreasing: query_start_loc[{i}]={qsl[i]} > "
                f"query_start_loc[{i + 1}]={qsl[i + 1]}"
            )
        bad = np.flatnonzero(seq < query_lens)
        if bad.size:
            i = int(bad[0])
            raise MetadataError(
                f"seq_lens[{i}] = {seq[i]} < query_len {query_lens[i]} (request {i}): seq_len "
                "counts context + query tokens"
            )
        width = common.block_table.shape[1]
        bad = np.flatnonzero(-(-seq.astype(np.int64) // block_size) > width)
        if bad.size:
            i = int(bad[0])
            raise MetadataError(
                f"seq_lens[{i}] = {seq[i]} needs {-(-int(seq[i]) // block_size)} blocks of "
                f"{block_size} but block_table rows hold {width} (request {i})"
            )
        if common.max_query_len < query_lens.max() or common.max_seq_len < seq.max():
            raise MetadataError(
                f"max_query_len = {common.max_query_len} / max_seq_len = {common.max_seq_len} "
                f"must bound the step's {int(query_lens.max())} / {int(seq.max())}"
            )
    last = int(qsl[-1]) if num_reqs else 0
    if last != common.num_actual_tokens:
        raise MetadataError(
            f"num_actual_tokens = {common.num_actual_tokens}, expected query_start_loc[-1] = {last}"
        )
    raise MetadataError(
        f"query_start_loc[-1] = {common.num_actual_tokens} scheduled tokens but slot_mapping "
        f"(the token rows) has only {common.num_tokens}"
    )
