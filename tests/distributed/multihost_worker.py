"""One process of the two-process tensor-parallel test (tests/distributed/test_multihost.py).

    python -m tests.distributed.multihost_worker <coordinator port> <process id>

Each process has 2 fake CPU devices (XLA_FLAGS set by the parent), joins
`jax.distributed` with gloo CPU collectives, and builds the same TP = 4 runner
over the 4 global devices on the tiny 8-query / 2-KV-head model. Process 0 runs
the engine (scheduler, batching, preemption) and prints `RESULT {json}` with the
greedy tokens; process 1 runs `follower_loop` until the leader's stop.
"""

from __future__ import annotations

import json
import sys


def main(port: int, pid: int) -> None:
    from jaxserve.distributed import multihost

    multihost.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax

    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.distributed.tensor_parallel import shard_report
    from jaxserve.scheduler.buckets import BucketPolicy
    from tests.conftest import tiny_params
    from tests.distributed.tp_worker import PROMPTS, TINY_ENGINE, TINY_HEADS, _run

    cfg, params = tiny_params(**TINY_HEADS)
    config = make_engine_config(cfg, attention_backend="xla", tensor_parallel_size=4,
                                **TINY_ENGINE)
    info = {"process": pid, "local_devices": jax.local_device_count(),
            "global_devices": jax.device_count()}
    if pid == 0:
        engine = LLMEngine(config, params, None, progress=False)
        leader = multihost.Leader(engine.runner)
        engine.runner.set_step_listener(leader.send_step)
        runs = _run(engine, PROMPTS)
        st = engine.get_stats()
        rep = shard_report(engine.runner.params)
        leader.stop()
        info.update(runs=runs, late=st["num_compiles_after_warmup"], steps=st["num_steps"],
                    preemptions=st["num_preemptions"], local_param_bytes=rep["bytes_per_device"],
                    wq_shards=rep["shards"]["['layers'][0]['wq']"])
    else:
        runner = ModelRunner(config, params, bucket_policy=BucketPolicy.from_config(config.scheduler))
        runner.warmup(progress=False)
        info.update(steps=multihost.follower_loop(runner), late=runner.stats().late_compiles,
                    wq_shards=shard_report(runner.params)["shards"]["['layers'][0]['wq']"])
    print("RESULT " + json.dumps(info), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
