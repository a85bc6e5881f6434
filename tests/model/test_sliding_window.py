"""Sliding-window layers through the config, the layer programs and the engine.

The per-layer window is read from HF configs as transformers reads it (Mistral,
Qwen2/Qwen3 with use_sliding_window, Gemma 3) and from GGUF metadata; the engine's
paged, chunked, bucketed forward (layer-group programs with the window and RoPE table
as data, and the scan) must give the greedy tokens of the dense reference, whose
mask is written out plainly (`llama.dense_causal_attn`), on prompts several windows
long. Gemma 3's block itself is checked against HF transformers in test_gemma3.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from conftest import tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.llm import LLM
from jaxserve.model.llama import Llama, prepare_params, reference_logits
from jaxserve.sampling_params import SamplingParams

HF = dict(vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
          num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize("d,want", [
    (dict(model_type="mistral", sliding_window=7), (7, 7, 7, 7)),
    (dict(model_type="mistral", sliding_window=None), (None,) * 4),
    (dict(model_type="qwen2", sliding_window=7, use_sliding_window=False), (None,) * 4),
    (dict(model_type="qwen2", sliding_window=7, use_sliding_window=True, max_window_layers=2),
     (None, None, 7, 7)),
    (dict(model_type="qwen3", sliding_window=7, use_sliding_window=True,
          layer_types=["sliding_attention", "full_attention"] * 2), (7, None, 7, None)),
    (dict(model_type="gemma3_text", sliding_window=7, sliding_window_pattern=2,
          query_pre_attn_scalar=64, head_dim=16), (7, None, 7, None)),
])
def test_hf_configs_with_a_window_load_with_it_per_layer(d, want):
    arch = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[d["model_type"]]
    cfg = ModelConfig.from_hf_dict({**HF, **d, "architectures": [arch]}, dtype="float32")
    assert cfg.layer_windows == want
    if d["model_type"] == "gemma3_text":
        assert cfg.sandwich_norms and cfg.scale_embeddings and cfg.qk_norm
        assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.rope_local_base_freq == 10000.0
        assert cfg.attn_scale == 64 ** -0.5


def test_gemma3_nested_text_config_and_per_type_rope_parameters():
    d = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
         "text_config": {**HF, "model_type": "gemma3_text", "sliding_window": 5, "head_dim": 16,
                         "rope_parameters": {
                             "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}}
    cfg = ModelConfig.from_hf_dict(d, dtype="float32")
    assert cfg.rope_theta == 1e6 and cfg.rope_local_base_freq == 1e4
    assert cfg.layer_windows == (5, 5, 5, 5)  # pattern 6: layer 6 would be the first global


@pytest.mark.parametrize("kw,match", [
    (dict(sliding_window=0), "sliding_window=0 must be None or an int >= 1"),
    (dict(sliding_window=4, layer_types=("sliding_attention",)), "one of .* per layer \\(2\\)"),
    (dict(layer_types=("sliding_attention", "full_attention")), "only with a sliding_window"),
    (dict(hidden_act="relu"), "hidden_act='relu' must be one of"),
])
def test_bad_window_settings_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.tiny(**kw)


def test_attention_softcapping_is_refused_before_anything_is_built():
    d = {**HF, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
         "sliding_window": 4, "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        ModelConfig.from_hf_dict(d)


def _greedy_reference(cfg, params, prompt, n, width=40):
    """Greedy tokens of the dense causal forward; the ids are padded to one width (the
    mask is causal, so the padding after a position changes nothing): one compile."""
    p = prepare_params(cfg, params, unroll_layers=False)
    ids = list(prompt)
    for _ in range(n):
        padded = np.zeros(width, np.int32)
        padded[:len(ids)] = ids
        ids.append(int(reference_logits(cfg, p, padded)[len(ids) - 1].argmax()))
    return ids[len(prompt):]


GEMMA_LIKE = dict(sandwich_norms=True, scale_embeddings=True, qk_norm=True,
                  hidden_act="gelu_pytorch_tanh", rope_local_base_freq=100.0,
                  query_pre_attn_scalar=24.0, final_logit_softcapping=3.0)


@pytest.mark.parametrize("family,unroll", [("gemma_like", True), ("llama", False)],
                         ids=["gemma_like-layer_programs", "llama-scan"])
def test_engine_with_windowed_layers_matches_the_dense_reference(family, unroll):
    """Window 5 on layers 0 and 2 of 3 (block size 4: the window spans page edges),
    prompts of 9-23 tokens prefilled in 8-token chunks, then decodes far past the window."""
    cfg = ModelConfig.tiny(num_hidden_layers=3, sliding_window=5, dtype="float32",
                           layer_types=("sliding_attention", "full_attention",
                                        "sliding_attention"),
                           **(GEMMA_LIKE if family == "gemma_like" else {}))
    model = Llama(cfg, rngs=nnx.Rngs(5), init_std=0.3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(4, 66, n)) for n in (9, 23, 14)]
    llm = LLM.from_module(model, tiny_tokenizer(), cfg=cfg, max_model_len=64, block_size=4,
                          num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                          token_buckets=(4, 8), seq_buckets=(4,), attention_backend="xla",
                          strict_compiles=True, unroll_layers=unroll,
                          enable_prompt_logprobs=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    windowless = cfg.replace(sliding_window=None, layer_types=None)
    params = nnx.state(model)
    differs = False
    for prompt, out in zip(prompts, outs):
        want = _greedy_reference(cfg, params, prompt, 12)
        assert list(out.outputs[0].token_ids) == want
        differs |= want != _greedy_reference(windowless, params, prompt, 12)
    assert differs, "the window changed no token: the test would not see it missing"
    stats = llm.engine.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_gemma_block_projections_take_quantized_weights_and_lora_deltas():
    """The Gemma 3 block's seven projections go through `lora.project`: int8 weights give
    the logits of the float model over the same weights dequantized (float64-free check
    against numpy's dequantization), and a LoRA slot changes the block's output exactly
    by the hand-computed delta of its q projection."""
    import jax.numpy as jnp

    from jaxserve.model import native_qmatmul, quant
    from jaxserve.model.llama import decoder_layer, dense_causal_attn, rope_inv_freq
    from jaxserve.model.lora import lora_leaf_shapes

    cfg = ModelConfig.tiny(num_hidden_layers=2, sliding_window=5, dtype="float32",
                           hidden_size=64, intermediate_size=96,
                           layer_types=("sliding_attention", "full_attention"), **GEMMA_LIKE)
    state = nnx.state(Llama(cfg, rngs=nnx.Rngs(5), init_std=0.3))
    q = prepare_params(cfg, state, unroll_layers=True, quantization="int8")
    assert any(quant.is_quantized(v) for v in q["layers"][0].values())
    def deq_dict(d):
        return {k: quant.dequantize_leaf(w, key=k) if quant.is_quantized(w) else w
                for k, w in d.items()}
    deq = deq_dict({k: v for k, v in q.items() if k != "layers"})
    deq["layers"] = [deq_dict(lp) for lp in q["layers"]]
    ids = np.arange(4, 12)
    # The activations in f32 (`set_int_rows(0)`): the native kernel's integer path (up to
    # `int_rows("int8")` rows) quantizes them, an error test_quant.py bounds on its own.
    before = native_qmatmul.int_rows() if native_qmatmul.available() else None
    if before is not None:
        native_qmatmul.set_int_rows(0)
    try:
        np.testing.assert_allclose(np.asarray(reference_logits(cfg, q, ids)),
                                   np.asarray(reference_logits(cfg, deq, ids)), rtol=2e-4,
                                   atol=2e-4)
    finally:
        if before is not None:
            native_qmatmul.set_int_rows(before)
    # LoRA: only the q projection's A/B non-zero in slot 1; zero everywhere else.
    p = prepare_params(cfg, state, unroll_layers=True)
    lp = dict(p["layers"][0])
    rng = np.random.default_rng(0)
    for k, s in lora_leaf_shapes(cfg, 2, 4).items():
        lp[k] = jnp.zeros(s, jnp.float32)
    x = jnp.asarray(rng.normal(size=(5, cfg.hidden_size)).astype(np.float32))

    def run(slot):
        return np.asarray(decoder_layer(cfg, x, lp, jnp.arange(5), jnp.asarray(rope_inv_freq(cfg)),
                                        dense_causal_attn(cfg), None, jnp.int32(0),
                                        lora_slots=jnp.full(5, slot, jnp.int32))[0])

    base = run(0)
    np.testing.assert_array_equal(run(1), base)  # a zero adapter adds nothing
    a_name = next(k for k in lp if k.startswith("lora_a_wq"))
    lp[a_name] = jnp.asarray(rng.normal(size=lp[a_name].shape).astype(np.float32))
    lp[a_name.replace("lora_a_", "lora_b_")] = jnp.asarray(
        rng.normal(size=lp[a_name.replace("lora_a_", "lora_b_")].shape).astype(np.float32))
    assert not np.allclose(run(1), base, atol=1e-3)  # the adapter reaches the Gemma block
    np.testing.assert_array_equal(run(0), base)  # slot 0 rows stay the base model's
