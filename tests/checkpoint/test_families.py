"""Qwen2, Qwen3, Mistral and Gemma 3 checkpoints vs HF transformers goldens (tests/fixtures/tiny_*).

The fixtures come from each family's own transformers class (scripts/make_golden.py
`--only families`): tiny_qwen2 has q/k/v biases, tiny_qwen3 per-head q/k RMSNorm and
head_dim 16 != hidden/heads (tied), tiny_mistral head_dim 12 != hidden/heads and one KV
head; tiny_gemma3 (scripts/make_gemma3_hf_fixture.py) three sliding layers (window 6) and a
global one, (1 + w) norms, query_pre_attn_scalar, soft-capping, two RoPE bases. Logits must match within 1e-4 (fp32) through the dense reference forward and through
the full paged engine (chunked prefill, five requests batched), and the engine's greedy
tokens must equal transformers' greedy.json, on sequences longer than Gemma's window.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.checkpoint import CheckpointError, load_model
from jaxserve.checkpoint.hf import load_hf_config
from jaxserve.model.llama import reference_logits

from .conftest import FIXTURES, max_err

FAMILIES = ["tiny_qwen2", "tiny_qwen3", "tiny_mistral", "tiny_gemma3"]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_forward_matches_transformers(name):
    cfg, params, _ = load_model(FIXTURES / name, cache_dir=None, progress=False)
    gold = np.load(FIXTURES / name / "logits.npz")
    for j in range(3):
        assert max_err(reference_logits(cfg, params, gold[f"ids_{j}"]), gold[f"logits_{j}"]) < 1e-4


def test_fixtures_exercise_their_switches():
    q2, q3, mi = (load_hf_config(FIXTURES / n) for n in FAMILIES[:3])
    assert (q2.attention_bias, q2.qk_norm, q2.tie_word_embeddings) == (True, False, False)
    assert (q3.attention_bias, q3.qk_norm, q3.tie_word_embeddings) == (False, True, True)
    assert q3.head_dim == 16 and q3.head_dim * q3.num_attention_heads != q3.hidden_size
    assert (mi.attention_bias, mi.qk_norm, mi.num_key_value_heads, mi.head_dim) == (False, False, 1, 12)
    # Each switch matters: turning it off (dropping the leaves) breaks the match.
    for name, leaves, off in (("tiny_qwen2", ("bq", "bk", "bv"), {"attention_bias": False}),
                              ("tiny_qwen3", ("q_norm", "k_norm"), {"qk_norm": False})):
        cfg, params, _ = load_model(FIXTURES / name, cache_dir=None, progress=False)
        assert set(leaves) <= set(params["layers"])
        stripped = {**params, "layers": {k: v for k, v in params["layers"].items() if k not in leaves}}
        gold = np.load(FIXTURES / name / "logits.npz")
        assert max_err(reference_logits(cfg.replace(**off), stripped, gold["ids_2"]),
                       gold["logits_2"]) > 1e-2


def _engine(cfg, params, tok):
    from jaxserve.engine import LLMEngine, make_engine_config

    # An 8-token budget chunks every prompt longer than 8 and batches the rest with it.
    config = make_engine_config(cfg, max_model_len=128, block_size=4, num_kv_blocks=128,
                                max_num_seqs=8, max_num_batched_tokens=8, attention_backend="xla",
                                max_logprobs=cfg.vocab_size, min_token_bucket=8,
                                min_seq_bucket=8)  # one bucket each: suite time
    return LLMEngine(config, params, tok, model_name="tiny", progress=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_engine_matches_transformers(name):
    """Prompt logits (as full-vocabulary logprobs of the first output token) and greedy tokens."""
    from jaxserve.sampling_params import SamplingParams

    d = FIXTURES / name
    cfg, params, tok = load_model(d, cache_dir=None, progress=False)
    gold, greedy = np.load(d / "logits.npz"), json.loads((d / "greedy.json").read_text())["runs"]
    engine = _engine(cfg, params, tok)
    V = cfg.vocab_size
    for j in range(3):
        engine.add_request(f"l{j}", [int(t) for t in gold[f"ids_{j}"]],
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=V))
    for k, run in enumerate(greedy):
        engine.add_request(f"g{k}", run["prompt_ids"],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for j in range(3):
        lp = done[f"l{j}"].outputs[0].logprobs[0]
        assert sorted(lp) == list(range(V))
        got = np.array([lp[t] for t in range(V)])
        assert max_err(got, _log_softmax(gold[f"logits_{j}"][-1])) < 1e-4, (name, j)
    for k, run in enumerate(greedy):
        # Compare up to the first near-tie (gap <= 1e-3): past it either token is right.
        n = next((i for i, g in enumerate(run["top2_logit_gap"]) if g <= 1e-3), 16)
        assert n >= 8, (name, k, run["top2_logit_gap"])
        assert done[f"g{k}"].outputs[0].token_ids[:n] == run["greedy_ids"][:n], (name, k)


def _edited(tmp_path, name, **fields):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    c = json.loads((d / "config.json").read_text())
    c.update(fields)
    (d / "config.json").write_text(json.dumps(c))
    return d


# transformers 5 saves `layer_types`; without it the layers >= max_window_layers slide.
NO_TYPES = dict(layer_types=None)


@pytest.mark.parametrize("name,fields,windows", [
    ("tiny_qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=0, **NO_TYPES),
     (32, 32)),
    ("tiny_qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1, **NO_TYPES),
     (None, 32)),
    ("tiny_qwen2", dict(use_sliding_window=True, sliding_window=32,
                        layer_types=["full_attention", "sliding_attention"]), (None, 32)),
    ("tiny_qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, **NO_TYPES),
     (16, 16)),
    ("tiny_mistral", dict(sliding_window=32), (32, 32)),
], ids=["qwen2", "qwen2-layer1", "qwen2-layer-types", "qwen3", "mistral"])
def test_sliding_window_in_use_loads_per_layer(tmp_path, name, fields, windows):
    """Issue 31: the configs refused before load with their window on the layers that
    use it; the fixture's sequences are shorter than the window, so HF's logits hold."""
    d = _edited(tmp_path, name, **fields)
    cfg, params, _ = load_model(d, cache_dir=None, progress=False)
    assert cfg.layer_windows == windows
    gold = np.load(FIXTURES / name / "logits.npz")
    assert len(gold["ids_1"]) <= min(w for w in windows if w)
    assert max_err(reference_logits(cfg, params, gold["ids_1"]), gold["logits_1"]) < 1e-4


@pytest.mark.parametrize("name,fields", [
    # What every published Qwen2/Qwen2.5 config carries: a window, switched off.
    ("tiny_qwen2", dict(use_sliding_window=False, sliding_window=32768, max_window_layers=28)),
    # Switched on, but only for layers >= max_window_layers = all of them: no layer uses it.
    ("tiny_qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2, **NO_TYPES)),
    # Switched on, but layer_types (which transformers obeys) marks every layer full.
    ("tiny_qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),
    # layer_types says sliding, but use_sliding_window=false nulls the window (transformers).
    ("tiny_qwen2", dict(use_sliding_window=False, sliding_window=32,
                        layer_types=["sliding_attention", "sliding_attention"])),
    ("tiny_mistral", dict(sliding_window=None)),
    # A window as long as the model's context never masks anything.
    ("tiny_mistral", dict(sliding_window=512)),
], ids=["qwen2-off", "qwen2-no-layer", "qwen3-types-full", "qwen2-types-but-off", "mistral-null",
        "mistral-full-context"])
def test_sliding_window_not_in_use_loads(tmp_path, name, fields):
    d = _edited(tmp_path, name, **fields)
    cfg, params, _ = load_model(d, cache_dir=None, progress=False)
    gold = np.load(FIXTURES / name / "logits.npz")
    assert max_err(reference_logits(cfg, params, gold["ids_1"]), gold["logits_1"]) < 1e-4


def test_unsupported_bias_variants_are_clear(tmp_path):
    d = _edited(tmp_path, "tiny_qwen3", attention_bias=True)
    with pytest.raises(CheckpointError, match="qwen3 config has attention_bias=true"):
        load_model(d, cache_dir=None, progress=False)
    d = _edited(tmp_path / "m", "tiny_mistral", mlp_bias=True)
    with pytest.raises(CheckpointError, match="mlp_bias=true: not supported"):
        load_model(d, cache_dir=None, progress=False)


def test_missing_family_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "tiny_qwen3"
    shutil.copytree(FIXTURES / "tiny_qwen3", d)
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.k_norm.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm"):
        load_model(d, cache_dir=None, progress=False)


def test_gemma3_fixture_exercises_its_features():
    """Every Gemma 3 feature the fixture carries is read, and each matters: the logits
    move by > 1e-2 without it (so the 1e-4 match above sees it missing)."""
    cfg, params, _ = load_model(FIXTURES / "tiny_gemma3", cache_dir=None, progress=False)
    assert cfg.layer_windows == (6, 6, None, 6)
    assert (cfg.qk_norm, cfg.sandwich_norms, cfg.scale_embeddings, cfg.tie_word_embeddings,
            cfg.hidden_act) == (True, True, True, True, "gelu_pytorch_tanh")
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.rope_local_base_freq, cfg.rope_theta,
            cfg.final_logit_softcapping) == (32, 24.0, 2e4, 1e6, 5.0)
    gold = np.load(FIXTURES / "tiny_gemma3" / "logits.npz")
    ids, want = gold["ids_2"], gold["logits_2"]
    assert len(ids) > 2 * 6  # two windows: the window masks keys here
    assert max_err(reference_logits(cfg, params, ids), want) < 1e-4
    no_shift = {**params, "final_norm": params["final_norm"] - 1.0, "layers": {
        k: v - 1.0 if k.endswith("norm") else v for k, v in params["layers"].items()}}
    for c, p in ((cfg, no_shift),  # HF's stored w, not Gemma's 1 + w
                 (cfg.replace(layer_types=None, sliding_window=None), params),
                 (cfg.replace(query_pre_attn_scalar=32.0), params),
                 (cfg.replace(rope_local_base_freq=1e6), params),
                 (cfg.replace(final_logit_softcapping=None), params)):
        assert max_err(reference_logits(c, p, ids), want) > 1e-2


def test_gemma3_names_and_norm_shift():
    """The tree's Gemma leaves are HF's tensors: MLP norm = pre_feedforward_layernorm,
    post norms from their own tensors, every norm 1 + w (llama.cpp's GGUF convention)."""
    raw = load_file(str(FIXTURES / "tiny_gemma3" / "model.safetensors"))
    _, params, _ = load_model(FIXTURES / "tiny_gemma3", cache_dir=None, progress=False)
    lay = params["layers"]
    for leaf, hf in (("attn_norm", "input_layernorm"), ("mlp_norm", "pre_feedforward_layernorm"),
                     ("post_attn_norm", "post_attention_layernorm"),
                     ("post_mlp_norm", "post_feedforward_layernorm"),
                     ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")):
        np.testing.assert_array_equal(lay[leaf][3], raw[f"model.layers.3.{hf}.weight"] + 1.0)
    np.testing.assert_array_equal(params["final_norm"], raw["model.norm.weight"] + 1.0)
    np.testing.assert_array_equal(lay["wq"][2], raw["model.layers.2.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(params["embed"], raw["model.embed_tokens.weight"])
    assert "lm_head" not in params


def test_gemma3_multimodal_checkpoint_is_refused_by_name(tmp_path):
    d = tmp_path / "mm"
    shutil.copytree(FIXTURES / "tiny_gemma3", d)
    text = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(CheckpointError, match="Gemma3ForConditionalGeneration.*text-only"):
        load_model(d, cache_dir=None, progress=False)


def test_gemma3_missing_post_norm_is_named(tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "g"
    shutil.copytree(FIXTURES / "tiny_gemma3", d)
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.2.post_feedforward_layernorm.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.post_feedforward"):
        load_model(d, cache_dir=None, progress=False)
