"""Load a llama.cpp GGUF file: ModelConfig from metadata, dequantized params, tokenizer.

Reads with `gguf.GGUFReader` (memory-mapped) and dequantizes with
`gguf.quants.dequantize` to float32. GGUF stores each matrix as ggml
`ne = [in, out]`, which NumPy sees as [out, in] (HF layout). Architectures
(`general.architecture`, metadata keys prefixed with it): "llama" (also what
llama.cpp writes for Mistral), whose attn_q/attn_k rows carry llama.cpp's RoPE
permutation, undone with `layout.unpermute_qk`; "qwen2" (q/k/v biases) and
"qwen3" (attn_q_norm/attn_k_norm), which llama.cpp's convert_hf_to_gguf.py does
not permute (they run with NEOX-style, i.e. rotate_half, RoPE); "gemma3" (Gemma 3
text, not permuted either; its norm weights are already the (1 + w) Gemma applies,
llama.cpp's converter adds the 1). What llama.cpp hard-codes for gemma3 rather than
writes into the file is read the same way here: 5 sliding layers to 1 global
(`GEMMA3_SLIDING_WINDOW_PATTERN`), RoPE base 10,000 on the sliding layers, scores
scaled by head_dim ** -0.5, and `<end_of_turn>` as an end-of-generation token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tqdm.auto import tqdm

from jaxserve.checkpoint.layout import (CheckpointError, TensorSource, check_tree, stack_layers,
                                        unpermute_qk)
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)

# Tree leaf -> GGUF tensor name (llama.cpp `MODEL_TENSOR` names for LLM_ARCH_LLAMA).
GGUF_LAYER_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight", "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
    "bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",  # Gemma 3
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
}
GGUF_TOP_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                  "lm_head": "output.weight"}
# general.architecture -> (ModelConfig switches, Q/K rows permuted by llama.cpp's converter).
GGUF_ARCHS: dict[str, tuple[dict[str, bool], bool]] = {
    "llama": ({}, True),
    "qwen2": ({"attention_bias": True}, False),
    "qwen3": ({"qk_norm": True}, False),
    "gemma3": ({"qk_norm": True, "sandwich_norms": True, "scale_embeddings": True}, False),
}
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3


class _Reader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map.

    GGUFReader slices its `np.memmap` once per metadata value and per tensor; each
    slice of a memmap is a memmap whose `__array_finalize__` runs Python code, which
    made SmolLM2's 49k-token vocabulary + 48k merges cost ~3 s of the ~4 s parse
    (py-spy, notes/params_startup.md). The view shares the mapping (its `.base`
    keeps it open); every value read is the same.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning any parse failure into a CheckpointError naming the file."""
    p = Path(path)
    try:
        reader = _Reader(p)
    except Exception as e:  # GGUFReader raises ValueError/KeyError/IndexError on bad bytes
        raise CheckpointError(f"{p}: not a readable GGUF file (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from e
    size = p.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{p}: truncated GGUF: tensor '{t.name}' ends at byte {end} "
                                  f"but the file has {size} bytes")
    return reader


