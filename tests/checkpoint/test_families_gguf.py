"""Qwen2 / Qwen3 GGUF files, the qwen2 pre-tokenizer, and chat templates checked at load.

tiny_qwen2_gguf/ is the tiny Qwen2 written as llama.cpp's converter does (arch "qwen2",
attn_{q,k,v}.bias, Q/K rows not permuted); its golden logits come from transformers'
own GGUF loader. transformers cannot load a qwen3 GGUF with head_dim != hidden/heads
(it ignores attention.key_length), so the Qwen3 GGUF is written here from the HF
fixture and checked against that fixture's HF golden logits. The tiny Gemma 3 is written
as llama.cpp's Gemma3Model converter writes it (norm weights + 1): the GGUF loader's tree
must equal the HF loader's.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.checkpoint import CheckpointError, load_model
from jaxserve.checkpoint.gguf_loader import GGUF_LAYER_NAMES, GGUF_TOP_NAMES
from jaxserve.checkpoint.hf import GEMMA3_LAYER_NAMES, HF_LAYER_NAMES, HF_TOP_NAMES
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.model.llama import reference_logits

from .conftest import FIXTURES, max_err

QWEN2_GGUF = FIXTURES / "tiny_qwen2_gguf" / "tiny-qwen2-f32.gguf"


def test_qwen2_gguf_matches_transformers_gguf_load():
    cfg, params, tok = load_model(QWEN2_GGUF, cache_dir=None, progress=False)
    assert cfg.attention_bias and not cfg.qk_norm and "bq" in params["layers"]
    gold = np.load(FIXTURES / "tiny_qwen2_gguf" / "logits_f32.npz")
    for j in range(3):
        assert max_err(reference_logits(cfg, params, gold[f"ids_{j}"]), gold[f"logits_{j}"]) < 1e-4
    # Not permuted: the GGUF's attn_q rows are HF's q_proj rows exactly.
    hf = load_file(str(FIXTURES / "tiny_qwen2" / "model.safetensors"))
    np.testing.assert_array_equal(params["layers"]["wq"][1],
                                  hf["model.layers.1.self_attn.q_proj.weight"].T)


def test_qwen2_gguf_sliding_window_loads_on_every_layer(gguf_rewriter):
    """Issue 31: a GGUF window (no per-layer pattern in the file) slides on every layer,
    as transformers' Mistral does; gemma3's 5:1 pattern is test_gemma3.py's."""
    path = gguf_rewriter("swa.gguf", src=QWEN2_GGUF, arch="qwen2", fields={
        "qwen2.attention.sliding_window": (32, gguf.GGUFValueType.UINT32)})
    cfg, _, _ = load_model(path, cache_dir=None, progress=False)
    assert cfg.layer_windows == (32,) * cfg.num_hidden_layers


