"""`jaxserve compile --target=h200|h100|a100`: every warm-up program, compiled for a GPU
that is not here, with a report per program.

`compile_for_target` checks the request (a known target, a model that fits its
memory, tiles the kernels can take), builds the plugin venv if needed
(`jaxserve.gpu.venv`), then runs `jaxserve.gpu.deviceless` in that venv's python with
`JAX_PLATFORMS=cpu` (the user sets no variable). The worker compiles the programs in
warm-up order; a process abort (Mosaic for sm_80 is an `LLVM ERROR`, exit 134, not a
Python exception) costs only the program it was compiling: that program is recorded
as failed and a new worker goes on with the rest.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.gpu import venv as gpu_venv
from jaxserve.gpu.targets import GpuTarget, load_target

PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "llama3-8b": ModelConfig.llama3_8b, "smollm2-135m": ModelConfig.smollm2_135m,
    "tiny-d64": lambda **kw: ModelConfig.tiny(head_dim=64, **kw),
    "gemma3-270m": ModelConfig.gemma3_270m}
GIB = 2 ** 30


def model_config_from(name_or_path: str, *, dtype: str) -> ModelConfig:
    """A preset name (`PRESETS`) or an HF `config.json` path -> ModelConfig in `dtype`.

    Raises:
      ValueError: neither a preset nor a readable config.json (listing the presets).
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path](dtype=dtype)
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--model_config={name_or_path!r} is neither a preset "
                         f"({', '.join(PRESETS)}) nor an HF config.json")
    return ModelConfig.from_hf_dict(json.loads(p.read_text()), dtype=dtype)


