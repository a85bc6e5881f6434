"""The server configurations `jaxserve bench compare` runs side by side (issue 26).

Users run llama.cpp at its defaults (f16 KV) and on the GGUF file as shipped, not with
F32 weights and an f32 KV cache, so the comparison has every one of them:

  llama.cpp         F32 weights (the requantized file), default KV (f16)
  llama.cpp f32kv   F32 weights, `-ctk f32 -ctv f32` (the first comparison's set-up)
  llama.cpp gguf    the original GGUF file (no requantization), all defaults
  jaxserve          fp32 weights (`--quantization=none`)
  jaxserve gguf     the original file's own quantization kept (`--quantization=auto`)

`PAIRS` says which two configurations a table row compares (jaxserve's over llama.cpp's).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServerConfig:
    """One configuration: its engine, the weights it loads ("f32": the requantized F32
    file; "gguf": the original) and its extra flags; `kv_bytes` per K or V element."""

    engine: str
    weights: str
    flags: tuple[str, ...] = ()
    kv_bytes: int = 4


CONFIGS: dict[str, ServerConfig] = {
    "llama.cpp": ServerConfig("llama.cpp", "f32", (), kv_bytes=2),
    "llama.cpp f32kv": ServerConfig("llama.cpp", "f32", ("-ctk", "f32", "-ctv", "f32")),
    "llama.cpp gguf": ServerConfig("llama.cpp", "gguf", (), kv_bytes=2),
    "jaxserve": ServerConfig("jaxserve", "f32", ("--quantization=none",)),
    "jaxserve gguf": ServerConfig("jaxserve", "gguf", ("--quantization=auto",)),
}
# (jaxserve's configuration, llama.cpp's): the rows of the table, goals on their ratio.
PAIRS = (("jaxserve", "llama.cpp"), ("jaxserve gguf", "llama.cpp gguf"),
         ("jaxserve", "llama.cpp f32kv"))


def configs_for(engines: str | tuple[str, ...]) -> tuple[str, ...]:
    """--engines (both | llama.cpp | jaxserve) or a tuple of configuration names ->
    the configurations to run, in CONFIGS order.

    Raises:
      ValueError: an unknown configuration name.
    """
    if isinstance(engines, str):
        engines = tuple(CONFIGS) if engines == "both" else tuple(
            n for n, c in CONFIGS.items() if c.engine == engines)
    bad = [n for n in engines if n not in CONFIGS]
    if bad:
        raise ValueError(f"unknown configuration(s) {bad}; known: {list(CONFIGS)}")
    return tuple(n for n in CONFIGS if n in engines)


def server_command(name: str, args: argparse.Namespace, num_seqs: int, plan: Any,
                   port: int) -> list[str]:
    """The command line of configuration `name`'s server for N = num_seqs sequences and
    the KV plan (`compare.KVPlan`): equal capacity in tokens in every configuration. A
    reused llama-server (--reuse_server, cold cases) gets a --slot-save-path directory,
    created here under --out_dir."""
    cfg = CONFIGS[name]
    if cfg.engine == "llama.cpp":
        model = args.f32_model if cfg.weights == "f32" else args.model
        cold: list[str] = []
        if getattr(args, "reuse_server", False) and not getattr(args, "warm_cases", False):
            # `compare.make_cold` erases the slots between cases (POST /slots/N?action=erase),
            # which llama-server refuses (501) without an existing --slot-save-path directory
            slots = Path(args.out_dir) / "llama_slots"
            slots.mkdir(parents=True, exist_ok=True)
            cold = ["--slot-save-path", str(slots)]
        return [str(args.llama_server), "-m", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--parallel", str(num_seqs), "-kvu",
                "-c", str(plan.llama_ctx), "-t", "2", "-tb", "2", *cfg.flags, *cold,
                "--no-webui"]
    # jaxserve dequantizes the original file for fp32 (the same weights as llama.cpp's F32
    # requantization of it), or keeps its blocks. --warmup=full: a server that compiles its
    # programs otherwise reports ready after the small buckets and compiles the rest in the
    # background, beside the case being measured (seed8 ran at 65 tok/s against 80-84
    # restored, and a mean TTFT of 2.24 s against 0.83). A --warmup in --jaxserve_cmd or
    # --jaxserve_extra is kept instead (the extras come last; absl keeps a flag's last value).
    cmd = shlex.split(args.jaxserve_cmd)
    named = any(f.lstrip("-").split("=")[0] == "warmup" for f in [*cmd, *args.jaxserve_extra])
    warm = [] if named else ["--warmup=full"]
    return [*cmd, f"--model={args.model}", "--host=127.0.0.1",
            f"--port={port}", f"--max_num_seqs={num_seqs}",
            f"--num_kv_blocks={plan.jaxserve_num_kv_blocks}", f"--block_size={args.block_size}",
            *cfg.flags, *warm, *args.jaxserve_extra]
