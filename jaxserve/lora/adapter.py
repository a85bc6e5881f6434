"""LoRA adapters on the host: loaded from a PEFT directory, a PEFT flat state dict or an
in-memory tree, checked against the model, and brought to one layout.

LoRA (Hu et al. 2021) adds scale * B @ A to a frozen projection W: with our [in, out]
weights, y = x @ W + scale * (x @ A) @ B, A [in, r], B [r, out]. PEFT's scale is
lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora` (Kalajdzievski 2023). The
host layout folds the scale into B, so the device never multiplies by it:

  LoRAAdapter.weights[target] = (A f32[L, in, r], B f32[L, r, out] already scaled)

for each target projection among `TARGETS` (our names; PEFT's q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj). Layers the adapter does not touch are zeros.
NumPy only: the engine loads and validates adapters without jax (the device pool,
`jaxserve.model.lora`, writes them into a slot).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

# HF / PEFT module name -> our projection name (`jaxserve.model.llama`'s canonical keys).
HF_TO_TARGET = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
TARGETS = tuple(HF_TO_TARGET.values())

_PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def target_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection for a `ModelConfig`."""
    E, F = cfg.hidden_size, cfg.intermediate_size
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {"wq": (E, H * D), "wk": (E, K * D), "wv": (E, K * D), "wo": (H * D, E),
            "w_gate": (E, F), "w_up": (E, F), "w_down": (F, E)}


def lora_scaling(lora_alpha: float, r: int, use_rslora: bool = False) -> float:
    """PEFT's scale: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    return float(lora_alpha) / (math.sqrt(r) if use_rslora else r)


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in the host layout (module doc): `rank` r, and per target
    (A f32[L, in, r], B f32[L, r, out] with the scale folded in)."""

    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    scaling: float

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _target(hf_name: str) -> str:
    if hf_name in HF_TO_TARGET:
        return HF_TO_TARGET[hf_name]
    if hf_name in TARGETS:
        return hf_name
    raise ValueError(f"LoRA target module {hf_name!r} is not supported: the targets are "
                     f"{sorted(HF_TO_TARGET)} (or {list(TARGETS)})")


def _host(a: Any, what: str) -> np.ndarray:
    """a as a float32 NumPy array (a jax array, any sharding, is gathered to the host)."""
    arr = np.asarray(a)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
        raise ValueError(f"LoRA weight {what} has dtype {arr.dtype}, expected a floating dtype")
    return arr.astype(np.float32)


def from_flat_state_dict(cfg: Any, state: Mapping[str, Any], *, scaling: float,
                         max_rank: int) -> LoRAAdapter:
    """An adapter from PEFT's flat state dict (as `safetensors` loads
    adapter_model.safetensors: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
    -> [r, in], `...lora_B.weight` -> [out, r]); `scaling` from its adapter_config.json.

    Raises:
      ValueError: a key that is not a LoRA A/B weight of a supported projection, a layer
        index >= num_hidden_layers, a rank over max_rank, mismatched or wrong shapes
        (naming the key, the shape and the expected one), or an A without its B.
    """
    L = cfg.num_hidden_layers
    parts: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for key, val in state.items():
        m = _PEFT_KEY.search(key)
        if m is None:
            raise ValueError(f"LoRA state dict key {key!r} is not a lora_A/lora_B weight of a "
                             f"decoder layer's projection")
        layer, target, ab = int(m.group(1)), _target(m.group(2)), m.group(3)
        if layer >= L:
            raise ValueError(f"LoRA key {key!r}: layer {layer} >= num_hidden_layers={L}")
        arr = _host(val, key)
        if arr.ndim != 2:
            raise ValueError(f"LoRA weight {key!r} has shape {arr.shape}, expected 2-D")
        # PEFT keeps torch's [out, in] Linear layout: A [r, in], B [out, r] -> ours A [in, r], B [r, out]
        parts.setdefault(target, {}).setdefault(ab, {})[layer] = arr.T
    tree = {}
    for target, ab in parts.items():
        if set(ab.get("A", {})) != set(ab.get("B", {})):
            raise ValueError(f"LoRA target {target}: lora_A layers {sorted(ab.get('A', {}))} != "
                             f"lora_B layers {sorted(ab.get('B', {}))}")
        tree[target] = ab
    return _assemble(cfg, tree, scaling=scaling, max_rank=max_rank, scale_b=True)


