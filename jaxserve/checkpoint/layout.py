"""The canonical parameter tree (the state of `jaxserve.model.llama.Llama`) and the
conversions into it.

Loaders build it as host NumPy and the params cache stores it; only
`jaxserve.model.llama.prepare_params` turns it into the engine layout.

Param tree (numpy arrays; matrices stored [in, out] so the forward is `x @ w`;
layers stacked on a leading L axis so the forward can `scan` over them):

  {"embed": [V, E],
   "layers": {"attn_norm": [L, E], "wq": [L, E, H*D], "wk": [L, E, K*D],
              "wv": [L, E, K*D], "wo": [L, H*D, E], "mlp_norm": [L, E],
              "w_gate": [L, E, F], "w_up": [L, E, F], "w_down": [L, F, E]},
   "final_norm": [E],
   "lm_head": [E, V]}          # absent when cfg.tie_word_embeddings

plus, only for the families that have them, the layer leaves bq [L, H*D],
bk/bv [L, K*D] (Qwen2, cfg.attention_bias) and q_norm/k_norm [L, D] (Qwen3,
cfg.qk_norm); `param_shapes(cfg)` is the list.

Q/K rows are in HF's "rotate_half" RoPE layout. llama.cpp's converter
(convert_hf_to_gguf.py, `LlamaModel.permute`) reorders them to the
interleaved-pair layout GGML's RoPE expects; `unpermute_qk` undoes it exactly.
Only the llama architecture is permuted: qwen2/qwen3 GGUFs keep HF's rows
(llama.cpp runs them with NEOX-style RoPE, i.e. rotate_half).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from jaxserve.checkpoint.errors import CheckpointError  # noqa: F401 - re-exported
from jaxserve.config import ModelConfig
from jaxserve.model.llama import param_shapes, validate_params


# Per-layer leaves stored [in, out] (transposed from the checkpoints' [out, in]); the
# others (norms, biases) are vectors. The leaves themselves: `param_shapes(cfg)["layers"]`.
MATRIX_LEAVES = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})


class TensorSource:
    """Named tensors of one checkpoint, taken one by one; remembers which were taken so
    the loader can refuse the ones it did not use.

    Args:
      tensors: name -> stored tensor (an array, or a file's tensor record).
      source: the checkpoint path (for messages).
      convert: stored tensor -> NumPy array (e.g. GGUF dequantization); identity by default.
    """

    def __init__(self, tensors: Mapping[str, Any], source: Path,
                 convert: Callable[[Any], np.ndarray] | None = None):
        self.tensors, self.source, self.convert = tensors, source, convert
        self.used: set[str] = set()

    def take(self, name: str) -> np.ndarray:
        """The tensor `name`, converted.

        Raises:
          CheckpointError: no tensor of that name.
        """
        if name not in self.tensors:
            raise CheckpointError(f"{self.source}: missing tensor '{name}'")
        self.used.add(name)
        t = self.tensors[name]
        return t if self.convert is None else self.convert(t)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Apply llama.cpp's Q/K row permutation (HF rotate_half -> GGML interleaved pairs).

    Args:
      w: [n_head * D, E] an HF q_proj/k_proj weight ([out, in]); D even.
      n_head: H for q_proj, K for k_proj.
    Returns: same shape; inside each head, row j*2+p takes HF row p*D/2+j.
    """
    rows = w.shape[0]
    _check_qk_rows(rows, n_head)
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of `permute_qk`: GGML interleaved-pair rows -> HF rotate_half rows.

    Args:
      w: [n_head * D, E] a GGUF attn_q/attn_k weight, dequantized, rows = outputs.
      n_head: H for attn_q, K for attn_k.
    """
    rows = w.shape[0]
    _check_qk_rows(rows, n_head)
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _check_qk_rows(rows: int, n_head: int) -> None:
    if n_head <= 0 or rows % (2 * n_head) != 0:
        raise ValueError(f"Q/K permutation needs rows={rows} divisible by 2*n_head={2 * n_head}")


def stack_layers(cfg: ModelConfig, get: Callable[[int, str], np.ndarray], source: Path) -> dict:
    """Build the stacked `layers` subtree.

    Args:
      get: (layer index, leaf name) -> that layer's array, already in tree layout
        ([in, out] for matrices, [E] for norms); a view (e.g. a transpose) is fine:
        each layer is copied once, into its slot of the preallocated [L, ...] leaf.
      source: file or directory named in errors.
    Raises:
      CheckpointError: a layer's array has the wrong shape.
    """
    want = param_shapes(cfg)["layers"]
    out = {}
    for name in want:
        stacked = None
        for i in range(cfg.num_hidden_layers):
            a = get(i, name)
            if a.shape != want[name][1:]:
                raise CheckpointError(
                    f"{source}: layer {i} '{name}' has shape {a.shape}, expected {want[name][1:]} "
                    f"for the config read from the checkpoint")
            if stacked is None:  # filled in place: one copy per layer, not np.stack's second
                stacked = np.empty(want[name], np.result_type(a))
            elif np.result_type(a) != stacked.dtype:
                raise CheckpointError(f"{source}: layer {i} '{name}' is {np.result_type(a)}, "
                                      f"layer 0 is {stacked.dtype}")
            stacked[i] = a
        out[name] = stacked
    return out


def check_tree(cfg: ModelConfig, params: dict, source: Path) -> None:
    """Raise CheckpointError unless `params` is a canonical tree for `cfg`.

    The same validation `jaxserve.model.llama.prepare_params` runs, with the source
    named in the message.
    """
    try:
        validate_params(cfg, params)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def tree_nbytes(params: dict) -> int:
    """Total bytes of all leaves."""
    return sum(tree_nbytes(v) if isinstance(v, dict) else int(v.nbytes) for v in params.values())
