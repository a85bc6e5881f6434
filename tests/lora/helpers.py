"""Random LoRA adapters for the tiny model, and the hand-merged reference weights."""

from __future__ import annotations

import numpy as np

from jaxserve.lora.adapter import target_shapes


def random_adapter(cfg, rank: int, seed: int, targets=None, std: float = 0.3) -> dict:
    """An in-memory tree {target: {"lora_a": [L, in, r], "lora_b": [L, r, out]}, "scaling"}
    with non-zero B (the scale is lora_alpha / r with lora_alpha = 2r)."""
    rng = np.random.default_rng(seed)
    shapes = target_shapes(cfg)
    tree = {"scaling": 2.0}
    for t in targets or shapes:
        din, dout = shapes[t]
        L = cfg.num_hidden_layers
        tree[t] = {"lora_a": rng.normal(0, std, (L, din, rank)).astype(np.float32),
                   "lora_b": rng.normal(0, std, (L, rank, dout)).astype(np.float32)}
    return tree


def merged_params(params: dict, tree: dict) -> dict:
    """The canonical tree with W + scale * A @ B merged by hand, in float64 then f32."""
    layers = dict(params["layers"])
    for t, ab in tree.items():
        if t == "scaling":
            continue
        delta = np.einsum("lir,lro->lio", ab["lora_a"].astype(np.float64),
                          ab["lora_b"].astype(np.float64)) * tree["scaling"]
        layers[t] = (layers[t].astype(np.float64) + delta).astype(np.float32)
    return {**params, "layers": layers}


def to_peft_state_dict(tree: dict) -> dict:
    """The tree as PEFT's flat state dict (torch's [out, in] layout, B unscaled)."""
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    out = {}
    for t, ab in tree.items():
        if t == "scaling":
            continue
        for i in range(ab["lora_a"].shape[0]):
            pre = f"base_model.model.model.layers.{i}.{names[t]}"
            out[f"{pre}.lora_A.weight"] = np.ascontiguousarray(ab["lora_a"][i].T)
            out[f"{pre}.lora_B.weight"] = np.ascontiguousarray(ab["lora_b"][i].T)
    return out
