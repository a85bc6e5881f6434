"""Issue 26: does XLA's GPU compiler fuse the dequantization into the GEMM? Checked deviceless.

    make gpu-venv
    JAX_PLATFORMS=cpu PYTHONPATH=. .venv-gpu/bin/python scripts/gpu_quant_fusion.py

For each target (H200, A100), weight format (Q8_0 blocks, per-channel int8, Q4_1 blocks)
and row count M, compiles jaxserve's GPU path of a quantized matmul (`linear.
quantized_matmul(..., native=False)`: the in-graph dequantize + `dot_general` that a
deviceless `jaxserve compile --quantization=...` lowers) for a Llama-3-8B-sized matrix
[N = 4096, K = 4096], bf16 activations, on compile-only devices, and prints:
  temp MiB: the executable's scratch (memory_analysis); a materialised bf16 weight would
    need N * K * 2 bytes = 32 MiB of it;
  materialised: whether that scratch holds the dequantized weight (temp >= its size):
    if not, the GEMM fusion reads the quantized weight itself;
  fusions: XLA's fused computations in the entry (a kLoop fusion before the GEMM that
    writes the weight is the dequantization outside it).
Each case runs in its own process (a compiler abort costs only that case).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

N = K = 4096
CASES = [(t, kind, m) for t in ("h200", "a100") for kind in ("q8_0", "int8", "q4")
         for m in (1, 4, 64)]


def one(target: str, kind: str, m: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxserve.gpu.deviceless import compile_only_devices
    from jaxserve.gpu.targets import load_target
    from jaxserve.model.linear import quantized_matmul
    from jaxserve.model.quant import abstract_quantized

    dev = compile_only_devices(load_target(target), 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    w = abstract_quantized((K, N), kind, key="wq")  # canonical [in, out] -> stored [N, K]
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), w)
    x = jax.ShapeDtypeStruct((m, K), jnp.bfloat16, sharding=sharding)
    fn = jax.jit(lambda x, w: quantized_matmul(x, w, native=False))
    compiled = fn.trace(x, w).lower().compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    fusions = [ln.split("=")[0].strip().lstrip("%") for ln in text.splitlines()
               if " fusion(" in ln and ln.strip().startswith("%")]
    temp = mem.temp_size_in_bytes
    return {"target": target, "kind": kind, "M": m, "temp_mib": round(temp / 2**20, 2),
            "materialised": temp >= N * K * 2, "fusions": fusions,
            "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))}


def main() -> int:
    if len(sys.argv) == 4:
        print(json.dumps(one(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
        return 0
    print(f"{'target':6s} {'weights':7s} {'M':>4s} {'temp MiB':>9s}  materialised  fusions")
    for t, kind, m in CASES:
        p = subprocess.run([sys.executable, __file__, t, kind, str(m)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            print(f"{t:6s} {kind:7s} {m:4d}  FAILED (exit {p.returncode}): "
                  f"{p.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{t:6s} {kind:7s} {m:4d} {r['temp_mib']:9.2f}  {str(r['materialised']):12s}"
              f"  {', '.join(r['fusions'])} {', '.join(r['custom_calls'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
