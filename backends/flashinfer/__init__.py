"""FlashInfer paged attention (in progress)."""
