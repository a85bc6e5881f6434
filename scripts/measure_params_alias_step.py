"""Step speed with memory-mapped (aliased) vs copied device params (issue 12, no loss of step speed).

    .venv/bin/python scripts/measure_params_alias_step.py --cache_dir /tmp/pc [--rows 1,8]
        [--ctx 512] [--iters 20] [--scan]

Loads SmolLM2 through the params cache (a hit: copy-on-write memory maps, which
`jax.device_put` aliases on CPU: the weights are page-cache pages) and builds the
engine layout twice: "mmap" (aliased, as `jaxserve serve` now runs) and "anon"
(the same leaves copied into XLA-owned buffers, as with the orbax cache). One
compiled `forward_paged` (unrolled layers unless --scan; xla attention, random
finite KV, the cache donated and threaded through) runs round-robin on both
(scripts/profile_step.py's `compare`); prints median/min ms per variant, how many
leaves alias the file, and the process's RssFile / RssAnon.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import compare, decode_common  # noqa: E402


def _rss() -> str:
    f = {ln.split(":")[0]: ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("Rss")}
    return f"RssAnon {int(f['RssAnon']) // 1024} MiB, RssFile {int(f['RssFile']) // 1024} MiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--scan", action="store_true")
    a = ap.parse_args()
    from jaxserve.checkpoint import load_model
    from jaxserve.model import llama
    from jaxserve.attention.xla import XlaBackend

    cfg, tree, _ = load_model(None, cache_dir=a.cache_dir, progress=False)
    assert isinstance(tree["embed"], np.memmap), "not a params-cache hit: run once to fill it"
    mm = llama.prepare_params(cfg, tree, unroll_layers=not a.scan)
    anon = jax.tree.map(lambda x: jnp.array(x, copy=True), mm)
    jax.block_until_ready(anon)
    lo = tree["embed"].ctypes.data
    leaves_mm, leaves_anon = jax.tree.leaves(mm), jax.tree.leaves(anon)
    # A leaf aliases the file when its device buffer lies inside one of the memory maps.
    maps = [(int(s, 16), int(e, 16)) for s, e in
            (ln.split()[0].split("-") for ln in open("/proc/self/maps") if ".npy" in ln)]
    aliased = sum(1 for x in leaves_mm if any(s <= x.unsafe_buffer_pointer() < e for s, e in maps))
    print(f"jax {jax.__version__}; leaves aliasing the cache files: {aliased}/{len(leaves_mm)} "
          f"(anon copies: {sum(1 for x in leaves_anon if any(s <= x.unsafe_buffer_pointer() < e for s, e in maps))}); "
          f"{_rss()}; load {os.getloadavg()[0]:.1f}; embed at {lo:#x}", flush=True)
    del tree
    L, K, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    be = XlaBackend(block_size=16)
    for rows in [int(r) for r in a.rows.split(",")]:
        n = max(rows * -(-a.ctx // 16) + 2, 64)
        rng = np.random.default_rng(2)
        state = {"kv": tuple(jnp.asarray(rng.standard_normal((L, n, 16, K, D), np.float32))
                             for _ in range(2))}
        md = jax.device_put(be.prepare(decode_common(rows, a.ctx, 16, n)))
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, rows, dtype=np.int32))
        pos = jnp.full((rows,), a.ctx - 1, jnp.int32)
        li = jnp.arange(rows, dtype=jnp.int32)
        fwd = functools.partial(llama.forward_paged, cfg, backend=be)
        t0 = time.perf_counter()
        exe = jax.jit(lambda p, kv, i, q, m, l: fwd(p, i, q, kv, m, l),
                      donate_argnums=(1,)).lower(mm, state["kv"], ids, pos, md, li).compile()
        comp = time.perf_counter() - t0
        outs = {}

        def call(p, name):
            logits, state["kv"] = exe(p, state["kv"], ids, pos, md, li)
            outs[name] = np.asarray(logits)

        res = compare({"mmap": lambda: call(mm, "mmap"), "anon": lambda: call(anon, "anon")},
                      a.iters)
        same = np.array_equal(outs["mmap"], outs["anon"])
        print(f"rows={rows} ctx={a.ctx} compile {comp:.1f} s, load {os.getloadavg()[0]:.1f}: "
              + "  ".join(f"{k} {m:.1f}/{mn:.1f} ms" for k, (m, mn) in res.items())
              + f"  (median/min; same logits: {same}); {_rss()}", flush=True)


if __name__ == "__main__":
    main()
