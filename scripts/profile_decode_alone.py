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
  layers_on  FLOAT_NATIVE_MAX_ROWS = 8 as well (the layers' matrices on the "kn" kernel)
The load average is printed with each row: only ratios within one run mean anything.

  PYTHONPATH=. .venv/bin/python scripts/profile_decode_alone.py --variants=head_off,default
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.model import linear

VARIANTS = {"default": {}, "head_off": {"HEAD_NATIVE_MAX_ROWS": 0},
            "layers_on": {"FLOAT_NATIVE_MAX_ROWS": 8}}


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


def run(a, variant: str) -> tuple[dict, list]:
    saved = {k: getattr(linear, k) for k in VARIANTS[variant]}
    for k, v in VARIANTS[variant].items():
        setattr(linear, k, v)
    try:
        llm = LLM(a.model, quantization=a.quantization, max_num_seqs=1,
                  max_num_batched_tokens=64, max_model_len=1024, executable_cache_dir=None)
    finally:
        for k, v in saved.items():
            setattr(linear, k, v)
    rate, _, toks = max(_decode(llm, a.prompt, a.max_tokens, None) for _ in range(a.reps))
    acc: dict = {}
    _wrap(llm.engine.runner, acc)
    _, steps, _ = _decode(llm, a.prompt, a.max_tokens, acc)
    med = {n: statistics.median(s[1].get(n, 0.0) for s in steps) * 1e3
           for n in ("layers", "embed+final", "head")}
    med["step"] = statistics.median(s[0] for s in steps) * 1e3
    med["host"] = statistics.median(s[0] - sum(s[1].values()) for s in steps) * 1e3
    med["tok/s"] = rate
    return med, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--variants", default="head_off,default")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    a = ap.parse_args()
    cols = ("layers", "embed+final", "head", "host", "step", "tok/s")
    print(f"{'variant':10s} " + " ".join(f"{c:>11s}" for c in cols) + "  load  greedy",
          flush=True)
    first = None
    for v in a.variants.split(","):
        med, toks = run(a, v)
        first = first or toks
        same = "same" if toks == first else "DIFFERS"
        print(f"{v:10s} " + " ".join(f"{med[c]:11.2f}" for c in cols) +
              f"  {os.getloadavg()[0]:.2f}  {same}", flush=True)
    print("(ms per step, medians; tok/s of the run without timers)")


if __name__ == "__main__":
    main()
