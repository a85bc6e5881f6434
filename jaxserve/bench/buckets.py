"""`jaxserve bench buckets`: which token/sequence buckets to compile, measured on a trace.

    jaxserve bench buckets --trace=../shared/bench/ragged64.jsonl --dry_run
    jaxserve bench buckets --trace=../shared/bench/ragged64.jsonl --policies=pow2:8,fit:4

Every step pads its ragged token count up to a bucket, and every (T_pad,
S_pad) pair is a program compiled at warm-up (vLLM's CUDA-graph capture
sizes, tpu-inference's token paddings). Few buckets: cheap warm-up, much
padding; many: the reverse. Per candidate policy this reports programs
compiled, warm-up seconds (cold and with the persistent compile cache),
padded-token fraction overall and per bucket, steps, output tokens/s, and
TTFT/TPOT at p50/p99, marks the Pareto fronts, plots them, and recommends
the cheapest policy within 2% of the best throughput as `jaxserve serve` flags.

Candidates (`--policies`, comma-separated): `pow2:MIN` (powers of two from
MIN), `pow2_linear:GAP`, `single` (one bucket), `fit:K[:KS]` (K token
buckets, KS sequence buckets, fitted with `fit_buckets` to the
tokens-per-step / seqs-per-step histograms of a dry run with every size a
bucket, i.e. no padding), and `--explicit 16,64,256` lists.

`--dry_run` replays the trace through the real scheduler with a fake runner:
steps and padding are exact, throughput/latency come from the `StepCost`
model and warm-up from `--compile_s` (both labeled "modeled"). Without it,
each policy runs in a fresh subprocess on the real model (fresh compile-cache
directory: a cold engine build, a second build that hits the cache, then the
trace in real time), which is slow on a CPU: choose few policies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from jaxserve.bench.replay import ReplayResult, StepCost, dry_run, prompt_ids_for
from jaxserve.bench.traces import (TraceRequest, load_default_tokenizer, load_trace,
                                   synthetic_trace)
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.bench.bucket_fit import fit_buckets
from jaxserve.scheduler.buckets import BucketPolicy, pow2_buckets, pow2_linear_buckets

DEFAULT_POLICIES = "single,pow2:8,pow2:1,pow2_linear:64,pow2_linear:32,fit:2,fit:4,fit:6,fit:8"
THROUGHPUT_TOLERANCE = 0.02


@dataclass(frozen=True)
class PolicySpec:
    """A named candidate: its token and sequence buckets."""

    name: str
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]

    def policy(self) -> BucketPolicy:
        return BucketPolicy(self.token_buckets, self.seq_buckets)

    @property
    def programs(self) -> int:
        """Programs compiled at warm-up: the reachable (T_pad, S_pad) pairs."""
        return len(self.policy().all_shapes())

    def flags(self, max_num_batched_tokens: int, max_num_seqs: int) -> str:
        """The exact `jaxserve serve` flags that select this policy."""
        return (f"--max_num_batched_tokens={max_num_batched_tokens} --max_num_seqs={max_num_seqs} "
                f"--token_buckets={','.join(map(str, self.token_buckets))} "
                f"--seq_buckets={','.join(map(str, self.seq_buckets))}")


def fit_histograms(rows: Sequence[TraceRequest], prompt_ids, sched: SchedulerConfig,
                   cache: CacheConfig, cost: StepCost, respect_arrivals: bool
                   ) -> tuple[dict[int, int], dict[int, int]]:
    """Tokens-per-step and seqs-per-step histograms of a dry run with every size a bucket."""
    finest = BucketPolicy(range(1, sched.max_num_batched_tokens + 1), range(1, sched.max_num_seqs + 1))
    seqs: dict[int, int] = {}

    def note(out) -> None:
        seqs[out.num_seqs] = seqs.get(out.num_seqs, 0) + 1

    r = dry_run(rows, prompt_ids, sched, cache, policy=finest, cost=cost,
                respect_arrivals=respect_arrivals, on_step=note)
    return dict(r.tokens_per_step), seqs


def build_candidates(specs: str, explicit: Sequence[str], *, max_tokens: int, max_seqs: int,
                     token_hist: dict[int, int] | None = None,
                     seq_hist: dict[int, int] | None = None) -> list[PolicySpec]:
    """Parse `--policies` / `--explicit` into PolicySpecs (histograms needed for fit:K).

    Raises:
      ValueError: an unknown policy name, a bad parameter, or an explicit list
        whose last bucket is not max_num_batched_tokens.
    """
    seq_pow2 = pow2_buckets(max_seqs)
    out: list[PolicySpec] = []
    for spec in [s.strip() for s in specs.split(",") if s.strip()]:
        kind, _, arg = spec.partition(":")
        try:
            if kind == "pow2":
                out.append(PolicySpec(spec, pow2_buckets(max_tokens, int(arg or 8)), seq_pow2))
            elif kind == "pow2_linear":
                out.append(PolicySpec(spec, pow2_linear_buckets(max_tokens, int(arg or 64), 8), seq_pow2))
            elif kind == "single":
                out.append(PolicySpec(spec, (max_tokens,), (max_seqs,)))
            elif kind == "fit":
                k, _, ks = arg.partition(":")
                if token_hist is None or seq_hist is None:
                    raise ValueError("fit:K needs the dry-run histograms")
                tb = fit_buckets(token_hist, int(k), max_tokens)
                sb = fit_buckets(seq_hist, int(ks or k), max_seqs)
                out.append(PolicySpec(spec, tb, sb))
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except ValueError as e:
            raise ValueError(f"--policies entry {spec!r}: {e} (kinds: pow2:MIN, pow2_linear:GAP, "
                             "single, fit:K[:KS])") from None
    for lst in explicit:
        tb = tuple(int(x) for x in lst.split(","))
        if not tb or tb[-1] != max_tokens:
            raise ValueError(f"--explicit {lst!r}: the last bucket must equal "
                             f"--max_num_batched_tokens={max_tokens}")
        out.append(PolicySpec(f"explicit:{lst}", tb, seq_pow2))
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate policies in {names}")
    return out


def evaluate_dry(spec: PolicySpec, rows, prompt_ids, sched: SchedulerConfig, cache: CacheConfig,
                 cost: StepCost, respect_arrivals: bool, compile_s: tuple[float, float]) -> dict[str, Any]:
    """One policy's dry-run row (exact steps/padding; modeled time)."""
    r: ReplayResult = dry_run(rows, prompt_ids, sched, cache, policy=spec.policy(), cost=cost,
                              respect_arrivals=respect_arrivals)
    s = r.summary()
    n = spec.programs
    s.update(name=spec.name, token_buckets=list(spec.token_buckets), seq_buckets=list(spec.seq_buckets),
             programs=n, warmup_cold_s=n * compile_s[0], warmup_cached_s=n * compile_s[1],
             timing="modeled")
    return s


