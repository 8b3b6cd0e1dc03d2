"""pagedkv bench with a CUDA-graph decode grid capped at CAP items per request (the
empty programs' cost): python3 probe/capped.py CAP <bench args>."""
import sys

import pagedkv.backends.triton.builder as builder

cap = int(sys.argv[1])
orig = builder.graph_items
builder.graph_items = lambda layer, plan, max_reqs, num_sms, fit=None: min(
    orig(layer, plan, max_reqs, num_sms, fit), max_reqs * cap
)
from pagedkv.cli import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
