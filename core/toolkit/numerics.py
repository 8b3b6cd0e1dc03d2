"""Constants every kernel language shares (imports nothing)."""

from __future__ import annotations

# exp(x) == exp2(x * LOG2E): kernels keep scores in the log2 domain and use exp2
LOG2E = 1.4426950408889634
# log(x) == log2(x) * LN2: a base-2 log-sum-exp in the natural base (the merge's)
LN2 = 0.6931471805599453
