"""How an HF `config.json` names a family and its layer types (the parts of
`ModelConfig.from_hf_dict` that follow transformers' per-family rules). Plain Python."""

from __future__ import annotations

from typing import Any


# HF model_type -> (architecture class, the ModelConfig switches it implies).
HF_FAMILIES: dict[str, tuple[str, dict[str, bool]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"attention_bias": True}),
    "qwen3": ("Qwen3ForCausalLM", {"qk_norm": True}),
    "gemma3_text": ("Gemma3ForCausalLM", {"qk_norm": True, "sandwich_norms": True,
                                          "scale_embeddings": True}),
}
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF `layer_types` values
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # transformers' Gemma3TextConfig default: 5 local, 1 global


def hf_layer_types(d: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of an HF config dict, as transformers reads them.

    Mistral: every layer slides when `sliding_window` is not null. Qwen2/Qwen3: only
    with `use_sliding_window`, on the layers `layer_types` marks "sliding_attention"
    (when absent: layers >= `max_window_layers`). Gemma 3: `layer_types`, or every
    layer whose (index + 1) is not a multiple of `sliding_window_pattern` (default 6).
    (None, None) when no layer slides."""
    model_type, window, types = d.get("model_type", "llama"), d.get("sliding_window"), \
        d.get("layer_types")
    L = int(d["num_hidden_layers"])
    if window is None or model_type not in ("mistral", "qwen2", "qwen3", "gemma3_text") or (
            model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window")):
        return None, None
    if model_type in ("qwen2", "qwen3"):
        types = types or ["sliding_attention" if i >= int(d.get("max_window_layers", 0))
                          else "full_attention" for i in range(L)]
    elif model_type == "gemma3_text":
        pattern = int(d.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN))
        types = types or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                          for i in range(L)]
    if types is not None and "sliding_attention" not in types:
        return None, None
    return int(window), (tuple(types) if types is not None else None)


def hf_family_switches(d: dict[str, Any]) -> dict[str, bool]:
    """The `ModelConfig` switches of an HF config dict, after checking it is supported.

    The sliding window, per layer, is read by `hf_layer_types`.

    Raises:
      ValueError: unknown model_type/architecture, o_proj/MLP biases (Llama/Qwen3
        `attention_bias`, `mlp_bias`), attention-logit soft-capping.
    """
    model_type = d.get("model_type", "llama")
    if model_type not in HF_FAMILIES:
        raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures="
                         f"{d.get('architectures')!r} (supported model_type: {sorted(HF_FAMILIES)})")
    arch, switches = HF_FAMILIES[model_type]
    archs = d.get("architectures") or [arch]
    if arch not in archs:
        raise ValueError(f"unsupported architecture: model_type={model_type!r}, "
                         f"architectures={archs!r} (expected {arch})")
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{model_type} config has attn_logit_softcapping="
                         f"{d['attn_logit_softcapping']!r}: attention-logit soft-capping is not "
                         "supported by jaxserve's attention kernels (Gemma 2)")
    if model_type != "qwen2" and d.get("attention_bias"):
        raise ValueError(f"{model_type} config has attention_bias=true (q/k/v/o biases): "
                         "not supported (only Qwen2's q/k/v biases)")
    if d.get("mlp_bias"):
        raise ValueError(f"{model_type} config has mlp_bias=true: not supported")
    return dict(switches)
