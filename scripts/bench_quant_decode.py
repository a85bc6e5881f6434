"""One request decoding alone, fp32 weights vs quantized ones, in one process (issue 26).

Builds an `LLM` per --quantization value over the same file (each with buckets for one
row only, so the warm-up stays short), generates --max_tokens greedy tokens
(`ignore_eos`) for one chat prompt, and prints decode tokens/s (tokens after the first /
time after the first), time to first token, the weights' bytes and greedy agreement
with the first configuration. Prints the load average: numbers are only as quiet as
the machine.

  PYTHONPATH=. .venv/bin/python scripts/bench_quant_decode.py \
      --model=checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf --quantization=none,auto

--fp32_native=off,default also compares, per quantization, the native CPU float head off
(`linear.HEAD_NATIVE_MAX_ROWS = 0`) and as shipped (notes/issue26_fp32.md).
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from jaxserve import LLM, SamplingParams


def run(model: str, quantization: str, max_tokens: int, prompt: str, reps: int) -> tuple:
    t0 = time.perf_counter()
    llm = LLM(model, quantization=quantization, max_num_seqs=1, max_num_batched_tokens=64,
              max_model_len=1024, executable_cache_dir=None)
    build = time.perf_counter() - t0
    nbytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    best = None
    for _ in range(reps):
        eng = llm.engine
        eng.add_request("r", prompt, sp)
        t_start = time.perf_counter()
        t_first = None
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
                if t_first is None and o.outputs[0].token_ids:
                    t_first = time.perf_counter()
        t_end = time.perf_counter()
        toks = list(out.outputs[0].token_ids)
        rate = (len(toks) - 1) / (t_end - t_first)
        if best is None or rate > best[0]:
            best = (rate, t_first - t_start, toks)
    return best + (nbytes, build)


def _run_native(a, quantization: str, fp32_native: str) -> tuple:
    """`run` with the native float head off ("off") or as shipped ("default")."""
    from jaxserve.model import linear

    saved = linear.HEAD_NATIVE_MAX_ROWS
    if fp32_native == "off":
        linear.HEAD_NATIVE_MAX_ROWS = 0  # read when the programs are traced (warm-up)
    try:
        return run(a.model, quantization, a.max_tokens, a.prompt, a.reps)
    finally:
        linear.HEAD_NATIVE_MAX_ROWS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--quantization", default="none,auto")
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    ap.add_argument("--fp32_native", default="default", help="off,default: the float head")
    a = ap.parse_args()
    print("load before:", os.getloadavg(), flush=True)
    first = None
    for q in [f"{q}/{n}" for q in a.quantization.split(",") for n in a.fp32_native.split(",")]:
        rate, ttft, toks, nbytes, build = _run_native(a, *q.split("/"))
        agree = "" if first is None else \
            f" greedy agreement with {first[0]}: {next((i for i, (x, y) in enumerate(zip(toks, first[1])) if x != y), len(toks))}/{len(toks)} tokens"
        first = first or (q, toks)
        print(f"quantization={q}: {rate:6.1f} tok/s decode, TTFT {ttft * 1e3:6.0f} ms, weights "
              f"{nbytes / 1e6:6.1f} MB, engine build {build:5.1f} s, load {os.getloadavg()[0]:.2f}"
              f"{agree}", flush=True)


if __name__ == "__main__":
    main()
