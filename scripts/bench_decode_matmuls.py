"""Decode-sized matmuls with the weights streamed from memory, as in a decode step (issue 26).

Each product in a chain reads a different weight (dozens of them, more than the caches
hold), so a product costs what it costs inside a step, not what a warm-cache loop says
(`scripts/bench_qmatmul.py` times one weight again and again). Three tables, each variant
interleaved with the others in one process, medians of --reps:

  quant  the native quantized kernel's integer-dot path against its f32-activation
         kernels at M rows (`native_qmatmul.set_int_rows`: 64 puts every M on the
         integer path, 0 none: the direct path at M <= 2, the f32 panel above), on
         SmolLM2's Q4 layer shapes, fused (q|k|v, gate|up) and not, and (--q8_head) the
         tied Q8_0 head [49152, 576], whose integer path stops at 4 rows (VNNI) or 8
         (AVX2) whatever `set_int_rows` says: past that both columns are f32. This chose
         the q4 cuts, 16 on VNNI and 8 on AVX2 (notes/issue26.md).
  float  30 layers' worth of SmolLM2's fp32 matrices [K, N] (425 MB): XLA's dot against
         the native "kn" kernel serial, threaded, and as shipped
         (`native_fmatmul.set_kn_serial_bytes`). This chose `linear.FLOAT_NATIVE_MAX_ROWS`.
  stream the fp32 kernel's streaming orders against its register tiles alone
         (`native_fmatmul.set_stream_order`; the same bits): 30 layers' products as the
         engine calls them and the tied fp32 head [49152, 576] at M rows (--stream_rows).

  PYTHONPATH=. .venv/bin/python scripts/bench_decode_matmuls.py --table=quant,float
  PYTHONPATH=. .venv/bin/python scripts/bench_decode_matmuls.py --table=stream
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import linear, native_fmatmul, native_qmatmul, quant

QUANT_SHAPES = {"mlp_up Q4 [1536, 576]": (1536, 576, 60),
                "mlp_down Q4 [576, 1536]": (576, 1536, 60),
                "q / o Q4 [576, 576]": (576, 576, 100),
                "gate|up Q4 [3072, 576]": (3072, 576, 30),
                "q|k|v Q4 [960, 576]": (960, 576, 60)}  # (N, K, weights in the chain)
Q8_HEAD = ("tied head Q8_0 [49152, 576]", (49152, 576, 3))
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
                (576, 1536)]  # (N, K): q, k, v, o, gate, up, down


def _chain(m: int, product, k_of):
    """A jitted chain of products of x [m, k_of(w)] with each weight w; every input
    depends on the previous output, so XLA runs them one after another."""
    def f(x, ws):
        acc = jnp.zeros((m, 1), jnp.float32)
        for w in ws:
            y = product(jnp.broadcast_to(x[:, :1], (m, k_of(w))) + acc, w)
            acc = acc + y[:, :1] * 1e-9
        return acc
    return jax.jit(f)


def _time(variants: dict, reps: int) -> dict[str, float]:
    """{name: median seconds} of `variants` {name: (set-up callable, run callable)}, the
    rounds interleaved."""
    for setup, run in variants.values():
        setup()
        jax.block_until_ready(run())
    out: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, (setup, run) in variants.items():
            setup()
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            out[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def quant_table(rows: list[int], reps: int, q8_head: bool) -> None:
    rng = np.random.default_rng(0)
    before = native_qmatmul.int_rows()
    print("| shape | M | integer path ms | f32 kernels ms | ratio |\n|---|---|---|---|---|")
    shapes = [*QUANT_SHAPES.items(), *([Q8_HEAD] if q8_head else [])]
    try:
        for name, (n, k, count) in shapes:
            qz = quant.quantize_q8 if "Q8" in name else quant.quantize_q4
            ws = [jax.device_put(qz(rng.standard_normal((n, k)).astype(np.float32)))
                  for _ in range(count)]
            prod = lambda a, w: linear.quantized_matmul(a, w, native=True)  # noqa: E731
            for m in rows:
                x = jax.device_put(rng.standard_normal((m, k)).astype(np.float32))
                g = _chain(m, prod, lambda w: k)
                t = _time({"int": (lambda: native_qmatmul.set_int_rows(64), lambda: g(x, ws)),
                           "f32": (lambda: native_qmatmul.set_int_rows(0), lambda: g(x, ws))},
                          reps)
                i, p = t["int"] / count * 1e3, t["f32"] / count * 1e3
                print(f"| {name} | {m} | {i:.3f} | {p:.3f} | {p / i:.2f}x |", flush=True)
    finally:
        native_qmatmul.set_int_rows(before)


def float_table(rows: list[int], reps: int) -> None:
    rng = np.random.default_rng(0)
    ws = [jax.device_put(rng.standard_normal((k, n)).astype(np.float32) * 0.01)
          for _ in range(30) for (n, k) in LAYER_SHAPES]
    nbytes = sum(w.nbytes for w in ws)
    before, knob = native_fmatmul.kn_serial_bytes(), native_fmatmul.set_kn_serial_bytes
    print(f"| M | XLA dot | kn serial | kn threaded | kn as shipped | ({nbytes / 1e6:.0f} MB, "
          "ms) |\n|---|---|---|---|---|---|")
    try:
        for m in rows:
            x = jax.device_put(rng.standard_normal((m, 576)).astype(np.float32))
            xla = _chain(m, lambda a, w: a @ w, lambda w: w.shape[0])
            nat = _chain(m, lambda a, w: native_fmatmul.fmatmul(a, w, layout="kn"),
                         lambda w: w.shape[0])
            t = _time({"xla": (lambda: None, lambda: xla(x, ws)),
                       "serial": (lambda: knob(1 << 40), lambda: nat(x, ws)),
                       "threaded": (lambda: knob(0), lambda: nat(x, ws)),
                       "shipped": (lambda: knob(before), lambda: nat(x, ws))}, reps)
            print(f"| {m} | " + " | ".join(f"{t[k] * 1e3:.2f}" for k in
                                           ("xla", "serial", "threaded", "shipped"))
                  + f" | {t['shipped'] / t['xla']:.2f}x XLA |", flush=True)
    finally:
        knob(before)


def stream_table(rows: list[int], reps: int) -> None:
    """The fp32 kernel's streaming orders (`native_fmatmul.set_stream_order`, the same
    bits) against its register tiles alone: 30 layers' "kn" products as the engine calls
    them (q, k, v and gate, up one call each, `fmatmul_many`) and the tied head [49152,
    576] ("nk", three copies), threaded as shipped."""
    rng = np.random.default_rng(0)
    layers = [[jax.device_put(rng.standard_normal((k, n)).astype(np.float32) * 0.01)
               for (n, k) in LAYER_SHAPES] for _ in range(30)]
    heads = [jax.device_put(rng.standard_normal((49152, 576)).astype(np.float32) * 0.01)
             for _ in range(3)]
    lbytes = sum(w.nbytes for ws in layers for w in ws)

    def stack(x, layers):
        acc = jnp.zeros_like(x[:, :1])
        for wq, wk, wv, wo, wg, wu, wd in layers:
            q, k, v = native_fmatmul.fmatmul_many(x + acc, (wq, wk, wv))
            o = native_fmatmul.fmatmul(q, wo, layout="kn")
            acc = acc + (o[:, :1] + k[:, :1] + v[:, :1]) * 1e-9
            g, u = native_fmatmul.fmatmul_many(x + acc, (wg, wu))
            acc = acc + native_fmatmul.fmatmul(g * u, wd, layout="kn")[:, :1] * 1e-9
        return acc

    def head(x, heads):
        return [native_fmatmul.fmatmul(x, h, layout="nk") for h in heads]

    stack_jit, head_jit = jax.jit(stack), jax.jit(head)
    on = native_fmatmul.set_stream_order
    print(f"| M | layers tiles | layers streamed | ratio | head tiles | head streamed | ratio | "
          f"(layers {lbytes / 1e6:.0f} MB, head {heads[0].nbytes / 1e6:.0f} MB; ms) |\n"
          "|---|---|---|---|---|---|---|---|")
    try:
        for m in rows:
            x = jax.device_put(rng.standard_normal((m, 576)).astype(np.float32))
            t = _time({"lt": (lambda: on(False), lambda: stack_jit(x, layers)),
                       "ls": (lambda: on(True), lambda: stack_jit(x, layers)),
                       "ht": (lambda: on(False), lambda: head_jit(x, heads)),
                       "hs": (lambda: on(True), lambda: head_jit(x, heads))}, reps)
            lt, ls, ht, hs = (t[k] * 1e3 for k in ("lt", "ls", "ht", "hs"))
            print(f"| {m} | {lt:.2f} ({lbytes / lt / 1e6:.1f} GB/s) | {ls:.2f} "
                  f"({lbytes / ls / 1e6:.1f} GB/s) | {lt / ls:.2f}x | {ht / 3:.2f} | {hs / 3:.2f} "
                  f"| {ht / hs:.2f}x | |", flush=True)
    finally:
        on(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="quant,float")
    ap.add_argument("--quant_rows", default="1,2,4,8,16,32")
    ap.add_argument("--q8_head", action="store_true", help="also the tied Q8_0 head (~30 MB)")
    ap.add_argument("--float_rows", default="1,2,3,4")
    ap.add_argument("--stream_rows", default="1,2,4,6,8")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    print("load average:", os.getloadavg())
    if not (native_qmatmul.available() and native_fmatmul.available()):
        raise SystemExit("the native kernels are unavailable here (no C++ compiler?)")
    tables = a.table.split(",")
    if "quant" in tables:
        quant_table([int(r) for r in a.quant_rows.split(",")], a.reps, a.q8_head)
    if "float" in tables:
        float_table([int(r) for r in a.float_rows.split(",")], a.reps)
    if "stream" in tables:
        stream_table([int(r) for r in a.stream_rows.split(",")], a.reps)


if __name__ == "__main__":
    main()
