"""Serial vs static vs continuous batching on our engine, and a max_num_seqs sweep.

    python scripts/bench_batching.py --traces=../shared/bench/seed8.jsonl,../shared/bench/ragged64.jsonl
    python scripts/bench_batching.py --sweep --dry_run

The seeds' experiment (Orca, OSDI'22, iteration-level scheduling): the same
model and trace run three ways, greedy with ignore_eos so every request
yields exactly its max_tokens:

- serial: max_num_seqs=1, one request after another;
- static: `SchedulerConfig.static_batching` - a batch of up to B is admitted
  and nothing joins until all of it has finished;
- continuous: up to B rows, a finished row's slot refilled at the next step.

Reported per mode: steps, useful output tokens/s and its ratio to serial and
to static, measured row-step utilisation (rows that produced a token over
B x steps) next to the seeds' formula for one static batch (sum of lengths
over B x the longest length: 24.0% for seed8), and the TTFT of a probe
request that arrives just after a static batch starts (it waits for the
whole batch; with continuous batching it takes the first free slot).

`--dry_run` uses the fake runner and the `StepCost` model (exact steps,
modeled time); otherwise the real default model runs on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from jaxserve.bench.replay import ReplayResult, StepCost, dry_run, engine_run, prompt_ids_for
from jaxserve.bench.traces import TraceRequest, load_default_tokenizer, load_trace, synthetic_trace
from jaxserve.config import CacheConfig, SchedulerConfig

MODES = ("serial", "static", "continuous")
SWEEP_SEQS = (1, 4, 16, 64, 256)
PROBE_ID = "probe"


def mode_args(mode: str, batch: int) -> dict[str, Any]:
    """Engine arguments that select a batching mode with batch width `batch`.

    Raises:
      ValueError: an unknown mode or batch < 1.
    """
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if mode == "serial":
        return {"max_num_seqs": 1, "static_batching": False}
    if mode == "static":
        return {"max_num_seqs": batch, "static_batching": True}
    if mode == "continuous":
        return {"max_num_seqs": batch, "static_batching": False}
    raise ValueError(f"mode={mode!r} must be one of {MODES}")


def seeds_formula(lengths: Sequence[int], batch: int) -> float:
    """Row-step utilisation of static batches of `batch` in order: sum(len) / sum(B x max(len)).

    For one batch (seed8, B=8) this is the seeds' 1968 / (8 x 1024) = 24.0%.
    """
    denom = sum(batch * max(lengths[i:i + batch]) for i in range(0, len(lengths), batch))
    return sum(lengths) / denom


Runner = Callable[[Sequence[TraceRequest], str, int], ReplayResult]


def dry_runner(*, max_num_batched_tokens: int = 256, block_size: int = 16, num_kv_blocks: int = 4096,
               max_model_len: int = 2048, cost: StepCost = StepCost(), tokenizer: Any = None,
               vocab_size: int = 49152, chat: bool = True, respect_arrivals: bool = True) -> Runner:
    """A Runner that replays through the real scheduler with a fake runner (modeled time)."""
    def run(rows, mode, batch):
        ma = mode_args(mode, batch)
        sched = SchedulerConfig(max_num_batched_tokens=max(max_num_batched_tokens, ma["max_num_seqs"]),
                                max_num_seqs=ma["max_num_seqs"], max_model_len=max_model_len,
                                static_batching=ma["static_batching"])
        cache = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks)
        ids = prompt_ids_for(rows, tokenizer, vocab_size=vocab_size, chat=chat)
        return dry_run(rows, ids, sched, cache, cost=cost, respect_arrivals=respect_arrivals)
    return run


def engine_runner(make_engine: Callable[[dict[str, Any]], Any], *, chat: bool = True,
                  respect_arrivals: bool = True) -> Runner:
    """A Runner on real engines: `make_engine(engine_args)` builds (and warms up) one per call."""
    def run(rows, mode, batch):
        engine = make_engine(mode_args(mode, batch))
        try:
            return engine_run(engine, rows, respect_arrivals=respect_arrivals, chat=chat)
        finally:
            del engine
    return run


def compare_modes(rows: Sequence[TraceRequest], batch: int, runner: Runner,
                  modes: Sequence[str] = MODES) -> dict[str, Any]:
    """Run each mode on the same trace; rows of the comparison table (+ ratios)."""
    table: dict[str, Any] = {}
    for mode in modes:
        t0 = time.perf_counter()
        r = runner(rows, mode, batch)
        s = r.summary()
        s["bench_wall_s"] = time.perf_counter() - t0
        table[mode] = s
        print(f"[bench batching] {mode}: {s['steps']} steps, {s['output_tokens_per_s']:.1f} tok/s "
              f"({s['bench_wall_s']:.0f} s incl. engine build)", flush=True)
    for mode, s in table.items():
        for ref in ("serial", "static"):
            if ref in table and table[ref]["output_tokens_per_s"] > 0:
                s[f"speedup_vs_{ref}"] = s["output_tokens_per_s"] / table[ref]["output_tokens_per_s"]
    lengths = [r.max_tokens for r in rows]
    return {"batch": batch, "requests": len(rows), "output_tokens": sum(lengths),
            "seeds_formula_static_utilisation": seeds_formula(lengths, batch), "modes": table}


def probe_ttft(rows: Sequence[TraceRequest], batch: int, runner: Runner, *, delay_s: float = 0.05,
               max_tokens: int = 16) -> dict[str, float]:
    """TTFT (ms) of one extra request arriving `delay_s` after a batch that starts at t=0.

    The batch is `rows` with every arrival at 0; static makes the probe wait
    for the whole batch, continuous admits it at the first free slot.
    """
    batch_rows = [TraceRequest(r.id, r.prompt, r.max_tokens, 0.0, r.prompt_tokens) for r in rows]
    probe = TraceRequest(PROBE_ID, "What is the capital of France?", max_tokens, delay_s)
    out = {}
    for mode in ("static", "continuous"):
        r = runner(batch_rows + [probe], mode, batch)
        out[mode] = r.ttft_by_id[PROBE_ID] * 1e3
    return out


def sweep(runner: Runner, *, num_requests: int = 256, max_tokens: int = 16,
          seqs: Sequence[int] = SWEEP_SEQS, min_requests: int = 32) -> list[dict[str, Any]]:
    """Continuous batching at each max_num_seqs over short requests, all arriving at once.

    Small widths run `max(min_requests, 4 * B)` of the requests (capped at
    num_requests): serial throughput does not depend on the count, and 256
    one-at-a-time requests would take minutes on a CPU.
    """
    rows = [TraceRequest(f"w{i}", f"Say {i}.", max_tokens, 0.0) for i in range(num_requests)]
    out = []
    for b in seqs:
        n = min(num_requests, max(min_requests, 4 * b))
        s = runner(rows[:n], "continuous", b).summary()
        s.update(max_num_seqs=b, requests=n)
        print(f"[bench batching] sweep max_num_seqs={b}: {s['output_tokens_per_s']:.1f} tok/s", flush=True)
        out.append(s)
    return out


def print_compare(name: str, c: dict[str, Any]) -> None:
    print(f"\n{name}: {c['requests']} requests, {c['output_tokens']} output tokens, B={c['batch']}, "
          f"seeds' static formula {100 * c['seeds_formula_static_utilisation']:.1f}%")
    print(f"{'mode':<12}{'steps':>7}{'wall s':>9}{'tok/s':>9}{'x serial':>10}{'x static':>10}"
          f"{'row util':>10}{'TTFT p50 ms':>13}{'pad%':>7}")
    for mode, s in c["modes"].items():
        print(f"{mode:<12}{s['steps']:>7}{s['duration_s']:>9.2f}{s['output_tokens_per_s']:>9.1f}"
              f"{s.get('speedup_vs_serial', float('nan')):>10.2f}{s.get('speedup_vs_static', float('nan')):>10.2f}"
              f"{100 * s['row_step_utilisation']:>9.1f}%{s['ttft_ms']['median']:>13.0f}"
              f"{100 * s['padding_fraction']:>7.1f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/bench_batching.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="../shared/bench/seed8.jsonl,../shared/bench/ragged64.jsonl")
    p.add_argument("--batch", type=int, default=8, help="B: max_num_seqs of static and continuous")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ignore_arrivals", action="store_true", help="every request at t=0")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--probe_trace", default=None, help="batch for the probe (default: first trace)")
    p.add_argument("--sweep", action="store_true", help="also sweep max_num_seqs")
    p.add_argument("--sweep_only", action="store_true")
    p.add_argument("--sweep_requests", type=int, default=256)
    p.add_argument("--sweep_max_tokens", type=int, default=16)
    p.add_argument("--sweep_seqs", default=",".join(map(str, SWEEP_SEQS)))
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--step_cost_ms", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--max_num_batched_tokens", type=int, default=256)
    p.add_argument("--compile_cache_dir", default="checkpoints/jax_compile_cache")
    p.add_argument("--output_json", default="bench_batching.json")
    p.add_argument("--plot", default="docs/batching_sweep.png")
    return p


def _real_factory(args) -> Callable[[dict[str, Any]], Any]:
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.compile import enable_compilation_cache

    enable_compilation_cache(args.compile_cache_dir)
    cfg, params, tok = load_model(resolve_model_path(args.model))

    def make(extra: dict[str, Any]) -> Any:
        ea = dict(max_num_batched_tokens=max(args.max_num_batched_tokens, extra["max_num_seqs"]))
        ea.update(extra)
        return LLMEngine(make_engine_config(cfg, **ea), params, tok, progress=False)
    return make


def _sweep_factory(make: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """Two programs per width: decode steps padded to B rows, prefill steps to the budget."""
    def make_sweep(extra: dict[str, Any]) -> Any:
        b = extra["max_num_seqs"]
        top = max(256, b)
        return make(dict(extra, max_num_batched_tokens=top, token_buckets=tuple(sorted({b, top})),
                         seq_buckets=(b,)))
    return make_sweep


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    modes = [m for m in args.modes.split(",") if m]
    respect = not args.ignore_arrivals
    if args.dry_run:
        tok = load_default_tokenizer()
        cost = StepCost.parse(args.step_cost_ms) if args.step_cost_ms else StepCost()
        runner = dry_runner(cost=cost, tokenizer=tok, max_num_batched_tokens=args.max_num_batched_tokens,
                            respect_arrivals=respect)
        sweep_runner = dry_runner(cost=cost, tokenizer=tok, chat=False, respect_arrivals=False)
    else:
        make = _real_factory(args)
        runner = engine_runner(make, respect_arrivals=respect)
        sweep_runner = engine_runner(_sweep_factory(make), chat=False, respect_arrivals=False)
    doc: dict[str, Any] = {"config": vars(args), "timing": "modeled" if args.dry_run else "measured",
                           "traces": {}}
    traces = [t for t in args.traces.split(",") if t] if not args.sweep_only else []
    for path in traces:
        rows = load_trace(path)
        c = compare_modes(rows, args.batch, runner, modes)
        doc["traces"][Path(path).name] = c
        print_compare(Path(path).name, c)
    if args.probe and traces:
        rows = load_trace(args.probe_trace or traces[0])
        doc["probe_ttft_ms"] = probe_ttft(rows, args.batch, runner)
        print(f"\nprobe arriving 50 ms after a static batch of {Path(args.probe_trace or traces[0]).name} "
              f"starts: TTFT static {doc['probe_ttft_ms']['static']:.0f} ms, continuous "
              f"{doc['probe_ttft_ms']['continuous']:.0f} ms")
    if args.sweep or args.sweep_only:
        seqs = [int(x) for x in args.sweep_seqs.split(",")]
        pts = sweep(sweep_runner, num_requests=args.sweep_requests, max_tokens=args.sweep_max_tokens,
                    seqs=seqs)
        doc["sweep"] = pts
        print(f"\nmax_num_seqs sweep ({args.sweep_max_tokens} tokens per request, all at t=0):")
        print(f"{'max_num_seqs':>13}{'requests':>10}{'steps':>7}{'wall s':>9}{'tok/s':>9}")
        for s in pts:
            print(f"{s['max_num_seqs']:>13}{s['requests']:>10}{s['steps']:>7}{s['duration_s']:>9.2f}"
                  f"{s['output_tokens_per_s']:>9.1f}")
        if args.plot:
            from jaxserve.bench.plots import plot_sweep

            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot_sweep([(s["max_num_seqs"], s["output_tokens_per_s"]) for s in pts], args.plot,
                       title=f"continuous batching, {args.sweep_max_tokens}-token requests"
                             + (" (modeled)" if args.dry_run else ""))
    Path(args.output_json).write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
