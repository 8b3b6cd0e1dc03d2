"""A serving loop on pagedkv's serving layer: a tiny Llama (random weights, no download;
needs pagedkv[models]) answers requests that share a system prompt, one of them
sampled twice, stepped by hand through whichever backend the config selects.

    python examples/serving_loop.py                            # $PAGEDKV_BACKEND or auto
    PAGEDKV_BACKEND=triton python examples/serving_loop.py     # on a GPU
"""

from __future__ import annotations

import torch
from pagedkv.models import ByteTokenizer, load_model
from pagedkv.serving import Engine, EngineConfig, SamplingParams

SYSTEM_PROMPT = "You are a paged KV cache. Blocks are pages. "  # 44 bytes: 2 full blocks


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model("tiny-llama", device=device)
    config = EngineConfig(device=device, num_blocks=64, max_model_len=256)
    engine = Engine(model, config)  # caches of every layer, scheduler, KV manager
    print("\n".join(engine.runner.kv.describe()))
    tokenizer = ByteTokenizer()
    for i, question in enumerate(["What is a block?", "What is a slot?", "Who owns block 0?"]):
        engine.add_request(f"req{i}", tokenizer.encode(SYSTEM_PROMPT + question))
    twice = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=8)
    engine.add_request("twins", tokenizer.encode(SYSTEM_PROMPT + "Fork me."), twice)
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            for sample in out.samples:
                print(f"  {out.request_id} sample {sample.index}: {sample.token_ids}")
        stats = engine.stats
        print(
            f"step {step}: {stats.blocks_in_use} blocks in use, prefix hit rate "
            f"{stats.prefix_hit_rate:.0%}, {stats.scheduler.num_forks} forks, "
            f"{stats.scheduler.num_block_copies} block copies"
        )
        step += 1
    print(f"all freed: {engine.stats.blocks_in_use} blocks in use of {engine.stats.num_blocks}")


if __name__ == "__main__":
    main()
