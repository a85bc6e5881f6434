"""GGUF -> jaxserve params: logits vs transformers' GGUF load, Q/K permutation, errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.checkpoint import CheckpointError, load_model
from jaxserve.checkpoint.gguf_loader import SUPPORTED_TYPES, load_gguf, read_gguf_header
from jaxserve.checkpoint.layout import permute_qk, unpermute_qk
from jaxserve.model.llama import reference_logits

from .conftest import FIXTURES, Q, TINY_GGUF_F32, max_err

TINY = FIXTURES / "tiny_gguf"


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_logits_match_transformers_gguf_load(qtype):
    cfg, params, tok = load_model(TINY / f"tiny-{qtype}.gguf", cache_dir=None, progress=False)
    gold = np.load(TINY / f"logits_{qtype}.npz")
    for j in range(3):
        got = reference_logits(cfg, params, gold[f"ids_{j}"])
        assert max_err(got, gold[f"logits_{j}"]) < 1e-4, (qtype, j)


def test_config_from_metadata():
    _, cfg, tok = read_gguf_header(TINY / "tiny-q8_0.gguf")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (67, 64, 160, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 24)
    assert cfg.rope_theta == 10000.0 and cfg.max_position_embeddings == 512
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert not cfg.tie_word_embeddings and cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert tok.vocab_size == 67 and tok.all_special_ids == [0, 1, 2]


def test_q8_0_differs_from_f32_but_matches_dequantizer():
    _, p32, _ = load_gguf(TINY / "tiny-f32.gguf", progress=False)
    _, p8, _ = load_gguf(TINY / "tiny-q8_0.gguf", progress=False)
    d = np.abs(p32["layers"]["wq"] - p8["layers"]["wq"])
    assert 0 < d.max() < 0.01  # quantization error of Q8_0, weights ~N(0, 0.2)


def test_missing_output_weight_means_tied(gguf_rewriter):
    path = gguf_rewriter("tied.gguf", drop=("output.weight",))
    cfg, p, _ = load_model(path, cache_dir=None, progress=False)
    assert cfg.tie_word_embeddings and "lm_head" not in p
    cfg0, p0, _ = load_model(TINY_GGUF_F32, cache_dir=None, progress=False)
    ids = np.array([3, 9, 27, 1, 66], np.int32)
    want = reference_logits(cfg0, {**p0, "lm_head": p0["embed"].T}, ids)
    assert max_err(reference_logits(cfg, p, ids), want) < 1e-5


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_quant_types_dequantize_like_gguf(gguf_rewriter, qtype):
    name = "blk.1.attn_q.weight"
    path = gguf_rewriter(f"{qtype.name}.gguf", retype={name: qtype, "blk.0.ffn_up.weight": qtype})
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    assert t.tensor_type == qtype
    ref = gguf.quants.dequantize(t.data, qtype).reshape(96, 64)  # [H*D, E] in GGML row order
    cfg, p, _ = load_model(path, cache_dir=None, progress=False)
    np.testing.assert_array_equal(p["layers"]["wq"][1], unpermute_qk(ref, 4).T)


def test_k_quants_are_supported():
    assert {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K} <= set(SUPPORTED_TYPES)


def test_unsupported_quantization_type(gguf_rewriter):
    name = "blk.0.ffn_down.weight"  # [E=64, F=160] -> TQ2_0 needs 256-wide rows: use raw bytes
    qt = Q.IQ4_NL
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((64, 160 // block * nbytes), np.uint8)
    path = gguf_rewriter("iq.gguf", raw={name: (raw, qt)})
    with pytest.raises(CheckpointError, match=rf"iq\.gguf: tensor '{name}' has unsupported "
                                              rf"quantization type IQ4_NL \(supported: F32"):
        load_model(path, cache_dir=None, progress=False)


def test_wrong_architecture(gguf_rewriter):
    path = gguf_rewriter("q.gguf", arch="gemma")
    with pytest.raises(CheckpointError, match=r"q\.gguf: unsupported architecture.*'gemma'.*"
                                              r"supported: \['gemma3', 'llama', 'qwen2', 'qwen3'\]"):
        load_model(path, cache_dir=None, progress=False)


def test_truncated_gguf_names_file(tmp_path):
    path = tmp_path / "cut.gguf"
    data = TINY_GGUF_F32.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: .*truncated"):
        load_model(path, cache_dir=None, progress=False)
    path.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(CheckpointError, match=r"cut\.gguf: not a readable GGUF file"):
        load_model(path, cache_dir=None, progress=False)


def test_corrupt_magic_names_file(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + TINY_GGUF_F32.read_bytes()[4:])
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a readable GGUF file.*magic"):
        load_model(path, cache_dir=None, progress=False)


def test_missing_tensor_and_bad_metadata(gguf_rewriter):
    path = gguf_rewriter("m.gguf", drop=("blk.1.attn_v.weight",))
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensor 'blk\.1\.attn_v\.weight'"):
        load_model(path, cache_dir=None, progress=False)
    path = gguf_rewriter("s.gguf", fields={"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)})
    with pytest.raises(CheckpointError, match="rope scaling 'yarn'"):
        load_model(path, cache_dir=None, progress=False)


# ---- llama.cpp Q/K permutation ------------------------------------------------------------------

def test_permutation_matches_hand_computed_rows():
    # One head of D=6: HF rows (rotate_half) are [x0 x1 x2 | y0 y1 y2]; llama.cpp interleaves
    # the pairs (x_j, y_j) -> GGML rows [x0 y0 x1 y1 x2 y2].
    w = np.arange(2 * 6, dtype=np.float32).reshape(2, 6).T.copy()  # [6 rows, 2 cols]
    out = permute_qk(w, n_head=1)
    np.testing.assert_array_equal(out[:, 0], [0, 3, 1, 4, 2, 5])
    # Two heads of D=4: each head permuted on its own.
    w = np.arange(8, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(permute_qk(w, 2)[:, 0], [0, 2, 1, 3, 4, 6, 5, 7])


@settings(max_examples=40, deadline=None)
@given(n_head=st.integers(1, 6), half=st.integers(1, 5), cols=st.integers(1, 7))
def test_unpermute_is_exact_inverse(n_head, half, cols):
    rng = np.random.default_rng(n_head * 100 + half * 10 + cols)
    w = rng.standard_normal((n_head * 2 * half, cols)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    if half > 1:
        assert not np.array_equal(permute_qk(w, n_head), w)


def test_permutation_rejects_odd_rows():
    with pytest.raises(ValueError, match="rows=6 divisible by 2\\*n_head=4"):
        unpermute_qk(np.zeros((6, 3)), 2)
