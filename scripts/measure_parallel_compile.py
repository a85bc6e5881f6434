"""Serial vs threaded program builds, and where one build's time goes (issue 12).

    .venv/bin/python scripts/measure_parallel_compile.py --mode serial|threads \
        [--keys stack:8,stack:16] [--max_num_seqs 8] [--threads 2] [--layers_per_program 1]

Builds the default model's `ModelRunner` (JAX compile cache and executable cache off,
so every program is a real XLA compile), then the listed programs either one after
the other (timing trace, lower and XLA compile of each: `jit.trace`, `.lower()`,
`.compile()`) or all at once from `--threads` threads (wall time only). Run the two
modes back to back in fresh processes (an in-process repeat would hit JAX's
in-memory caches). Prints one JSON line with `uptime` before and after.
"""

import argparse
import concurrent.futures
import json
import subprocess
import time

from jaxserve.checkpoint import load_model
from jaxserve.engine import make_engine_config
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.scheduler.buckets import BucketPolicy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("serial", "threads"), required=True)
    ap.add_argument("--keys", default="stack:8,stack:16")
    ap.add_argument("--max_num_seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers_per_program", type=int, default=1,
                    help="G of the layer-group stack (num_layers: the one-program stack)")
    a = ap.parse_args()
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()
    cfg, params, _ = load_model(None, progress=False)
    t_params = time.perf_counter() - t0
    config = make_engine_config(cfg, max_model_len=2048, block_size=16,
                                kv_cache_memory_bytes=512 * 2**20, max_num_seqs=a.max_num_seqs,
                                max_num_batched_tokens=256, attention_backend="auto",
                                layers_per_program=a.layers_per_program)
    runner = ModelRunner(config, params, bucket_policy=BucketPolicy.from_config(config.scheduler),
                         executable_cache_dir="")
    keys = [(k.split(":")[0], int(k.split(":")[1])) for k in a.keys.split(",")]
    res = {"mode": a.mode, "keys": a.keys, "params_load_s": t_params, "uptime_start": up0}
    t0 = time.perf_counter()
    if a.mode == "serial":
        per = {}
        for key in keys:
            if key[0] == "stack" and runner.group is not None:  # its embed / layers / final
                progs = {f"stack.{n}:{key[1]}": fa
                         for n, fa in runner._group_stack_args(key[1]).items()}
            else:
                progs = {f"{key[0]}:{key[1]}": runner._example_args(key)}
            for name, (fn, args) in progs.items():
                t1 = time.perf_counter()
                traced = fn.trace(*args)
                t2 = time.perf_counter()
                lowered = traced.lower()
                t3 = time.perf_counter()
                lowered.compile()
                t4 = time.perf_counter()
                per[name] = {"trace_s": t2 - t1, "lower_s": t3 - t2, "compile_s": t4 - t3}
        res["per_program"] = per
    else:
        with concurrent.futures.ThreadPoolExecutor(a.threads) as ex:
            list(ex.map(runner._build, keys))
    res["wall_s"] = time.perf_counter() - t0
    res["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
