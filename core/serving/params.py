"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.serving.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling.

    ``temperature == 0`` is greedy (argmax; top-k / top-p are then irrelevant).
    Otherwise logits are divided by the temperature, restricted to the ``top_k``
    most likely tokens (0 = all) and to the smallest set whose probability reaches
    ``top_p`` (1.0 = all), and one token is drawn. ``seed`` makes the draws of this
    request reproducible whatever else is in the batch (sample ``i`` of ``n`` uses
    ``seed + i``). ``n > 1`` samples share the prompt's KV blocks (fork +
    copy-on-write). ``return_logits`` keeps the float32 logits row each token was
    drawn from (for tests and conformance).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    return_logits: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        for name in ("n", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        elif self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            problems.append(f"top_k must be an int >= 0 (0 = all tokens), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be an int >= 0 or None, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if problems:
            raise RequestError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
