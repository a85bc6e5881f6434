"""The runner's LoRA pool (issue 27): the slot leaves inside the engine-layout params,
and the one AOT program that writes a slot.

The pool leaves (`jaxserve.model.lora.lora_leaf_shapes`) sit in each layer's dict of
`ModelRunner.params`, so every step program, its shardings and its specs carry them
like any weight, and one compiled program per bucket serves any mix of adapters.
Loading, replacing or removing an adapter runs `write`, an executable compiled once
when the runner is built (the pool donated, updated in place): nothing compiles
after warm-up. Under tensor parallelism A and B are sharded like the projection they
attach to (`jaxserve.distributed.tensor_parallel.LAYER_SPECS`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.lora import lora_leaf_shapes, write_slot
from jaxserve.worker.input_batch import token_lora_slots


def _is_lora(key: str) -> bool:
    return key.startswith("lora_a_") or key.startswith("lora_b_")


class LoRAPool:
    """The device slots of a runner (slots 1..max_loras; 0 is the base model).

    Args:
      runner: the `ModelRunner` (its config, placement and params).

    Raises:
      ValueError: max_lora_rank < 1, a fused projection layout, or tensor
        parallelism that replicates KV heads (TP > num_key_value_heads).
    """

    def __init__(self, runner: Any):
        cfg, config = runner.cfg, runner.config
        self.max_loras, self.rank = config.max_loras, config.max_lora_rank
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras!r} must be an int >= 0")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"max_lora_rank={self.rank!r} must be an int >= 1")
        if runner.tp.replicas > 1:
            raise ValueError(f"LoRA with tensor_parallel_size={config.tensor_parallel_size} > "
                             f"num_key_value_heads={cfg.num_key_value_heads} is not supported")
        self.runner = runner
        self.dtype = np.dtype(jnp.dtype(cfg.dtype))
        self.shapes = lora_leaf_shapes(cfg, self.max_loras, self.rank)
        self.L = cfg.num_hidden_layers

    @classmethod
    def attach_to(cls, runner: Any) -> "LoRAPool | None":
        """A pool for `runner` (None when max_loras = 0), its leaves added to runner.params."""
        if not runner.config.max_loras:
            return None
        pool = cls(runner)
        runner.params = pool.attach(runner.params)
        return pool

    def attach(self, params: dict) -> dict:
        """params with zeroed pool leaves in each layer (placed as the runner places weights)."""
        layers = params["layers"]
        if isinstance(layers, (list, tuple)):
            zeros = [{k: np.zeros(s, self.dtype) for k, s in self.shapes.items()}
                     for _ in layers]
        else:
            zeros = {k: np.zeros((self.L, *s), self.dtype) for k, s in self.shapes.items()}
        pool = self.runner.tp.place_params({"layers": zeros})["layers"]
        self._build_writer(pool)
        return self.merge(params, pool)

    def token_slots(self, out: Any, rows: list) -> np.ndarray:
        """i32[T_pad]: each token's slot (`jaxserve.worker.input_batch.token_lora_slots`)."""
        return token_lora_slots(out, rows, out.token_bucket)

    def place(self, new_params: dict) -> dict:
        """`update_params`'s placement: the new base weights placed as the runner places
        them, with the live pool leaves carried over (`update_lora` swaps those).

        Raises:
          ValueError: the pool was discarded (`sleep(2, discard_weights=True)`): the
            adapters' slots are gone, so serving them would be silently wrong.
        """
        pool = self.split(self.runner.params)
        if not all(isinstance(a, jax.Array) for a in jax.tree.leaves(pool)):
            raise ValueError("update_params: the LoRA slots were discarded by sleep(level=2, "
                             "discard_weights=True); a LoRA engine sleeps with "
                             "discard_weights=False")
        return self.merge(self.runner.tp.place_params(new_params), pool)

    @staticmethod
    def split(params: dict) -> Any:
        """The pool leaves of params (same list / dict structure as its layers)."""
        layers = params["layers"]
        if isinstance(layers, (list, tuple)):
            return [{k: v for k, v in lp.items() if _is_lora(k)} for lp in layers]
        return {k: v for k, v in layers.items() if _is_lora(k)}

    @staticmethod
    def merge(params: dict, pool: Any) -> dict:
        """params with its layers' pool leaves replaced by `pool`'s."""
        layers = params["layers"]
        if isinstance(layers, (list, tuple)):
            layers = [{**lp, **pl} for lp, pl in zip(layers, pool, strict=True)]
        else:
            layers = {**layers, **pool}
        return {**params, "layers": layers}

    def _new_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Specs of one slot's host arrays: A [L, in, r], B [L, r, out]."""
        out = {}
        for k, s in self.shapes.items():
            one = (s[0], s[2]) if k.startswith("lora_a_") else (s[1], s[2])
            out[k] = jax.ShapeDtypeStruct((self.L, *one), self.dtype)
        return out

    def _build_writer(self, pool: Any) -> None:
        shardings = jax.tree.map(lambda a: a.sharding, pool)
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            pool)
        fn = jax.jit(write_slot, donate_argnums=(0,), out_shardings=shardings)
        self._write = fn.lower(spec, self._new_spec(),
                               jax.ShapeDtypeStruct((), jnp.int32)).compile()

    def host_slot(self, adapter: Any) -> dict[str, np.ndarray]:
        """One slot's arrays from a `LoRAAdapter` (None: zeros), rank padded to r."""
        new = {k: np.zeros(s.shape, self.dtype) for k, s in self._new_spec().items()}
        if adapter is not None:
            r = adapter.rank
            for t, (a, b) in adapter.weights.items():
                new[f"lora_a_{t}"][:, :, :r] = a
                new[f"lora_b_{t}"][:, :r, :] = b
        return new

    @staticmethod
    def write_to(runner: Any, slot: int, adapter: Any) -> None:
        """`runner.lora.write(slot, adapter)`; ValueError when the runner has no pool."""
        if runner.lora is None:
            raise ValueError("LoRA is off: build the engine with max_loras > 0")
        runner.lora.write(slot, adapter)

    def write(self, slot: int, adapter: Any) -> None:
        """Write `adapter` (a `jaxserve.lora.adapter.LoRAAdapter`, None: zeros) into slot
        1..max_loras between steps. Compiles nothing.

        Raises:
          ValueError: a slot out of range, a rank over max_lora_rank, or a runner asleep
            at level 2.
        """
        if jax.process_count() > 1:  # the followers would keep the old slot
            raise ValueError(f"LoRA slots cannot be written across {jax.process_count()} "
                             f"processes (multi-host)")
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..max_loras={self.max_loras}")
        if not self.runner.sleeper.weights_on_device:  # a level-2 sleep holds no pool
            raise ValueError(f"LoRA slot {slot} cannot be written while the engine sleeps "
                             "at level 2 (its weights are off the device); wake_up() first")
        if adapter is not None and adapter.rank > self.rank:
            raise ValueError(f"LoRA rank {adapter.rank} exceeds max_lora_rank={self.rank}")
        new = self.host_slot(adapter)  # before touching the pool: a bad adapter changes nothing
        r = self.runner
        pool = self._write(self.split(r.params), new, np.int32(slot - 1))
        r.params = self.merge(r.params, pool)
