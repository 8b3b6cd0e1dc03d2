"""Multi-head latent attention (in progress)."""
