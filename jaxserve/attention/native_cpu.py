"""A native XLA:CPU paged decode-attention kernel (XLA FFI custom call) for the "xla" backend.

XLA:CPU has no fast way to read a paged KV cache: its gather fusions copy pages at
~3-4 GB/s on one thread and YNNPACK's tiny batched dots run far below peak, so the
jnp decode path (`xla._decode_online`) reads KV at 2-5 GB/s (notes/perf.md). This
module compiles `native/paged_decode.cc` (PagedAttention's page walk, Kwon et al.
2023, with flash-decoding's split over (slot, chunk of pages) tasks, Dao et al. 2023)
into a shared library once per source / compiler / jaxlib / CPU, caches it under
`$JAXSERVE_NATIVE_CACHE` (default `~/.cache/jaxserve/native`), and registers it as
one FFI target per KV cache dtype (`TARGETS`: f32, and the f16 / bf16 caches of
`--kv_cache_dtype`, whose rows the kernel converts to f32 as it reads them) for the
CPU platform.

`available()` is False (with the reason in `unavailable_reason()`) when no C++
compiler is found or the build fails; the backend then keeps the jnp path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.kernels.tiling import window_scalar

log = logging.getLogger(__name__)

TARGET = "jaxserve_paged_decode_f32"
# {cache dtype name: (custom-call target, exported handler symbol)}
TARGETS = {"float32": (TARGET, "JaxservePagedDecodeF32"),
           "float16": ("jaxserve_paged_decode_f16", "JaxservePagedDecodeF16"),
           "bfloat16": ("jaxserve_paged_decode_bf16", "JaxservePagedDecodeBF16")}
CACHE_DTYPES = tuple(TARGETS)
_SRC = Path(__file__).with_name("native") / "paged_decode.cc"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared",
          "-fPIC")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_library(src_path: Path, stem: str) -> Path:
    """Compile one native kernel source into a shared library (or reuse the cached build,
    keyed on source and its `<stem>*.h` headers / compiler / flags / jaxlib / CPU); the
    library's path. Also used by `jaxserve.model.native_qmatmul`.

    Raises:
      RuntimeError: no C++ compiler ($CXX, c++, g++, clang++) or the compile failed.
    """
    cxx = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++")
                if c and shutil.which(c)), None)
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    # the source and the headers beside it (qmatmul.cc includes qmatmul_int.h)
    src = b"\0".join(p.read_bytes() for p in
                      [src_path, *sorted(src_path.parent.glob(f"{stem}*.h"))])
    key = hashlib.sha256(b"\0".join([src, cxx.encode(), " ".join(_FLAGS).encode(),
                                     jax.__version__.encode(), _cpu_flags().encode()]))
    cache = Path(os.environ.get("JAXSERVE_NATIVE_CACHE",
                                Path.home() / ".cache" / "jaxserve" / "native"))
    lib = cache / f"{stem}_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(src_path), "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: concurrent builders each write their own temp file
    return lib


class NativeKernels:
    """One C++ source built once per process (`build_library`) whose exported XLA FFI
    handlers are registered as XLA:CPU custom-call targets. Shared by the decode-attention
    kernel here, `jaxserve.model.native_qmatmul` and `jaxserve.model.native_fmatmul`.

    Args:
      src: the .cc file; stem: the library's file-name stem; targets: {custom-call target
        name: exported handler symbol}; what: the kernels' name in messages.
    """

    def __init__(self, src: Path, stem: str, targets: dict[str, str], what: str):
        self.src, self.stem, self.targets, self.what = src, stem, targets, what
        self._lock = threading.Lock()
        self._state: dict = {}

    def available(self) -> bool:
        """Build (once per process) and register the kernels; False (logged) if impossible."""
        with self._lock:
            if "ok" not in self._state:
                try:
                    lib = ctypes.cdll.LoadLibrary(str(build_library(self.src, self.stem)))
                    for target, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(
                            target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                    self._state.update(ok=True, lib=lib)
                except (RuntimeError, OSError, AttributeError) as e:
                    log.warning("%s unavailable: %s", self.what, e)
                    self._state.update(ok=False, reason=str(e))
            return self._state["ok"]

    def status(self) -> str:
        """"built <library>", "unavailable" or "not tried", without building anything: a
        part of the executable-cache key (a program traced with the kernel cannot run
        where the kernel does not load)."""
        if "ok" not in self._state:
            return "not tried"
        return (f"built {Path(self._state['lib']._name).name}" if self._state["ok"]
                else "unavailable")

    def unavailable_reason(self) -> str | None:
        """Why `available()` returned False (None if it was never called or succeeded)."""
        return self._state.get("reason")

    def call_int64(self, name: str, *args: int, default: int = 0) -> int:
        """The library's exported `int64_t name(int64_t...)` called with `args` (the
        process-wide knobs the kernels' measurements read and set), or `default` where the
        library does not load."""
        if not self.available():
            return default
        fn = getattr(self._state["lib"], name)
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64] * len(args)
        return int(fn(*args))


_KERNELS = NativeKernels(_SRC, "paged_decode", dict(TARGETS.values()),
                         "native CPU decode attention")
available, status, unavailable_reason = (_KERNELS.available, _KERNELS.status,
                                         _KERNELS.unavailable_reason)


def paged_decode(q, kv_len, pages, k_cache, v_cache, layer, *, sm_scale: float,
                 chunk_pages: int, window=None):
    """Decode attention of one query per slot against its KV pages, read in place.

    Args:
      q: [S, K, G, D] queries (cast to f32), G query heads per KV head.
      kv_len: i32[S] keys of each slot (0: not a decode row -> output 0).
      pages: i32[S, P] each slot's page ids into the cache, in [0, N).
      k_cache, v_cache: [L, N, B, K, D] stacked paged caches (one layer: L = 1), both
        float32, float16 or bfloat16 (`CACHE_DTYPES`); 16-bit rows are read as f32.
      layer: i32 scalar, the layer to read.
      sm_scale: softmax scale.
      chunk_pages: pages per (slot, chunk) task of the split over both cores.
      window: i32 scalar (data) or None: a slot sees only its last `window` keys
        (sliding-window attention; pages wholly before them are never read).

    Returns:
      f32[S, K, G, D], softmax(q k^T * sm_scale) v over each slot's first kv_len keys.

    Raises:
      RuntimeError: `available()` is False.
      ValueError: the caches' dtypes differ or are not in `CACHE_DTYPES`.
      (At run time the call fails with an out-of-range error naming the value when
      kv_len exceeds P * B, a used page id is outside [0, N), or layer outside [0, L).)
    """
    if not available():
        raise RuntimeError(f"native CPU decode attention unavailable: {unavailable_reason()}")
    kdt = jnp.dtype(k_cache.dtype).name
    if kdt != jnp.dtype(v_cache.dtype).name or kdt not in TARGETS:
        raise ValueError(f"paged_decode needs k and v caches of one dtype in {CACHE_DTYPES}, "
                         f"got {k_cache.dtype}/{v_cache.dtype}")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGETS[kdt][0], out)(
        q.astype(jnp.float32), kv_len.astype(jnp.int32), pages.astype(jnp.int32), k_cache,
        v_cache, jnp.asarray(layer, jnp.int32).reshape(()), window_scalar(window),
        sm_scale=np.float32(sm_scale),
        chunk_pages=int(chunk_pages))
