"""Decode speed with a float32 vs a float16 / bfloat16 KV cache (`--kv_cache_dtype`, issue 26),
side by side in one process.

    .venv/bin/python scripts/bench_kv_dtype.py [--prompt_len=1500] [--max_tokens=64] [--rounds=3]

1. The native CPU decode-attention kernel alone (`native_cpu.paged_decode`): one slot at
   `prompt_len` keys in SmolLM2's geometry (K 3, G 3, D 64), all 30 layers of a stacked
   cache, per dtype: ms per call and the KV bytes it reads.
2. One request decoding alone on SmolLM2 (the shipped Q4_1 file, its blocks kept) after a
   `prompt_len`-token prompt: decode tok/s per KV dtype, engines alternated round by round.
The load average is printed with the numbers (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def bench_kernel(prompt_len: int, dtypes: list[str], slots: int = 1, reps: int = 20) -> None:
    """ms per native decode-attention call over every layer for `slots` rows of
    prompt_len keys each, per cache dtype."""
    import jax
    import jax.numpy as jnp

    from jaxserve.attention import native_cpu

    L, B, K, G, D = 30, 16, 3, 3, 64
    pages = -(-prompt_len // B)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((L, slots * pages + 1, B, K, D)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((slots, K, G, D)), jnp.float32)
    kv_len = jnp.full((slots,), prompt_len, jnp.int32)
    table = jnp.asarray(rng.permutation(np.arange(1, slots * pages + 1)).reshape(slots, pages),
                        jnp.int32)
    caches = {d: jnp.asarray(base, d) for d in dtypes}

    @jax.jit
    def all_layers(q, kc, vc):
        return sum(native_cpu.paged_decode(q, kv_len, table, kc, vc, layer, sm_scale=0.125,
                                           chunk_pages=16) for layer in range(L))
    times = {d: [] for d in dtypes}
    for d in dtypes:
        all_layers(q, caches[d], caches[d]).block_until_ready()
    for _ in range(reps):
        for d in dtypes:  # interleaved: the same load for each
            t = time.perf_counter()
            all_layers(q, caches[d], caches[d]).block_until_ready()
            times[d].append(time.perf_counter() - t)
    del base
    for d in dtypes:
        nbytes = 2 * L * slots * prompt_len * K * D * jnp.dtype(d).itemsize
        ms = statistics.median(times[d]) * 1e3
        print(f"kernel {d:9s} {L} layers x {slots} slots x {prompt_len} keys: {ms:7.2f} ms/step "
              f"({nbytes / 2**20:5.1f} MiB KV read, {nbytes / ms / 1e6:5.1f} GB/s) "
              f"load {os.getloadavg()[0]:.2f}", flush=True)


def bench_engine(prompt_len: int, max_tokens: int, rounds: int, dtypes: list[str],
                 batch: int = 1) -> None:
    """Decode tok/s of `batch` requests after prompt_len prompts each, per KV dtype
    (alternated round by round): output tokens after the step where every request has its
    first one, over the time from that step to the end."""
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.sampling_params import SamplingParams

    cfg, params, tok = load_model(resolve_model_path(None), dtype="float32",
                                  quantization="auto", progress=False)
    blocks = batch * (-(-(prompt_len + max_tokens) // 16)) + 2
    engines = {}
    for d in dtypes:
        config = make_engine_config(cfg, max_model_len=2048, block_size=16,
                                    num_kv_blocks=blocks, max_num_seqs=batch,
                                    max_num_batched_tokens=256,
                                    token_buckets=tuple(sorted({batch, 256})),
                                    seq_buckets=(batch,), attention_backend="xla",
                                    quantization="auto", kv_cache_dtype=d,
                                    enable_prefix_caching=False, enable_prompt_logprobs=False)
        engines[d] = LLMEngine(config, params, tok, model_name=d, progress=False)
    prompts = [[int(x) for x in np.random.default_rng(1 + i).integers(100, 40000, prompt_len)]
               for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {d: [] for d in dtypes}
    tokens: dict[str, list[int]] = {}
    for r in range(rounds):
        for d, eng in engines.items():
            for i, p in enumerate(prompts):
                eng.add_request(f"r{r}.{i}", p, sp)
            t_first, last, started = None, {}, set()
            while eng.has_unfinished_requests():
                for o in eng.step():
                    last[o.request_id] = o
                    if o.outputs[0].token_ids:
                        started.add(o.request_id)
                if t_first is None and len(started) == batch:
                    t_first = time.perf_counter()
                    n0 = sum(len(o.outputs[0].token_ids) for o in last.values())
            n = sum(len(o.outputs[0].token_ids) for o in last.values()) - n0
            rates[d].append(n / (time.perf_counter() - t_first))
            tokens[d] = [last[f"r{r}.{i}"].outputs[0].token_ids for i in range(batch)]
    same = len({str(t) for t in tokens.values()}) == 1
    for d in dtypes:
        print(f"engine {d:9s} {batch} request(s) decoding after {prompt_len} prompt tokens: "
              f"{statistics.median(rates[d]):6.1f} tok/s (rounds {['%.1f' % x for x in rates[d]]}) "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"greedy tokens equal across KV dtypes: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt_len", type=int, default=1500)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--skip_engine", action="store_true")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--slots", default="1,16", help="decode rows of the kernel-only runs")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    for slots in map(int, args.slots.split(",")):
        bench_kernel(args.prompt_len, dtypes, slots)
    if not args.skip_engine:
        bench_engine(args.prompt_len, args.max_tokens, args.rounds, dtypes, args.batch)


if __name__ == "__main__":
    main()