def memory_need(config: EngineConfig) -> dict[str, int]:
    """Bytes one GPU holds at these flags: weights / TP and the KV pool / TP (the
    sharded layout of `jaxserve.distributed.tensor_parallel`; replicated norms and a
    replicated vocabulary are counted once per GPU where they are replicated)."""
    from jaxserve.model.params import param_shapes
    from jaxserve.worker.kv_cache import kv_bytes_per_block, resolve_num_kv_blocks

    cfg, tp = config.model, config.tensor_parallel_size
    item = np.dtype(np.float32).itemsize if cfg.dtype == "float32" else 2

    def count(d):
        return sum(count(v) if isinstance(v, dict) else int(np.prod(v)) for v in d.values())

    params = count(param_shapes(cfg)) * item
    kv = resolve_num_kv_blocks(config) * kv_bytes_per_block(cfg, config.cache.block_size,
                                                         config.kv_dtype)
    return {"params_bytes": -(-params // tp), "kv_cache_bytes": -(-kv // tp)}


def check_fits(config: EngineConfig, target: GpuTarget) -> dict[str, int]:
    """`memory_need`, or ValueError saying how much is missing on one `target` GPU.
    (Activations and XLA's temporaries come on top: the report's temp bytes.)"""
    need = memory_need(config)
    total = sum(need.values())
    if total > target.memory_bytes:
        raise ValueError(
            f"the model does not fit one {target.device_kind} at these flags: "
            f"{need['params_bytes'] / GIB:.2f} GiB of weights + {need['kv_cache_bytes'] / GIB:.2f} "
            f"GiB of KV cache per GPU = {total / GIB:.2f} GiB > {target.memory_bytes / GIB:.2f} "
            f"GiB; {(total - target.memory_bytes) / GIB:.2f} GiB missing (lower "
            f"--kv_cache_memory_mb / --num_kv_blocks"
            f"{', use bfloat16' if config.model.dtype == 'float32' else ''}, or raise "
            f"--tensor_parallel_size)")
    return need


def worker_env(workdir: Path) -> dict[str, str]:
    """The compile worker's environment: CPU as jax's platform (the plugin then only
    compiles), ptxas's -v report in XLA's log, Mosaic's ptxas reports dumped."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env.update({
        "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0",
        "TF_CPP_VMODULE": "subprocess_compilation=2",
        "XLA_FLAGS": f"{flags} --xla_gpu_ptx_compiler_extra_flags=-v".strip(),
        "MOSAIC_GPU_DUMP_TO": str(workdir / "mosaic"), "MOSAIC_GPU_DUMP_PTXAS": "1",
        # this jaxserve, whichever venv's site-packages hold another copy
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                       env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    return env


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _abort_reason(log: Path, rc: int) -> str:
    tail = log.read_text(errors="replace").splitlines()[-200:] if log.exists() else []
    fatal = [ln for ln in tail if "LLVM ERROR" in ln or ln.startswith(("F1", "E1"))
             or "Error" in ln]
    return f"compile process aborted (rc {rc})" + (f": {fatal[-1].strip()[:300]}" if fatal else "")


def compile_for_target(config: EngineConfig, target: str | GpuTarget, *,
                       executable_cache_dir: str | None = None, workdir: str | None = None,
                       venv: Path | None = None, timeout: float = 3600.0,
                       progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Compile every warm-up program of `config` for `target`, deviceless.

    Returns:
      {"target", "device_kind", "sm", "backend", "layers_per_program", "memory": memory_need,
       "programs": [per-program records of `jaxserve.gpu.report.program_report`, in warm-up
       order], "failed": [{"key", "error"}], "keys": the warm-up keys, "seconds"}.

    Raises:
      ValueError: an unknown target, a model that does not fit it, or a config the
        backend refuses (head_dim / page size it cannot tile; from the worker), all
        before any compile.
      RuntimeError: the plugin venv could not be built, or a worker died before its
        first program.
    """
    tgt = target if isinstance(target, GpuTarget) else load_target(target)
    need = check_fits(config, tgt)
    py = gpu_venv.ensure(venv)
    work = Path(workdir or tempfile.mkdtemp(prefix=f"jaxserve-compile-{tgt.name}-"))
    (work / "mosaic").mkdir(parents=True, exist_ok=True)
    results, log = work / "results.jsonl", work / "compile.log"
    results.unlink(missing_ok=True)
    request = {"config": config, "target": tgt, "results": str(results), "log": str(log),
               "mosaic_dump": str(work / "mosaic"), "skip": [],
               "executable_cache_dir": executable_cache_dir}
    failed: list[dict] = []
    t0 = time.perf_counter()
    while True:
        (work / "request.pkl").write_bytes(pickle.dumps(request))
        seen = len(_read(results))
        with open(log, "ab") as err:
            rc = subprocess.run([str(py), "-m", "jaxserve.gpu.deviceless",
                                 str(work / "request.pkl")], env=worker_env(work),
                                stdout=err, stderr=err, timeout=timeout).returncode
        recs = _read(results)
        for r in recs[seen:]:
            if progress is not None and ("key" in r or "start" in r):
                progress(r)
        if any("error" in r for r in recs[seen:]):
            raise ValueError(next(r["error"] for r in recs[seen:] if "error" in r))
        if rc == 0:
            break
        done = {tuple(r["key"]) for r in recs if "key" in r}
        started = [tuple(r["start"]) for r in recs[seen:] if "start" in r]
        if not started or started[-1] in done:
            raise RuntimeError(f"{_abort_reason(log, rc)} before its first program; log: {log}")
        failed.append({"key": list(started[-1]), "error": _abort_reason(log, rc)})
        request["skip"] = [list(k) for k in done | {tuple(f["key"]) for f in failed}]
    recs = _read(results)
    head = next(r for r in recs if "keys" in r)
    return {"target": tgt.name, "device_kind": tgt.device_kind, "sm": tgt.sm,
            "backend": head["backend"], "layers_per_program": head["layers_per_program"],
            "memory": need, "keys": head["keys"], "failed": failed,
            "programs": [r for r in recs if "key" in r],
            "seconds": round(time.perf_counter() - t0, 1), "workdir": str(work)}
