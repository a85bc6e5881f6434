"""GPU readiness check of the ragged paged attention (run by scripts/gpu_check.sh).

On a GPU (H200 in mind):
  1. checks the Pallas kernel and the xla path against the float64 reference in
     bf16 and fp32 on mixed batches with NaN-poisoned unused KV slots and padding rows;
  2. times both on a decode-heavy batch (256 seqs x 2k context) and a mixed batch
     (the same plus one 2k-token prefill chunk): median of many block_until_ready
     runs after warm-up;
  3. prints achieved KV-read bandwidth as a fraction of a measured device copy;
  4. exits non-zero on any mismatch.
`--dry-run` runs the same flow at tiny shapes with interpret=True on CPU (tested by
tests/pallas/test_gpu_check.py). `--cpu-bench` prints the CPU numbers of
notes/attention.md: xla-path time per call, interpret-mode time, Triton lowering
time, and a 30-layer scan with the stacked cache as the carry vs as xs/ys.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.model import attention as attn  # noqa: E402
from jaxserve.pallas import ragged_paged_attention as rpa  # noqa: E402
from tests.pallas.cases import random_batch  # noqa: E402

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def compare(name: str, got: np.ndarray, ref: np.ndarray, num_tokens: int, tol: float) -> bool:
    """Print and return whether got[:num_tokens] is finite and within tol of ref."""
    got, ref = got[:num_tokens].astype(np.float64), ref[:num_tokens]
    finite = bool(np.isfinite(got).all())
    err = float(np.max(np.abs(got - ref) / (1.0 + np.abs(ref)))) if finite else float("nan")
    ok = finite and err <= tol
    print(f"  {name:34s} max_rel_err={err:.2e} tol={tol:.0e} {'OK' if ok else 'MISMATCH'}")
    return ok


def _run(backend, batch, interpret, block_q=None):
    h, k = batch.q.shape[1], batch.k_cache.shape[2]
    md = attn.make_attention_metadata(**batch.metadata_kwargs(), num_queries_per_kv=h // k,
                                      pallas_block_q=block_q)
    md = jax.device_put(jax.tree.map(jnp.asarray, md))
    fn = jax.jit(lambda q, kc, vc, md: attn.attention(
        q, kc, vc, md, sm_scale=q.shape[-1] ** -0.5, backend=backend, interpret=interpret))
    args = (jnp.asarray(batch.q), jnp.asarray(batch.k_cache), jnp.asarray(batch.v_cache), md)
    return fn, args


def check_correctness(shapes: dict, interpret: bool) -> bool:
    ok = True
    for dtype in ("bfloat16", "float32"):
        batch = random_batch(np.random.default_rng(0), dtype=jnp.dtype(dtype), **shapes)
        ref = rpa.reference_ragged_paged_attention(
            batch.q.astype(np.float32), batch.k_cache.astype(np.float32),
            batch.v_cache.astype(np.float32), batch.query_start_loc, batch.seq_lens,
            batch.block_table, batch.num_seqs, sm_scale=batch.q.shape[-1] ** -0.5)
        for backend in ("pallas", "xla"):
            fn, args = _run(backend, batch, interpret)
            out = np.asarray(fn(*args).astype(jnp.float32))
            ok &= compare(f"{backend} {dtype}", out, ref, batch.num_tokens, TOL[dtype])
    return ok


def median_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Bytes/s of a device copy (read + write) of an nbytes buffer."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    ms = median_ms(jax.jit(lambda x: x + 1.0), (x,), iters)
    return 2 * nbytes / (ms * 1e-3)


def bench(cases: dict, interpret: bool, iters: int, copy_bytes: int) -> None:
    bw = copy_bandwidth(copy_bytes, iters)
    print(f"  device copy bandwidth: {bw / 1e9:.1f} GB/s")
    for name, shapes in cases.items():
        batch = random_batch(np.random.default_rng(1), dtype=jnp.bfloat16, poison=False, **shapes)
        kv_bytes = 2 * int(batch.seq_lens.sum()) * batch.k_cache[0, 0].size * 2  # K+V, bf16
        for backend in ("pallas", "xla"):
            fn, args = _run(backend, batch, interpret)
            ms = median_ms(fn, args, iters)
            frac = kv_bytes / (ms * 1e-3) / bw
            print(f"  {name:12s} {backend:6s} {ms:9.3f} ms  KV read {kv_bytes / 1e6:8.1f} MB"
                  f"  = {frac:6.1%} of copy bandwidth")


def _scan_steps(n_layers, k):
    """Two jitted 30-layer steps: cache as the scan carry (in place) vs as xs -> ys."""
    from jax import lax

    def carry_step(kc, vc, x, md):
        def body(c, li):
            kc, vc = attn.write_kv(*c, x[:, :k], x[:, k:2 * k], md, layer=li)
            return (kc, vc), attn.attention(x, kc, vc, md, layer=li, sm_scale=0.125)[0, 0, 0]
        (kc, vc), o = lax.scan(body, (kc, vc), jnp.arange(n_layers, dtype=jnp.int32))
        return o, kc, vc

    def naive_step(kc, vc, x, md):
        def body(_, kv):
            kl, vl = attn.write_kv(*kv, x[:, :k], x[:, k:2 * k], md)
            return None, (attn.attention(x, kl, vl, md, sm_scale=0.125)[0, 0, 0], kl, vl)
        _, (o, kc, vc) = lax.scan(body, None, (kc, vc))
        return o, kc, vc

    return {name: jax.jit(f, donate_argnums=(0, 1))
            for name, f in (("carry", carry_step), ("xs/ys", naive_step))}


def cpu_bench(iters: int = 20) -> None:
    h, k, d, bs = 9, 3, 64, 16
    common = dict(max_blocks_per_seq=128, block_size=bs, num_heads=h, num_kv_heads=k,
                  head_dim=d, poison=False)
    cases = {"decode 32x512": dict(q_lens=[1] * 32, seq_lens=[512] * 32, num_tokens=32,
                                   num_seqs=32, num_kv_blocks=1100),
             "mixed 31x512+225@1024": dict(q_lens=[1] * 31 + [225], seq_lens=[512] * 31 + [1024],
                                           num_tokens=256, num_seqs=32, num_kv_blocks=1100)}
    for name, c in cases.items():
        batch = random_batch(np.random.default_rng(0), **c, **common)
        fn, args = _run("xla", batch, False)
        print(f"  xla {name:24s} {median_ms(fn, args, iters):8.2f} ms/call (median)")
    small = random_batch(np.random.default_rng(0), q_lens=[1] * 4 + [24], seq_lens=[100] * 4 + [24],
                         num_tokens=32, num_seqs=8, max_blocks_per_seq=8, num_kv_blocks=40,
                         block_size=16, num_heads=6, num_kv_heads=2, head_dim=16)
    fn, args = _run("pallas", small, True)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    print(f"  pallas interpret T=32 S=8: first call {time.perf_counter() - t0:.2f} s, "
          f"then {median_ms(fn, args, iters):.2f} ms/call")
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "tests" / "pallas" / "test_lowering.py"
    spec = importlib.util.spec_from_file_location("lowering", path)
    low = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(low)
    t0 = time.perf_counter()
    low._lower_step(t=256, s=256, h=h, k=k, d=d, dtype=jnp.bfloat16)
    print(f"  Triton lowering, 2-layer scan of write_kv+attention: {time.perf_counter() - t0:.2f} s")
    n_layers = 30
    batch = random_batch(np.random.default_rng(0), **cases["decode 32x512"], **common)
    md = jax.device_put(jax.tree.map(jnp.asarray, attn.make_attention_metadata(
        **batch.metadata_kwargs(), num_queries_per_kv=h // k)))
    x = jnp.asarray(batch.q)
    pool = np.random.default_rng(1).standard_normal((n_layers, 1100, bs, k, d)).astype(np.float32)
    print(f"  30-layer scan, decode 32x512, KV pool {2 * pool.nbytes / 1e6:.0f} MB:")
    for name, step in _scan_steps(n_layers, k).items():
        kc, vc = jnp.asarray(pool), jnp.asarray(pool)
        o, kc, vc = step(kc, vc, x, md)
        ts = []
        for _ in range(max(3, iters // 4)):
            t0 = time.perf_counter()
            o, kc, vc = step(kc, vc, x, md)
            jax.block_until_ready(o)
            ts.append(time.perf_counter() - t0)
        print(f"    cache as {name:6s}: {np.median(ts) * 1e3:8.1f} ms/step (median), "
              f"{np.min(ts) * 1e3:8.1f} min")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, Pallas interpret=True, runs on CPU")
    ap.add_argument("--cpu-bench", action="store_true",
                    help="print the CPU numbers of notes/attention.md and exit")
    args = ap.parse_args(argv)
    print(f"devices: {jax.devices()}")
    if args.cpu_bench:
        cpu_bench()
        return 0
    if args.dry_run:
        common = dict(max_blocks_per_seq=8, num_kv_blocks=40, block_size=16, num_heads=6,
                      num_kv_heads=2, head_dim=16)
        check = dict(q_lens=[1, 20, 1, 5], seq_lens=[50, 20, 16, 37], num_tokens=32,
                     num_seqs=8, **common)
        cases = {"decode": dict(q_lens=[1] * 4, seq_lens=[100] * 4, num_tokens=4, num_seqs=4,
                                **common),
                 "mixed": dict(q_lens=[1] * 4 + [24], seq_lens=[100] * 4 + [24],
                               num_tokens=32, num_seqs=8, **common)}
        interpret, iters, copy_bytes = True, 3, 1 << 20
    else:
        if jax.default_backend() != "gpu":
            print("no GPU found; use --dry-run on CPU", file=sys.stderr)
            return 2
        ctx, s = 2048, 256
        common = dict(max_blocks_per_seq=ctx // 16, num_kv_blocks=s * ctx // 16 + ctx // 16 + 1,
                      block_size=16, num_heads=9, num_kv_heads=3, head_dim=64)
        check = dict(q_lens=[1] * 60 + [300, 77, 1], seq_lens=[1 + i * 33 for i in range(60)]
                     + [300, 900, 2048], num_tokens=512, num_seqs=64, **common)
        cases = {"decode": dict(q_lens=[1] * s, seq_lens=[ctx] * s, num_tokens=s, num_seqs=s,
                                **common),
                 "mixed": dict(q_lens=[1] * s + [ctx], seq_lens=[ctx] * s + [ctx],
                               num_tokens=s + ctx, num_seqs=s + 1, **common)}
        interpret, iters, copy_bytes = False, 50, 1 << 30
    print("1. correctness vs float64 reference (NaN-poisoned padding):")
    ok = check_correctness(check, interpret)
    print("2-3. timing (median after warm-up) and bandwidth:")
    bench(cases, interpret, iters, copy_bytes)
    print("PASS" if ok else "FAIL: mismatch")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
