"""FlashAttention paged attention (in progress)."""