def pareto(points: Sequence[tuple[float, float]]) -> list[bool]:
    """True for points no other point dominates; both coordinates are minimised."""
    flags = []
    for i, (a, b) in enumerate(points):
        dominated = any((c <= a and d <= b) and (c < a or d < b)
                        for j, (c, d) in enumerate(points) if j != i)
        flags.append(not dominated)
    return flags


def recommend(rows: Sequence[dict[str, Any]], tol: float = THROUGHPUT_TOLERANCE) -> dict[str, Any]:
    """Cheapest (fewest programs, then least cold warm-up, then least padding) row
    whose throughput is within `tol` of the best."""
    best = max(r["output_tokens_per_s"] for r in rows)
    ok = [r for r in rows if r["output_tokens_per_s"] >= (1 - tol) * best]
    return min(ok, key=lambda r: (r["programs"], r["warmup_cold_s"], r["padding_fraction"]))


def mark_fronts(rows: list[dict[str, Any]]) -> None:
    """Set `pareto_padding` (padding vs programs) and `pareto_throughput`
    (throughput vs cold warm-up) on each row."""
    f1 = pareto([(r["padding_fraction"], r["programs"]) for r in rows])
    f2 = pareto([(-r["output_tokens_per_s"], r["warmup_cold_s"]) for r in rows])
    for r, a, b in zip(rows, f1, f2):
        r["pareto_padding"], r["pareto_throughput"] = a, b


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """Policy table on stdout (* marks a Pareto-front point: padding | throughput)."""
    hdr = (f"{'policy':<16}{'token buckets':<34}{'progs':>6}{'warm cold/cache s':>19}{'pad%':>7}"
           f"{'seqpad%':>8}{'steps':>7}{'tok/s':>8}{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>17}  front")
    print(hdr)
    for r in rows:
        tb = ",".join(map(str, r["token_buckets"]))
        print(f"{r['name']:<16}{tb[:33]:<34}{r['programs']:>6}"
              f"{r['warmup_cold_s']:>10.1f}/{r['warmup_cached_s']:<8.1f}"
              f"{100 * r['padding_fraction']:>7.1f}{100 * r['seq_padding_fraction']:>8.1f}{r['steps']:>7}"
              f"{r['output_tokens_per_s']:>8.1f}"
              f"{r['ttft_ms']['median']:>9.0f}/{r['ttft_ms']['p99']:<8.0f}"
              f"{r['tpot_ms']['median']:>8.1f}/{r['tpot_ms']['p99']:<8.1f}"
              f"  {'*' if r['pareto_padding'] else ' '}{'*' if r['pareto_throughput'] else ' '}")
    print("per-bucket padding (bucket: steps, padding %):")
    for r in rows:
        per = " ".join(f"{b}:{v['steps']},{100 * v['padding_fraction']:.0f}%"
                       for b, v in r["per_bucket"].items() if v["steps"])
        print(f"  {r['name']:<14} {per}")


