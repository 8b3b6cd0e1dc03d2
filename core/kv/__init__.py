"""The memory side of PagedAttention (in progress)."""
