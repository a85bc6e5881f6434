"""Where does a decode step of the real model go, and does a change pay? (CPU, fp32)

Two modes, each timing several variants ROUND-ROBIN in one process (the machine
is shared, so only ratios within one run mean anything; `uptime`'s load is
printed with every table). Every call blocks on its result.

  attn  one layer's decode attention alone, `backend.attention` on one layer's
        [N, B, K, D] cache with layer=None (`--cache=stacked`: at a traced layer of a
        stacked [2, N, B, K, D] cache), for each (rows, ctx): variants are
        XlaBackend settings (`--attn_variants`, "name=field:value,..."). Prints
        median ms per layer and the effective GB/s of the real KV bytes read
        (rows x ctx x K x D x 2 x 4 bytes).
  fwd   the real model's `forward_paged` (SmolLM2-135M from `checkpoints/`, fp32,
        random finite KV) at each (rows, ctx): variants are engine layouts from
        `prepare_params` (fused/unfused projections, unrolled/scan layers) and
        "noattn" (attention replaced by zeros: bounds attention's share), each
        optionally with an attention variant ("unfused@old"). The KV cache is
        donated and threaded through the calls, as in the engine. Prints compile
        seconds per variant and median step ms.
  --xprof=N  also traces N calls per variant and prints the top HLO ops.
  --s_pad / --t_pad / --pages / --pool_blocks give the engine's bucket layout
        (the stack runs at the largest seq bucket, block tables max_model_len / 16
        wide, a 728-block pool at 512 MiB).

    .venv/bin/python scripts/profile_step.py attn --rows=1,8,16,64 --ctx=256,1024
    .venv/bin/python scripts/profile_step.py fwd --rows=8 --ctx=512 \
        --fwd_variants=fused,unfused --iters=15

Results and how to read them: notes/perf.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def compare(fns: dict, iters: int, warm: int = 2) -> dict:
    """Round-robin the blocking callables `iters` times; {name: (median ms, min ms)}.

    With PROFILE_CPU_TIME=1 the times are this process's CPU seconds (all threads,
    `time.process_time`) instead of wall seconds: on a machine loaded by other jobs
    wall time mostly measures the wait for a core, CPU time much less so.
    """
    clock = time.process_time if os.environ.get("PROFILE_CPU_TIME") == "1" else time.perf_counter
    for f in fns.values():
        for _ in range(warm):
            f()
    ts = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            t0 = clock()
            f()
            ts[k].append(clock() - t0)
    return {k: (1e3 * statistics.median(v), 1e3 * min(v)) for k, v in ts.items()}


def decode_common(rows: int, ctx: int, block_size: int, num_blocks: int, seed: int = 0, *,
                  s_pad: int | None = None, t_pad: int | None = None, pages: int | None = None):
    """CommonAttentionMetadata of `rows` decode rows at context `ctx`, distinct random pages.

    s_pad / t_pad: sequence slots and tokens of the bucket (default rows; the engine's
    stack uses its largest seq bucket); pages: the block table width (default just
    enough; the engine uses max_model_len / block_size).
    """
    from jaxserve.attention import CommonAttentionMetadata

    s_pad, t_pad = s_pad or rows, t_pad or rows
    per = -(-ctx // block_size)
    pages = pages or per
    if rows * per >= num_blocks or s_pad < rows or t_pad < rows or pages < per:
        raise ValueError(f"rows={rows} x {per} pages do not fit the pool of {num_blocks} "
                         f"blocks / s_pad={s_pad} / t_pad={t_pad} / pages={pages}")
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))[:rows * per]
    bt = np.zeros((s_pad, pages), np.int32)
    bt[:rows, :per] = perm.reshape(rows, per)
    pos = ctx - 1
    slot = np.zeros(t_pad, np.int32)
    slot[:rows] = bt[:rows, pos // block_size] * block_size + pos % block_size
    qsl = np.full(s_pad + 1, rows, np.int32)
    qsl[:rows + 1] = np.arange(rows + 1)
    seq_lens = np.zeros(s_pad, np.int32)
    seq_lens[:rows] = ctx
    return CommonAttentionMetadata(slot_mapping=slot, query_start_loc=qsl, seq_lens=seq_lens,
                                   block_table=bt, num_seqs=np.int32(rows))


def print_top_ops(fn, n: int, top: int = 25) -> None:
    """Trace n calls of fn with jax.profiler; print the HLO ops with the most time per call
    (numeric suffixes stripped, so the unrolled layers' copies of an op add up)."""
    import collections
    import glob
    import re
    import tempfile

    from jax.profiler import ProfileData

    d = tempfile.mkdtemp(prefix="jaxserve_xprof_")
    with jax.profiler.trace(d):
        for _ in range(n):
            fn()
    pd = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    tot, cnt = collections.Counter(), collections.Counter()
    for plane in pd.planes:
        for line in plane.lines:
            for ev in line.events:
                name = re.sub(r"[.\d]+$", "", ev.name)
                tot[(line.name, name)] += ev.duration_ns
                cnt[(line.name, name)] += 1
    for (line, name), ns in tot.most_common(top):
        print(f"    {ns / 1e6 / n:9.3f} ms/call {cnt[(line, name)] / n:8.1f}x  {line[:24]:24} "
              f"{name[:80]}", flush=True)


def parse_variants(spec: str) -> dict[str, dict]:
    """"a=decode_chunk:64;b=" -> {"a": {"decode_chunk": 64}, "b": {}} (ints where they parse)."""
    out = {}
    for item in filter(None, spec.split(";")):
        name, _, fields = item.partition("=")
        kw = {}
        for f in filter(None, fields.split(",")):
            k, _, v = f.partition(":")
            kw[k] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v)
        out[name] = kw
    return out


