"""Where one request decoding alone spends its step (issue 26 item 3), per variant, in one process.

Builds an `LLM` (one sequence, buckets for one row) per --variants entry over the same
checkpoint at --quantization (default none: SmolLM2 fp32), wraps the runner's compiled
programs (the stack's embed / layers / final, the head) in timers that block on their
results, decodes --max_tokens greedy tokens and prints per step: the layer programs
(summed over the L / G calls), embed + final, the head (LM head + sampler), the host time
between program calls (step wall minus the programs), and tokens/s of the unwrapped run
(no blocking). Variants:
  default    the shipped thresholds (`linear.HEAD_NATIVE_MAX_ROWS`, `FLOAT_NATIVE_MAX_ROWS`)
  head_off   HEAD_NATIVE_MAX_ROWS = 0 (the tied fp32 head on XLA: the "before")
  layers_on  FLOAT_NATIVE_MAX_ROWS = 8 (the shipped value since the fourteenth session)
  layers2    FLOAT_NATIVE_MAX_ROWS = 2 (the shipped value, fifth to thirteenth session)
  layers_off FLOAT_NATIVE_MAX_ROWS = 0 (the layers on XLA's dot: the "before" of that)
  many_off   FLOAT_NATIVE_MANY = False (q, k, v and gate, up one native call each: the
             "before" of `linear.linear_many`)
  g<N>       the shipped thresholds with `EngineConfig.layers_per_program = N` (g1: the CPU
             default; g30: SmolLM2's whole stack in one program)
  fused      `EngineConfig.fuse_projections = True` (q|k|v and gate|up as one matrix each)
  unfused    `EngineConfig.fuse_projections = False` (the default on float weights; on
             block-quantized ones on CPU the default fuses: the "before" of that)
Every variant's engine is built first, then the untimed runs are interleaved (variant by
variant, --reps rounds) and so are the timed ones; --hlo prints what each variant's one-row
layer program holds (custom calls: the native matmuls and attention; fusions). The load average is printed with each row: only ratios within one run mean anything.

  PYTHONPATH=. .venv/bin/python scripts/profile_decode_alone.py --variants=head_off,default
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.model import linear

VARIANTS = {"default": {}, "head_off": {"HEAD_NATIVE_MAX_ROWS": 0},
            "layers_on": {"FLOAT_NATIVE_MAX_ROWS": 8}, "layers2": {"FLOAT_NATIVE_MAX_ROWS": 2},
            "layers_off": {"FLOAT_NATIVE_MAX_ROWS": 0}, "many_off": {"FLOAT_NATIVE_MANY": False}}


class Timed:
    """A compiled program that blocks on its result and adds its seconds to `acc[name]`."""

    def __init__(self, fn, name: str, acc: dict):
        self.fn, self.name, self.acc = fn, name, acc

    def __call__(self, *args):
        t = time.perf_counter()
        out = jax.block_until_ready(self.fn(*args))
        self.acc[self.name] = self.acc.get(self.name, 0.0) + time.perf_counter() - t
        return out

    def __getattr__(self, attr):  # input_shardings, out_info, ...
        return getattr(self.fn, attr)


def _wrap(runner, acc: dict) -> None:
    progs = runner.programs.programs
    for key, prog in list(progs.items()):
        if key[0] == "head":
            progs[key] = Timed(prog, "head", acc)
        elif key[0] == "stack" and hasattr(prog, "layers"):
            for field, name in (("embed", "embed+final"), ("layers", "layers"),
                                ("final", "embed+final")):
                object.__setattr__(prog, field, Timed(getattr(prog, field), name, acc))


def _decode(llm, prompt: str, max_tokens: int, acc: dict | None) -> tuple[float, list, list]:
    """(tokens/s after the first, per-step [(wall s, {program: s})], token ids)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.add_request("r", prompt, sp)
    steps, t_first, out = [], None, None
    while eng.has_unfinished_requests():
        if acc is not None:
            acc.clear()
        t = time.perf_counter()
        for o in eng.step():
            out = o
        steps.append((time.perf_counter() - t, dict(acc or {})))
        if t_first is None and out is not None and out.outputs[0].token_ids:
            t_first = time.perf_counter()
    toks = list(out.outputs[0].token_ids)
    return (len(toks) - 1) / (time.perf_counter() - t_first), steps[1:], toks


