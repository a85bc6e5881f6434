"""Adapters from jaxserve to other JAX libraries; each is optional (its own extra)."""
