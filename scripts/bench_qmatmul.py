"""Microbenchmark of the quantized matmul (issue 26): GB/s of weight bytes read at M rows.

For each shape and M, times (min of --reps calls, each jit-compiled once) fp32 XLA
(`x @ w`), the in-graph dequantize + dot path on XLA:CPU, and the native FFI kernel for
"q8" (Q8_0 blocks) and "q4" (Q4_1 blocks). GB/s = the weight's bytes in that format /
time. Prints `uptime` first: the numbers are only as quiet as the machine.

  PYTHONPATH=. .venv/bin/python scripts/bench_qmatmul.py --rows=1,8,64
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from jaxserve.model import linear, quant

SHAPES = {"mlp_up [N=1536, K=576]": (1536, 576), "mlp_down [N=576, K=1536]": (576, 1536),
          "tied head [N=49152, K=576]": (49152, 576)}


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
    a = ap.parse_args()
    print("load:", os.getloadavg())
    rng = np.random.default_rng(0)
    names = list(SHAPES)
    for si in (int(s) for s in a.shapes.split(",")):
        name = names[si]
        n, k = SHAPES[name]
        w = rng.standard_normal((n, k)).astype(np.float32)
        wt = jax.device_put(np.ascontiguousarray(w.T))
        fmts = {"q8": jax.device_put(quant.quantize_q8(w)), "q4": jax.device_put(quant.quantize_q4(w))}
        f32 = jax.jit(lambda x, w: x @ w)
        nat = jax.jit(lambda x, w: linear.quantized_matmul(x, w, native=True))
        deq = jax.jit(lambda x, w: linear.quantized_matmul(x, w, native=False))
        for m in (int(r) for r in a.rows.split(",")):
            x = jax.device_put(rng.standard_normal((m, k)).astype(np.float32))
            t = _time(f32, x, wt, reps=a.reps)
            row = [f"fp32 XLA {t * 1e3:7.3f} ms {w.nbytes / t / 1e9:5.1f} GB/s"]
            for kind, qw in fmts.items():
                for label, fn in (("native", nat), ("XLA dequant", deq)):
                    t = _time(fn, x, qw, reps=a.reps)
                    row.append(f"{kind} {label} {t * 1e3:7.3f} ms {qw.nbytes / t / 1e9:5.1f} GB/s")
            print(f"{name} M={m}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
