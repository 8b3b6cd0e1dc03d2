"""CommonAttentionMetadata: one scheduler step, described the same way for every backend."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.errors import MetadataError
from pagedkv.intmath import cdiv, is_int
from pagedkv.slots import compute_slot_mapping


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """The batch of one step, backend-neutral. B requests, T (possibly padded) tokens.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they
    are the last ``query_len`` positions of its ``seq_lens[i]`` tokens (context +
    query), so query row ``j`` sits at absolute position
    ``seq_lens[i] - query_len + j``. Rows ``num_actual_tokens:T`` are padding.
    """

    query_start_loc: torch.Tensor  # [B+1] int32, device; 0, non-decreasing
    seq_lens: torch.Tensor  # [B] int32, device; context + query tokens per request
    block_table: torch.Tensor  # [B, max_blocks] int32, device; physical block per logical block
    slot_mapping: torch.Tensor  # [T] int64, device; cache slot per token, < 0 = padding
    num_actual_tokens: int  # real tokens; query_start_loc[-1]
    max_query_len: int  # an upper bound of the longest query
    max_seq_len: int  # an upper bound of the longest sequence
    query_start_loc_cpu: torch.Tensor  # [B+1] int32, CPU copy
    seq_lens_cpu: torch.Tensor  # [B] int32, CPU copy
    block_size: int  # tokens per block; the unit of block_table entries

    # -- derived views ------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    # read by every layer's forward: found once (the fields of a frozen step never change)
    @functools.cached_property
    def num_tokens(self) -> int:
        """T, padded token count (rows of query/key/value/output)."""
        return self.slot_mapping.shape[0]

    @functools.cached_property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        """Tokens already in the cache before this step (num_computed_tokens)."""
        return self.seq_lens_cpu - self.query_lens_cpu

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_requests(
        cls,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        num_tokens: int | None = None,
        max_blocks_per_req: int | None = None,
    ) -> CommonAttentionMetadata:
        """Build a step from per-request (seq_len, query_len, physical block ids).

        ``num_tokens`` pads T (extra slots are -1); ``max_blocks_per_req`` widens the
        block table (unused entries point at the null block 0).
        """
        if not (is_int(block_size) and block_size > 0):
            raise MetadataError(f"block_size must be a positive int, got {block_size!r}")
        if not (len(seq_lens) == len(query_lens) == len(block_ids)):
            raise MetadataError(
                f"seq_lens, query_lens and block_ids must have one entry per request, got "
                f"{len(seq_lens)}, {len(query_lens)}, {len(block_ids)}"
            )
        for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
            if q < 0 or s < q:
                raise MetadataError(
                    f"request {i}: need 0 <= query_len <= seq_len, got query_len={q}, seq_len={s}"
                )
            need = cdiv(s, block_size)
            if len(block_ids[i]) < need:
                raise MetadataError(
                    f"block_ids[{i}]: seq_len {s} needs {need} blocks of {block_size}, got "
                    f"{len(block_ids[i])}"
                )
        num_reqs = len(seq_lens)
        width = max([len(b) for b in block_ids] + [1, max_blocks_per_req or 0])
        table = np.zeros((num_reqs, width), dtype=np.int32)
        for i, ids in enumerate(block_ids):
            table[i, : len(ids)] = ids
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(np.asarray(query_lens, dtype=np.int64))
        seq_np = np.asarray(seq_lens, dtype=np.int32).reshape(num_reqs)
        slots = compute_slot_mapping(table, qsl, seq_np, block_size, num_tokens)
        return cls.from_numpy(qsl, seq_np, table, slots, block_size, device)

    @classmethod
    def from_numpy(
        cls,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> CommonAttentionMetadata:
        """Wrap host arrays; the device tensors are copies on ``device``."""
        qsl_cpu = torch.from_numpy(np.ascontiguousarray(query_start_loc, dtype=np.int32))
        seq_cpu = torch.from_numpy(np.ascontiguousarray(seq_lens, dtype=np.int32))
        query_lens = np.diff(query_start_loc)
        return cls(
            query_start_loc=qsl_cpu.to(device),
            seq_lens=seq_cpu.to(device),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table, dtype=np.int32)).to(
                device
            ),
            slot_mapping=torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64)).to(
                device
            ),
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(np.max(seq_lens, initial=0)),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
            block_size=block_size,
        )

    # -- validation ---------------------------------------------------------------

    def validate(self, num_blocks: int | None) -> None:
        """Check every invariant against a pool of ``num_blocks`` blocks (None: the pool's
        size is not known, so block ids and slots are bounded below only).

        Raises MetadataError naming the field, the request (or token) and what was
        expected; among them, a scheduled token mapped into block 0, the null block
        (context entries may be 0). Costs a device->host copy: a debugging and test tool, not for the
        hot path.
        """
        _check_tensor("query_start_loc_cpu", self.query_start_loc_cpu, torch.int32, 1, "cpu")
        _check_tensor("seq_lens_cpu", self.seq_lens_cpu, torch.int32, 1, "cpu")
        device = self.slot_mapping.device
        _check_tensor("query_start_loc", self.query_start_loc, torch.int32, 1, device)
        _check_tensor("seq_lens", self.seq_lens, torch.int32, 1, device)
        _check_tensor("block_table", self.block_table, torch.int32, 2, device)
        _check_tensor("slot_mapping", self.slot_mapping, torch.int64, 1, device)
        if self.block_size <= 0:
            raise MetadataError(f"block_size must be positive, got {self.block_size}")
        num_reqs = self.seq_lens_cpu.shape[0]
        for name, t, n in (
            ("query_start_loc", self.query_start_loc_cpu, num_reqs + 1),
            ("query_start_loc", self.query_start_loc, num_reqs + 1),
            ("seq_lens", self.seq_lens, num_reqs),
            ("block_table", self.block_table, num_reqs),
        ):
            if t.shape[0] != n:
                raise MetadataError(
                    f"{name}: expected {n} rows for {num_reqs} requests, got shape {tuple(t.shape)}"
                )
        qsl = self.query_start_loc_cpu.numpy().astype(np.int64)
        seq = self.seq_lens_cpu.numpy().astype(np.int64)
        if not torch.equal(self.query_start_loc.cpu(), self.query_start_loc_cpu):
            raise MetadataError("query_start_loc: device tensor differs from query_start_loc_cpu")
        if not torch.equal(self.seq_lens.cpu(), self.seq_lens_cpu):
            raise MetadataError("seq_lens: device tensor differs from seq_lens_cpu")
        if qsl[0] != 0:
            raise MetadataError(f"query_start_loc[0] must be 0, got {qsl[0]}")
        query_lens = np.diff(qsl)
        for i in np.flatnonzero(query_lens < 0)[:1]:
            raise MetadataError(
                f"query_start_loc must be non-decreasing: request {i} has "
                f"query_start_loc[{i}]={qsl[i]} > query_start_loc[{i + 1}]={qsl[i + 1]}"
            )
        for i in np.flatnonzero(seq < query_lens)[:1]:
            raise MetadataError(
                f"seq_lens[{i}] = {seq[i]} < query_len {query_lens[i]} (request {i}): "
                "seq_len counts context + query tokens, so it must be >= query_len"
            )
        if qsl[-1] != self.num_actual_tokens:
            raise MetadataError(
                f"num_actual_tokens = {self.num_actual_tokens}, expected query_start_loc[-1] = {qsl[-1]}"
            )
        if self.num_actual_tokens > self.num_tokens:
            raise MetadataError(
                f"num_actual_tokens = {self.num_actual_tokens} exceeds slot_mapping length {self.num_tokens}"
            )
        if num_reqs and self.max_query_len < query_lens.max():
            i = int(query_lens.argmax())
            raise MetadataError(
                f"max_query_len = {self.max_query_len} < query_len {query_lens[i]} of request {i}"
            )
        if num_reqs and self.max_seq_len < seq.max():
            i = int(seq.argmax())
            raise MetadataError(f"max_seq_len = {self.max_seq_len} < seq_lens[{i}] = {seq[i]}")
        table = self.block_table.cpu().numpy().astype(np.int64)
        blocks_needed = -(-seq // self.block_size)
        for i in np.flatnonzero(blocks_needed > table.shape[1])[:1]:
            raise MetadataError(
                f"block_table is {table.shape[1]} blocks wide but request {i} (seq_len {seq[i]}, "
                f"block_size {self.block_size}) needs {blocks_needed[i]}"
            )
        used = np.arange(table.shape[1])[None, :] < blocks_needed[:, None]
        bad = used & (table < 0 if num_blocks is None else (table < 0) | (table >= num_blocks))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise MetadataError(
                f"block_table[{i}, {j}] = {table[i, j]} (request {i}) is out of range: expected "
                + ("a block id >= 0" if num_blocks is None else f"a block id in [0, {num_blocks})")
            )
        self._validate_slots(table, qsl, seq, num_blocks)

    def _validate_slots(
        self, table: np.ndarray, qsl: np.ndarray, seq: np.ndarray, num_blocks: int | None
    ) -> None:
        slots = self.slot_mapping.cpu().numpy()
        expected = compute_slot_mapping(table, qsl, seq, self.block_size, self.num_tokens)
        actual = slots[: self.num_actual_tokens]
        if num_blocks is None:
            out_of_range, wanted = actual < 0, "a slot >= 0"
        else:
            num_slots = num_blocks * self.block_size
            out_of_range = (actual < 0) | (actual >= num_slots)
            wanted = f"a slot in [0, {num_slots})"
        for t in np.flatnonzero(out_of_range)[:1]:
            raise MetadataError(
                f"slot_mapping[{t}] = {actual[t]} (request {_request_of(qsl, t)}) is out of range: "
                f"expected {wanted} for a scheduled token"
            )
        # Block 0 is the null block: padding shared by every table, never a request's.
        for t in np.flatnonzero(actual < self.block_size)[:1]:
            raise MetadataError(
                f"slot_mapping[{t}] = {actual[t]} (request {_request_of(qsl, t)}) is in block 0, "
                f"the null block: expected a slot >= block_size {self.block_size} for a "
                "scheduled token (block 0 pads every block table)"
            )
        for t in np.flatnonzero(expected[: self.num_actual_tokens] < self.block_size)[:1]:
            i = _request_of(qsl, t)
            j = (seq[i] - (qsl[i + 1] - t)) // self.block_size
            raise MetadataError(
                f"block_table[{i}, {j}] = 0 (request {i}) is the null block, but scheduled "
                f"token {t} is written there: expected a real block id (>= 1)"
            )
        for t in np.flatnonzero(actual != expected[: self.num_actual_tokens])[:1]:
            raise MetadataError(
                f"slot_mapping[{t}] = {actual[t]} (request {_request_of(qsl, t)}) disagrees with "
                f"block_table: expected {expected[t]}"
            )
        for t in np.flatnonzero(slots[self.num_actual_tokens :] >= 0)[:1]:
            t += self.num_actual_tokens
            raise MetadataError(
                f"slot_mapping[{t}] = {slots[t]} is a padding token (>= num_actual_tokens "
                f"{self.num_actual_tokens}): expected a negative slot"
            )


def _request_of(query_start_loc: np.ndarray, token: int) -> int:
    return int(np.searchsorted(query_start_loc, token, side="right") - 1)


def _check_tensor(name: str, t: object, dtype: torch.dtype, ndim: int, device: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise MetadataError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise MetadataError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise MetadataError(f"{name}: expected {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != torch.device(device):
        raise MetadataError(f"{name}: expected on {device}, got {t.device}")