def run_attn(args) -> None:
    from jaxserve.attention.xla import XlaBackend

    K, D, G, B = 3, 64, 3, 16  # SmolLM2-135M: 9 query heads over 3 KV heads, head_dim 64
    variants = parse_variants(args.attn_variants)
    for rows in args.rows:
        for ctx in args.ctx:
            n = max(rows * -(-ctx // B) + 2, args.pool_blocks)
            rng = np.random.default_rng(1)
            lead = () if args.cache == "per_layer" else (2,)
            kc = jnp.asarray(rng.standard_normal((*lead, n, B, K, D), np.float32))
            vc = jnp.asarray(rng.standard_normal((*lead, n, B, K, D), np.float32))
            q = jnp.asarray(rng.standard_normal((max(rows, args.t_pad), K * G, D), np.float32))
            layer1 = None if args.cache == "per_layer" else jnp.int32(1)
            fns = {}
            for name, kw in variants.items():
                be = XlaBackend(block_size=B, **kw)
                md = jax.device_put(be.prepare(decode_common(
                    rows, ctx, B, n, s_pad=max(rows, args.s_pad), t_pad=max(rows, args.t_pad),
                    pages=max(-(-ctx // B), args.pages))))
                f = jax.jit(functools.partial(be.attention, sm_scale=D ** -0.5))
                fns[name] = (lambda f=f, md=md: f(q, kc, vc, md, layer=layer1)
                             .block_until_ready())
            res = compare(fns, args.iters)
            gb = rows * ctx * K * D * 2 * 4 / 1e9
            cells = "  ".join(f"{k} {m:7.2f}/{mn:6.2f} ms ({gb / mn * 1e3:5.1f} GB/s)"
                              for k, (m, mn) in res.items())
            print(f"attn rows={rows:3d} ctx={ctx:5d} load {load():>5}: {cells}", flush=True)
            for name, f in fns.items() if args.xprof else ():
                print(f"  xprof {name} rows={rows} ctx={ctx}:")
                print_top_ops(f, args.xprof)


def fwd_variants(cfg, tree, names):
    """{name: (engine params, skip attention, attn variant)} for the requested variants:
    [noattn_](fused|unfused|scan_fused|scan_unfused)[@attn_variant]."""
    from jaxserve.model.llama import prepare_params

    out, cache = {}, {}
    for name in names:
        layout, _, attn = name.partition("@")
        base = layout.removeprefix("noattn_")
        key = (not base.endswith("unfused"), not base.startswith("scan"))
        if key not in cache:
            cache[key] = prepare_params(cfg, tree, unroll_layers=key[1], fuse=key[0])
        out[name] = (cache[key], layout.startswith("noattn_"), attn)
    return out


def run_fwd(args) -> None:
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.model import llama
    from jaxserve.attention.xla import XlaBackend

    cfg, tree, _ = load_model(resolve_model_path(None), dtype="float32", progress=False)
    attn_kw = parse_variants(args.attn_variants)
    L, K, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    variants = fwd_variants(cfg, tree, args.fwd_variants.split(","))
    del tree

    def noattn(md, backend):  # attention replaced by zeros; the KV write stays
        def fn(q, k, v, carry, layer):
            return jnp.zeros_like(q), backend.write_kv(*carry, k, v, md, layer=layer)
        return fn

    def fwd(params, kv, ids, pos, md, li, *, skip_attn, be):
        if not skip_attn:
            return llama.forward_paged(cfg, params, ids, pos, kv, md, li, backend=be)
        hidden, kv = llama.run_layers(cfg, params, ids, pos, noattn(md, be), kv)
        return llama.compute_logits(cfg, params, hidden[li]), kv

    for rows in args.rows:
        for ctx in args.ctx:
            n = max(rows * -(-ctx // 16) + 2, args.pool_blocks)
            s_pad, t_pad = max(rows, args.s_pad), max(rows, args.t_pad)
            rng = np.random.default_rng(2)
            # The cache is donated and threaded through every call, as in the engine.
            state = {"kv": tuple(jnp.asarray(rng.standard_normal((L, n, 16, K, D), np.float32))
                                 for _ in range(2))}
            common = decode_common(rows, ctx, 16, n, s_pad=s_pad, t_pad=t_pad,
                                   pages=max(-(-ctx // 16), args.pages))
            ids = jnp.asarray(rng.integers(0, cfg.vocab_size, t_pad, dtype=np.int32))
            pos = jnp.full((t_pad,), ctx - 1, jnp.int32)
            li = jnp.arange(s_pad, dtype=jnp.int32)
            fns, comp = {}, {}
            for name, (params, skip, attn) in variants.items():
                be = XlaBackend(block_size=16, **attn_kw.get(attn, {}))
                md = jax.device_put(be.prepare(common))
                t0 = time.perf_counter()
                exe = jax.jit(functools.partial(fwd, skip_attn=skip, be=be),
                              donate_argnums=(1,)).lower(params, state["kv"], ids, pos, md,
                                                         li).compile()
                comp[name] = time.perf_counter() - t0

                def call(exe=exe, p=params, md=md):
                    logits, state["kv"] = exe(p, state["kv"], ids, pos, md, li)
                    logits.block_until_ready()
                fns[name] = call
            res = compare(fns, args.iters)
            cells = "  ".join(f"{k} {m:7.1f}/{mn:6.1f} ms (compile {comp[k]:4.1f} s)"
                              for k, (m, mn) in res.items())
            print(f"fwd rows={rows:3d} ctx={ctx:5d} T_pad={t_pad} S_pad={s_pad} "
                  f"load {load():>5}: {cells}", flush=True)
            for name, f in fns.items() if args.xprof else ():
                print(f"  xprof {name} rows={rows} ctx={ctx}:")
                print_top_ops(f, args.xprof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("attn", "fwd"))
    ap.add_argument("--rows", default="1,8,16,64")
    ap.add_argument("--ctx", default="256,1024")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--s_pad", type=int, default=0,
                    help="sequence slots of the bucket (the engine's stack: its largest seq "
                         "bucket); default = rows")
    ap.add_argument("--t_pad", type=int, default=0, help="tokens of the bucket; default = rows")
    ap.add_argument("--pages", type=int, default=0,
                    help="block-table width (the engine: max_model_len / 16); default = ctx / 16")
    ap.add_argument("--pool_blocks", type=int, default=0,
                    help="KV pool blocks at least (the engine at 512 MiB: 728)")
    ap.add_argument("--cache", choices=("per_layer", "stacked"), default="per_layer",
                    help="attn mode: one layer's [N, B, K, D] cache passed with layer=None "
                         "(the per-layer runner), or layer 1 of a stacked [2, N, B, K, D] one")
    ap.add_argument("--xprof", type=int, default=0,
                    help="trace this many calls per variant with jax.profiler; print top ops")
    ap.add_argument("--attn_variants", default="current=",
                    help='";"-separated name=field:value,... XlaBackend settings')
    ap.add_argument("--fwd_variants", default="unfused",
                    help="comma list of fused|unfused|scan_fused|scan_unfused, each "
                         "optionally prefixed noattn_ and suffixed @<attn variant name>")
    args = ap.parse_args()
    args.rows = [int(x) for x in args.rows.split(",")]
    args.ctx = [int(x) for x in args.ctx.split(",")]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load {load()}", flush=True)
    (run_attn if args.mode == "attn" else run_fwd)(args)


if __name__ == "__main__":
    main()