def _hf_to_gguf(src, dst, arch: str):
    """An HF dir as an F32 GGUF of `arch` (no Q/K permutation: not llama), with its tokenizer;
    gemma3 as llama.cpp's converter writes it (Gemma names, every norm weight + 1)."""
    c = json.loads((src / "config.json").read_text())
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tj["added_tokens"] if t["special"]}
    rp = c["rope_parameters"]
    w = gguf.GGUFWriter(str(dst), arch)
    for add, v in ((w.add_context_length, c["max_position_embeddings"]),
                   (w.add_embedding_length, c["hidden_size"]), (w.add_block_count, c["num_hidden_layers"]),
                   (w.add_feed_forward_length, c["intermediate_size"]),
                   (w.add_head_count, c["num_attention_heads"]), (w.add_head_count_kv, c["num_key_value_heads"]),
                   (w.add_key_length, c["head_dim"]), (w.add_value_length, c["head_dim"]),
                   (w.add_rope_freq_base, rp.get("full_attention", rp)["rope_theta"]),
                   (w.add_layer_norm_rms_eps, c["rms_norm_eps"]), (w.add_tokenizer_model, "gpt2"),
                   (w.add_tokenizer_pre, "qwen2"), (w.add_token_list, tokens),
                   (w.add_token_types, [3 if t in specials else 1 for t in tokens]),
                   (w.add_token_merges, [" ".join(m) if isinstance(m, list) else m
                                         for m in tj["model"]["merges"]]),
                   (w.add_bos_token_id, c["bos_token_id"]), (w.add_eos_token_id, c["eos_token_id"])):
        add(v)
    gemma = arch == "gemma3"
    if gemma:
        w.add_sliding_window(c["sliding_window"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    hf = load_file(str(src / "model.safetensors"))
    layer_names = GEMMA3_LAYER_NAMES if gemma else HF_LAYER_NAMES
    names = {HF_TOP_NAMES[k]: GGUF_TOP_NAMES[k] for k in HF_TOP_NAMES}
    for i in range(c["num_hidden_layers"]):
        names.update({layer_names[k].format(i=i): GGUF_LAYER_NAMES[k].format(i=i)
                      for k in layer_names})
    for name, a in hf.items():
        shift = 1.0 if gemma and name.endswith("norm.weight") else 0.0
        w.add_tensor(names[name], np.ascontiguousarray(a + shift, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_qwen3_gguf_matches_hf_logits(tmp_path):
    path = _hf_to_gguf(FIXTURES / "tiny_qwen3", tmp_path / "q3.gguf", "qwen3")
    cfg, params, tok = load_model(path, cache_dir=None, progress=False)
    assert cfg.qk_norm and cfg.head_dim == 16 and cfg.tie_word_embeddings
    gold = np.load(FIXTURES / "tiny_qwen3" / "logits.npz")
    for j in range(3):
        assert max_err(reference_logits(cfg, params, gold[f"ids_{j}"]), gold[f"logits_{j}"]) < 1e-4
    hf_tok = Tokenizer.from_hf_dir(FIXTURES / "tiny_qwen3")
    assert tok.encode("the cat sat on") == hf_tok.encode("the cat sat on")


def test_gemma3_gguf_and_hf_loaders_give_the_same_tree(tmp_path):
    path = _hf_to_gguf(FIXTURES / "tiny_gemma3", tmp_path / "g3.gguf", "gemma3")
    g_cfg, g_params, _ = load_model(path, cache_dir=None, progress=False)
    cfg, params, _ = load_model(FIXTURES / "tiny_gemma3", cache_dir=None, progress=False)

    def leaves(t, pre=""):
        return {k2: v2 for k, v in t.items()
                for k2, v2 in (leaves(v, f"{pre}{k}/") if isinstance(v, dict) else {pre + k: v}).items()}
    g, h = leaves(g_params), leaves(params)
    assert sorted(g) == sorted(h)
    for k in h:
        np.testing.assert_array_equal(g[k], h[k], err_msg=k)
    # What a gemma3 GGUF cannot say (llama.cpp hard-codes the 5:1 pattern, the local base and
    # query_pre_attn_scalar = head_dim) taken from HF; the rest of the config is the file's.
    hf_only = dict(layer_types=cfg.layer_types, rope_local_base_freq=cfg.rope_local_base_freq,
                   query_pre_attn_scalar=cfg.query_pre_attn_scalar)
    assert g_cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)  # GGUF stores f32
    assert g_cfg.replace(**hf_only, rms_norm_eps=cfg.rms_norm_eps) == cfg
    gold = np.load(FIXTURES / "tiny_gemma3" / "logits.npz")
    assert max_err(reference_logits(g_cfg.replace(**hf_only), g_params, gold["ids_2"]),
                   gold["logits_2"]) < 1e-4


def test_qwen2_pre_tokenizer_splits_every_digit():
    tok = load_model(QWEN2_GGUF, cache_dir=None, progress=False)[2]
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("abc 12345 it's\n\nok")]
    # Qwen2's regex: one piece per digit (Llama 3 groups up to three), "'s" apart, a newline run.
    assert pieces == ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s", "ĊĊ", "ok"]


def _with_template(tmp_path, template):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tiny_qwen2", d)
    c = json.loads((d / "tokenizer_config.json").read_text())
    c["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize("template,match", [
    ("{% for m in messages %}{% frobnicate %}{% endfor %}", r"does not compile \(line 1\).*frobnicate"),
    ("{{ messages | shout }}", r"does not compile.*No filter named 'shout'"),
    ("{{ render_tools(tools) }}", r"fails on a probe conversation.*'render_tools' is undefined"),
])
def test_unsupported_template_fails_at_load(tmp_path, template, match):
    d = _with_template(tmp_path, template)
    with pytest.raises(CheckpointError, match=match):
        load_model(d, cache_dir=None, progress=False)


def test_template_features_of_transformers_render(tmp_path):
    # `{% generation %}` (transformers' assistant-mask tag) renders its body; a template's own
    # raise_exception on the probe does not fail the load, only the request that trips it.
    t = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
         "{% endif %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
         "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}")
    tok = load_model(_with_template(tmp_path, t), cache_dir=None, progress=False)[2]
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<u>x</u><a>y</a>"
    with pytest.raises(ValueError, match="chat template of .* rejected the messages: no system"):
        tok.apply_chat_template([{"role": "system", "content": "s"}], tokenize=False)
