"""Compile time of the engine's jitted step at one bucket shape, persistent cache off.

    .venv/bin/python scripts/measure_compile.py [--dtype float32] [--tokens 64 --seqs 8]

Builds the SmolLM2 runner without warm-up, then times lower+compile of the
step for one (T_pad, S_pad) pair. The 30 layers run under lax.scan, so this
is roughly one layer's compile plus the embedding, logits and sampler.
"""

import argparse
import time

import jax

from jaxserve.checkpoint import load_model
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.scheduler.output import SchedulerOutput


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=8)
    a = ap.parse_args()
    cfg, params, tok = load_model(None, dtype=a.dtype, progress=False)
    config = make_engine_config(cfg, max_model_len=2048, block_size=16, num_kv_blocks=1024,
                                max_num_seqs=a.seqs, max_num_batched_tokens=a.tokens,
                                attention_backend="xla")
    engine = LLMEngine(config, params, tok, warmup=False, progress=False)
    r = engine.runner
    empty = SchedulerOutput(scheduled=(), num_scheduled_tokens=0, token_bucket=a.tokens,
                            seq_bucket=a.seqs, preempted_ids=(), finished_ids=(), step=-1)
    host = r._host_batch(empty, {})
    dev = jax.device_put(host)
    t0 = time.perf_counter()
    lowered = r._step.lower(r.params, r.kv_cache, dev)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    print(f"dtype={a.dtype} T_pad={a.tokens} S_pad={a.seqs}: trace+lower {t1 - t0:.2f} s, "
          f"compile {t2 - t1:.2f} s")


if __name__ == "__main__":
    main()
