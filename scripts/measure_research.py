"""Per-RL-step costs on the real model (issue 15): in-process weight swap vs a fresh engine.

Measures, on one engine config (the engine defaults unless flags say otherwise):
  - the score programs: count added and compile seconds (runner's per-family split);
  - update_params time (host NumPy tree, and a tree already on the device);
  - a rollout: P prompts x n samples x T tokens (temperature 1, ignore_eos, seeded);
  - score() of the same completions (teacher-forced), and its agreement with the
    rollout's own logprobs;
  - the same work done by a fresh engine: load_model (params cache) + LLMEngine
    warm-up (programs from the compile cache) + rollout + score, i.e. what a
    process-separated engine pays per RL step if it restarts to take new weights.

Usage (not part of make test; minutes on a 2-core CPU):
  PYTHONPATH=$PWD python scripts/measure_research.py [--out notes/research_measure.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2 in checkpoints/)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--max_num_seqs", type=int, default=32)
    ap.add_argument("--max_num_batched_tokens", type=int, default=256)
    ap.add_argument("--compile_cache_dir", default="checkpoints/jax_compile_cache")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("--compile_only", action="store_true",
                    help="only time cold compiles (no compile cache) of every score program "
                         "and of the largest stack program, for comparison")
    a = ap.parse_args()
    if a.compile_only:
        return compile_only(a)

    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.compile import enable_compilation_cache

    enable_compilation_cache(a.compile_cache_dir)
    path = resolve_model_path(a.model)
    eargs = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
    res: dict = {"model": str(path), "engine_args": eargs, "load_before": os.getloadavg()}

    def fresh_engine() -> tuple[LLM, dict]:
        t0 = time.perf_counter()
        cfg, params, tok = load_model(path, progress=False)
        t1 = time.perf_counter()
        eng = LLMEngine(make_engine_config(cfg, **eargs), params, tok, progress=False)
        t2 = time.perf_counter()
        st = eng.runner.stats()
        return LLM(engine=eng), {
            "load_s": t1 - t0, "engine_s": t2 - t1, "start_s": t2 - t0,
            "programs": st.warmup_programs, "built": st.programs_built,
            "loaded": st.programs_loaded, "compile_s_by_family": dict(st.compile_seconds_by_family),
            "score_programs": sum(f == "score" for f, _ in eng.runner._programs)}

    llm, res["first_start"] = fresh_engine()
    tok = llm.engine.tokenizer
    texts = [f"Question {i}: explain briefly why {w} matters." for i, w in enumerate(
        "rain soil light code tea salt iron glass wind music bread maps ice sleep trust time"
        .split())][:a.prompts]
    prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
    sps = [SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True,
                          seed=1000 * i) for i in range(len(prompts))]

    def rollout(m: LLM) -> tuple[list, dict]:
        t0 = time.perf_counter()
        outs = m.generate(prompts, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return outs, {"seconds": dt, "tokens": toks, "tokens_per_s": toks / dt}

    def score(m: LLM, outs) -> tuple[object, dict]:
        ps = [o.prompt_token_ids for o in outs for _ in o.outputs]
        cs = [c.token_ids for o in outs for c in o.outputs]
        t0 = time.perf_counter()
        sb = m.score(ps, cs)
        dt = time.perf_counter() - t0
        n = int(sb.lengths.sum())
        tot = n + sum(len(p) for p in ps)
        return sb, {"seconds": dt, "scored_tokens": n, "scored_per_s": n / dt,
                    "prefill_tokens": tot, "prefill_tokens_per_s": tot / dt}

    llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)  # first-call costs
    c0 = llm.engine.runner.stats().programs_built + llm.engine.runner.stats().programs_loaded
    outs, res["rollout"] = rollout(llm)
    sb, res["score"] = score(llm, outs)
    lp = np.concatenate([np.asarray(c.token_logprobs) for o in outs for c in o.outputs])
    res["score"]["max_abs_diff_vs_rollout_logprobs"] = float(np.abs(sb.logprobs[sb.mask] - lp).max())

    host = jax.tree.map(np.asarray, load_model(path, progress=False)[1])
    dev = jax.device_put(host)
    jax.block_until_ready(dev)
    for name, tree in (("update_params_host_s", host), ("update_params_device_s", dev)):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            llm.update_params(tree)
            jax.block_until_ready(llm.engine.runner.params)
            ts.append(time.perf_counter() - t0)
        res[name] = min(ts)
    st = llm.engine.runner.stats()
    res["compiles_during_steps_and_updates"] = st.programs_built + st.programs_loaded - c0
    res["late_compiles"] = st.late_compiles
    outs2, res["rollout_after_update"] = rollout(llm)
    del llm

    fresh, res["fresh_start"] = fresh_engine()
    fresh.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    _, res["fresh_rollout"] = rollout(fresh)
    _, res["fresh_score"] = score(fresh, outs2)
    res["per_step_in_process_s"] = (res["update_params_host_s"] + res["rollout"]["seconds"]
                                    + res["score"]["seconds"])
    res["per_step_fresh_engine_s"] = (res["fresh_start"]["start_s"] + res["fresh_rollout"]["seconds"]
                                      + res["fresh_score"]["seconds"])
    res["load_after"] = os.getloadavg()
    print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


def compile_only(a) -> None:
    """Cold (no persistent cache) compile seconds of each ("score", T) program and of the
    largest ("stack", T): what --enable_prompt_logprobs adds to a first start."""
    from jaxserve.checkpoint import load_model
    from jaxserve.engine import make_engine_config
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.scheduler.buckets import BucketPolicy

    cfg, params, _ = load_model(a.model, progress=False)
    config = make_engine_config(cfg, max_num_seqs=a.max_num_seqs,
                                max_num_batched_tokens=a.max_num_batched_tokens)
    policy = BucketPolicy.from_config(config.scheduler)
    runner = ModelRunner(config, params, bucket_policy=policy)
    res: dict = {"load_before": os.getloadavg(), "token_buckets": policy.token_buckets,
                 "programs_without_score": len(policy.program_keys()),
                 "programs_with_score": len(policy.program_keys(score=True)), "score_s": {}}
    for t in policy.token_buckets:
        t0 = time.perf_counter()
        runner._build(("score", t))
        res["score_s"][t] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner._build(("stack", policy.token_buckets[-1]))
    res["largest_stack_s"] = time.perf_counter() - t0
    res["score_total_s"] = sum(res["score_s"].values())
    res["built_by_xla"] = runner.stats().programs_built
    res["load_after"] = os.getloadavg()
    print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
