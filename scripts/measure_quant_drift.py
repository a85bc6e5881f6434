"""Logprob drift of the integer-activation quantized matmul (issue 26), in one process.

Serves the shipped Q4_1 file with its blocks kept (`--quantization=auto`) and decodes the
same greedy continuations twice: with the native kernel's integer path (x quantized to
two int8 digits per 32-block, `native_qmatmul.int_rows() > 0`) and with the
f32-activation kernels (`set_int_rows(0)`); the compiled programs are the same. Prints,
per prompt, the greedy agreement and, over the agreeing prefix, the largest |difference|
of the chosen token's logprob and of any top-k logprob both runs report.

  PYTHONPATH=. .venv/bin/python scripts/measure_quant_drift.py --max_tokens=64
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.model import native_qmatmul

PROMPTS = ("Write a long story about a lighthouse keeper.",
           "What is the capital of France? Explain its history.",
           "List ten prime numbers and say why each is prime.",
           "def fibonacci(n):")


def decode(llm: LLM, rows: int, max_tokens: int, top: int) -> list:
    """[(token ids, [{id: logprob}] per token)] per prompt, with int_rows set to rows."""
    assert native_qmatmul.set_int_rows(rows) == rows, rows
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top)
    outs = []
    for p in PROMPTS:  # one request at a time: decode steps of one row (M = 1)
        o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        outs.append((list(o.token_ids), o.logprobs))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    if not native_qmatmul.available() or native_qmatmul.int_rows() == 0:
        raise SystemExit("the native kernel has no integer path here (needs AVX-512 VNNI or AVX2)")
    llm = LLM(a.model, quantization="auto", max_num_seqs=1, max_num_batched_tokens=64,
              max_model_len=1024, executable_cache_dir=None)
    rows = native_qmatmul.int_rows()
    ints, f32s = decode(llm, rows, a.max_tokens, a.top), decode(llm, 0, a.max_tokens, a.top)
    native_qmatmul.set_int_rows(rows)
    worst_chosen = worst_top = 0.0
    for p, (ti, li), (tf, lf) in zip(PROMPTS, ints, f32s):
        agree = next((i for i, (x, y) in enumerate(zip(ti, tf)) if x != y), len(ti))
        chosen = [abs(li[i][ti[i]] - lf[i][tf[i]]) for i in range(agree)]
        top = [abs(li[i][t] - lf[i][t]) for i in range(agree) for t in li[i] if t in lf[i]]
        worst_chosen, worst_top = max(worst_chosen, *chosen), max(worst_top, *top)
        tie = ""
        if agree < len(ti):  # how close the two candidates were where the runs part
            lp = sorted(li[agree].values(), reverse=True)
            tie = f" (int run's top-2 logprob gap there {lp[0] - lp[1]:.1e})"
        print(f"{p[:40]!r:44} greedy agreement {agree}/{len(ti)}{tie}; chosen-token "
              f"logprob |diff| max {max(chosen):.2e} mean {np.mean(chosen):.2e}; top-{a.top}"
              f" max {max(top):.2e}")
    print(f"overall: chosen max {worst_chosen:.2e}, top-{a.top} max {worst_top:.2e} "
          f"(load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
