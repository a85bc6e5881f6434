"""Registers and spills of every attention-kernel configuration the engine can pick on
H200 and A100 (issue 25 item 4), compiled deviceless (`jaxserve.gpu.compile`).

One 1-layer model per (head_dim, dtype) with Gp = 4 query heads per KV head (SmolLM2
9/3 and Llama-3 32/8 both pad to 4), buckets T = 8 (decode tiles: T <= 2 S) and T = 64
(prefill tiles) over S = 4, for Mosaic on H200 and Triton on H200 and A100.

    .venv/bin/python scripts/gpu_kernel_matrix.py --out=/tmp/matrix.json [--head_dims=64,128]

Prints one line per kernel: target, backend, dtype, D, kernel, registers, spill bytes;
a configuration the engine refuses before compiling (e.g. Mosaic at f32 x d128) is one
"refused" line. Exit status 1 when any Pallas kernel spills or a program fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxserve.config import ModelConfig
from jaxserve.engine import make_engine_config
from jaxserve.gpu.compile import compile_for_target
from jaxserve.gpu.report import pallas_kernels

CASES = (("h200", "pallas_mosaic"), ("h200", "pallas_triton"), ("a100", "pallas_triton"))


def case_config(head_dim: int, dtype: str, backend: str, *, block_size: int = 16):
    cfg = ModelConfig.tiny(head_dim=head_dim, num_attention_heads=8, num_key_value_heads=2,
                           num_hidden_layers=1, dtype=dtype)
    return make_engine_config(cfg, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                              token_buckets=(8, 64), seq_buckets=(4,), num_kv_blocks=64,
                              block_size=block_size, attention_backend=backend,
                              enable_prompt_logprobs=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--head_dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--cases", default=",".join(f"{t}:{b}" for t, b in CASES))
    a = ap.parse_args(argv)
    rows = []
    for case in a.cases.split(","):
        target, backend = case.split(":")
        for d in map(int, a.head_dims.split(",")):
            for dtype in a.dtypes.split(","):
                n = len(rows)
                try:
                    rep = compile_for_target(case_config(d, dtype, backend), target)
                except ValueError as e:  # refused before any compile: the choice is recorded
                    rows.append({"target": target, "backend": backend, "dtype": dtype,
                                 "head_dim": d, "refused": str(e)})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                for f in rep["failed"]:
                    rows.append({"target": target, "backend": backend, "dtype": dtype,
                                 "head_dim": d, "program": "/".join(map(str, f["key"])),
                                 "error": f["error"]})
                for k in pallas_kernels(rep):
                    if k["kernel"].startswith("ragged_paged_attention"):
                        rows.append({"target": target, "backend": backend, "dtype": dtype,
                                     "head_dim": d, **k})
                for r in rows[n:]:
                    print(json.dumps({x: r.get(x) for x in ("target", "backend", "dtype",
                          "head_dim", "program", "kernel", "registers", "spill_bytes",
                          "error")}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r.get("spill_bytes") or r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
