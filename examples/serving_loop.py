"""A miniature serving loop: the KV manager hands out blocks, the step assembler turns
the schedule into metadata, and whichever backend the config string selects runs
attention. Requests share a system prompt, so later ones hit the prefix cache.

    python examples/serving_loop.py                      # default backend (auto)
    PAGEDKV_BACKEND=triton python examples/serving_loop.py   # on a GPU
"""

from __future__ import annotations

import pagedkv
import torch
from pagedkv.kv import KVCacheManager, Request, ScheduledRequest, StepAssembler

NUM_BLOCKS, MAX_MODEL_LEN = 64, 256
SPEC = pagedkv.AttentionSpec(
    num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16
)
SYSTEM_PROMPT = list(range(100, 140))  # 40 tokens: two full blocks shared by every request


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = pagedkv.select_backend(None, SPEC, device)  # $PAGEDKV_BACKEND or auto
    print(f"backend: {backend!r} on {device}, layout {backend.layout}")
    kv_cache = backend.allocate_kv_cache(NUM_BLOCKS, SPEC, device)
    builder, impl = backend.make_builder(SPEC, device), backend.make_impl(SPEC)
    manager = KVCacheManager(NUM_BLOCKS, SPEC.block_size, MAX_MODEL_LEN, enable_prefix_caching=True)
    assembler = StepAssembler(
        SPEC.block_size, max_num_reqs=8, max_model_len=MAX_MODEL_LEN, device=device
    )

    waiting = [Request(f"req{i}", SYSTEM_PROMPT + [i] * (5 + 7 * i)) for i in range(4)]
    running: list[Request] = []
    for step in range(6):
        scheduled = []
        for request in running:  # decode: one new token each
            request.append_output_token_ids(7)
            assert manager.allocate_slots(request, 1) is not None, "pool exhausted"
            new_ids = manager.take_new_block_ids(request.request_id)
            scheduled.append(
                ScheduledRequest(request.request_id, request.num_computed_tokens, 1, new_ids)
            )
        if waiting:  # admit one prefill per step, reusing cached prefix blocks
            request = waiting.pop(0)
            hit_blocks, num_hit = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            assert manager.allocate_slots(request, num_new, num_hit, hit_blocks) is not None
            new_ids = manager.take_new_block_ids(request.request_id)  # hits included
            scheduled.append(ScheduledRequest(request.request_id, num_hit, num_new, new_ids))
            running.append(request)
        common = assembler.build(scheduled)
        num_tokens = common.num_tokens
        q = torch.randn(num_tokens, SPEC.num_heads, SPEC.head_size, device=device, dtype=SPEC.dtype)
        k = torch.randn(
            num_tokens, SPEC.num_kv_heads, SPEC.head_size, device=device, dtype=SPEC.dtype
        )
        v = torch.randn_like(k)
        out = impl.forward(q, k, v, kv_cache, builder.build(common))
        assert torch.isfinite(out[: common.num_actual_tokens]).all()
        for request, s in zip(
            running, scheduled, strict=True
        ):  # same order: decodes, then the prefill
            manager.mark_computed(request, s.num_new_tokens)  # its full blocks become hits
        stats = manager.prefix_cache_stats
        print(
            f"step {step}: {common.num_reqs} requests, {common.num_actual_tokens} tokens "
            f"(max query {common.max_query_len}), free blocks {manager.get_num_free_blocks()}, "
            f"prefix hit rate {stats.hit_rate:.0%}"
        )
    for request in running:
        manager.free(request)
        assembler.remove_request(request.request_id)
    print(f"all freed: {manager.get_num_free_blocks()} free blocks of {NUM_BLOCKS - 1} usable")


if __name__ == "__main__":
    main()
