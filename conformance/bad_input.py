"""Bad input: a valid step with one argument broken must raise a ``PagedKVError`` that
names what is wrong, before the cache changes (the check ``bad-input``).

Compiled kernels take tensors as bare addresses: a step whose lengths overrun its
block table, a slot in the null block or a query of the wrong shape is read or
written out of bounds, silently, unless something checks it first. The contract's
``build`` (``pagedkv.step_check``) and ``forward`` check every step; a backend that
overrides them, or plans from a field before the check sees it, loses that. Each
breakage here is one field of the step's metadata or one ``forward`` argument; the
two that only a device read finds (a slot in the null block, a block id past the
pool) run with ``PAGEDKV_VALIDATE=1``, as a debug run would; the others without it,
whatever the environment says, so that the cheap checks alone must catch them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.check import write_context
from pagedkv.conformance.design import scenario_problems
from pagedkv.conformance.failure import describe_exception
from pagedkv.conformance.problem import build_problem
from pagedkv.conformance.scenario import Scenario
from pagedkv.errors import PagedKVError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.step_check import full_validation


@dataclass(frozen=True)
class Breakage:
    what: str  # the broken field, in words
    names: str  # what the error must name (the field)
    needs_validation: bool = False  # only PAGEDKV_VALIDATE=1's device read finds it


def metadata_breakages(
    common: CommonAttentionMetadata, block_size: int
) -> Iterator[tuple[Breakage, CommonAttentionMetadata]]:
    """Every way to break one field of ``common`` (a valid step of ``block_size``) that
    this step allows: (the breakage, the broken metadata)."""
    replace = dataclasses.replace
    yield Breakage("block size", "block_size"), replace(common, block_size=block_size * 2)
    query_lens = common.query_lens_cpu
    seq = common.seq_lens_cpu
    if common.num_actual_tokens:
        i = int(torch.nonzero(query_lens)[0])
        shorter = seq.clone()
        shorter[i] = int(query_lens[i]) - 1
        yield Breakage("seq_len < query_len", "seq_lens"), replace(common, seq_lens_cpu=shorter)
        fewer_rows = common.slot_mapping[: common.num_actual_tokens - 1]
        yield Breakage("token rows", "slot_mapping"), replace(common, slot_mapping=fewer_rows)
        slots = common.slot_mapping.clone()
        slots[0] = 1  # a slot of block 0, the null block
        null_slot = Breakage("slot in the null block", "slot_mapping", needs_validation=True)
        yield null_slot, replace(common, slot_mapping=slots)
    if common.num_reqs > 1:
        qsl = common.query_start_loc_cpu.clone()
        qsl[1] = qsl[2] + 1
        order = Breakage("query_start_loc order", "query_start_loc")
        yield order, replace(common, query_start_loc_cpu=qsl)
    if common.num_reqs:
        i = int(seq.argmax())
        grown = seq.clone()
        grown[i] = common.block_table.shape[1] * block_size + 1
        past_row = Breakage("seq_len past its row", "block_table")
        yield past_row, replace(common, seq_lens_cpu=grown, max_seq_len=int(grown[i]))
        if int(seq[i]):
            table = common.block_table.clone()
            table[i, 0] = 10_000
            past_pool = Breakage("block id past the pool", "block_table", needs_validation=True)
            yield past_pool, replace(common, block_table=table)


# forward's arguments: query, key, value, kv_cache, output
Args = dict[str, Any]


def argument_breakages(args: Args, is_mla: bool) -> Iterator[tuple[Breakage, Args]]:
    """Every way to break one ``forward`` argument of a valid call: (the breakage, the
    arguments)."""
    query, key, cache, output = args["query"], args["key"], args["kv_cache"], args["output"]
    other = torch.float16 if query.dtype != torch.float16 else torch.float32
    yield Breakage("query heads", "query"), {**args, "query": torch.cat([query, query], 1)}
    yield Breakage("query dtype", "query"), {**args, "query": query.to(other)}
    yield Breakage("output rows", "output"), {**args, "output": output[:-1]}
    yield Breakage("key rows", "key"), {**args, "key": key[:-1]}
    if is_mla:
        yield Breakage("a value for a latent cache", "value"), {**args, "value": key.clone()}
    else:
        yield Breakage("key without value", "value"), {**args, "value": None}
    yield Breakage("cache dtype", "kv_cache"), {**args, "kv_cache": cache.view(torch.uint8)}
    narrower = cache[..., :-1]  # one value short of the head, a strided view
    yield Breakage("cache shape", "kv_cache"), {**args, "kv_cache": narrower}


def bad_input_problems(backend: AttentionBackend, base: Scenario, device: str) -> list[str]:
    """Each breakage of a valid mixed step on ``base``'s layer: problems where the call
    was accepted, raised something other than a ``PagedKVError`` (a traceback from deep
    inside), raised one that does not name the field, or changed the cache."""
    b = base.block_size
    mixed = base.replace(
        name="bad-input", seq_lens=(2 * b + 3, 5, b), query_lens=(1, 5, 3), num_padding_tokens=1
    )
    scenario = base if scenario_problems(backend, mixed, device) else mixed
    problem = build_problem(scenario, device)
    spec = problem.spec
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
    impl = backend.make_impl(spec, sinks=problem.sinks)
    builder = backend.make_builder(spec, device)
    write_context(impl, builder, cache, problem)
    rows = problem.common.num_tokens
    args: Args = dict(
        query=problem.query,
        key=problem.new_key,
        value=problem.new_value,
        kv_cache=cache,
        output=problem.query.new_empty(rows, spec.num_heads, spec.head_size_v),
    )

    def forward(common: CommonAttentionMetadata, call: Args) -> None:
        metadata = builder.build(common)
        impl.forward(
            call["query"], call["key"], call["value"], call["kv_cache"], metadata, call["output"]
        )

    problems = []
    cases: list[tuple[Breakage, Callable[[], None]]] = [
        (broken, lambda common=common: forward(common, args))
        for broken, common in metadata_breakages(problem.common, spec.block_size)
    ]
    cases += [
        (broken, lambda call=call: forward(problem.common, call))
        for broken, call in argument_breakages(args, spec.is_mla)
    ]
    if not isinstance(builder.build(problem.common), CommonAttentionMetadata):
        # the step itself where its built metadata belongs (``forward(..., common)``, the
        # build forgotten): its fields are not the backend's, read from inside a kernel
        # call they fail with an AttributeError or are misread
        unbuilt = Breakage("the step's CommonAttentionMetadata, not built", "metadata")
        unbuilt_args = (*(args[k] for k in ("query", "key", "value", "kv_cache")), problem.common)
        cases.append((unbuilt, lambda: impl.forward(*unbuilt_args, args["output"])))
    for broken, call in cases:
        before = cache.view(torch.uint8).clone()
        with full_validation(broken.needs_validation):
            outcome = _outcome(call, broken)
        if outcome:
            problems.append(f"{broken.what}: {outcome}")
        if not torch.equal(cache.view(torch.uint8), before):
            problems.append(f"{broken.what}: the cache changed before the error")
            cache.view(torch.uint8).copy_(before)
    return problems


def _outcome(call: Callable[[], None], broken: Breakage) -> str | None:
    """None when ``call`` raised a PagedKVError naming the field; else what happened."""
    try:
        call()
    except PagedKVError as exc:
        if broken.names not in str(exc):
            return f"the error does not name {broken.names}: {describe_exception(exc)}"
        return None
    except Exception as exc:
        return (
            f"raised {describe_exception(exc)}, not a PagedKVError naming {broken.names} "
            "(a check before the kernel would say what is wrong)"
        )
    return f"accepted (expected a PagedKVError naming {broken.names})"
