"""Fused projections (`jaxserve.model.fused`): wq|wk|wv and w_gate|w_up as one matrix."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.model import fused, linear, native_qmatmul, quant
from jaxserve.model.quant import QuantizedWeight


def _parts(kind: str, ns=(64, 32, 32), k=96, seed=0) -> list:
    rng = np.random.default_rng(seed)
    # canonical [K, N] floats, quantized the way the loader / prepare_params do
    return [quant.quantize_leaf(rng.standard_normal((k, n)).astype(np.float32), kind, key="wq")
            for n in ns]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kind", ["q4", "q8_0", "int8"])
@pytest.mark.parametrize("m", [1, 7])
def test_fused_product_is_the_parts_products_side_by_side(kind, native, m):
    """The fused matrix's product equals the parts' products concatenated: bit for bit on
    the native CPU kernel (rows of whole blocks: each output column reads the same blocks
    and sums them in the same order), within f32 rounding on XLA's dot (its reduction
    order may follow the shape); the fused blocks dequantize to the parts stacked."""
    if native and not native_qmatmul.available():
        pytest.skip("no C++ compiler for the native kernel")
    parts = _parts(kind)
    w = fused.concat_outputs(parts, key="wqkv")
    assert isinstance(w, QuantizedWeight) and w.shape == (128, 96)
    x = jax.numpy.asarray(np.random.default_rng(1).standard_normal((m, 96)).astype(np.float32))
    whole = np.asarray(linear.quantized_matmul(x, w, native=native))
    each = np.concatenate([np.asarray(linear.quantized_matmul(x, p, native=native))
                           for p in parts], axis=-1)
    if native:
        np.testing.assert_array_equal(whole, each)
    else:
        np.testing.assert_allclose(whole, each, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(quant.dequantize(w),
                                  np.concatenate([quant.dequantize(p) for p in parts]))


def test_float_parts_concatenate_on_the_output_axis():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((8, 3)), rng.standard_normal((8, 5))
    np.testing.assert_array_equal(fused.concat_outputs([a, b], key="w_gate_up"),
                                  np.concatenate([a, b], axis=1))
    j = fused.concat_outputs([jax.numpy.asarray(a), b], key="w_gate_up")
    assert isinstance(j, jax.Array) and j.shape == (8, 8)
    # NumPy in: a 64-byte-aligned new buffer (CPU device_put takes it in place), the
    # parts' promoted dtype as np.concatenate gives it (f32 + f64 -> f64)
    for parts in ([a.astype(np.float32), b.astype(np.float32)], [a.astype(np.float32), b]):
        out = fused.concat_outputs(parts, key="w_gate_up")
        want = np.concatenate(parts, axis=1)
        assert out.ctypes.data % 64 == 0 and out.dtype == want.dtype
        np.testing.assert_array_equal(out, want)


def test_mixed_formats_are_refused_and_not_fusable():
    q4, q8 = _parts("q4", ns=(32,))[0], _parts("q8_0", ns=(32,))[0]
    with pytest.raises(ValueError, match=r"wqkv's parts have different formats"):
        fused.concat_outputs([q4, q8], key="wqkv")
    with pytest.raises(ValueError, match="different formats"):
        fused.concat_outputs([q4, np.zeros((96, 32), np.float32)], key="wqkv")
    layers = dict(zip(("wq", "wk", "wv", "w_gate", "w_up"), _parts("q4", ns=(8,) * 5)))
    assert fused.fusable(layers)
    assert not fused.fusable(dict(layers, wk=q8))
    assert not fused.fusable(dict(layers, w_up=np.zeros((96, 8), np.float32)))
    un = fused.unfused_like(fused.fuse_projections(layers, attention_bias=False))
    assert set(un) == set(layers) and un["wq"] is un["wv"]  # each part like its fused leaf


def _config(**kw):
    model = SimpleNamespace(sandwich_norms=kw.pop("sandwich", False))
    return SimpleNamespace(fuse_projections=kw.pop("fuse", None), max_loras=kw.pop("loras", 0),
                           tensor_parallel_size=kw.pop("tp", 1), model=model)


def test_resolve_fuse():
    """None: decided by the weights on CPU (None), off elsewhere or with LoRA / TP /
    Gemma 3; True with one of those is an error naming it; False stays False."""
    assert fused.resolve_fuse(_config(), "cpu") is None
    assert fused.resolve_fuse(_config(), "cuda") is False
    assert fused.resolve_fuse(_config(loras=2), "cpu") is False
    assert fused.resolve_fuse(_config(fuse=True), "cuda") is True
    assert fused.resolve_fuse(_config(fuse=False), "cpu") is False
    with pytest.raises(ValueError, match=r"not supported with max_loras=2"):
        fused.resolve_fuse(_config(fuse=True, loras=2), "cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2, the Gemma 3 block"):
        fused.resolve_fuse(_config(fuse=True, tp=2, sandwich=True), "cpu")


def test_config_validates_fuse_projections():
    from jaxserve.config import ModelConfig
    from jaxserve.engine import make_engine_config

    with pytest.raises(ValueError, match=r"fuse_projections='yes' must be None"):
        make_engine_config(ModelConfig.tiny(), fuse_projections="yes")
    assert EngineConfig.__dataclass_fields__["fuse_projections"].default is None


def test_prepare_params_auto_fuses_block_quantized_layers_only():
    from jaxserve.model.llama import prepare_params
    from tests.conftest import tiny_params

    cfg, params = tiny_params(seed=3, hidden_size=64, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    q = prepare_params(cfg, params, unroll_layers=True, fuse=None, quantization="q4")
    assert isinstance(q["layers"][0]["wqkv"], QuantizedWeight) and "wq" not in q["layers"][0]
    assert q["layers"][1]["w_gate_up"].shape == (2 * 96, 64)
    f = prepare_params(cfg, params, unroll_layers=True, fuse=None, quantization="none")
    assert "wq" in f["layers"][0] and "wqkv" not in f["layers"][0]
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        prepare_params(cfg, params, unroll_layers=True, fuse=True, tensor_parallel_size=2)
