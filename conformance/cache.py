"""Checks of the KV cache: after writing, the logical K/V hold exactly the written
rows at their slots and nothing else changed (tails and unreferenced blocks keep
their poison); ``copy_blocks`` copies exactly the named blocks. Failure lines
diagnose what a wrong slot holds and whether every write is shifted."""

from __future__ import annotations

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.failure import Failure, describe_exception
from pagedkv.conformance.problem import GARBAGE, PAD_VALUE, PagedProblem
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.kv_write import dequantize_from_cache, quantize_for_cache

# Unreferenced blocks are checked this many at a time, on the cache's device, so
# a pool of more than 32k blocks is never copied to the host whole.
_BLOCKS_PER_CHUNK = 4096


def cache_problems(
    logical: tuple[torch.Tensor, torch.Tensor], problem: PagedProblem
) -> list[Failure]:
    """Why the cache, read through its logical K/V views, does not hold exactly the
    written K/V at their slots with everything else unchanged (empty: it does)."""
    failures: list[Failure] = []
    spec = problem.spec
    k_view, v_view = logical
    views = [("K", k_view, problem.keys, spec.k_scale)]
    if not problem.scenario.is_mla:  # MLA's V is a view of K's storage
        views.append(("V", v_view, problem.values, spec.v_scale))
    referenced = torch.zeros(problem.num_blocks, dtype=torch.bool)
    for ids in problem.block_ids:
        referenced[ids] = True
    for label, view, rows, scale in views:
        stored = [_blocks_of(view, ids) for ids in problem.block_ids]  # [n * bs, H, D] each
        wants = [quantize_for_cache(full, view.dtype, scale) for full in rows]
        for req, ids in enumerate(problem.block_ids):
            if ids:
                found = _request_cache_problem(req, ids, stored, wants, scale, spec.block_size)
                if found:
                    text, fields = found
                    failures.append(
                        Failure(
                            "cache",
                            f"cache {label} of request {req}, {text}",
                            {"tensor": label, "request": req, **fields},
                        )
                    )
                    break
        block = _first_written_unreferenced(view, referenced)
        if block is not None:
            what = (
                "block 0 (the null block)"
                if block == 0
                else f"block {block}, which no request references,"
            )
            failures.append(
                Failure(
                    "cache",
                    f"cache {label}: {what} was written (e.g. a -1 padding slot or a wrong slot)",
                    {"tensor": label, "unreferenced_block": block},
                )
            )
    return failures


def _blocks_of(view: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The rows of blocks ``ids`` in order, on the host (the pool stays on its device)."""
    index = torch.tensor(ids, dtype=torch.int64, device=view.device)
    return view.index_select(0, index).flatten(0, 1).cpu()


def _request_cache_problem(
    req: int,
    ids: list[int],
    stored: list[torch.Tensor],
    wants: list[torch.Tensor],
    scale: float,
    block_size: int,
) -> tuple[str, dict[str, object]] | None:
    """Why request ``req``'s blocks do not hold its K (or V) rows then poison (and the
    facts as fields), or None."""
    mine, want = stored[req], wants[req]
    seq_len = want.shape[0]
    wrong = ~_matches(mine[:seq_len], want, scale).flatten(1).all(dim=1)
    if bool(wrong.any()):
        pos = int(torch.nonzero(wrong)[0, 0])
        what = "does not hold the written value (write_kv wrote the wrong slot or value)"
    else:
        tail = mine[seq_len:]
        changed = (_bits(tail) != _bits(_poison_like(GARBAGE, tail.dtype))).flatten(1).any(dim=1)
        if not bool(changed.any()):
            return None
        pos = seq_len + int(torch.nonzero(changed)[0, 0])
        what = "is past the sequence end but was overwritten"
    holds = _what_it_holds(mine[pos], req, wants, scale)
    block, offset = ids[pos // block_size], pos % block_size
    text = f"position {pos} (block {block}, offset {offset}): {what}; it {holds}"
    shift = _shift_of(stored, wants, scale, block_size)
    if shift:
        text += (
            f"; every written value sits {abs(shift)} slot(s) "
            f"{'after' if shift > 0 else 'before'} its position (the slot is computed off by "
            f"{shift:+d})"
        )
    fields = {
        "seq_len": seq_len,
        "position": pos,
        "block": block,
        "offset": offset,
        "holds": holds,
        "slot_shift": shift or None,
    }
    return text, fields


def _what_it_holds(row: torch.Tensor, req: int, wants: list[torch.Tensor], scale: float) -> str:
    if bool((_bits(row) == _bits(_poison_like(GARBAGE, row.dtype))).all()):
        return "still holds the poison (nothing was written there)"
    value = dequantize_from_cache(row, scale, torch.float64)
    if bool(torch.isnan(value).any()):
        return "holds NaN"
    pad = quantize_for_cache(torch.tensor([PAD_VALUE]), row.dtype, scale)
    if bool((value == dequantize_from_cache(pad, scale, torch.float64)).all()):
        return "holds a padding row (a token with slot -1 was written)"
    for other, want in enumerate(wants):
        same = _matches(row, want, scale).flatten(1).all(dim=1)
        if bool(same.any()):
            pos = int(torch.nonzero(same)[0, 0])
            owner = "" if other == req else f"request {other}, "
            return f"holds the value of {owner}position {pos}"
    return "holds values that were never written"


def _shift_of(
    stored: list[torch.Tensor], wants: list[torch.Tensor], scale: float, block_size: int
) -> int:
    """d when, in every request, position p's value sits at p + d (d = +-1, +-2) wherever
    p and p + d share a block (the next logical block is elsewhere in the pool), else 0."""
    for d in (1, -1, 2, -2):
        compared = 0
        for mine, want in zip(stored, wants, strict=True):
            lo, hi = max(0, -d), min(want.shape[0], mine.shape[0] - d)
            p = torch.arange(lo, max(lo, hi))
            p = p[p // block_size == (p + d) // block_size]
            if not p.numel():
                continue
            if not bool(_matches(mine[p + d], want[p], scale).all()):
                break
            compared += p.numel()
        else:
            if compared >= 2:
                return d
    return 0


def _matches(stored: torch.Tensor, written: torch.Tensor, scale: float) -> torch.Tensor:
    """Elementwise: ``stored`` holds ``written`` (cache dtype; broadcasts). Exact bits,
    except fp8, whose rounding may differ by one step of the format between
    implementations (a step is eps relative, or eps * smallest_normal when subnormal)."""
    if stored.dtype.itemsize != 1:
        return _bits(stored) == _bits(written)
    info = torch.finfo(stored.dtype)
    a = dequantize_from_cache(stored, scale, torch.float64)
    b = dequantize_from_cache(written, scale, torch.float64)
    return (a - b).abs() <= info.eps * (1.01 * b.abs() + info.smallest_normal * scale)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaN compares equal to the same NaN."""
    return t.view(_BITS[t.dtype.itemsize])