# ---------------------------------------------------------------- real-model mode
def _real_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process: cold build, cached build, then the trace (all measured)."""
    from jaxserve.bench.replay import engine_run
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.compile import enable_compilation_cache

    enable_compilation_cache(spec["cache_dir"])
    cfg, params, tok = load_model(resolve_model_path(spec["model"]), dtype=spec["dtype"])
    config = make_engine_config(cfg, **spec["engine_args"])
    res: dict[str, Any] = {}
    for phase in ("cold", "cached"):
        eng = LLMEngine(config, params, tok, progress=False)
        st = eng.runner.stats()
        res[f"warmup_{phase}_s"] = st.warmup_seconds
        res[f"backend_compiles_{phase}"] = st.programs_built  # the rest came from the cache
        res[f"programs_loaded_{phase}"] = st.programs_loaded
        if phase == "cold":
            del eng
    rows = [TraceRequest(**r) for r in spec["rows"]]
    r = engine_run(eng, rows, respect_arrivals=spec["respect_arrivals"])
    res.update(r.summary())
    res["compiles_after_warmup"] = eng.runner.stats().late_compiles
    return res


def evaluate_real(spec: PolicySpec, rows: Sequence[TraceRequest], args: argparse.Namespace,
                  engine_args: dict[str, Any]) -> dict[str, Any]:
    """One policy on the real model, in a subprocess with its own fresh compile cache."""
    with tempfile.TemporaryDirectory(prefix="jaxserve_bench_cc_") as cc:
        job = {"cache_dir": cc, "model": args.model, "dtype": args.dtype,
               "engine_args": dict(engine_args, token_buckets=spec.token_buckets,
                                   seq_buckets=spec.seq_buckets),
               "rows": [r.__dict__ for r in rows], "respect_arrivals": not args.ignore_arrivals}
        jpath = Path(cc) / "job.json"
        jpath.write_text(json.dumps(job))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxserve.bench.buckets", "--_worker", str(jpath)],
                              capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(f"policy {spec.name}: worker failed:\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    res.update(name=spec.name, token_buckets=list(spec.token_buckets),
               seq_buckets=list(spec.seq_buckets), programs=spec.programs, timing="measured",
               subprocess_s=time.perf_counter() - t0)
    return res


# ---------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench buckets", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="JSONL trace (default: a synthetic one)")
    p.add_argument("--num_requests", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--synthetic", default="lognormal:32,exponential:96,4.0,64",
                   help="PROMPT_DIST:MEAN,OUTPUT_DIST:MEAN,RATE,N for the synthetic trace")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--explicit", action="append", default=[], help="an explicit token-bucket list")
    p.add_argument("--max_num_batched_tokens", type=int, default=256)
    p.add_argument("--max_num_seqs", type=int, default=32)
    p.add_argument("--max_model_len", type=int, default=2048)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--num_kv_blocks", type=int, default=2048)
    p.add_argument("--min_token_bucket", type=int, default=8,
                   help="fit:K buckets start here (StepCost's old CPU probe: no cheaper below "
                        "8; the engine's own default is 1 since notes/perf.md's fifth wave)")
    p.add_argument("--ignore_arrivals", action="store_true", help="all requests at t=0")
    p.add_argument("--dry_run", action="store_true", help="fake runner, no model (seconds)")
    p.add_argument("--step_cost_ms", default=None, help="dry-run cost model FIXED,PER_TOKEN[,PER_SEQ]")
    p.add_argument("--compile_s", default="3.0,0.3",
                   help="dry-run warm-up model: seconds per program cold,cached")
    p.add_argument("--tokenizer", choices=("auto", "none"), default="auto",
                   help="auto: SmolLM2's real tokenizer + chat template when the model file exists")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output_json", default="bench_buckets.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return p


def _trace(args) -> list[TraceRequest]:
    if args.trace:
        return load_trace(args.trace, limit=args.num_requests)
    try:
        pd, om, rate, n = args.synthetic.split(",")
        (pdist, pmean), (odist, omean) = pd.split(":"), om.split(":")
        return synthetic_trace(int(n), request_rate=float(rate), prompt_dist=pdist,
                               prompt_mean=float(pmean), output_dist=odist, output_mean=float(omean))
    except ValueError as e:
        raise ValueError(f"--synthetic={args.synthetic!r}: {e}") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate every candidate; returns the JSON document."""
    rows = _trace(args)
    tok = load_default_tokenizer() if args.tokenizer == "auto" else None
    ids = prompt_ids_for(rows, tok, vocab_size=49152 if tok is None else tok.vocab_size)
    sched = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    cache = CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks)
    cost = StepCost.parse(args.step_cost_ms) if args.step_cost_ms else StepCost()
    respect = not args.ignore_arrivals
    th, sh = fit_histograms(rows, ids, sched, cache, cost, respect)
    # Fit on counts raised to --min_token_bucket: below it a step costs no less on this
    # CPU (StepCost.knee_tokens), so a smaller bucket would only add a program.
    th_fit: dict[int, int] = {}
    for n, c in th.items():
        m = min(max(n, args.min_token_bucket), args.max_num_batched_tokens)
        th_fit[m] = th_fit.get(m, 0) + c
    cands = build_candidates(args.policies, args.explicit, max_tokens=args.max_num_batched_tokens,
                             max_seqs=args.max_num_seqs, token_hist=th_fit, seq_hist=sh)
    compile_s = tuple(float(x) for x in args.compile_s.split(","))
    if args.dry_run:
        results = [evaluate_dry(c, rows, ids, sched, cache, cost, respect, compile_s) for c in cands]
    else:
        eargs = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     max_model_len=args.max_model_len, block_size=args.block_size,
                     num_kv_blocks=args.num_kv_blocks)
        results = []
        for c in cands:
            print(f"[bench buckets] {c.name}: {c.programs} programs ...", flush=True)
            results.append(evaluate_real(c, rows, args, eargs))
    mark_fronts(results)
    rec = recommend(results)
    return {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "trace": {"requests": len(rows), "output_tokens": sum(r.max_tokens for r in rows),
                      "prompt_tokens": sum(len(x) for x in ids),
                      "tokenizer": "smollm2+chat_template" if tok is not None else "approx"},
            "step_cost_ms": cost.__dict__ if args.dry_run else None,
            "tokens_per_step_histogram": {str(k): v for k, v in sorted(th.items())},
            "seqs_per_step_histogram": {str(k): v for k, v in sorted(sh.items())},
            "policies": results,
            "recommendation": {"name": rec["name"],
                               "flags": PolicySpec(rec["name"], tuple(rec["token_buckets"]),
                                                   tuple(rec["seq_buckets"])).flags(
                                   args.max_num_batched_tokens, args.max_num_seqs)}}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (argv: the arguments after `bench buckets`)."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args._worker:
        print(json.dumps(_real_worker(json.loads(Path(args._worker).read_text()))))
        return 0
    doc = run(args)
    print_table(doc["policies"])
    best = max(r["output_tokens_per_s"] for r in doc["policies"])
    rec = doc["recommendation"]
    print(f"\nrecommended ({'modeled' if args.dry_run else 'measured'} throughput within "
          f"{100 * THROUGHPUT_TOLERANCE:.0f}% of the best, {best:.1f} tok/s, with the fewest programs): "
          f"{rec['name']}\n  jaxserve serve {rec['flags']}")
    out = Path(args.output_json)
    out.write_text(json.dumps(doc, indent=1))
    from jaxserve.bench.plots import plot_bucket_tradeoffs

    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot_bucket_tradeoffs(doc["policies"], png, title=Path(args.trace).name if args.trace else "synthetic",
                          modeled=args.dry_run)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
