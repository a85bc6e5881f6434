"""Output processing alone (issue 24): `OutputProcessor.process_tokens` + `collect` per row.

Builds `jaxserve bench host`'s engine (fake runner, SmolLM2's tokenizer) with --rows
requests of the bench's chat prompt in the --kind output mode, runs their prefills, then
feeds the output processor --steps synthetic steps (a random token a row, logprob -0.5)
and prints microseconds per row; --profile adds a cProfile of a second run. The heap is
frozen first, as after a server's warm-up.

  PYTHONPATH=. .venv/bin/python scripts/bench_output_processing.py --kind=FINAL_ONLY
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

import numpy as np

from jaxserve.bench import host_common as host
from jaxserve.checkpoint.loader import load_tokenizer
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.worker.runner import SampledToken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kind", default="CUMULATIVE", choices=[k.name for k in RequestOutputKind])
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    tok = load_tokenizer(None)
    eng = host._engine(a.rows, 0.0, False, tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": host.PROMPT}],
                                     add_generation_prompt=True, tokenize=True)
    sp = SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True,
                        output_kind=RequestOutputKind[a.kind])
    ids = [f"r{i}" for i in range(a.rows)]
    for rid in ids:
        eng.add_request(rid, list(prompt), sp)
    for _ in range(5):
        eng.step()
    toks = np.random.default_rng(0).integers(100, 20000, size=(2 * a.steps, a.rows)).tolist()
    top, zero = np.zeros(20, np.int32), np.zeros(20, np.float32)
    steps = [{rid: SampledToken(t, -0.5, top, zero) for rid, t in zip(ids, row)}
             for row in toks]
    out = eng.outputs
    gc.collect()
    gc.freeze()

    def run(first: int, last: int) -> None:
        for k in range(first, last):
            progressed, _ = out.process_tokens(steps[k], 1.0)
            out.collect(progressed)

    t0 = time.perf_counter()
    run(0, a.steps)
    dt = (time.perf_counter() - t0) / a.steps
    print(f"{a.kind}: process_tokens + collect {dt * 1e3:.3f} ms a step, "
          f"{dt / a.rows * 1e6:.2f} us a row ({a.rows} rows)")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(a.steps, 2 * a.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