def _poison_like(
    value: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    # fill_ on the cache's device, as poison_cache does: a float32 NaN converted to
    # bfloat16 has other bits than a bfloat16 filled with NaN
    return torch.empty(1, dtype=dtype, device=device).fill_(value)


def _first_written_unreferenced(view: torch.Tensor, referenced: torch.Tensor) -> int | None:
    """The first block no request references whose bits are not the NaN poison."""
    nan_bits = _bits(_poison_like(float("nan"), view.dtype, view.device))
    unreferenced = torch.nonzero(~referenced).flatten().to(view.device)
    for chunk in unreferenced.split(_BLOCKS_PER_CHUNK):
        blocks = _bits(view.index_select(0, chunk))
        changed = (blocks != nan_bits).flatten(1).any(dim=1)
        if bool(changed.any()):
            return int(chunk[torch.nonzero(changed)[0, 0]])
    return None


# -- copy_blocks ------------------------------------------------------------------------


def check_copy_blocks(
    backend: AttentionBackend, spec: AttentionSpec, device: torch.device | str
) -> list[str]:
    """``copy_blocks`` copies exactly the named blocks, sources read before any write.

    Block 4 is both a destination and a source, so an implementation that copies
    in place one pair at a time is caught. When the result is what copying along
    another axis of the cache tensor gives, the last line says which axis.
    """
    num_blocks, src, dst = 8, [1, 4, 6], [4, 5, 2]
    kv_cache = backend.allocate_kv_cache(num_blocks, spec, device)
    views = backend.kv_cache_to_logical(kv_cache, spec)
    names = ("K",) if spec.is_mla else ("K", "V")
    gen = torch.Generator().manual_seed(1234)
    for view in views[: len(names)]:
        data = torch.randn(view.shape, generator=gen)
        view.copy_(quantize_for_cache(data, view.dtype, 1.0).to(view.device))
    before = [_bits(v).cpu().clone() for v in views[: len(names)]]
    raw_before = kv_cache.clone()
    try:
        backend.copy_blocks(
            kv_cache, torch.tensor(src, device=device), torch.tensor(dst, device=device)
        )
    except Exception as exc:
        return [f"copy_blocks(src={src}, dst={dst}) raised {describe_exception(exc)}"]
    after = [_bits(v).cpu() for v in backend.kv_cache_to_logical(kv_cache, spec)[: len(names)]]
    problems = []
    source_of = dict(zip(dst, src, strict=True))
    for name, old, new in zip(names, before, after, strict=True):
        for block in range(num_blocks):
            want = old[source_of.get(block, block)]
            if not torch.equal(new[block], want):
                problems.append(
                    f"copy_blocks(src={src}, dst={dst}): block {block} of {name} "
                    + (
                        f"does not equal block {source_of[block]} as it was before the copy "
                        "(all sources must be read before any destination is written)"
                        if block in source_of
                        else "changed although it was not a destination"
                    )
                )
    if problems:
        problems += _copy_axis_hint(raw_before, kv_cache, views[0], src, dst)
    return problems


def _copy_axis_hint(
    before: torch.Tensor,
    after: torch.Tensor,
    logical: torch.Tensor,
    src: list[int],
    dst: list[int],
) -> list[str]:
    """A hint when ``after`` is exactly ``before`` copied src -> dst along an axis of
    the cache tensor that does not index blocks."""
    blocks = [a for a in range(before.dim()) if _is_block_axis(before, logical, a)]
    for axis in range(before.dim()):
        if axis in blocks or before.shape[axis] <= max(src + dst):
            continue
        bits, index = _bits(before), torch.tensor(dst, device=before.device)
        moved = bits.index_copy(axis, index, bits.index_select(axis, index.new_tensor(src)))
        if torch.equal(moved, _bits(after)):
            where = f"axis {blocks[0]}" if blocks else "another axis"
            return [
                f"hint: the cache equals the copy along axis {axis} of the kv_cache tensor "
                f"(shape {tuple(before.shape)}): copy_blocks indexes axis {axis}, but blocks are "
                f"on {where} (AttentionBackend.block_axis)"
            ]
    return []


def _is_block_axis(raw: torch.Tensor, logical: torch.Tensor, axis: int) -> bool:
    """Whether ``axis`` of ``raw`` steps from block to block of its logical K view."""
    return raw.shape[axis] == logical.shape[0] and raw.stride(axis) == logical.stride(0)
