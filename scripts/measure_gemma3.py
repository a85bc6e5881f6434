"""Gemma 3 270M against SmolLM2-135M on this CPU: decode step time at 1, 8 and 64 rows,
and the KV bytes a 4k-token Gemma 3 request holds (issue 31).

Step time: a real LLMEngine per model (fp32, xla backend, token and sequence buckets
1 / 8 / 64, prompt logprobs off), R requests of a 24-token prompt, and the median wall
time of the engine steps in which all R rows decode (the warm-up and prefill steps are
not counted). KV: the engine's own cache arrays (bytes per block over all layers) times
the blocks the KV manager allocates to one 4,096-token request, and what the same
request would hold if the local layers kept only their last `sliding_window` tokens.

    PYTHONPATH=. .venv/bin/python scripts/measure_gemma3.py [--rows 1,8,64] [--steps 12]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import jax


def kv_report(cfg, block_size: int = 16, tokens: int = 4096) -> None:
    item = 4 if cfg.dtype == "float32" else 2
    per_token_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * item  # K and V
    blocks = math.ceil(tokens / block_size)
    today = blocks * block_size * per_token_layer * cfg.num_hidden_layers
    windows = cfg.layer_windows
    local = sum(min(blocks, math.ceil(w / block_size) + 1) if w else blocks for w in windows)
    hybrid = local * block_size * per_token_layer
    print(f"KV of one {tokens}-token request ({cfg.dtype}, block {block_size}): {blocks} blocks "
          f"x {cfg.num_hidden_layers} layers = {today / 2**20:.1f} MiB today; with local layers "
          f"holding their last {cfg.sliding_window} tokens (+1 partial block): "
          f"{hybrid / 2**20:.1f} MiB ({hybrid / today:.0%})")


def step_times(path, rows_list, steps: int) -> dict[int, float]:
    from jaxserve.checkpoint import load_model
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.sampling_params import SamplingParams

    cfg, params, tok = load_model(path, dtype="float32")
    top = max(rows_list)
    config = make_engine_config(cfg, max_model_len=256, block_size=16,
                                num_kv_blocks=top * 4 + 8, max_num_seqs=top,
                                max_num_batched_tokens=max(top, 64) * 2,
                                token_buckets=tuple(sorted({*rows_list, max(top, 64) * 2})),
                                seq_buckets=tuple(rows_list), attention_backend="xla",
                                enable_prompt_logprobs=False)
    engine = LLMEngine(config, params, tok, model_name=str(path), progress=False)
    out = {}
    prompt = list(range(1000, 1024))
    for rows in rows_list:
        sp = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(rows):
            engine.add_request(f"r{rows}-{i}", prompt, sp)
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            times.append(dt)
        # the first step prefills; the last steps may have fewer rows
        out[rows] = statistics.median(times[2:2 + steps]) * 1e3
        print(f"{path.name}: {rows} rows, median decode step {out[rows]:.1f} ms "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    from jaxserve.checkpoint.default import DEFAULT_MODEL_PATH
    from jaxserve.checkpoint.fetch_gemma3 import GEMMA3_PATH
    from jaxserve.config import ModelConfig

    for dt in ("float32", "bfloat16"):
        kv_report(ModelConfig.gemma3_270m(dtype=dt))
    rows = [int(r) for r in args.rows.split(",")]
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    g = step_times(GEMMA3_PATH, rows, args.steps)
    s = step_times(DEFAULT_MODEL_PATH, rows, args.steps)
    print("| rows | Gemma 3 270M ms/step | SmolLM2-135M ms/step | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r} | {g[r]:.1f} | {s[r]:.1f} | {g[r] / s[r]:.2f} |")


if __name__ == "__main__":
    main()
