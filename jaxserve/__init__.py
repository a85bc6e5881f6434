"""jaxserve: a JAX/Pallas LLM inference engine.

Continuous batching over a paged KV cache, with the ragged batch padded to a
few token-count buckets that are compiled once at warm-up.
"""

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "LoRARequest"]


def __getattr__(name):
    # Lazy: importing the package (e.g. for the jax-free scheduler) must not import jax.
    if name == "LLM":
        from jaxserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from jaxserve.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
