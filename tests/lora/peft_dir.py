"""Write a random adapter as a PEFT directory (adapter_config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

from lora.helpers import to_peft_state_dict

PEFT_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
              "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def write_peft_dir(path: Path, tree: dict, *, rank: int, use_rslora: bool = False) -> Path:
    """`tree` (tests.lora.helpers.random_adapter) as PEFT writes it; lora_alpha is chosen so
    PEFT's scale equals tree["scaling"]."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    denom = rank ** 0.5 if use_rslora else rank
    targets = [PEFT_NAMES[t] for t in tree if t != "scaling"]
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": tree["scaling"] * denom,
        "use_rslora": use_rslora, "target_modules": targets, "bias": "none"}))
    save_file(to_peft_state_dict(tree), str(path / "adapter_model.safetensors"))
    return path
