"""Tensor-parallel checks run in a child process with fake CPU devices.

`XLA_FLAGS=--xla_force_host_platform_device_count=4` must be set before jax
initialises, and the rest of the suite runs on one device, so
tests/distributed/test_tensor_parallel.py runs this module as `python -m tests.distributed.tp_worker
<group>` and asserts on the JSON it prints last. Groups: "xla" (TP = 1, 2, 4 through
the whole engine on a tiny 8-query / 2-KV-head model, shard shapes, bytes per
device, update_params, bad sizes), "pallas" (the same with the Pallas Triton
kernel per shard in interpret mode), "smollm2" (TP = 3 on the real model).
The parent sets XLA_FLAGS; this module never does, since test_multihost.py imports
its constants into the one-device test process.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.distributed.tensor_parallel import shard_report
from jaxserve.sampling_params import SamplingParams

# vocab 68: TP 2 and 4 divide it, so the default vocab-parallel embed / lm_head is used.
TINY_HEADS = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=68)
# Batched, chunked (prompts up to 33 tokens over a 16-token budget) and preempted
# (15 usable blocks x 4 tokens cannot hold the running requests at once).
TINY_ENGINE = dict(max_model_len=64, block_size=4, num_kv_blocks=16, max_num_seqs=4,
                   max_num_batched_tokens=16, token_buckets=(8, 16), seq_buckets=(4,),
                   strict_compiles=True)
# The xla runs add the default's one-token / one-row buckets (the T_pad 1 KV write under TP).
XLA_BUCKETS = dict(token_buckets=(1, 8, 16), seq_buckets=(1, 4))
PROMPTS = [list(range(3, 3 + 5 + 7 * i)) for i in range(5)]


def _run(engine, prompts, max_tokens=12, logprobs=3, prompt_logprobs=None):
    # prompt_logprobs: the score programs (LM head over every token row) run sharded too
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = {"ids": c.token_ids,
                                      "logprobs": [{str(k): v for k, v in d.items()}
                                                   for d in c.logprobs or ()],
                                      "prompt": None if prompt_logprobs is None else
                                      np.nan_to_num(o.prompt_token_logprobs, nan=0.0).tolist()}
    return [done[f"r{i}"] for i in range(len(prompts))]


def on_training_mesh(params):
    """The canonical tree as a JAX trainer might hold it: FSDP-style on its own 1-D mesh
    over every device, each leaf split on its first axis where that divides, else
    replicated (a layout unlike the engine's Megatron TP one)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("fsdp",))

    def put(x):
        x = np.asarray(x)
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % len(devs) == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, params)


def _shards(runner):
    rep, kv = shard_report(runner.params), shard_report(runner.kv_cache)
    layer0 = {k.split("'")[-2]: v for k, v in rep["shards"].items() if "[0]" in k}
    return {"param_bytes": rep["bytes_per_device"], "kv_bytes": kv["bytes_per_device"],
            "layer0": layer0, "embed": rep["shards"]["['embed']"],
            "lm_head": rep["shards"].get("['lm_head']"), "vocab_parallel": runner.tp.vocab_parallel,
            # layer 0's K cache (each layer has its own [N, B, K', D] buffer)
            "kv_shards": kv["shards"]["[0][0]"], "kv_shape": list(runner.kv_cache[0][0].shape),
            "kv_layers": len(runner.kv_cache[0])}


def engine_group(backend: str, interpret: bool, tps: tuple[str, ...], *, prompts=PROMPTS,
                 max_tokens: int = 12, **cfg_kw) -> dict:
    """Per entry of tps ("4": TP = 4, "4r": TP = 4 with replicated embed / lm_head)."""
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.scheduler.buckets import BucketPolicy
    from tests.conftest import tiny_params

    cfg, params = tiny_params(**{**TINY_HEADS, **cfg_kw})
    out = {"devices": len(jax.devices()), "tp": {}}
    for name in tps:
        tp = int(name.rstrip("r"))
        be = "xla" if tp == 1 else backend  # TP = 1 on xla: the reference
        config = make_engine_config(cfg, attention_backend=be, attention_interpret=interpret
                                    and be != "xla", tensor_parallel_size=tp,
                                    **{**TINY_ENGINE, **(XLA_BUCKETS if backend == "xla" else {})})
        runner = ModelRunner(config, params, bucket_policy=BucketPolicy.from_config(
            config.scheduler), vocab_parallel=False if name.endswith("r") else None)
        eng = LLMEngine(config, runner=runner, progress=False)
        shardings = [a.sharding for a in jax.tree.leaves(runner.params)]
        r = {"runs": _run(eng, prompts, max_tokens, prompt_logprobs=2),
             "backend": eng.runner.backend.name,
             "sharded": type(eng.runner.backend).__name__, **_shards(eng.runner)}
        st = eng.get_stats()
        r.update(t1_steps=st["bucket_stats"].get(1, {}).get("steps", 0),
                 preemptions=st["num_preemptions"], late=st["num_compiles_after_warmup"],
                 programs=st["warmup_programs"], free=st["num_free_blocks"],
                 total=st["num_total_blocks"])
        if name in ("2", "4") and backend == "xla":  # weights swap: same shardings, no recompile
            # ... from a trainer's mesh (FSDP-style over all 4 devices): resharded to TP's
            trained = on_training_mesh(params)
            r["trained_sharded_leaves"] = sum(not a.sharding.is_fully_replicated
                                              for a in jax.tree.leaves(trained))
            eng.update_params(trained)
            r["param_shardings_kept"] = all(
                a.sharding == b for a, b in zip(jax.tree.leaves(eng.runner.params), shardings))
            eng.step()  # delivers nothing (idle), keeps the engine clean
            r["after_update"] = _run(eng, PROMPTS[:2])
            r["late_after_update"] = eng.get_stats()["num_compiles_after_warmup"]
        out["tp"][name] = r
    if backend == "xla":
        out["errors"] = bad_sizes(cfg, params)
    return out


