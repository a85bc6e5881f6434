"""Paired A/B of async scheduling with and without output placeholders, in one process.

One `LLM` over --model (default: the Q4_1 SmolLM2 GGUF, weights kept quantized), 16
slots. Each round runs a workload (--workload, default `../shared/bench/seed8.jsonl`:
its prompts as chat messages, each with its own max_tokens, greedy, `ignore_eos`, all
arriving at once) twice, in alternating order: once with placeholders (step n+1 planned
and dispatched before step n's tokens are back, its decode rows reading them on the
device) and once without (step n+1 planned after step n's fetch, overlapped with its
output processing only: the behaviour before placeholders, and the default on CPU;
`ModelRunner.placeholders`, i.e. `EngineConfig.async_placeholders`, set per run). Prints each round's tokens/s with the load average, the on/off ratios,
and whether the two runs' token ids are identical (they must be).

  PYTHONPATH=. .venv/bin/python scripts/ab_placeholders.py --rounds=6
  PYTHONPATH=. .venv/bin/python scripts/ab_placeholders.py --quantization=none  # fp32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from jaxserve import LLM, SamplingParams


def load_workload(path: str) -> list[tuple[list[dict], int]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [([{"role": "user", "content": r["prompt"]}], int(r["max_tokens"])) for r in rows]


def run(llm: LLM, work, placeholders: bool) -> tuple[float, int, list]:
    llm.engine.runner.placeholders = placeholders  # `EngineConfig.async_placeholders`
    return generate_timed(llm, work)


def generate_timed(llm: LLM, work) -> tuple[float, int, list]:
    """(seconds, tokens, token ids per prompt) of one greedy `ignore_eos` generate of `work`."""
    params = [SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True) for _, mt in work]
    t0 = time.perf_counter()
    outs = llm.generate([m for m, _ in work], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return dt, sum(map(len, ids)), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--quantization", default="auto", help="auto keeps GGUF blocks; none: fp32")
    ap.add_argument("--workload", default="../shared/bench/seed8.jsonl")
    ap.add_argument("--max_num_seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    work = load_workload(a.workload)
    llm = LLM(a.model, quantization=a.quantization, max_num_seqs=a.max_num_seqs,
              max_model_len=2048, executable_cache_dir=None)
    run(llm, work, True)  # untimed: first calls, caches
    rates: dict[bool, list[float]] = {True: [], False: []}
    ref = None
    for r in range(a.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            dt, n, ids = run(llm, work, on)
            ref = ref or ids
            rates[on].append(n / dt)
            print(f"round {r} placeholders={'on ' if on else 'off'} {n} tokens {dt:6.2f} s "
                  f"{n / dt:6.1f} tok/s  load {os.getloadavg()[0]:.2f}  same={ids == ref}",
                  flush=True)
    ratios = [x / y for x, y in zip(rates[True], rates[False])]
    print(f"median tok/s on {statistics.median(rates[True]):.1f}, off "
          f"{statistics.median(rates[False]):.1f}; on/off per round: "
          + " ".join(f"{x:.3f}" for x in ratios) + f" (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
