"""Where does one engine step of the real model go? (SmolLM2-135M, fp32, CPU)

Builds the real-model engine (like `jaxserve.cli.build_engine`, without
warm-up), drives real requests into steady decode at a chosen context length,
then times side by side in ONE process (median of --iters after warm-up,
block_until_ready on every call):

  step      the engine's full jitted step (forward + sampler) at the bucket
  fwd       forward only (logits at logits_indices, no sampler)
  noattn    forward with attention replaced by the identity (bounds attention's share)
  wkv       forward with the KV write but no attention read
  sampler   the sampler alone on random logits [S, V]
  host      host work of one engine step (schedule, build_batch, metadata,
            device_put, device_get, update_from_output, detokenizer), i.e.
            the wall time of `engine.step()` minus its device step

The machine is shared, so `uptime`'s load is printed with each row; compare
ratios within one run, not absolute times across runs.

    .venv/bin/python scripts/profile_step.py --rows=1,8,32 --ctx=128,512
    # A/B against older files in the same process (adds step_before / altattn):
    .venv/bin/python scripts/profile_step.py --rows=8 --ctx=256 \
        --alt_attention=OLD/attention.py --alt_sampler=OLD/sampler.py
    # per-HLO-op time of the step: --xprof=5 ; cProfile of engine.step(): --cprofile

Results and how to read them: notes/perf.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def load() -> str:
    return os.getloadavg().__repr__().split(",")[0].strip("(")


def timeit(fn, iters: int, warm: int = 2) -> float:
    """Median wall milliseconds of fn() (fn must block)."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts), 1e3 * min(ts)


def compare(fns: dict, iters: int) -> dict:
    """Round-robin the callables iters times; {name: (median ms, min ms)}.

    Interleaving makes the ratios fair on a machine shared with other jobs.
    """
    ts = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return {k: (1e3 * statistics.median(v), 1e3 * min(v)) for k, v in ts.items()}


def print_top_ops(fn, n: int, top: int = 30) -> None:
    """Trace n calls of fn with jax.profiler and print the ops with the most total time."""
    import collections
    import tempfile

    from jax.profiler import ProfileData

    d = tempfile.mkdtemp(prefix="jaxserve_xprof_")
    with jax.profiler.trace(d):
        for _ in range(n):
            fn()
    import glob
    path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
    pd = ProfileData.from_file(path)
    tot = collections.Counter()
    cnt = collections.Counter()
    for plane in pd.planes:
        for line in plane.lines:
            for ev in line.events:
                name = re.sub(r"\.\d+$", "", ev.name)  # unrolled layers: fusion.12 -> fusion
                tot[(plane.name, name)] += ev.duration_ns
                cnt[(plane.name, name)] += 1
    for (plane, name), ns in tot.most_common(top):
        print(f"  {ns / 1e6 / n:9.2f} ms/step {cnt[(plane, name)] // n:6d}x  {plane[:20]:20} {name[:90]}")


