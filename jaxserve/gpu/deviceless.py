"""Build a runner's warm-up programs for a GPU that is not here (the compile worker).

Runs inside the plugin venv (`jaxserve.gpu.venv`) with `JAX_PLATFORMS=cpu`, started
by `jaxserve.gpu.compile` (`python -m jaxserve.gpu.deviceless REQUEST.pkl`):

1. `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`
   gives compile-only GPUs (../shared/gpu/NOTES.md 1.4).
2. A real `ModelRunner` is built over them with `DevicelessTensorParallel`: weights
   and KV cache are `jax.ShapeDtypeStruct`s placed on those GPUs (the weights come
   from `abstract_params`, zero-stride NumPy views: no download, no memory), so the
   runner traces, lowers and XLA-compiles exactly the programs a GPU runner of the
   same config would (`ModelRunner.warmup_keys()`, then the placeholder merge of each
   token bucket, key ("merge_placeholders", T), when async scheduling with placeholders
   is on, as it is by default on a GPU), for the target's sm_90a / sm_80, Pallas kernels
   (Triton, Mosaic GPU) and ptxas included.
3. Per program it appends one JSON line to the result file: a "start" record before
   the compile (so a process abort, e.g. an LLVM error, names its program), then the
   report (`jaxserve.gpu.report.program_report`). Compiled programs are stored in the
   executable cache under a key that names the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.distributed.tensor_parallel import TensorParallel, expand_kv_heads, param_specs
from jaxserve.gpu.report import program_report
from jaxserve.gpu.targets import GpuTarget
from jaxserve.model.params import param_shapes
from jaxserve.model.quant import LINEAR_KEYS, TOP_KEYS, abstract_quantized
from jaxserve.worker.executable_cache import ExecutableCache

MERGE = "merge_placeholders"  # the report's key family of `PlaceholderFeed.program`


def compile_only_devices(target: GpuTarget, count: int) -> list:
    """`count` compile-only devices of `target` (one host, one partition).

    Raises:
      RuntimeError: the CUDA plugin is missing or did not register (it needs
        JAX_PLATFORMS=cpu on a machine without a GPU).
    """
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.text,
                                            topology=f"1x1x{count}")
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(f"no deviceless CUDA topology ({type(e).__name__}: {e}); run in the "
                           f"plugin venv (jaxserve.gpu.venv) with JAX_PLATFORMS=cpu") from e
    return list(topo.devices)


def abstract_params(cfg: Any, quantization: str = "auto") -> dict:
    """The canonical parameter tree of `cfg` as zero-stride NumPy views in cfg.dtype:
    every leaf has its real shape and dtype but owns one element of memory, so an
    8B-parameter model is traced and compiled without a download or an allocation.
    With quantization "int8" | "q8_0" | "q4" the matrices are `QuantizedWeight`s of
    zero-stride blocks (`quant.abstract_quantized`), as the engine would place them."""
    dt = np.dtype(jax.numpy.dtype(cfg.dtype))
    one = np.zeros((), dt)

    def leaf(k, x):
        if isinstance(x, dict):
            return leaf_map(x)
        if quantization in ("int8", "q8_0", "q4") and k in LINEAR_KEYS + TOP_KEYS:
            return abstract_quantized(tuple(x), quantization, key=k)
        return np.broadcast_to(one, tuple(x))

    def leaf_map(d):
        return {k: leaf(k, v) for k, v in d.items()}

    return leaf_map(param_shapes(cfg))


class DevicelessTensorParallel(TensorParallel):
    """`TensorParallel` over compile-only GPUs: it places `ShapeDtypeStruct`s, never data.

    With tp = 1 there is no mesh, as for a real one-GPU runner: every leaf is placed
    on the one compile-only device, so the programs are those a GPU runner compiles.

    Args:
      cfg: the model config; tp: tensor_parallel_size (1 x 1 x tp topology).
      devices: `compile_only_devices(target, tp)`; target: names the key parts.
    """

    def __init__(self, cfg: Any, tp: int, *, devices: list, target: GpuTarget):
        super().__init__(cfg, tp, devices=devices)
        self.target = target
        self.key_parts = {"target": target.name, "device_kind": devices[0].device_kind,
                          "device_count": tp, "backend": "gpu", "cpu": "",
                          "platform_version": f"deviceless {target.sm}",
                          "jax_cuda12_plugin": _plugin_version()}

    def single_mesh(self) -> jax.sharding.Mesh:
        """A one-device mesh of the compile-only GPU (tp = 1: Pallas lowers for its kind)."""
        return jax.sharding.Mesh(np.array(self.devices[:1]), ("x",))

    def _single(self) -> Any:
        return jax.sharding.SingleDeviceSharding(self.devices[0])

    def place_params(self, tree: dict, *, alias_host: bool = False) -> dict:
        if self.replicas > 1:  # as the base class, abstractly (no repeated weights in memory)
            layers = tree["layers"]
            expand = lambda lp: jax.eval_shape(  # noqa: E731
                lambda x: expand_kv_heads(self.cfg, x, self.replicas), lp)
            tree = dict(tree, layers=[expand(lp) for lp in layers]
                        if isinstance(layers, (list, tuple)) else expand(layers))
        if self.mesh is None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=self._single()), tree)
        return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=self.sharding(spec)),
                            tree, param_specs(tree, vocab_parallel=self.vocab_parallel))

    def zeros(self, shape: tuple[int, ...], dtype, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self._single())


class _StoreOnlyCache(ExecutableCache):
    """The executable cache, written but never read here: a compile-only client cannot
    load an executable, and `jaxserve compile` always builds its programs fresh."""

    def load(self, parts: dict) -> None:
        return None


def _plugin_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("jax-cuda12-plugin")
    except md.PackageNotFoundError:
        return ""


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Redirect fd 2 (XLA's C++ log: ptxas -v reports) to `path` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def run(request: dict) -> int:
    """Compile every warm-up program of `request["config"]` for `request["target"]`.

    request: {"config": EngineConfig, "target": GpuTarget, "results": path (JSON lines),
    "log": path (the compiler's stderr), "mosaic_dump": dir, "skip": [keys done before a
    process abort], "executable_cache_dir": str | None}. Returns 0, or 2 after an
    "error" record for a config the target or its kernels refuse (before any compile).
    """
    from jaxserve.scheduler.buckets import BucketPolicy
    from jaxserve.worker.model_runner import ModelRunner

    config, target = request["config"], request["target"]
    out = open(request["results"], "a")

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec, default=str) + "\n")
        out.flush()

    tp = config.tensor_parallel_size
    try:
        devices = compile_only_devices(target, tp)
        dtp = DevicelessTensorParallel(config.model, tp, devices=devices, target=target)
        runner = ModelRunner(config, abstract_params(config.model, config.quantization),
                             tensor_parallel=dtp,
                             bucket_policy=BucketPolicy.from_config(config.scheduler))
    except (ValueError, RuntimeError) as e:
        emit({"error": f"{type(e).__name__}: {e}"})
        return 2
    if request.get("executable_cache_dir"):
        runner._exec_cache = _StoreOnlyCache(request["executable_cache_dir"])
    # The placeholder merges (issue 24) a GPU runner builds at warm-up beside the table's
    # programs: async scheduling with placeholders is on by default off CPU.
    merges = [(MERGE, t) for t in runner.bucket_policy.token_buckets] \
        if runner.placeholders_ok() else []
    emit({"backend": runner.backend.name, "keys": runner.warmup_keys() + merges,
          "layers_per_program": runner.group})
    skip = {tuple(k) for k in request.get("skip", ())}
    log, dump = Path(request["log"]), Path(request["mosaic_dump"])
    for key in runner.warmup_keys() + merges:
        if key in skip:
            continue
        emit({"start": key})
        before = {p.name for p in dump.glob("*.ptxas")} if dump.is_dir() else set()
        offset = log.stat().st_size if log.exists() else 0
        t0 = time.perf_counter()
        # Pallas reads the GPU it lowers for from the ambient mesh's device kind.
        with _stderr_to(log), jax.set_mesh(dtp.mesh or dtp.single_mesh()):
            if key[0] == MERGE:
                program = runner.feed.program(key[1])
            else:
                runner.programs.build(key)
                program = runner.programs.programs[key]
        dt = time.perf_counter() - t0
        emit(program_report(key, program, seconds=dt, log=log,
                            log_offset=offset, mosaic_dump=dump, mosaic_before=before))
    return 0


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        sys.exit(run(pickle.load(f)))
