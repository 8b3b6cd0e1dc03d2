"""A small pure-torch decoder for the serving tests (no transformers): it reads and
writes pagedkv caches through StepAttention, and recomputes any sequence densely,
without a cache, as the reference."""

from __future__ import annotations

import pytest
import torch
from pagedkv.serving import AttentionLayer, StepAttention
from pagedkv.spec import AttentionSpec


class TinyDecoder(torch.nn.Module):
    """Embedding + learned positions, ``len(windows)`` attention layers (GQA; the
    window of layer i is ``windows[i]``) with residuals, and a head, in ``dtype``
    (float32 by default; 16-bit for backends that run only those)."""

    def __init__(
        self,
        vocab_size: int = 64,
        hidden: int = 32,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_size: int = 16,
        windows: tuple[int | None, ...] = (None, 6),
        max_positions: int = 256,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.windows = windows
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = torch.nn.Embedding(vocab_size, hidden)
            self.pos = torch.nn.Embedding(max_positions, hidden)
            self.qkv = torch.nn.ModuleList(
                torch.nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_size) for _ in windows
            )
            self.out = torch.nn.ModuleList(
                torch.nn.Linear(num_heads * head_size, hidden) for _ in windows
            )
            self.head = torch.nn.Linear(hidden, vocab_size)
        self.requires_grad_(False)
        self.dtype = dtype
        self.to(dtype)

    def attention_layers(self, block_size: int) -> list[AttentionLayer]:
        return [
            AttentionLayer(
                AttentionSpec(
                    num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size,
                    dtype=self.dtype,
                    block_size=block_size,
                    sliding_window=w,
                )
            )
            for w in self.windows
        ]

    def _split(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv[layer](h).split(
            [
                self.num_heads * self.head_size,
                self.num_kv_heads * self.head_size,
                self.num_kv_heads * self.head_size,
            ],
            dim=-1,
        )
        t = h.shape[0]
        return (
            q.reshape(t, self.num_heads, self.head_size),
            k.reshape(t, self.num_kv_heads, self.head_size),
            v.reshape(t, self.num_kv_heads, self.head_size),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attention: StepAttention,
    ) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos(positions)
        for layer in range(len(self.windows)):
            q, k, v = self._split(layer, h)
            o = attention.forward(layer, q, k, v)
            h = h + self.out[layer](o.reshape(h.shape[0], -1))
        return self.head(h[logits_indices])

    def dense_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one sequence, no cache, dense masks."""
        ids = torch.tensor(tokens)
        t = len(tokens)
        h = self.embed(ids) + self.pos(torch.arange(t))
        group = self.num_heads // self.num_kv_heads
        qpos, kpos = torch.arange(t)[:, None], torch.arange(t)[None, :]
        for layer, window in enumerate(self.windows):
            q, k, v = self._split(layer, h)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.head_size**-0.5
            visible = kpos <= qpos
            if window is not None:
                visible &= qpos - kpos < window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            o = torch.einsum("hqk,khd->qhd", probs, v)
            h = h + self.out[layer](o.reshape(t, -1))
        return self.head(h)


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation, and stall when the
    machine's cores are busy (seen: 16 ms instead of 0.1 ms per einsum)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_first_samples_agree(expected, got, atol: float, rtol: float) -> None:
    """The first sample of each output: logits within the tolerance step by step, up
    to the first token the two runs chose differently (a 16-bit near tie: the later
    steps then see different tokens)."""
    for a, b in zip(expected, got, strict=True):
        pairs = zip(a.samples[0].token_ids, b.samples[0].token_ids, strict=True)
        for step, (x, y) in enumerate(pairs):
            torch.testing.assert_close(
                a.samples[0].logits[step], b.samples[0].logits[step], atol=atol, rtol=rtol
            )
            if x != y:
                break