def from_tree(cfg: Any, tree: Mapping[str, Any], *, max_rank: int,
              scaling: float | None = None) -> LoRAAdapter:
    """An adapter from the in-memory tree a JAX trainer holds:
    {target: {"lora_a": [L, in, r], "lora_b": [L, r, out]}, ..., optional "scaling": float}
    in our [in, out] orientation (targets: `TARGETS` or PEFT's module names), any array
    type or sharding; B is NOT yet scaled (scale = tree["scaling"], else `scaling`, else 1).
    A PEFT flat state dict (keys with "lora_A") is also accepted (then `scaling` is used).

    Raises:
      ValueError: as `from_flat_state_dict`, or a target without "lora_a"/"lora_b".
    """
    if any("lora_A" in str(k) for k in tree):
        return from_flat_state_dict(cfg, tree, scaling=1.0 if scaling is None else scaling,
                                    max_rank=max_rank)
    scale = float(tree.get("scaling", 1.0 if scaling is None else scaling))
    parts = {}
    for name, ab in tree.items():
        if name == "scaling":
            continue
        target = _target(name)
        if not isinstance(ab, Mapping) or set(ab) != {"lora_a", "lora_b"}:
            raise ValueError(f"LoRA tree entry {name!r} must be {{'lora_a': [L, in, r], "
                             f"'lora_b': [L, r, out]}}, got "
                             f"{sorted(ab) if isinstance(ab, Mapping) else type(ab).__name__}")
        a, b = _host(ab["lora_a"], f"{name}/lora_a"), _host(ab["lora_b"], f"{name}/lora_b")
        if a.ndim != 3 or b.ndim != 3:
            raise ValueError(f"LoRA tree entry {name!r}: lora_a {a.shape} / lora_b {b.shape} "
                             f"must be 3-D [L, in, r] / [L, r, out]")
        parts[target] = {"A": dict(enumerate(a)), "B": dict(enumerate(b))}
    return _assemble(cfg, parts, scaling=scale, max_rank=max_rank, scale_b=True)


def _assemble(cfg: Any, parts: dict, *, scaling: float, max_rank: int,
              scale_b: bool) -> LoRAAdapter:
    """Check every (layer, target) A [in, r] / B [r, out] and stack them over [L]."""
    if not parts:
        raise ValueError("the LoRA adapter has no weights")
    L, shapes = cfg.num_hidden_layers, target_shapes(cfg)
    ranks = {a.shape[1] for ab in parts.values() for a in ab["A"].values()}
    if len(ranks) != 1:
        raise ValueError(f"LoRA adapter mixes ranks {sorted(ranks)}; one rank per adapter")
    r = ranks.pop()
    if not 1 <= r <= max_rank:
        raise ValueError(f"LoRA rank {r} exceeds max_lora_rank={max_rank}" if r > max_rank
                         else f"LoRA rank {r} must be >= 1")
    if not math.isfinite(scaling):
        raise ValueError(f"LoRA scaling {scaling} must be finite")
    weights = {}
    for target, ab in parts.items():
        din, dout = shapes[target]
        if len(ab["A"]) > L:
            raise ValueError(f"LoRA target {target}: {len(ab['A'])} layers > num_hidden_layers={L}")
        A = np.zeros((L, din, r), np.float32)
        B = np.zeros((L, r, dout), np.float32)
        for i, a in ab["A"].items():
            b = ab["B"][i]
            if a.shape != (din, r) or b.shape != (r, dout):
                raise ValueError(f"LoRA {target} layer {i}: A {a.shape} / B {b.shape} (ours, "
                                 f"[in, r] / [r, out]) do not fit the model's {target}: expected "
                                 f"A {(din, r)} / B {(r, dout)}")
            A[i], B[i] = a, b * scaling if scale_b else b
        weights[target] = (A, B)
    return LoRAAdapter(rank=r, weights=weights, scaling=float(scaling))


def read_peft_config(path: str) -> dict:
    """adapter_config.json of a PEFT directory, checked for what the engine supports."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA path {path!r} has no adapter_config.json")
    with open(cfg_path) as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type={conf.get('peft_type')!r}, only 'LORA' is served")
    for key in ("use_dora", "modules_to_save", "fan_in_fan_out", "target_parameters",
                "trainable_token_indices", "layer_replication"):
        if conf.get(key):
            raise ValueError(f"{cfg_path}: {key}={conf[key]!r} is not supported")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"{cfg_path}: bias={conf['bias']!r} is not supported (only 'none')")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise ValueError(f"{cfg_path}: rank_pattern / alpha_pattern are not supported")
    return conf


def load_peft_dir(cfg: Any, path: str, *, max_rank: int) -> LoRAAdapter:
    """An adapter from a PEFT directory (adapter_config.json + adapter_model.safetensors).

    Raises:
      ValueError: a missing file, an unsupported PEFT option, or any check of
        `from_flat_state_dict` (rank, shapes, target modules), naming the value and limit.
    """
    from safetensors.numpy import load_file

    conf = read_peft_config(path)
    st = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st):
        raise ValueError(f"LoRA path {path!r} has no adapter_model.safetensors")
    r = int(conf["r"])
    if r > max_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank r={r} exceeds max_lora_rank={max_rank}")
    scale = lora_scaling(conf.get("lora_alpha", r), r, bool(conf.get("use_rslora", False)))
    return from_flat_state_dict(cfg, load_file(st), scaling=scale, max_rank=max_rank)
