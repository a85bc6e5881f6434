"""Loading a GGUF file's quantized matrices as blocks (issue 26): the stacked blocks
against gguf-py's own dequantization of the same file, the errors for layers of one
leaf in different formats, and what the loader leaves resident (no tokenizer fields
in the reader, the file's pages dropped)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoint import load_model
from jaxserve.checkpoint.gguf_loader import read_gguf_header
from jaxserve.checkpoint.gguf_quant import drop_file_pages, load_gguf_blocks
from jaxserve.checkpoint.layout import CheckpointError
from jaxserve.model import quant

MATS = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
        "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}


def test_stacked_blocks_equal_gguf_py_dequantization(gguf_rewriter):
    """Every layer matrix as Q8_0 or Q4_1 blocks: dequantized, the stacked leaves equal
    the float load of the same file (gguf-py's dequantize, the Q/K un-permutation and the
    [in, out] transpose of `load_gguf_params`) bit for bit."""
    retype = {f"blk.{i}.{g}.weight": (Q.Q8_0 if g.startswith("attn") else Q.Q4_1)
              for i in range(2) for g in MATS}
    path = gguf_rewriter("q.gguf", retype=retype)
    _, blocks, tok = load_model(path, quantization="auto", cache_dir=None, progress=False)
    _, floats, _ = load_model(path, quantization=None, cache_dir=None, progress=False)
    assert tok.vocab_size == 67
    for g, leaf in MATS.items():
        qw = blocks["layers"][leaf]
        assert isinstance(qw, quant.QuantizedWeight)
        assert qw.kind == ("q8" if g.startswith("attn") else "q4") and qw.q.shape[0] == 2
        got = np.swapaxes(np.asarray(quant.dequantize(qw)), -1, -2)  # [L, N, K] -> [L, in, out]
        np.testing.assert_array_equal(got, floats["layers"][leaf], err_msg=leaf)
    for leaf in ("attn_norm", "mlp_norm"):
        np.testing.assert_array_equal(blocks["layers"][leaf], floats["layers"][leaf])


@pytest.mark.parametrize("retype, needle", [
    ({"blk.0.attn_q.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.Q4_1},
     r"'wq': layer 1 is \('q4', 32, \(96, 64\)\), layer 0 is \('q8', 32, \(96, 64\)\)"),
    ({"blk.1.ffn_up.weight": Q.Q8_0}, r"layers of 'w_up' mix float and quantized tensors"),
])
def test_layers_of_one_leaf_in_different_formats_are_refused(gguf_rewriter, retype, needle):
    path = gguf_rewriter("mixed.gguf", retype=retype)
    with pytest.raises(CheckpointError, match=needle):
        load_model(path, quantization="auto", cache_dir=None, progress=False)


def test_reader_keeps_no_tokenizer_fields_and_drops_file_pages(gguf_rewriter):
    path = gguf_rewriter("q.gguf", retype={f"blk.{i}.ffn_down.weight": Q.Q4_1 for i in range(2)})
    reader, cfg, tok = read_gguf_header(path)
    assert tok.vocab_size == cfg.vocab_size == 67
    assert "general.architecture" in reader.fields
    assert not [n for n in reader.fields if n.startswith("tokenizer.")]
    before = np.array(reader.tensors[1].data)  # a copy of one tensor's bytes
    tree = load_gguf_blocks(reader, cfg, path)  # drops the map's pages after each leaf
    q = tree["layers"]["w_down"].q
    assert q.shape == (2, 64, 80) and not np.shares_memory(q, reader.data)  # copied out
    drop_file_pages(reader)
    np.testing.assert_array_equal(reader.tensors[1].data, before)  # read back from the file