def bad_sizes(cfg, params) -> dict:
    """Each bad TP size: its error message, and how many XLA compiles it triggered."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    errors = {}
    for tp in (3, 8):
        n0 = len(compiles)
        try:
            LLMEngine(make_engine_config(cfg, attention_backend="xla", tensor_parallel_size=tp,
                                         **TINY_ENGINE), params, None, progress=False)
            errors[str(tp)] = None
        except ValueError as e:
            errors[str(tp)] = {"msg": str(e), "compiles": len(compiles) - n0}
    return errors


def smollm2_group() -> dict:
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from tests.model.test_real_model import GOLDEN

    golden = json.loads(GOLDEN.read_text())
    cfg, params, tok = load_model(resolve_model_path(None), dtype="float32")
    config = make_engine_config(cfg, max_model_len=128, block_size=16, num_kv_blocks=48,
                                max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32),
                                seq_buckets=(4,), attention_backend="xla", tensor_parallel_size=3,
                                strict_compiles=True)
    eng = LLMEngine(config, params, tok, progress=False)
    runs = _run(eng, [r["prompt_ids"] for r in golden["runs"]],
                max_tokens=golden["max_new_tokens"], logprobs=None)
    st = eng.get_stats()
    return {"ids": [r["ids"] for r in runs], "late": st["num_compiles_after_warmup"],
            **_shards(eng.runner)}


def lora_group() -> dict:
    """Issue 27: LoRA under TP = 1 and 2 (two adapters and base rows in one batch, then an
    update_lora), the pool leaves' shard shapes, compiles after warm-up, and TP > K."""
    from tests.conftest import tiny_params
    from tests.lora.helpers import random_adapter

    from jaxserve.lora import LoRARequest

    cfg, params = tiny_params(**TINY_HEADS)
    t0, t1, t2 = (random_adapter(cfg, r, seed=s) for r, s in ((8, 1), (3, 2), (8, 3)))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    out = {}
    for tp in (1, 2, 4):
        config = make_engine_config(cfg, attention_backend="xla", tensor_parallel_size=tp,
                                    max_loras=2, max_lora_rank=8,
                                    **{**TINY_ENGINE, **XLA_BUCKETS})
        try:
            eng = LLMEngine(config, params, None, progress=False)
        except ValueError as e:
            out[str(tp)] = {"error": str(e)}
            continue
        lrs = [LoRARequest("a", 1, t0), LoRARequest("b", 2, t1), None]
        runs = []
        for phase in range(2):
            for i, p in enumerate(PROMPTS[:3]):
                eng.add_request(f"r{phase}{i}", p, sp, lora_request=lrs[i])
            done = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        c = o.outputs[0]
                        done[o.request_id] = {"ids": c.token_ids, "logprobs": [
                            {str(k): v for k, v in d.items()} for d in c.logprobs]}
            runs.append([done[f"r{phase}{i}"] for i in range(3)])
            if phase == 0:
                eng.lora.update_lora("a", t2)
        rep = shard_report(eng.runner.params)["shards"]
        out[str(tp)] = {"runs": runs, "late": eng.get_stats()["num_compiles_after_warmup"],
                        "shards": {k.split("'")[-2]: v for k, v in rep.items()
                                   if "[0]" in k and "lora" in k}}
    return out


def main(argv: list[str]) -> None:
    group = argv[1]
    if group == "xla":
        res = engine_group("xla", False, ("1", "2", "4", "4r"))
    elif group == "pallas":  # Triton needs head_dim >= 16; the interpreter is slow: 3 prompts
        res = engine_group("pallas_triton", True, ("1", "2", "4"), prompts=PROMPTS[:3],
                           max_tokens=6, head_dim=16)
    elif group == "lora":
        res = lora_group()
    elif group == "smollm2":
        res = smollm2_group()
    else:
        raise SystemExit(f"unknown group {group!r}")
    print("RESULT " + json.dumps(res, default=lambda x: np.asarray(x).tolist()))


if __name__ == "__main__":
    main(sys.argv)
