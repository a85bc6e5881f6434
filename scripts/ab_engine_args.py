"""Paired A/B of two engine-argument settings, one `LLM` each, in one process.

Builds an `LLM` over --model (default: the Q4_1 SmolLM2 GGUF, weights kept quantized,
16 slots) for --a and for --b (each a JSON object of `LLM` / `make_engine_config`
keyword arguments), then runs a workload (--workload, default
`../shared/bench/seed8.jsonl`: its prompts as chat messages, each with its own
max_tokens capped at --max_tokens_cap, greedy, `ignore_eos`, all arriving at once) on
each, alternating which goes first round by round (the machine's drift hits both
alike). Prints each run's tokens/s with the load average, the a/b ratio per round and
their median, and whether the two settings' token ids are identical. --a_native /
--b_native (JSON: "int_rows", "serial_work") set the quantized kernel's process-wide
knobs (`native_qmatmul.set_int_rows`, `set_serial_work`) before each of that setting's
runs; a knob not named keeps its default.

  PYTHONPATH=. .venv/bin/python scripts/ab_engine_args.py \\
      --a='{"fuse_projections": true}' --b='{"fuse_projections": false}' --rounds=4
  PYTHONPATH=.:scripts .venv/bin/python scripts/ab_engine_args.py --a='{}' --b='{}' \\
      --b_native='{"int_rows": 0}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from jaxserve import LLM
from jaxserve.model import native_qmatmul

from ab_placeholders import generate_timed, load_workload  # scripts/: the script's dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--a", required=True, help="JSON engine arguments of setting a")
    ap.add_argument("--b", required=True, help="JSON engine arguments of setting b")
    ap.add_argument("--quantization", default="auto", help="auto keeps GGUF blocks; none: fp32")
    ap.add_argument("--workload", default="../shared/bench/seed8.jsonl")
    ap.add_argument("--max_tokens_cap", type=int, default=1 << 30)
    ap.add_argument("--max_num_seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--a_native", default="{}", help="JSON native kernel knobs for a's runs")
    ap.add_argument("--b_native", default="{}", help="JSON native kernel knobs for b's runs")
    a = ap.parse_args()
    setters = {"int_rows": native_qmatmul.set_int_rows,
               "serial_work": native_qmatmul.set_serial_work}
    default = {"int_rows": native_qmatmul.int_rows(), "serial_work": native_qmatmul.serial_work()}
    knobs = {k: default | json.loads(v) for k, v in (("a", a.a_native), ("b", a.b_native))}

    def run(llm, work, name):
        for knob, value in knobs[name].items():
            if setters[knob](value) != value:
                raise SystemExit(f"{name}: {knob}={value} is not settable here")
        return generate_timed(llm, work)

    work = [(m, min(mt, a.max_tokens_cap)) for m, mt in load_workload(a.workload)]
    llms = {}
    for name, args in (("a", json.loads(a.a)), ("b", json.loads(a.b))):
        kw = dict(quantization=a.quantization, max_num_seqs=a.max_num_seqs, max_model_len=2048,
                  executable_cache_dir=None) | args
        llms[name] = LLM(a.model, **kw)
        run(llms[name], work, name)  # untimed: first calls, caches
    rates: dict[str, list[float]] = {"a": [], "b": []}
    ids_of: dict[str, list] = {}
    for r in range(a.rounds):
        for name in (("a", "b") if r % 2 == 0 else ("b", "a")):
            dt, n, ids = run(llms[name], work, name)
            ids_of.setdefault(name, ids)
            rates[name].append(n / dt)
            print(f"round {r} {name} {n} tokens {dt:6.2f} s {n / dt:6.1f} tok/s  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    ratios = [x / y for x, y in zip(rates["a"], rates["b"])]
    print(f"a={a.a} {knobs['a']} b={a.b} {knobs['b']}: median tok/s a "
          f"{statistics.median(rates['a']):.1f}, b {statistics.median(rates['b']):.1f}; "
          "a/b per round: "
          + " ".join(f"{x:.3f}" for x in ratios) + f" (median {statistics.median(ratios):.3f});"
          f" token ids identical: {ids_of['a'] == ids_of['b']}")


if __name__ == "__main__":
    main()
