"""Sampling: `metadata` is the host half (NumPy), `sampler` the device half (jax)."""
