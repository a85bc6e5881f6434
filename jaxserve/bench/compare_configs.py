"""The server configurations `jaxserve bench compare` runs side by side (issue 26).

Users run llama.cpp at its defaults (f16 KV) and on the GGUF file as shipped, not with
F32 weights and an f32 KV cache, so the comparison has every one of them:

  llama.cpp         F32 weights (the requantized file), default KV (f16)
  llama.cpp f32kv   F32 weights, `-ctk f32 -ctv f32` (the first comparison's set-up)
  llama.cpp gguf    the original GGUF file (no requantization), all defaults
  jaxserve          fp32 weights (`--quantization=none`)
  jaxserve gguf     the original file's own quantization kept (`--quantization=auto`)
  jaxserve f16kv, jaxserve gguf f16kv   the same with `--kv_cache_dtype=float16`, the KV
                    element llama.cpp's defaults use (the same bytes of pool); only when
                    named in `--configs`

`PAIRS` says which two configurations a table row compares (jaxserve's over llama.cpp's).
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServerConfig:
    """One configuration: its engine, the weights it loads ("f32": the requantized F32
    file; "gguf": the original) and its extra flags; `kv_bytes` per K or V element;
    `default`: run by `--engines` (else only when named in `--configs`)."""

    engine: str
    weights: str
    flags: tuple[str, ...] = ()
    kv_bytes: int = 4
    default: bool = True


CONFIGS: dict[str, ServerConfig] = {
    "llama.cpp": ServerConfig("llama.cpp", "f32", (), kv_bytes=2),
    "llama.cpp f32kv": ServerConfig("llama.cpp", "f32", ("-ctk", "f32", "-ctv", "f32")),
    "llama.cpp gguf": ServerConfig("llama.cpp", "gguf", (), kv_bytes=2),
    "jaxserve": ServerConfig("jaxserve", "f32", ("--quantization=none",)),
    "jaxserve gguf": ServerConfig("jaxserve", "gguf", ("--quantization=auto",)),
    "jaxserve f16kv": ServerConfig("jaxserve", "f32", ("--quantization=none",
                                                       "--kv_cache_dtype=float16"), 2, False),
    "jaxserve gguf f16kv": ServerConfig("jaxserve", "gguf", ("--quantization=auto",
                                                             "--kv_cache_dtype=float16"), 2, False),
}
# (jaxserve's configuration, llama.cpp's): the rows of the table, goals on their ratio.
PAIRS = (("jaxserve", "llama.cpp"), ("jaxserve gguf", "llama.cpp gguf"),
         ("jaxserve", "llama.cpp f32kv"), ("jaxserve f16kv", "llama.cpp"),
         ("jaxserve gguf f16kv", "llama.cpp gguf"))


def configs_for(engines: str | tuple[str, ...]) -> tuple[str, ...]:
    """--engines (both | llama.cpp | jaxserve) or a tuple of configuration names ->
    the configurations to run, in CONFIGS order.

    Raises:
      ValueError: an unknown configuration name.
    """
    if isinstance(engines, str):
        engines = tuple(n for n, c in CONFIGS.items()
                        if c.default and engines in ("both", c.engine))
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


# llama.cpp rounds the context up to a multiple of 256 (src/llama-context.cpp:
# `cparams.n_ctx = GGML_PAD(cparams.n_ctx, 256)`), so equal capacity is a multiple of it.
LLAMA_CTX_PAD = 256


# ------------------------------------------------------------ KV capacity arithmetic
@dataclass(frozen=True)
class KVPlan:
    """Equal KV capacity: `tokens` in both engines; jaxserve's block count includes the null block."""

    tokens: int
    jaxserve_num_kv_blocks: int
    llama_ctx: int


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int = 4) -> int:
    """K plus V bytes of one token over all layers: 2 * L * K * D * itemsize."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def jaxserve_pool_tokens(kv_cache_mib: int, block_size: int, bytes_per_token: int) -> int:
    """Tokens jaxserve's pool holds under `--kv_cache_memory_mb`: whole blocks, minus the null block.

    Mirrors `worker.kv_cache.resolve_num_kv_blocks` + `describe_capacity`
    (without importing jax). Raises ValueError if the budget holds < 2 blocks.
    """
    blocks = kv_cache_mib * 2**20 // (block_size * bytes_per_token)
    if blocks < 2:
        raise ValueError(f"kv_cache_mib={kv_cache_mib} holds {blocks} blocks of {block_size} "
                         f"tokens x {bytes_per_token} B; need >= 2")
    return (blocks - 1) * block_size


def plan_kv(tokens: int, block_size: int, pad: int = LLAMA_CTX_PAD) -> KVPlan:
    """Round `tokens` up to llama.cpp's context granularity; jaxserve gets the same in blocks.

    Raises:
      ValueError: tokens < 1, or `pad` not a multiple of `block_size`.
    """
    if tokens < 1:
        raise ValueError(f"kv tokens={tokens} must be >= 1")
    if pad % block_size:
        raise ValueError(f"llama.cpp's pad {pad} is not a multiple of block_size={block_size}")
    t = math.ceil(tokens / pad) * pad
    return KVPlan(tokens=t, jaxserve_num_kv_blocks=t // block_size + 1, llama_ctx=t)


def gguf_kv_dims(path: Path) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from a GGUF's metadata (memory-mapped, no weights read)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def get(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    arch = get("general.architecture")
    heads = get(f"{arch}.attention.head_count")
    head_dim = get(f"{arch}.attention.key_length") or get(f"{arch}.embedding_length") // heads
    return int(get(f"{arch}.block_count")), int(get(f"{arch}.attention.head_count_kv")), int(head_dim)
