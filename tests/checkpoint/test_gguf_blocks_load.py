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
        assert all(a.ctypes.data % 64 == 0 for a in (qw.q, qw.scale, qw.min) if a is not None)
        got = np.swapaxes(np.asarray(quant.dequantize(qw)), -1, -2)  # [L, N, K] -> [L, in, out]
        np.testing.assert_array_equal(got, floats["layers"][leaf], err_msg=leaf)
    for leaf in ("attn_norm", "mlp_norm"):
        np.testing.assert_array_equal(blocks["layers"][leaf], floats["layers"][leaf])


@pytest.mark.parametrize("retype, needle", [
    ({"blk.0.attn_q.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.Q4_1},
     r"'wq': layer 1 is \('q4', 32, \(96, 64\), 'uint8', 'float16', 'float16'\), layer 0 is "
     r"\('q8', 32, \(96, 64\), 'int8', 'float16', None\)"),
    ({"blk.1.ffn_up.weight": Q.Q8_0}, r"layers of 'w_up' mix float and quantized tensors"),
    # a float leaf's layers must agree too (a [32] norm would broadcast into a [64] slot)
    ({"blk.0.ffn_up.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q8_0},
     r"'attn_norm': layer 1 is \(\(32,\), 'float32'\), layer 0 is \(\(64,\), 'float32'\)"),
])
def test_layers_of_one_leaf_in_different_formats_are_refused(gguf_rewriter, retype, needle):
    raw = {"blk.1.attn_norm.weight": (np.ones(32, np.float32), Q.F32)} if "norm" in needle else None
    path = gguf_rewriter("mixed.gguf", retype=retype, raw=raw)
    with pytest.raises(CheckpointError, match=needle):
        load_model(path, quantization="auto", cache_dir=None, progress=False)


def _mapped_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) > 5 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_reader_keeps_no_tokenizer_fields_and_drops_file_pages(gguf_rewriter):
    path = gguf_rewriter("q.gguf", retype={f"blk.{i}.ffn_down.weight": Q.Q4_1 for i in range(2)})
    reader, cfg, tok = read_gguf_header(path)
    assert tok.vocab_size == cfg.vocab_size == 67
    assert "general.architecture" in reader.fields
    assert not [n for n in reader.fields if n.startswith("tokenizer.")]
    before = np.array(reader.tensors[1].data)  # a copy of one tensor's bytes
    tree = load_gguf_blocks(reader, cfg, path)  # drops the map's pages after each leaf
    assert _mapped_rss_kib(path) == 0
    q = tree["layers"]["w_down"].q
    assert q.shape == (2, 64, 80) and not np.shares_memory(q, reader.data)  # copied out
    int(np.asarray(reader.data).sum())  # every page of the file read back in
    assert _mapped_rss_kib(path) >= path.stat().st_size // 1024 - 4
    drop_file_pages(reader)
    assert _mapped_rss_kib(path) == 0
    np.testing.assert_array_equal(reader.tensors[1].data, before)  # read back from the file


def test_a_copy_on_write_map_keeps_its_pages(gguf_rewriter):
    """On a writable (copy-on-write) map, dropping pages would throw writes away: no-op."""
    from jaxserve.checkpoint.gguf_loader import _Reader

    reader = _Reader(gguf_rewriter("c.gguf"), "c")
    t = reader.tensors[1]
    t.data[...] = 7
    drop_file_pages(reader)
    assert np.all(np.asarray(reader.tensors[1].data) == 7)