def read_fields(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """All metadata key/values decoded to Python values (strings, ints, lists)."""
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except Exception as e:
            raise CheckpointError(f"{path}: cannot decode GGUF metadata key '{name}': {e}") from e
    return out


def config_from_gguf(fields: dict[str, Any], tensor_names: set[str], path: Path, *,
                     dtype: str | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (`<arch>.*` keys, tokenizer.ggml.* ids).

    Raises:
      CheckpointError: `general.architecture` not in GGUF_ARCHS, a required key
        missing, or a feature jaxserve lacks (partial rotary, non-llama3 rope
        scaling, attention-logit soft-capping).
    """
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise CheckpointError(f"{path}: unsupported architecture general.architecture={arch!r} "
                              f"(supported: {sorted(GGUF_ARCHS)})")

    def key(k: str, default: Any = KeyError) -> Any:
        v = fields.get(f"{arch}.{k}", default)
        if v is KeyError:
            raise CheckpointError(f"{path}: GGUF metadata lacks required key '{arch}.{k}'")
        if isinstance(v, list):
            raise CheckpointError(f"{path}: per-layer '{arch}.{k}' is not supported")
        return v

    E, H = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", E // H))
    rot = int(key("rope.dimension_count", head_dim))
    if rot != head_dim or int(key("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: rope.dimension_count={rot} / value_length differ from "
                              f"head_dim={head_dim} (partial rotary is not supported)")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{path}: rope scaling {scaling!r} / rope_freqs tensor is not supported "
                              "from GGUF (load the HF checkpoint for llama3 rope scaling)")
    if key("attn_logit_softcapping", None) is not None:
        raise CheckpointError(f"{path}: {arch}.attn_logit_softcapping is not supported by "
                              "jaxserve's attention kernels")
    window = int(key("attention.sliding_window", 0) or 0) or None
    L = int(key("block_count"))
    extra: dict[str, Any] = {"sliding_window": window}
    if arch == "gemma3":
        from jaxserve.config import GEMMA3_SLIDING_WINDOW_PATTERN as pat

        extra.update(layer_types=tuple("full_attention" if (i + 1) % pat == 0 else
                                       "sliding_attention" for i in range(L)),
                     rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE, hidden_act="gelu_pytorch_tanh",
                     query_pre_attn_scalar=float(head_dim),
                     final_logit_softcapping=key("final_logit_softcapping", None))
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(key("vocab_size"))
    eos = [fields.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    if arch == "gemma3" and tokens and "<end_of_turn>" in tokens:
        eos.append(tokens.index("<end_of_turn>"))  # llama.cpp's EOT by text for Gemma
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=E, intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=L, num_attention_heads=H,
            num_key_value_heads=int(key("attention.head_count_kv", H)), head_dim=head_dim,
            max_position_embeddings=int(key("context_length", 2048)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            tie_word_embeddings=GGUF_TOP_NAMES["lm_head"] not in tensor_names,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)), dtype=dtype,
            **extra, **GGUF_ARCHS[arch][0])
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid model metadata: {e}") from e


_WHOLE_TENSOR_BYTES = 32 << 20  # float32 output size up to which a tensor is decoded in one call


def dequantize_tensor(t: Any, path: Path) -> np.ndarray:
    """One GGUF tensor -> float32 NumPy array in NumPy order (ggml ne reversed).

    Raises:
      CheckpointError: the tensor's type is not in SUPPORTED_TYPES (names file, tensor, type).
    """
    qtype = Q(int(t.tensor_type))
    if qtype not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path}: tensor '{t.name}' has unsupported quantization type {qtype.name} "
            f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml ne [in, out] -> [out, in]
    if qtype == Q.F32:
        a = np.asarray(t.data, dtype=np.float32)
    elif qtype == Q.F16:
        a = np.asarray(t.data, dtype=np.float16).astype(np.float32)
    elif int(np.prod(shape)) * 4 <= _WHOLE_TENSOR_BYTES:
        # gguf's `dequantize` runs the block decoder over groups of 16 rows, ~0.05 ms of
        # Python per group; one call over a layer's whole tensor halves SmolLM2's
        # dequantization (1.2-1.6 -> 0.7 s). Same elementwise decoder: same bits.
        quant = getattr(gguf.quants, qtype.name)
        quant.init_grid()
        a = quant.dequantize_rows(t.data)
    else:  # the embedding / LM head: grouped rows keep the temporaries small
        a = gguf.quants.dequantize(t.data, qtype)
    return np.asarray(a, dtype=np.float32).reshape(shape)


def load_gguf_params(reader: gguf.GGUFReader, cfg: ModelConfig, path: Path, *,
                     progress: bool = True) -> dict:
    """Dequantize every tensor into the float32 param tree ([in, out], layers stacked).

    Q/K rows are un-permuted only for the "llama" architecture (see GGUF_ARCHS).

    Raises:
      CheckpointError: missing / unexpected tensors, wrong shapes, unsupported types.
    """
    by_name = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    permuted = GGUF_ARCHS[arch][1]
    bar = tqdm(total=len(by_name), desc=f"dequantizing {path.name}", unit="tensor",
               disable=not progress, leave=False)

    def dequantize(t: Any) -> np.ndarray:
        a = dequantize_tensor(t, path)
        bar.update(1)
        return a

    src = TensorSource(by_name, path, dequantize)
    take, used = src.take, src.used

    def layer(i: int, leaf: str) -> np.ndarray:
        a = take(GGUF_LAYER_NAMES[leaf].format(i=i))
        if permuted and leaf == "wq":
            a = unpermute_qk(a, cfg.num_attention_heads)
        elif permuted and leaf == "wk":
            a = unpermute_qk(a, cfg.num_key_value_heads)
        return a if a.ndim == 1 else a.T  # [out, in] -> [in, out]: stack_layers copies the view

    try:
        params = {"embed": take(GGUF_TOP_NAMES["embed"]), "layers": stack_layers(cfg, layer, path),
                  "final_norm": take(GGUF_TOP_NAMES["final_norm"])}
        if not cfg.tie_word_embeddings:
            params["lm_head"] = np.ascontiguousarray(take(GGUF_TOP_NAMES["lm_head"]).T)
    finally:
        bar.close()
    extra = sorted(set(by_name) - used)
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors for a {arch} GGUF: {extra[:8]}")
    check_tree(cfg, params, path)
    return params


def read_gguf_header(path: str | Path, *, dtype: str | None = None
                     ) -> tuple[gguf.GGUFReader, ModelConfig, Tokenizer]:
    """Open a GGUF file and build its ModelConfig and Tokenizer (no tensor data read).
    The returned reader no longer holds the `tokenizer.*` fields (the Tokenizer does).

    Raises:
      CheckpointError: unreadable file, unsupported architecture / tokenizer, or a
        tokenizer whose size differs from the model vocabulary.
    """
    p = Path(path)
    reader = open_gguf(p)
    fields = read_fields(reader, p)
    cfg = config_from_gguf(fields, {t.name for t in reader.tensors}, p, dtype=dtype)
    tok = Tokenizer.from_gguf_fields(fields, p)
    if tok.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{p}: tokenizer has {tok.vocab_size} ids but the model "
                              f"vocab_size is {cfg.vocab_size}")
    # GGUFReader keeps a NumPy view per value of every array field: for SmolLM2's 49k
    # tokens and 48k merges that is ~70 MiB, which would stay resident beside the weights
    # being read. The Tokenizer holds its own copy now; the loaders read scalars only.
    for name in [n for n, f in reader.fields.items() if n.startswith("tokenizer.")]:
        del reader.fields[name]
    return reader, cfg, tok


def load_gguf(path: str | Path, *, progress: bool = True) -> tuple[ModelConfig, dict, Tokenizer]:
    """(config, float32 param tree, tokenizer) from a GGUF file, without the cache."""
    reader, cfg, tok = read_gguf_header(path)
    return cfg, load_gguf_params(reader, cfg, Path(path), progress=progress), tok
