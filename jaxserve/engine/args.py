"""Engine arguments: flat keyword arguments (vLLM's `EngineArgs`) into an `EngineConfig`,
and the EOS ids an engine stops on."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.sample.metadata import MAX_EOS_TOKEN_IDS


def make_engine_config(model: ModelConfig, **engine_args: Any) -> EngineConfig:
    """Distribute flat keyword arguments (vLLM `EngineArgs` style) over the configs.

    Each name must be a field of CacheConfig, SchedulerConfig or EngineConfig
    (`dtype` goes to the ModelConfig, None keeps its dtype; `scheduling_policy`, vLLM's name, is
    SchedulerConfig.policy: "fcfs" or "priority").

    Raises:
      ValueError: an unknown argument, or any field validation error.
    """
    if "scheduling_policy" in engine_args:
        policy = engine_args.pop("scheduling_policy")
        if engine_args.setdefault("policy", policy) != policy:
            raise ValueError(f"scheduling_policy={policy!r} and policy="
                             f"{engine_args['policy']!r} disagree: give one")
    if engine_args.pop("enable_lora", False):  # vLLM's switch; LoRA is on with max_loras > 0
        engine_args["max_loras"] = engine_args.get("max_loras") or 1
    if "dtype" in engine_args:  # None keeps the model's (its loader's platform default)
        dtype = engine_args.pop("dtype")
        model = model if dtype is None else model.replace(dtype=dtype)
    groups: dict[type, dict[str, Any]] = {CacheConfig: {}, SchedulerConfig: {}, EngineConfig: {}}
    for name, value in engine_args.items():
        for cls, kw in groups.items():
            if name in {f.name for f in dataclasses.fields(cls)} and name not in ("model", "cache",
                                                                                   "scheduler"):
                kw[name] = value
                break
        else:
            raise ValueError(f"unknown engine argument {name}={value!r}")
    sched = groups[SchedulerConfig]
    sched.setdefault("max_model_len", min(2048, model.max_position_embeddings))
    return EngineConfig(model=model, cache=CacheConfig(**groups[CacheConfig]),
                        scheduler=SchedulerConfig(**sched), **groups[EngineConfig])


def _eos_token_ids(config: EngineConfig, tokenizer: Any) -> tuple[int, ...]:
    """The model's EOS ids plus the tokenizer's.

    Raises:
      ValueError: an id outside the vocabulary, or more than the sampler supports.
    """
    eos = set(config.model.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    ids = tuple(sorted(eos))
    V = config.model.vocab_size
    if any(not 0 <= t < V for t in ids):
        raise ValueError(f"eos_token_ids={ids} must lie in [0, vocab_size={V})")
    if len(ids) > MAX_EOS_TOKEN_IDS:
        raise ValueError(f"{len(ids)} EOS ids {ids}: the sampler supports at most "
                         f"MAX_EOS_TOKEN_IDS={MAX_EOS_TOKEN_IDS}")
    return ids
