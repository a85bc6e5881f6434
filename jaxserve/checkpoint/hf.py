"""Load a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 (text) checkpoint
directory into the jaxserve param tree.

Reads config.json (-> `ModelConfig.from_hf_dict`, which checks the architecture
against `jaxserve.config.HF_FAMILIES`), `model.safetensors` or the
shards listed in `model.safetensors.index.json` (safetensors' NumPy API), and
maps HF names to the tree through ONE table, `hf_name`. HF `nn.Linear`
weights are [out, in]; the tree stores [in, out], so matrices are transposed.
HF q/k rows are already in rotate_half layout: no permutation here. Qwen2's
q/k/v biases and Qwen3's per-head q/k norms map to the optional leaves
bq/bk/bv and q_norm/k_norm, read only when the config switches them on.

Gemma 3 (`Gemma3ForCausalLM`, model_type gemma3_text; `cfg.sandwich_norms`) renames the
MLP norm (`pre_feedforward_layernorm`) and adds `post_attention_layernorm` /
`post_feedforward_layernorm` (`GEMMA3_LAYER_NAMES`). Its RMSNorm computes x * (1 + w)
and HF stores w; the tree holds the effective 1 + w on every norm leaf (q/k and final
norms included), which is what llama.cpp's converter writes into a gemma3 GGUF, so both
loaders give the same tree. A multimodal `Gemma3ForConditionalGeneration` checkpoint
(vision tower, `language_model` prefixes) is refused: text only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from jaxserve.checkpoint.layout import (
    MATRIX_LEAVES, CheckpointError, TensorSource, check_tree, stack_layers)
from jaxserve.config import ModelConfig

# Tree leaf -> HF tensor name ("{i}" = layer index). The single source of truth.
HF_LAYER_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias",  # Qwen2
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",  # Qwen3
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
# Gemma 3 (text): the names that differ from HF_LAYER_NAMES (transformers' Gemma3DecoderLayer).
GEMMA3_LAYER_NAMES = {
    **HF_LAYER_NAMES,
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Leaves that are RMSNorm weights (Gemma stores w, applies 1 + w).
NORM_LEAVES = frozenset({"attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm",
                         "q_norm", "k_norm", "final_norm"})
HF_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                "lm_head": "lm_head.weight"}
# Buffers some old checkpoints saved; they carry no weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_name(leaf: str, layer: int | None = None, *, gemma: bool = False) -> str:
    """HF tensor name of a tree leaf (`layer` for per-layer leaves; `gemma`: Gemma 3's
    names, for a config with `sandwich_norms`)."""
    names = GEMMA3_LAYER_NAMES if gemma else HF_LAYER_NAMES
    if leaf in names:
        return names[leaf].format(i=layer)
    return HF_TOP_NAMES[leaf]


def _refuse_multimodal(raw: dict, path: Path) -> None:
    archs = raw.get("architectures") or []
    if raw.get("model_type") == "gemma3" or any("ConditionalGeneration" in a for a in archs):
        raise CheckpointError(
            f"{path}: model_type={raw.get('model_type')!r}, architectures={archs!r} is a "
            "multimodal checkpoint (e.g. Gemma3ForConditionalGeneration): jaxserve loads text-only "
            "models (for Gemma 3: Gemma3ForCausalLM, model_type 'gemma3_text')")


def load_hf_config(directory: str | Path, *, dtype: str | None = None) -> ModelConfig:
    """config.json (+ generation_config.json eos ids) -> ModelConfig.

    Raises:
      CheckpointError: config.json missing/unparsable, an unsupported architecture (a
        multimodal one such as Gemma3ForConditionalGeneration included), or a config the
        family's switches cannot express (the message names the file and the fields).
    """
    d = Path(directory)
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{d}: no config.json, not an HF checkpoint directory")
    try:
        raw = json.loads(path.read_text())
        _refuse_multimodal(raw, path)
        gen = d / "generation_config.json"
        if gen.is_file():
            g_eos = json.loads(gen.read_text()).get("eos_token_id")
            eos = raw.get("eos_token_id")
            ids = [x for v in (eos, g_eos) for x in (v if isinstance(v, list) else [v]) if x is not None]
            if ids:
                raw["eos_token_id"] = list(dict.fromkeys(ids))
        return ModelConfig.from_hf_dict(raw, dtype=dtype)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {type(e).__name__}: {e}") from e


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF dir: the index's shards, or model.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable shard index: {e}") from e
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        root = directory.resolve()
        outside = [f for f in files if not f.resolve().is_relative_to(root)]
        if outside:  # an index must not point a loader (or the admin route) elsewhere
            raise CheckpointError(f"{index}: shard(s) outside the checkpoint dir {root}: "
                                  f"{[str(f) for f in outside]}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights (pytorch .bin is not supported)")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{directory}: shard(s) listed in the index are missing: {missing}")
    return files


def _read_raw(path: Path, name: str, info: dict) -> np.ndarray:
    # safetensors' NumPy API cannot build bfloat16 arrays; read the bytes via the header.
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        start, end = info["data_offsets"]
        f.seek(8 + hlen + start)
        buf = f.read(end - start)
    if len(buf) != end - start:
        raise CheckpointError(f"{path}: tensor '{name}' is truncated")
    return np.frombuffer(buf, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(hlen))


def read_safetensors(files: Iterable[Path], *, progress: bool = True) -> dict[str, np.ndarray]:
    """All tensors of the given files as float32 NumPy arrays (HF names, HF layout).

    Raises:
      CheckpointError: a file is corrupt or truncated (names the file), or a
        tensor name repeats across shards.
    """
    out: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                names = list(f.keys())
                header = None
                for name in tqdm(names, desc=f"reading {path.name}", unit="tensor",
                                 disable=not progress, leave=False):
                    if name in out:
                        raise CheckpointError(f"{path}: tensor '{name}' appears in more than one shard")
                    if f.get_slice(name).get_dtype() == "BF16":
                        header = header or _header(path)
                        a = _read_raw(path, name, header[name])
                    else:
                        a = f.get_tensor(name)
                    out[name] = np.asarray(a, dtype=np.float32)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file: {e}") from e
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from e
    return out


def convert_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: Path) -> dict:
    """HF-named float32 tensors -> param tree (float32, [in, out], layers stacked).

    With `cfg.sandwich_norms` (Gemma 3) the names are `GEMMA3_LAYER_NAMES` and every norm
    leaf (`NORM_LEAVES`) is stored as 1 + w, the weight Gemma's RMSNorm applies.

    Raises:
      CheckpointError: a required tensor is missing, has a wrong shape, or an
        unexpected tensor (e.g. a bias this architecture lacks) is present.
    """
    src = TensorSource(tensors, source)
    take, used = src.take, src.used
    gemma = cfg.sandwich_norms

    def norm(a: np.ndarray) -> np.ndarray:
        return a + np.float32(1.0) if gemma else a

    def layer(i: int, leaf: str) -> np.ndarray:
        a = take(hf_name(leaf, i, gemma=gemma))
        if leaf in NORM_LEAVES:
            return norm(a)
        return a.T if leaf in MATRIX_LEAVES else a  # stack_layers copies the view

    params = {"embed": take(hf_name("embed")), "layers": stack_layers(cfg, layer, source),
              "final_norm": norm(take(hf_name("final_norm")))}
    if cfg.tie_word_embeddings:
        used.add(hf_name("lm_head"))  # some exporters save the tied copy; it is the embedding
    else:
        params["lm_head"] = np.ascontiguousarray(take(hf_name("lm_head")).T)
    extra = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensors for the architecture in "
                              f"config.json: {extra[:8]}")
    check_tree(cfg, params, source)
    return params


def load_hf_params(directory: str | Path, cfg: ModelConfig, *, progress: bool = True) -> dict:
    """Read and convert an HF checkpoint dir's weights to a float32 param tree."""
    d = Path(directory)
    return convert_hf_tensors(cfg, read_safetensors(safetensors_files(d), progress=progress), d)
