"""Time load_model on a checkpoint and print the params size (numbers for notes/checkpoint.md).

Usage: python scripts/measure_checkpoint_load.py CACHE_DIR DTYPE [PATH]
  run twice with the same CACHE_DIR: the first run is cold (convert + save), the second a cache hit.
"""

import sys
import time

t0 = time.perf_counter()
from jaxserve.checkpoint import load_model  # noqa: E402
from jaxserve.checkpoint.layout import tree_nbytes  # noqa: E402

t_import = time.perf_counter() - t0
cache_dir, dtype = sys.argv[1], sys.argv[2]
path = sys.argv[3] if len(sys.argv) > 3 else None
t = time.perf_counter()
cfg, params, tok = load_model(path, dtype=dtype, cache_dir=cache_dir, progress=False)
print(f"dtype={dtype} load={time.perf_counter() - t:.2f}s import={t_import:.2f}s "
      f"params={tree_nbytes(params) / 2**20:.1f} MiB")
