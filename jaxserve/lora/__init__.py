"""LoRA adapters (issue 27): `LoRARequest` (vLLM's name), host-side loading and
checks (`adapter`), and the engine's pool of device slots (`manager`). No jax here:
the device side is `jaxserve.model.lora` (the forward's shrink / expand) and the
runner's `set_lora` (writes a slot)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to serve (vLLM's `LoRARequest`).

    Fields:
      lora_name: the adapter's name (the server's `model` field names it).
      lora_int_id: a unique positive int id (0 is the base model).
      lora_path: a PEFT directory (adapter_config.json + adapter_model.safetensors),
        or an in-memory tree (`jaxserve.lora.adapter.from_tree`: the trainer's arrays,
        or PEFT's flat state dict).
    """

    lora_name: str
    lora_int_id: int
    lora_path: Any = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 "
                             f"(0 is the base model)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")


__all__ = ["LoRARequest"]