def build(a, variant: str):
    """The variant's `LLM` (linear's thresholds set while its programs are traced)."""
    group = int(variant[1:]) if variant[0] == "g" else None
    fuse = {"fused": True, "unfused": False}.get(variant)
    overrides = VARIANTS.get(variant, {})
    saved = {k: getattr(linear, k) for k in overrides}
    for k, v in overrides.items():
        setattr(linear, k, v)
    try:
        t = time.perf_counter()
        llm = LLM(a.model, quantization=a.quantization, max_num_seqs=1,
                  max_num_batched_tokens=64, max_model_len=1024, executable_cache_dir=None,
                  layers_per_program=group, fuse_projections=fuse)
        print(f"{variant}: engine built in {time.perf_counter() - t:.1f} s, load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        return llm
    finally:
        for k, v in saved.items():
            setattr(linear, k, v)


def hlo_counts(llm) -> str:
    """Custom calls and fusions in the one-row layer program (optimized HLO)."""
    progs = llm.engine.runner.programs.programs
    prog = next((p for k, p in progs.items() if k[0] == "stack" and k[1] == 1), None)
    if prog is None or not hasattr(prog, "layers"):
        return "no one-row layer program"
    ops = [m.group(1) for ln in prog.layers.as_text().splitlines() if " = " in ln
           and (m := re.search(r"\s([a-z][a-z0-9-]*)\(", " " + ln.split(" = ", 1)[1]))]
    return (f"{prog.group} layer(s) per program: {ops.count('custom-call')} custom calls, "
            f"{ops.count('fusion')} fusions, {len(ops)} instructions")


def summarize(steps: list, rate: float) -> dict:
    med = {n: statistics.median(s[1].get(n, 0.0) for s in steps) * 1e3
           for n in ("layers", "embed+final", "head")}
    med["step"] = statistics.median(s[0] for s in steps) * 1e3
    med["host"] = statistics.median(s[0] - sum(s[1].values()) for s in steps) * 1e3
    med["tok/s"] = rate
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--variants", default="head_off,default")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    ap.add_argument("--hlo", action="store_true", help="count the layer program's ops")
    a = ap.parse_args()
    names = a.variants.split(",")
    llms = {v: build(a, v) for v in names}
    if a.hlo:
        for v, llm in llms.items():
            print(f"{v}: {hlo_counts(llm)}", flush=True)
    best: dict = {v: (0.0, None) for v in names}
    for _ in range(a.reps):  # untimed runs, interleaved: tokens/s without blocking
        for v in names:
            rate, _, toks = _decode(llms[v], a.prompt, a.max_tokens, None)
            best[v] = max(best[v], (rate, toks), key=lambda r: r[0])
    accs = {v: {} for v in names}
    for v in names:
        _wrap(llms[v].engine.runner, accs[v])
    cols = ("layers", "embed+final", "head", "host", "step", "tok/s")
    print(f"{'variant':10s} " + " ".join(f"{c:>11s}" for c in cols) + "  load  greedy",
          flush=True)
    first = best[names[0]][1]
    for v in names:  # timed runs, one after the other
        _, steps, _ = _decode(llms[v], a.prompt, a.max_tokens, accs[v])
        med = summarize(steps, best[v][0])
        same = "same" if best[v][1] == first else "DIFFERS"
        print(f"{v:10s} " + " ".join(f"{med[c]:11.2f}" for c in cols) +
              f"  {os.getloadavg()[0]:.2f}  {same}", flush=True)
    print("(ms per step, medians; tok/s: the best untimed run)")


if __name__ == "__main__":
    main()
