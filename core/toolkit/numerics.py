"""Constants every kernel language shares (imports nothing)."""

from __future__ import annotations

# exp(x) == exp2(x * LOG2E): kernels keep scores in the log2 domain and use exp2
LOG2E = 1.4426950408889634
