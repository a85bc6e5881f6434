"""HF safetensors dirs -> jaxserve params; logits vs HF transformers golden files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.checkpoint import CheckpointError, load_model
from jaxserve.checkpoint.hf import HF_LAYER_NAMES, load_hf_config, load_hf_params
from jaxserve.model.llama import reference_logits

from .conftest import FIXTURES, max_err

VARIANTS = ["tiny_untied", "tiny_tied_sharded", "tiny_llama3_rope"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant):
    d = FIXTURES / variant
    cfg, params, tok = load_model(d, cache_dir=None, progress=False)
    gold = np.load(d / "logits.npz")
    for j in range(3):
        ids = gold[f"ids_{j}"]
        got = reference_logits(cfg, params, ids)
        assert got.shape == gold[f"logits_{j}"].shape
        assert max_err(got, gold[f"logits_{j}"]) < 1e-4, (variant, j)


def test_variants_exercise_what_they_claim():
    tied = load_hf_config(FIXTURES / "tiny_tied_sharded")
    assert tied.tie_word_embeddings and tied.num_hidden_layers == 3
    assert (FIXTURES / "tiny_tied_sharded" / "model.safetensors.index.json").is_file()
    untied = load_hf_config(FIXTURES / "tiny_untied")
    assert not untied.tie_word_embeddings
    assert untied.head_dim * untied.num_attention_heads != untied.hidden_size  # explicit head_dim
    # llama3 rope scaling changes the logits: dropping it must break the match.
    d = FIXTURES / "tiny_llama3_rope"
    cfg, params, _ = load_model(d, cache_dir=None, progress=False)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 64
    gold = np.load(d / "logits.npz")
    unscaled = reference_logits(cfg.replace(rope_scaling=None), params, gold["ids_2"])
    assert max_err(unscaled, gold["logits_2"]) > 1e-2


def test_layout_is_transposed_and_stacked():
    d = FIXTURES / "tiny_untied"
    cfg = load_hf_config(d)
    raw = load_file(str(d / "model.safetensors"))
    p = load_hf_params(d, cfg, progress=False)
    L, E, H, D = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    assert p["layers"]["wq"].shape == (L, E, H * D)
    np.testing.assert_array_equal(p["layers"]["wq"][1], raw[HF_LAYER_NAMES["wq"].format(i=1)].T)
    np.testing.assert_array_equal(p["layers"]["w_down"][0], raw[HF_LAYER_NAMES["w_down"].format(i=0)].T)
    np.testing.assert_array_equal(p["lm_head"], raw["lm_head.weight"].T)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_bfloat16_dtype():
    cfg, params, _ = load_model(FIXTURES / "tiny_untied", dtype="bfloat16", cache_dir=None, progress=False)
    assert cfg.dtype == "bfloat16"
    assert str(params["layers"]["wq"].dtype) == "bfloat16"
    with pytest.raises(ValueError, match="dtype='float16'"):
        load_model(FIXTURES / "tiny_untied", dtype="float16", cache_dir=None)


def test_hf_tokenizer_and_chat_template():
    _, _, tok = load_model(FIXTURES / "tiny_untied", cache_dir=None, progress=False)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.all_special_ids == [0, 1, 2]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_truncated_safetensors_names_file(tmp_path):
    d = _copy("tiny_untied", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_model(d, cache_dir=None, progress=False)


def test_garbage_safetensors_names_file(tmp_path):
    d = _copy("tiny_untied", tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(d, cache_dir=None, progress=False)


def test_wrong_architecture(tmp_path):
    d = _copy("tiny_untied", tmp_path)
    c = json.loads((d / "config.json").read_text())
    c.update(model_type="gemma", architectures=["GemmaForCausalLM"])
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=r"config\.json.*unsupported architecture.*'gemma'.*"
                                              r"supported model_type: \['gemma3_text', 'llama', 'mistral', 'qwen2'"):
        load_model(d, cache_dir=None, progress=False)
    # A known model_type whose class is another one is just as unsupported.
    c.update(model_type="llama", architectures=["LlamaForSequenceClassification"])
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=r"LlamaForSequenceClassification.*expected "
                                              r"LlamaForCausalLM"):
        load_model(d, cache_dir=None, progress=False)


def test_missing_and_unexpected_tensors(tmp_path):
    d = _copy("tiny_untied", tmp_path)
    t = load_file(str(d / "model.safetensors"))
    bias = {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(72, np.float32)}
    save_file(bias, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensors.*q_proj.bias"):
        load_model(d, cache_dir=None, progress=False)
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tiny_untied: missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(d, cache_dir=None, progress=False)


def test_wrong_shape_names_layer(tmp_path):
    d = _copy("tiny_untied", tmp_path)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:12]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layer 1 'wk' has shape"):
        load_model(d, cache_dir=None, progress=False)


def test_missing_shard_and_missing_path(tmp_path):
    d = _copy("tiny_tied_sharded", tmp_path)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(d, cache_dir=None, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", cache_dir=None)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"weights\.bin: expected a \.gguf file or an HF"):
        load_model(tmp_path / "weights.bin", cache_dir=None)


def test_bf16_safetensors_read(tmp_path):
    import ml_dtypes
    d = _copy("tiny_untied", tmp_path)
    t = load_file(str(d / "model.safetensors"))
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
    save_file(bf, str(d / "model.safetensors"))
    cfg, p, _ = load_model(d, cache_dir=None, progress=False)
    want = bf["model.layers.0.self_attn.o_proj.weight"].astype(np.float32).T
    np.testing.assert_array_equal(p["layers"]["wo"][0], want)
