"""The Llama decoder as a Flax NNX module (`Llama`), kept apart from `jaxserve.model.llama`
so that the engine's start-up does not import flax (~1 s); `jaxserve.model.llama.Llama`
still names it (a lazy module attribute)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model.params import param_shapes


class Llama(nnx.Module):
    """Llama decoder as an NNX module: its state is the canonical parameter tree.

    `Llama(cfg, rngs=nnx.Rngs(0))` initialises random weights (normal, std
    `init_std`, biases included; norms 1). The optional leaves of `param_shapes`
    (biases, q/k norms) exist only when cfg switches them on. The engine takes the module, or `nnx.state(model)`,
    through `prepare_params`, which splits it once (`nnx.split`) and hands the
    state's leaves, in the engine layout, to the jitted step: the step runs the
    pure functions of `jaxserve.model.llama` on those leaves (`forward_paged`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        dt = jnp.dtype(cfg.dtype)
        shapes = param_shapes(cfg)

        def init(shape, key_name):
            if key_name.endswith("norm"):
                return jnp.ones(shape, dt)
            return (init_std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dt)

        self.cfg = cfg
        self.embed = nnx.Param(init(shapes["embed"], "embed"))
        self.layers = nnx.Dict({k: nnx.Param(init(s, k)) for k, s in shapes["layers"].items()})
        self.final_norm = nnx.Param(init(shapes["final_norm"], "final_norm"))
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(init(shapes["lm_head"], "lm_head"))
