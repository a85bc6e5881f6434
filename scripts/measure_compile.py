"""Warm-up and step time of the real runner on the default model (notes/startup.md).

    .venv/bin/python scripts/measure_compile.py [--max_num_seqs 16] [--compile_cache_dir DIR]
        [--rows 1,8,16] [--context 128] [--iters 20] [--fused_rows 8]

Builds the SmolLM2 `ModelRunner` at the CLI's default bucket flags, times its
warm-up (programs built vs loaded), then the step of a synthetic decode batch
of n rows (each row one token at position `context`, its block table filled)
through `ModelRunner.execute`, median of `iters`. The engine config is the
CLI's default (512 MiB KV budget, max_model_len 2048), so a compile cache
filled by `jaxserve generate` serves it. For each n in `--fused_rows`, the same
batch also runs through one program composing the layer stack and the head
(the pre-split T x S form): the split's per-step cost is the difference of
the two medians at equal shapes.
"""

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from jaxserve.checkpoint import load_model
from jaxserve.engine import make_engine_config
from jaxserve.worker.compile import enable_compilation_cache
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.programs import _head_fn, _stack_fn
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput


def decode_plan(runner: ModelRunner, n: int, context: int) -> SchedulerOutput:
    """A plan of n decode rows at position `context` that brings its requests' data."""
    bs, pol = runner.block_size, runner.bucket_policy
    per_seq = context // bs + 1
    rows, new = [], []
    for i in range(n):
        blocks = tuple(1 + i * per_seq + j for j in range(per_seq))
        rid = f"r{i}"
        rows.append(ScheduledRequest(request_id=rid, token_ids=(17,), start_pos=context,
                                     block_ids=blocks, sample=True, output_pos=0))
        new.append(NewRequestData(rid, (17,) * context, SamplingParams(temperature=0.0),
                                  seed=0, eos_token_ids=(2,), logprob_start=None,
                                  output_token_ids=()))
    t_pad, s_pad = pol.pad(n, n)
    out = SchedulerOutput(scheduled=tuple(rows), num_scheduled_tokens=n, token_bucket=t_pad,
                          seq_bucket=s_pad, preempted_ids=(), finished_ids=(), step=0,
                          scheduled_new_reqs=tuple(new))
    return out


def median_ms(fn, iters: int) -> float:
    fn()  # first call outside the timing
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def fused_step(runner: ModelRunner, out: SchedulerOutput):
    """The pre-split form at one shape: stack and head inside one compiled program."""
    def step(params, kv, batch):
        rows, kv, _ = _stack_fn(runner.cfg, runner.backend, params, kv,
                             dataclasses.replace(batch, sampling=None))
        return _head_fn(runner.cfg, runner.config.max_logprobs, runner.config.logprobs_mode,
                        params, rows, batch.sampling)[0], kv  # [1]: the padded ids

    host, _ = runner._host_batch(out, runner.requests.update(out)[0])
    # _stack_fn takes the stacked [L, N, B, K, D] cache; layer-group runners keep one
    # buffer per layer, so this program gets a stacked copy of its own.
    kv = {"kv": runner.kv_cache if runner.group is None else
          tuple(jnp.stack(side) for side in runner.kv_cache)}
    exe = jax.jit(step, donate_argnums=(1,)).lower(runner.params, kv["kv"], host).compile()

    def run():
        res, kv["kv"] = exe(runner.params, kv["kv"], jax.device_put(host))
        jax.device_get(res.token_ids)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max_num_seqs", type=int, default=8)
    ap.add_argument("--compile_cache_dir", default="")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fused_rows", default="")
    a = ap.parse_args()
    enable_compilation_cache(a.compile_cache_dir)
    cfg, params, _ = load_model(None, progress=False)
    config = make_engine_config(cfg, max_model_len=2048, block_size=16,
                                kv_cache_memory_bytes=512 * 2**20, max_num_seqs=a.max_num_seqs,
                                max_num_batched_tokens=256, attention_backend="auto")
    runner = ModelRunner(config, params, bucket_policy=BucketPolicy.from_config(config.scheduler))
    runner.warmup(progress=False)
    st = runner.stats()
    print(f"max_num_seqs={a.max_num_seqs}: {st.warmup_programs} programs in "
          f"{st.warmup_seconds:.1f} s ({st.programs_built} built, {st.programs_loaded} loaded)")
    fused_rows = {int(x) for x in a.fused_rows.split(",") if x}
    for n in (int(x) for x in a.rows.split(",")):
        if n > a.max_num_seqs:
            continue
        out = decode_plan(runner, n, a.context)
        split = median_ms(lambda: runner.execute(out), a.iters)
        line = f"rows={n} (T_pad, S_pad)=({out.token_bucket}, {out.seq_bucket}): split {split:.2f} ms"
        if n in fused_rows:
            line += f", fused {median_ms(fused_step(runner, out), a.iters):.2f} ms"
        print(line, flush=True)


if __name__ == "__main__":
    main()
