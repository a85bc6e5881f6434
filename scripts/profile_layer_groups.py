"""Layer-group programs: compile seconds and step ms against the group size G.

A forward of L layers runs as L / G calls of ONE compiled program over G layers
(per-layer weight buffers, per-layer KV cache buffers donated call by call), plus
an embed call and a final-norm call. G = L is the unrolled one-program stack.
The tool behind `EngineConfig.layers_per_program` (notes/startup.md).

For each G: the cold XLA compile of one group program at T_pad (JAX's compile
cache off), then decode steps at each (rows, ctx) timed round-robin across the
G values in one process (the machine is shared: only ratios within a run count).

    PYTHONPATH=$PWD .venv/bin/python scripts/profile_layer_groups.py --groups=1,3,30 \
        --rows=1,8 --ctx=512 --t_pad=8 --s_pad=32 --iters=15
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from profile_step import compare, decode_common, load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="1,3,30")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--t_pad", type=int, default=8)
    ap.add_argument("--s_pad", type=int, default=32)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--pool_blocks", type=int, default=728)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)

    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.worker.layer_stack import embed_fn, final_fn, layers_fn
    from jaxserve.model import llama
    from jaxserve.attention.xla import XlaBackend

    cfg, tree, _ = load_model(resolve_model_path(None), dtype="float32", progress=False)
    params = llama.prepare_params(cfg, tree, unroll_layers=True)
    del tree
    L, K, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    groups = [int(g) for g in args.groups.split(",")]
    be = XlaBackend(block_size=16)
    n = args.pool_blocks
    rng = np.random.default_rng(2)
    kv = [[jnp.asarray(rng.standard_normal((n, 16, K, D), np.float32)) for _ in range(L)]
          for _ in range(2)]
    t_pad, s_pad = args.t_pad, args.s_pad

    group_fn = functools.partial(layers_fn, cfg, be)  # the engine's layer-group program
    embed = jax.jit(embed_fn)
    final = jax.jit(lambda p, x, li: llama.compute_logits(
        cfg, p, final_fn(cfg, p["final_norm"], x, li)[0]))
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, t_pad, dtype=np.int32))
    li = jnp.arange(s_pad, dtype=jnp.int32)
    head_params = {k: v for k, v in params.items() if k != "layers"}

    for rows in [int(r) for r in args.rows.split(",")]:
        for ctx in [int(c) for c in args.ctx.split(",")]:
            common = decode_common(rows, ctx, 16, n, s_pad=s_pad, t_pad=t_pad,
                                   pages=max(-(-ctx // 16), args.pages))
            md = jax.device_put(be.prepare(common))
            pos = jnp.full((t_pad,), ctx - 1, jnp.int32)
            x0 = embed(params["embed"], ids)
            fns, comp = {}, {}
            for g in groups:
                if L % g:
                    raise SystemExit(f"G={g} does not divide L={L}")
                t0 = time.perf_counter()
                exe = jax.jit(group_fn, donate_argnums=(1, 2)).lower(
                    params["layers"][:g], kv[0][:g], kv[1][:g], x0, pos, md).compile()
                comp[g] = time.perf_counter() - t0

                def step(exe=exe, g=g):
                    x = embed(params["embed"], ids)
                    for s in range(0, L, g):
                        x, kv[0][s:s + g], kv[1][s:s + g] = exe(
                            params["layers"][s:s + g], kv[0][s:s + g], kv[1][s:s + g], x, pos, md)
                    final(head_params, x, li).block_until_ready()
                fns[g] = step
            res = compare(fns, args.iters)
            cells = "  ".join(f"G={g} {m:6.1f}/{mn:6.1f} ms (compile {comp[g]:5.1f} s)"
                              for g, (m, mn) in res.items())
            print(f"rows={rows} ctx={ctx} T_pad={t_pad} S_pad={s_pad} load {load()}: {cells}",
                  flush=True)


if __name__ == "__main__":
    main()
