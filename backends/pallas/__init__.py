"""JAX Pallas paged attention (in progress)."""
