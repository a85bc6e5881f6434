"""The host engine (vLLM V1's engine layer): no jax, no flax.

  core.py              LLMEngine: one step = schedule, execute, update, output processing
  args.py              make_engine_config: flat engine arguments -> EngineConfig
  stats.py             get_stats: counters and gauges
  input_processor.py   prompt -> token ids -> Request(s), validation
  output_processor.py  detokenize, stop strings, RequestOutput; returns what to finish
  detokenizer.py       incremental detokenization

`LLMEngine` and `make_engine_config` are the public names research code imports.
"""

from jaxserve.engine.args import make_engine_config
from jaxserve.engine.core import LLMEngine

__all__ = ["LLMEngine", "make_engine_config"]
