"""Triton paged attention (in progress)."""
