"""The canonical parameter tree (the NNX `Llama` state) and `prepare_params`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model.llama import Llama, canonical_params, param_shapes, prepare_params
from tests.conftest import tiny_params


def test_module_state_is_the_canonical_tree():
    cfg = ModelConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    shapes = jax.tree.map(lambda a: tuple(a.shape), canonical_params(model))
    assert shapes == param_shapes(cfg)
    tied = ModelConfig.tiny(tie_word_embeddings=True)
    assert "lm_head" not in canonical_params(Llama(tied, rngs=nnx.Rngs(0)))


def test_family_switches_add_only_their_leaves():
    L, H, K, D = 2, 6, 2, 8
    plain = param_shapes(ModelConfig.tiny())["layers"]
    qwen2 = param_shapes(ModelConfig.tiny(attention_bias=True))["layers"]
    qwen3 = param_shapes(ModelConfig.tiny(qk_norm=True))["layers"]
    assert set(qwen2) - set(plain) == {"bq", "bk", "bv"} and set(qwen3) - set(plain) == {"q_norm", "k_norm"}
    assert (qwen2["bq"], qwen2["bk"], qwen2["bv"]) == ((L, H * D), (L, K * D), (L, K * D))
    assert qwen3["q_norm"] == qwen3["k_norm"] == (L, D)
    cfg = ModelConfig.tiny(attention_bias=True, qk_norm=True)
    state = canonical_params(Llama(cfg, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(state["layers"]["q_norm"], np.ones((L, D)))  # norms start at 1
    out = prepare_params(cfg, state, unroll_layers=True)
    assert out["layers"][1]["bk"].shape == (K * D,)
    assert prepare_params(cfg, state, unroll_layers=True, fuse=True)["layers"][1]["bqkv"].shape == \
        ((H + 2 * K) * D,)
    # A tree without the family's leaves (or with leaves the family lacks) names the path.
    with pytest.raises(ValueError, match=r"parameter tree at /layers: keys .* expected .*'bq'"):
        prepare_params(ModelConfig.tiny(attention_bias=True), tiny_params()[1], unroll_layers=True)
    with pytest.raises(ValueError, match=r"parameter tree at /layers: keys .*'q_norm'"):
        prepare_params(ModelConfig.tiny(attention_bias=True), state, unroll_layers=True)


def _fused_by_hand(layers):
    """The fused engine keys computed independently with NumPy (canonical -> engine)."""
    out = {k: w for k, w in layers.items() if k not in
           ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")}
    out["wqkv"] = np.concatenate([layers["wq"], layers["wk"], layers["wv"]], -1)
    if "bq" in layers:
        out["bqkv"] = np.concatenate([layers["bq"], layers["bk"], layers["bv"]], -1)
    out["w_gate_up"] = np.concatenate([layers["w_gate"], layers["w_up"]], -1)
    return out


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "canonical"])
@pytest.mark.parametrize("unroll", [True, False])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2"])
def test_prepare_params_layouts(unroll, fuse, bias):
    cfg = ModelConfig.tiny(attention_bias=bias)
    params = jax.tree.map(np.asarray, canonical_params(Llama(cfg, rngs=nnx.Rngs(2))))
    out = prepare_params(cfg, params, unroll_layers=unroll, fuse=fuse)
    assert all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in jax.tree.leaves(out))
    np.testing.assert_array_equal(out["embed"], params["embed"])
    want = _fused_by_hand(params["layers"]) if fuse else params["layers"]
    if fuse:  # [L, E, (H + 2K) * D] and [L, E, 2F]
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        assert want["wqkv"].shape[-1] == (H + 2 * K) * D
        assert want["w_gate_up"].shape[-1] == 2 * cfg.intermediate_size
    if unroll:
        assert isinstance(out["layers"], list) and len(out["layers"]) == cfg.num_hidden_layers
        for i, lp in enumerate(out["layers"]):
            assert set(lp) == set(want)
            for k, w in want.items():
                np.testing.assert_array_equal(lp[k], w[i])
    else:
        assert set(out["layers"]) == set(want)
        for k, w in want.items():
            np.testing.assert_array_equal(out["layers"][k], w)


def test_module_state_and_numpy_tree_prepare_to_the_same_leaves():
    cfg = ModelConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(3), init_std=0.3)
    from_np = prepare_params(cfg, jax.tree.map(np.asarray, canonical_params(model)),
                             unroll_layers=True)
    for src in (model, nnx.state(model)):
        got = prepare_params(cfg, src, unroll_layers=True)
        assert jax.tree.structure(got) == jax.tree.structure(from_np)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(from_np)):
            np.testing.assert_array_equal(a, b)


def test_device_leaves_are_copied_so_a_donating_trainer_cannot_delete_them():
    cfg = ModelConfig.tiny()
    state = nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))
    want = np.asarray(state["embed"][...])
    out = prepare_params(cfg, state, unroll_layers=False)
    fused = prepare_params(cfg, state, unroll_layers=False, fuse=True)
    assert out["embed"] is not state["embed"][...]
    state["embed"][...].delete()  # what a donated training step does to its input
    state["layers"]["w_down"][...].delete()
    np.testing.assert_array_equal(np.asarray(out["embed"]), want)
    assert not fused["layers"]["w_down"].is_deleted()
    assert not out["layers"]["w_down"].is_deleted()


def test_prepare_params_casts_to_bfloat16():
    cfg, params = tiny_params()
    out = prepare_params(cfg.replace(dtype="bfloat16"), params, unroll_layers=True, fuse=True)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(out))
    want = params["layers"]["w_up"][1].astype(ml_dtypes.bfloat16)  # round to nearest even
    up = np.asarray(out["layers"][1]["w_gate_up"])[:, cfg.intermediate_size:]  # fused [E, 2F]
    np.testing.assert_array_equal(up, want)


def _without(tree, *path):
    tree = jax.tree.map(lambda a: a, tree)  # a copy of the dict structure
    node = tree
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return tree


@pytest.mark.parametrize("edit,match", [
    (lambda p: _without(p, "lm_head"), r"at /: keys \['embed', 'final_norm', 'layers'\] "
                                       r"!= expected \['embed', 'final_norm', 'layers', 'lm_head'\]"),
    (lambda p: _without(p, "layers", "wq"), r"at /layers: keys .* != expected .*'wq'"),
    (lambda p: p | {"extra": p["embed"]}, r"at /: keys .*'extra'"),
    (lambda p: p | {"layers": p["layers"] | {"wk": p["layers"]["wk"][:, :, :8]}},
     r"parameter /layers/wk has shape \(2, 48, 8\), expected \(2, 48, 16\)"),
    (lambda p: p | {"embed": p["embed"].astype(np.int32)},
     r"parameter /embed has dtype int32, expected a floating dtype"),
    (lambda p: p | {"layers": [p["layers"]]}, r"at /layers: keys list"),
])
def test_prepare_params_names_the_bad_leaf(edit, match):
    cfg, params = tiny_params()
    with pytest.raises(ValueError, match=match):
        prepare_params(cfg, edit(params), unroll_layers=True)
