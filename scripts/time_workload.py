"""Tokens/s of one `LLM` on a workload, for A/B runs across commits (one process each).

Builds an `LLM` over --model (default: the Q4_1 SmolLM2 GGUF, weights kept quantized, 16
slots), warms it on the workload's first two prompts, then runs the whole workload
(--workload, default `../shared/bench/seed8.jsonl`, each prompt as a chat message with
its own max_tokens capped at --max_tokens_cap; greedy, `ignore_eos`, all arriving at
once) --runs times and prints one line a run: tokens/s, the load average and a hash of
every prompt's token ids (equal hashes: the same tokens). Where a setting has an engine
argument, `scripts/ab_engine_args.py` compares it in one process; this script is for
code changes: run it alternately from two worktrees, e.g.

  git worktree add /tmp/base HEAD~1 && ln -s $PWD/checkpoints /tmp/base/checkpoints
  for r in 1 2 3; do (cd /tmp/base && PYTHONPATH=. $OLDPWD/.venv/bin/python \\
      scripts/time_workload.py --label=base); PYTHONPATH=. .venv/bin/python \\
      scripts/time_workload.py --label=new; done
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_placeholders import generate_timed, load_workload  # noqa: E402
from jaxserve import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--workload", default=str(Path(__file__).resolve().parents[2] /
                                              "shared" / "bench" / "seed8.jsonl"))
    ap.add_argument("--max_tokens_cap", type=int, default=400)
    ap.add_argument("--max_num_seqs", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--label", default="run")
    a = ap.parse_args()
    work = [(m, min(mt, a.max_tokens_cap)) for m, mt in load_workload(a.workload)]
    llm = LLM(a.model, quantization=a.quantization, max_num_seqs=a.max_num_seqs)
    generate_timed(llm, work[:2])
    for _ in range(a.runs):
        dt, n, ids = generate_timed(llm, work)
        digest = hashlib.md5(json.dumps(ids).encode()).hexdigest()[:8]
        print(f"{a.label}: {n / dt:.2f} tok/s  load {os.getloadavg()[0]:.2f}  ids {digest}",
              flush=True)


if __name__ == "__main__":
    main()
