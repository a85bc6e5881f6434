"""Issue 27's LoRA measurements on SmolLM2 (a benchmark, not a test; numbers go to
BUILD_NOTES.md with the machine load).

1. A 16-row decode step: the base engine (max_loras=0) against one engine with
   max_loras=4, max_lora_rank=16 serving 0, 1 and 4 distinct rank-16 adapters (all 7
   target projections) over its 16 rows; side by side in one process, the
   configurations interleaved round by round, median step wall time.
2. `update_lora` (a rank-16 adapter, all 7 targets) against `update_params` (the
   whole model), both on the LoRA engine, median of a few calls.

Usage: .venv/bin/python scripts/bench_lora.py [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve import LoRARequest  # noqa: E402
from jaxserve.checkpoint import load_model  # noqa: E402
from jaxserve.checkpoint.default import resolve_model_path  # noqa: E402
from jaxserve.engine import LLMEngine, make_engine_config  # noqa: E402
from jaxserve.lora.adapter import target_shapes  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

ROWS, RANK = 16, 16


def adapter(cfg, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tree = {"scaling": 2.0}
    for t, (din, dout) in target_shapes(cfg).items():
        L = cfg.num_hidden_layers
        tree[t] = {"lora_a": rng.normal(0, 0.02, (L, din, RANK)).astype(np.float32),
                   "lora_b": rng.normal(0, 0.02, (L, RANK, dout)).astype(np.float32)}
    return tree


def engine(cfg, params, tok, max_loras: int) -> LLMEngine:
    config = make_engine_config(cfg, max_model_len=256, block_size=16, num_kv_blocks=160,
                                max_num_seqs=ROWS, max_num_batched_tokens=64,
                                token_buckets=(ROWS, 64), seq_buckets=(ROWS,),
                                attention_backend="xla", enable_prompt_logprobs=False,
                                max_loras=max_loras, max_lora_rank=RANK)
    return LLMEngine(config, params, tok, model_name="smollm2", progress=False)


def decode_step_ms(eng: LLMEngine, loras: list, steps: int) -> float:
    """Median wall ms of `steps` decode steps with ROWS running rows, row i on loras[i % n]."""
    sp = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(ROWS)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, [1, 100 + i, 200, 300], sp,
                        lora_request=loras[i % len(loras)] if loras else None)
    while any(r.num_computed_tokens < r.num_prompt_tokens + 1
              for r in eng.scheduler.requests.values()):
        eng.step()  # prefill (and the first decode)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        eng.abort(rid)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    cfg, params, tok = load_model(resolve_model_path(None), dtype="float32")
    base = engine(cfg, params, tok, 0)
    lora = engine(cfg, params, tok, 4)
    reqs = [LoRARequest(f"a{i}", i + 1, adapter(cfg, i)) for i in range(4)]
    for r in reqs:
        lora.lora.add_lora(r)
    configs = {"base engine": (base, []), "LoRA engine, 0 adapters": (lora, []),
               "LoRA engine, 1 adapter": (lora, reqs[:1]),
               "LoRA engine, 4 adapters": (lora, reqs)}
    for eng, loras in configs.values():  # warm the host paths once
        decode_step_ms(eng, loras, 2)
    got: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(a.rounds):
        for k, (eng, loras) in configs.items():
            got[k].append(decode_step_ms(eng, loras, a.steps))
    ref = statistics.median(got["base engine"])
    print(f"16-row decode step, SmolLM2 f32, rank {RANK}, all 7 targets "
          f"(median of {a.rounds} rounds x {a.steps} steps; load {os.getloadavg()[0]:.1f}):")
    for k, v in got.items():
        m = statistics.median(v)
        print(f"  {k:26s} {m:7.2f} ms  {100 * (m / ref - 1):+6.1f}%   rounds {[round(x, 1) for x in v]}")
    st = lora.runner.stats()
    print(f"  compiles after warm-up: {st.late_compiles}")

    t_lora, t_params = [], []
    new = adapter(cfg, 99)
    for _ in range(3):
        t0 = time.perf_counter()
        lora.lora.update_lora("a1", new)
        t_lora.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        lora.update_params(params)
        t_params.append(time.perf_counter() - t0)
    print(f"update_lora (rank {RANK}, 7 targets): {1e3 * statistics.median(t_lora):.1f} ms; "
          f"update_params (whole model): {1e3 * statistics.median(t_params):.1f} ms "
          f"(medians of 3; load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