def build(rows: int, max_num_seqs: int, seq_buckets=None):
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.model_runner import enable_compilation_cache

    if os.environ.get("PROFILE_COMPILE_CACHE", "1") == "1":
        enable_compilation_cache("checkpoints/jax_compile_cache")
    cfg, params, tok = load_model(resolve_model_path(None), dtype="float32")
    config = make_engine_config(cfg, max_model_len=2048, block_size=16,
                                kv_cache_memory_bytes=512 * 2**20, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=64, token_buckets=(8, 32, 64),
                                seq_buckets=seq_buckets or tuple(sorted({1, 8, max_num_seqs})),
                                attention_backend="xla")
    return LLMEngine(config, params, tok, model_name="smollm2", warmup=False, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--ctx", default="128,512", help="context length(s) of the decode rows")
    ap.add_argument("--seq_buckets", default="", help="e.g. 8,32 (default 1,8,32)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip", default="", help="comma list of parts to skip")
    ap.add_argument("--alt_attention", default="",
                    help="path of another attention.py: adds an 'altattn' forward using it")
    ap.add_argument("--alt_sampler", default="",
                    help="path of another sampler.py; with --alt_attention adds 'step_before': "
                         "stacked-weight scan + both alternatives")
    ap.add_argument("--cprofile", action="store_true", help="cProfile 10 engine.step() calls")
    ap.add_argument("--xprof", type=int, default=0,
                    help="trace this many jitted steps with jax.profiler; print the top ops")
    args = ap.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    skip = set(args.skip.split(","))

    from jaxserve.model.llama import compute_logits, forward_paged, run_layers
    from jaxserve.sampler import make_sampling_metadata, sample
    from jaxserve.sampling_params import SamplingParams

    sb = tuple(int(x) for x in args.seq_buckets.split(",")) if args.seq_buckets else None
    engine = build(max(rows_list), max(32, max(rows_list)), sb)
    runner = engine.runner
    cfg = runner.cfg
    print(f"jax {jax.__version__}, backend={runner.backend}, max_logprobs={runner.config.max_logprobs}, "
          f"kv blocks={runner.num_kv_blocks}, load {load()}", flush=True)

    def fwd_fn(params, kv, batch):
        logits, kv = forward_paged(cfg, params, batch["input_ids"], batch["positions"], kv,
                                   batch["attn"], batch["logits_indices"], backend=runner.backend)
        return logits, kv

    def variant_fn(mode, params, kv, batch):
        md = batch["attn"]

        def attn(q, k, v, carry, layer):
            if mode == "noattn":
                return q, carry
            if mode == "altattn":  # attention from another implementation (--alt_attention)
                kc, vc = alt_attention.write_kv(carry[0], carry[1], k, v, md, layer=layer,
                                                backend=runner.backend.name)
                o = alt_attention.attention(q, kc, vc, md, layer=layer, sm_scale=cfg.head_dim ** -0.5,
                                            backend=runner.backend.name)
                return o, (kc, vc)
            kc, vc = runner.backend.write_kv(carry[0], carry[1], k, v, md, layer=layer)
            return q, (kc, vc)

        hidden, kv = run_layers(cfg, params, batch["input_ids"], batch["positions"], attn, kv)
        return compute_logits(cfg, params, hidden[batch["logits_indices"]]), kv

    alt_attention = None
    if args.alt_attention:  # e.g. the previous attention.py, to A/B it in one process
        import importlib.util
        spec = importlib.util.spec_from_file_location("alt_attention", args.alt_attention)
        alt_attention = importlib.util.module_from_spec(spec)
        import sys
        sys.modules["alt_attention"] = alt_attention  # dataclasses look their module up
        spec.loader.exec_module(alt_attention)
    else:
        skip.add("altattn")
    alt_sampler = None
    if args.alt_sampler:
        import importlib.util
        import sys
        spec = importlib.util.spec_from_file_location("alt_sampler", args.alt_sampler)
        alt_sampler = importlib.util.module_from_spec(spec)
        sys.modules["alt_sampler"] = alt_sampler
        spec.loader.exec_module(alt_sampler)

    def before_fn(params, kv, batch):
        """The step as it was: scan over stacked weights, --alt_attention, --alt_sampler."""
        md = batch["attn"]

        def attn(q, k, v, carry, layer):
            kc, vc = alt_attention.write_kv(carry[0], carry[1], k, v, md, layer=layer,
                                            backend=runner.backend.name)
            o = alt_attention.attention(q, kc, vc, md, layer=layer, sm_scale=cfg.head_dim ** -0.5,
                                        backend=runner.backend.name)
            return o, (kc, vc)

        hidden, kv = run_layers(cfg, params, batch["input_ids"], batch["positions"], attn, kv)
        logits = compute_logits(cfg, params, hidden[batch["logits_indices"]])
        out = alt_sampler.sample(logits, batch["sampling"], max_logprobs=runner.config.max_logprobs)
        return out.token_ids, kv

    step_before = jax.jit(before_fn, donate_argnums=(1,))
    fwd = jax.jit(fwd_fn, donate_argnums=(1,))
    altattn = jax.jit(functools.partial(variant_fn, "altattn"), donate_argnums=(1,))
    noattn = jax.jit(functools.partial(variant_fn, "noattn"), donate_argnums=(1,))
    wkv = jax.jit(functools.partial(variant_fn, "wkv"), donate_argnums=(1,))
    from jaxserve.model_runner import _step_fn
    params_scan = runner.params
    if isinstance(params_scan["layers"], (list, tuple)):
        params_scan = dict(params_scan, layers={k: jnp.stack([lp[k] for lp in params_scan["layers"]])
                                                for k in params_scan["layers"][0]})
    step_scan = jax.jit(functools.partial(_step_fn, cfg, runner.backend,
                                          runner.config.max_logprobs), donate_argnums=(1,))
    samp = jax.jit(functools.partial(sample, max_logprobs=runner.config.max_logprobs))

    rng = np.random.default_rng(0)
    prompt_len = 48
    header = f"{'rows':>4} {'ctx':>5} {'bucket':>9} {'part':>8} {'med ms':>8} {'min ms':>8} {'load':>5}"
    print(header, flush=True)
    for ctx in ctxs:
        for S in rows_list:
            sp = SamplingParams(temperature=0.0, max_tokens=ctx + 64, ignore_eos=True)
            ids = [f"r{ctx}_{S}_{i}" for i in range(S)]
            for rid in ids:
                engine.add_request(rid, [int(x) for x in rng.integers(100, 40000, prompt_len)], sp)
            # Prefill, then decode until the context reaches ctx (fast path: fake tokens would
            # change nothing in cost, but real steps keep the scheduler state honest).
            steps_needed = ctx - prompt_len
            t0 = time.perf_counter()
            while True:
                engine.step()
                reqs = [engine._child(r).request for r in ids]
                if min(r.num_computed_tokens for r in reqs) >= ctx:
                    break
            t_drive = time.perf_counter() - t0
            out = engine.scheduler.schedule()
            requests = engine._requests_of(out)
            host = runner._host_batch(out, requests)
            bucket = (out.token_bucket, out.seq_bucket)
            # Undo the schedule: the scheduler state must advance with a sampled token.
            dev = jax.device_put(host)

            def run_step():
                res, runner.kv_cache = runner._step(runner.params, runner.kv_cache, dev)
                jax.block_until_ready(res.token_ids)

            def run(f):
                def g():
                    lg, runner.kv_cache = f(runner.params, runner.kv_cache, dev)
                    jax.block_until_ready(lg)
                return g

            res = {}
            if args.xprof:
                print_top_ops(run_step, args.xprof)
            fns = {"step": run_step}
            if "scan" not in skip:  # the step with stacked params (the lax.scan path)
                def run_step_scan():
                    r, runner.kv_cache = step_scan(params_scan, runner.kv_cache, dev)
                    jax.block_until_ready(r.token_ids)
                fns["step_scan"] = run_step_scan
            if alt_attention is not None and alt_sampler is not None:
                def run_before():
                    r, runner.kv_cache = step_before(params_scan, runner.kv_cache, dev)
                    jax.block_until_ready(r)
                fns["step_before"] = run_before
            for name, f in (("fwd", fwd), ("altattn", altattn), ("noattn", noattn), ("wkv", wkv)):
                if name not in skip:
                    fns[name] = run(f)
            if "sampler" not in skip:
                logits = jax.device_put(rng.standard_normal((out.seq_bucket, cfg.vocab_size),
                                                            np.float32) * 4)
                smd = jax.device_put(dev["sampling"])
                fns["sampler"] = lambda: jax.block_until_ready(samp(logits, smd).token_ids)
            for name, f in fns.items():  # compile + warm each before timing any
                t0 = time.perf_counter()
                f()
                print(f"  first call of {name}: {time.perf_counter() - t0:.1f} s", flush=True)
            res.update(compare(fns, args.iters))
            # host side of one engine step, measured piecewise on the real plan
            tb = timeit(lambda: runner._host_batch(out, requests), args.iters)
            tp = timeit(lambda: jax.block_until_ready(jax.device_put(host)), args.iters)
            res["hostbatch"] = tb
            res["dev_put"] = tp
            # Finish this plan as the engine would (sampled token ids -> scheduler).
            sampled = runner.execute(out, requests)
            engine.scheduler.update_from_output(out, {r: t.token_id for r, t in sampled.items()})
            for r, t in sampled.items():
                engine._on_token(r, t, time.monotonic())
            engine._collect({r: None for r in sampled})
            # whole engine.step() wall in steady decode (host + device)
            walls = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t0)
            if args.cprofile:
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(10):
                    engine.step()
                pr.disable()
                pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
            res["eng.step"] = 1e3 * statistics.median(walls), 1e3 * min(walls)
            res["host~"] = tuple(a - b for a, b in zip(res["eng.step"], res["step"]))
            for k, (med, mn) in res.items():
                print(f"{S:>4} {ctx:>5} {str(bucket):>9} {k:>8} {med:8.2f} {mn:8.2f} {load():>5}",
                      flush=True)
            print(f"  (drove {S} rows to ctx {ctx} in {t_drive:.1f} s)", flush=True)
            if S < max(rows_list):  # a mixed step: these decodes plus one 48-token prefill
                engine.add_request(f"mix{ctx}_{S}", [int(x) for x in rng.integers(100, 40000, prompt_len)], sp)
                ids.append(f"mix{ctx}_{S}")
                out = engine.scheduler.schedule()
                mdev = jax.device_put(runner._host_batch(out, engine._requests_of(out)))

                def run_mixed():
                    r, runner.kv_cache = runner._step(runner.params, runner.kv_cache, mdev)
                    jax.block_until_ready(r.token_ids)
                mfns = {"mixed": run_mixed}
                for name, f in (("mix_fwd", fwd), ("mix_alt", altattn)):
                    if name.replace("mix_", "") not in skip and not (name == "mix_alt" and "altattn" in skip):
                        def g(f=f):
                            lg, runner.kv_cache = f(runner.params, runner.kv_cache, mdev)
                            jax.block_until_ready(lg)
                        g()
                        mfns[name] = g
                run_mixed()
                if args.xprof:
                    print_top_ops(run_mixed, args.xprof)
                for name, (med, mn) in compare(mfns, args.iters).items():
                    print(f"{S:>4} {ctx:>5} {str((out.token_bucket, out.seq_bucket)):>9} {name:>8} "
                          f"{med:8.2f} {mn:8.2f} {load():>5}", flush=True)
                sampled = runner.execute(out, engine._requests_of(out))
                engine.scheduler.update_from_output(out, {r: t.token_id for r, t in sampled.items()})
            for rid in ids:
                engine.abort(rid)
    print(f"compiles after build: {runner._step._cache_size()} step programs")


if __name__ == "__main__":
    main()
