"""Ragged paged attention as backend objects (see `common.AttentionBackend`).

  common.py         the step's common metadata, the protocol, host tiling
  xla.py            the "xla" backend (jnp + a native decode kernel, the CPU default)
  native_cpu.py     that XLA:CPU FFI decode kernel (native/paged_decode.cc), built on first use
  pallas_triton.py  the "pallas_triton" backend (kernels in jaxserve/pallas/)
  reference.py      float64 NumPy references every backend is tested against
  registry.py       get_attention_backend(name, cfg, block_size=, interpret=)
"""

from jaxserve.attention.common import AttentionBackend, CommonAttentionMetadata
from jaxserve.attention.registry import get_attention_backend

__all__ = ["AttentionBackend", "CommonAttentionMetadata", "get_attention_backend"]
