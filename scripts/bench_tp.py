"""Warm-up and step time at tensor_parallel_size 1, 2, 4 on fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=$PWD \\
        python scripts/bench_tp.py [--tps 1,2,4] [--vocab_parallel auto|on|off|ab] [--layers 4]

A random-weight model with 8 query / 2 KV heads (TP = 4 replicates KV heads),
hidden 512, intermediate 1536, head_dim 64, vocab 49152 (SmolLM2's), fp32, xla
attention. Per TP: warm-up seconds (every bucket program, no compile cache),
then 8 requests of 96-token prompts generating 32 tokens each; the median
wall time of the pure-decode steps (8 rows) and of the prefill steps. Fake
CPU devices share this machine's cores, so TP > 1 adds collectives without adding
compute: these numbers show overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.engine import LLMEngine, make_engine_config  # noqa: E402
from jaxserve.model.llama import Llama, canonical_params  # noqa: E402
from jaxserve.worker.model_runner import ModelRunner  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.scheduler.buckets import BucketPolicy  # noqa: E402


def bench(cfg, params, tp: int, vocab_parallel: bool | None) -> dict:
    config = make_engine_config(cfg, max_model_len=256, block_size=16, num_kv_blocks=160,
                                max_num_seqs=8, max_num_batched_tokens=128,
                                token_buckets=(8, 128), seq_buckets=(8,), attention_backend="xla",
                                tensor_parallel_size=tp, strict_compiles=True)
    t0 = time.perf_counter()
    runner = ModelRunner(config, params, bucket_policy=BucketPolicy.from_config(config.scheduler),
                         vocab_parallel=vocab_parallel)
    load = time.perf_counter() - t0
    engine = LLMEngine(config, runner=runner, warmup=True, progress=False)
    warm = runner.stats().warmup_seconds
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(8):
        engine.add_request(f"r{i}", rng.integers(3, cfg.vocab_size, 96).tolist(), sp)
    decode, prefill = [], []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        (decode if engine.last_step_tokens == 8 else prefill).append(dt)
    return {"tp": tp, "vocab_parallel": runner.tp.vocab_parallel, "load_s": round(load, 2),
            "warmup_s": round(warm, 2), "programs": runner.stats().warmup_programs,
            "decode_step_ms": round(1e3 * statistics.median(decode), 2), "decode_steps": len(decode),
            "prefill_step_ms": round(1e3 * statistics.median(prefill), 2),
            "prefill_steps": len(prefill), "late": engine.get_stats()["num_compiles_after_warmup"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tps", default="1,2,4")
    ap.add_argument("--vocab_parallel", default="auto", choices=["auto", "on", "off", "ab"],
                    help="embed / lm_head split over the vocabulary; ab: both, same process")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    cfg = ModelConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_ids=(2,))
    params = jax.tree.map(np.asarray, canonical_params(Llama(cfg, rngs=nnx.Rngs(0))))
    print(f"devices={len(jax.devices())} load={os.getloadavg()}", flush=True)
    modes = {"auto": [None], "on": [True], "off": [False], "ab": [False, True]}[a.vocab_parallel]
    for tp in (int(x) for x in a.tps.split(",")):
        for vp in modes if tp > 1 else [None]:
            print(json.dumps(bench(cfg, params, tp, vp)), flush=True)
    print(f"load after={os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
