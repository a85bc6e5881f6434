"""The `jaxserve compile` command: flags -> `compile_for_target` -> report (+ JSON).

    jaxserve compile --target=h200                       # the default SmolLM2, bf16
    jaxserve compile --target=a100 --model_config=llama3-8b --json=/tmp/a100.json
    jaxserve compile --target=h200 --tensor_parallel_size=4 --model_config=path/config.json

Exit status: 0 when every program compiled and no Pallas kernel spills registers,
1 otherwise (a failed program, or a spill: the report names them), 2 for a request
refused before any compile (unknown target, a model that does not fit, a config
the kernels cannot tile).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.gpu.compile import compile_for_target, model_config_from
from jaxserve.gpu.report import format_report, pallas_kernels

# A deviceless compile is for a GPU: its default dtype is the GPU's (bf16), whatever
# the CPU default of `generate` / `serve`.
GPU_DTYPE = "bfloat16"


def model_config(model: str | None, preset: str | None, *, dtype: str) -> ModelConfig:
    """The ModelConfig to compile: `preset` (a name or config.json, no weights), else the
    config of the checkpoint `model` (GGUF header or HF config.json; no tensor is read).

    Raises:
      ValueError / CheckpointError: an unknown preset or unreadable checkpoint.
    """
    if preset:
        return model_config_from(preset, dtype=dtype)
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.checkpoint.gguf_loader import read_gguf_header
    from jaxserve.checkpoint.hf import load_hf_config

    path = resolve_model_path(model)
    if Path(path).is_dir():
        return load_hf_config(path, dtype=dtype)
    return read_gguf_header(path, dtype=dtype)[1]


def run(*, target: str, model: str | None, preset: str | None, dtype: str | None,
        engine_args: dict[str, Any], executable_cache_dir: str | None,
        json_path: str | None) -> int:
    """Compile, print the report, write `json_path`; the exit status (module docstring)."""
    from jaxserve.engine import make_engine_config

    engine_args = dict(engine_args)
    engine_args.pop("dtype", None)
    try:
        cfg = model_config(model, preset, dtype=dtype or GPU_DTYPE)
        config = make_engine_config(cfg, **engine_args)
        print(f"compiling {cfg.num_hidden_layers}-layer {cfg.dtype} model (H/K/D "
              f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}/{cfg.head_dim}) for "
              f"{target} ...", file=sys.stderr)
        rep = compile_for_target(config, target, executable_cache_dir=executable_cache_dir,
                                 progress=_progress)
    except ValueError as e:
        print(f"jaxserve compile: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    if json_path:
        Path(json_path).write_text(json.dumps(rep, indent=1, default=str))
    spills = [k for k in pallas_kernels(rep) if k["spill_bytes"]]
    return 1 if rep["failed"] or spills else 0


def _progress(rec: dict) -> None:
    if "key" in rec:
        print(f"  {'/'.join(map(str, rec['key']))}: {rec['seconds']:.1f} s", file=sys.stderr)
