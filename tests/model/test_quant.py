"""Quantized weights (issue 26): block formats against gguf-py, the quantized matmul
(native CPU kernel and the dequantize + dot path) against a float64 reference of the
dequantized weights, scheme validation, and a tiny engine on quantized weights."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoint.gguf_quant import blocks_of
from jaxserve.model import linear, native_qmatmul, quant
from jaxserve.model.quant import QuantizedWeight


def _gguf_tensor(w: np.ndarray, qtype: Q) -> SimpleNamespace:
    """A GGUF tensor record (what GGUFReader gives) of w [N, K] quantized by gguf-py."""
    raw = gguf.quants.quantize(w, qtype)
    return SimpleNamespace(tensor_type=int(qtype), shape=np.array(w.shape[::-1]), data=raw,
                           name="t")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_dequantize_bit_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 3, (7, 1))).astype(np.float32)
    t = _gguf_tensor(w, qtype)
    qw = blocks_of(t, "x.gguf")
    assert qw.kind == ("q8" if qtype == Q.Q8_0 else "q4") and qw.shape == (7, 96)
    want = gguf.quants.dequantize(t.data, qtype).reshape(7, 96)
    np.testing.assert_array_equal(quant.dequantize(qw), want)
    # stored compactly: 1 byte (q8) or half a byte (q4) per weight plus per-block scales
    assert qw.q.nbytes == (7 * 96 if qw.kind == "q8" else 7 * 48)


def test_float_tensor_is_not_blocks():
    t = SimpleNamespace(tensor_type=int(Q.F32), shape=np.array([64, 3]),
                        data=np.zeros((3, 64), np.float32), name="t")
    assert blocks_of(t, "x.gguf") is None


@pytest.mark.parametrize("kind", ["q8_0", "int8", "q4"])
def test_quantize_error_within_half_a_step(kind):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 64)).astype(np.float32) * np.float32(2.5)
    qw = (quant.quantize_q4(w) if kind == "q4" else
          quant.quantize_q8(w, block=64 if kind == "int8" else 32))
    err = np.abs(quant.dequantize(qw, np.float64) - w).reshape(5, -1, qw.block)
    step = np.asarray(qw.scale, np.float64)[..., None]
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-7)
    assert qw.scale.shape == (5, 64 // qw.block)


# The native kernel's integer path (M <= native_qmatmul.int_rows(), AVX-512 VNNI or AVX2) quantizes
# x to two int8 digits per 32-block: against the plain product of the dequantized weights
# its error is that quantization's, measured <= 3.7e-5 of max|y| on these shapes; the
# bound below documents it (the f32-activation paths stay within 1e-5).
X_QUANT_REL_ERR = 1e-4


def _quantize_x(x: np.ndarray, native: bool, kind: str = "q4") -> np.ndarray:
    """float64 x as the kernel multiplies it: `native_qmatmul.quantize_x` on the integer
    path (up to `int_rows` of the weight format's rows), x itself otherwise."""
    fmt = kind if kind in ("q4", "int8") else "q8"  # int8: q8 blocks of a whole row
    if native and x.shape[0] <= native_qmatmul.int_rows(fmt):
        return native_qmatmul.quantize_x(x)
    return x.astype(np.float64)


@pytest.fixture(params=["int", "f32"], ids=["int_x", "f32_x"])
def x_path(request):
    """The native kernel's activation path for M <= `int_rows` (q4 16 / q8 4 / int8 4
    with VNNI, 8 / 8 / 3 with AVX2): the integer one (where the CPU has it) or the f32 one
    (`set_int_rows(0)`); restored afterwards."""
    if not native_qmatmul.available():
        pytest.skip("no C++ compiler")
    before = native_qmatmul.int_rows()
    if request.param == "int" and before == 0:
        pytest.skip("no integer path on this CPU (AVX-512 VNNI or AVX2 + FMA + F16C)")
    if request.param == "f32":
        native_qmatmul.set_int_rows(0)
    yield request.param
    native_qmatmul.set_int_rows(before)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kind", ["q8", "q4", "int8"])
@pytest.mark.parametrize("shape", [(37, 96), (5, 160), (6, 64), (9, 224), (11, 576)])
def test_quantized_matmul_matches_float64(native, kind, shape, x_path):
    """Within 1e-5 of float64 (dequantized W) @ (x as the kernel quantizes it); within
    X_QUANT_REL_ERR of the unquantized product. Odd and even numbers of 32-blocks; for
    q4's quads of blocks, 0-4 quads with 0-3 blocks left over (3, 5, 2, 7, 18 blocks)."""
    if not native and x_path == "int":
        pytest.skip("the dequantize + dot path has no activation paths")
    n, k = shape
    rng = np.random.default_rng(n * k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw = (quant.quantize_q4(w) if kind == "q4" else
          quant.quantize_q8(w, block=k if kind == "int8" else 32))
    wd = quant.dequantize(qw, np.float64)
    fn = jax.jit(lambda x, w: linear.quantized_matmul(x, w, native=native))
    for m in (1, 2, 3, 4, 7, 16, 17, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = _quantize_x(x, native, kind) @ wd.T
        got = np.asarray(fn(x, qw))
        assert got.shape == (m, n)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        plain = x.astype(np.float64) @ wd.T
        assert np.abs(got - plain).max() <= X_QUANT_REL_ERR * np.abs(plain).max(), m


def test_native_matmul_threaded_equals_serial():
    """`set_serial_work(0)` (every product on the pool) gives the serial result bit for bit
    (tasks own disjoint output rows), and the threshold round-trips and is restored."""
    if not native_qmatmul.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(3)
    qw = quant.quantize_q4(rng.standard_normal((200, 224)).astype(np.float32))
    x = rng.standard_normal((1, 224)).astype(np.float32)
    fn = jax.jit(lambda x, w: linear.quantized_matmul(x, w, native=True))
    before = native_qmatmul.serial_work()
    serial = np.asarray(fn(x, qw))
    try:
        assert native_qmatmul.set_serial_work(0) == 0 == native_qmatmul.serial_work()
        np.testing.assert_array_equal(np.asarray(fn(x, qw)), serial)
    finally:
        native_qmatmul.set_serial_work(before)
    assert native_qmatmul.serial_work() == before > 0


def test_native_matmul_propagates_nan_and_inf(x_path):
    """A NaN / inf in x reaches y on both activation paths (the integer one hands such an
    x to the f32 kernels instead of quantizing it)."""
    rng = np.random.default_rng(9)
    qw = quant.quantize_q4(rng.standard_normal((8, 64)).astype(np.float32))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    x[0, 5], x[1, 40] = np.nan, np.inf
    got = np.asarray(jax.jit(lambda x, w: linear.quantized_matmul(x, w, native=True))(x, qw))
    assert np.isnan(got[0]).all() and not np.isfinite(got[1]).any()


def test_quantize_x_digits():
    """The two-digit activation quantization: error <= amax / 127 / 256 per block (a tie
    clamps lo to 127), exact on zeros and on multiples of the first digit."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 96)) * rng.uniform(1e-3, 1e3, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0
    xq = native_qmatmul.quantize_x(x)
    amax = np.abs(x).reshape(3, 3, 32).max(-1, keepdims=True).astype(np.float64)
    err = np.abs(xq - x).reshape(3, 3, 32)
    assert np.all(err <= amax / 127 / 256 * (1 + 1e-6))
    assert np.all(xq[1, 32:64] == 0)
    with pytest.raises(ValueError, match="K=40 is not a multiple of 32"):
        native_qmatmul.quantize_x(np.zeros((1, 40), np.float32))


def test_embed_rows_and_linear_dispatch():
    rng = np.random.default_rng(3)
    e = rng.standard_normal((11, 64)).astype(np.float32)
    qe = quant.quantize_q8(e)
    ids = np.array([3, 0, 10, 3], np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(linear.embed_rows)(qe, ids)),
                                  quant.dequantize(qe)[ids])
    x = rng.standard_normal((2, 64)).astype(np.float32)
    wt = np.ascontiguousarray(e.T)  # float canonical [K, N]: plain x @ w
    np.testing.assert_allclose(np.asarray(linear.linear(x, wt)), x @ wt, rtol=1e-5, atol=1e-5)


def test_scheme_errors_are_clear():
    with pytest.raises(ValueError, match="quantization='fp4' must be one of"):
        quant.resolve_scheme("fp4", kept_kinds=set(), source="m")
    with pytest.raises(ValueError, match="no 4-bit tensors.*fewer bits"):
        quant.resolve_scheme("q4", kept_kinds={"q8"}, source="m.gguf")
    assert quant.resolve_scheme("q4", kept_kinds={"q4", "q8"}, source="m") == "q4"
    assert quant.resolve_scheme("auto", kept_kinds=set(), source="m") == "keep"
    with pytest.raises(ValueError, match="K=48 is not a multiple of 32"):
        quant.quantize_q4(np.zeros((4, 48), np.float32))
    tree = {"embed": quant.quantize_q8(np.zeros((4, 64), np.float32)), "layers": {}}
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*32-element blocks"):
        quant.engine_scheme("auto", tree, tensor_parallel_size=2)
    assert quant.engine_scheme("none", tree, tensor_parallel_size=2) == "none"
    from jaxserve.config import ModelConfig
    from jaxserve.engine import make_engine_config

    with pytest.raises(ValueError, match="EngineConfig.quantization='int4' must be one of"):
        make_engine_config(ModelConfig.tiny(), quantization="int4")


# A tiny config whose every contraction (hidden 64, heads 4 x 16, MLP 96) holds whole
# 32-element blocks; vocab 67 and the KV width 32 keep the sizes distinct.
CFG_KW = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)


def _float_tree(tree: dict) -> dict:
    """The float canonical tree a quantized one stands for (the reference's weights)."""
    def f(k, v):
        return quant.dequantize_leaf(v, key=k) if isinstance(v, QuantizedWeight) else v

    return {**{k: f(k, v) for k, v in tree.items() if k != "layers"},
            "layers": {k: f(k, v) for k, v in tree["layers"].items()}}


def _quantized_tree(params: dict, scheme: str) -> dict:
    return {**{k: quant.quantize_leaf(v, scheme, key=k) for k, v in params.items()
               if k != "layers"},
            "layers": {k: quant.quantize_leaf(v, scheme, key=k)
                       for k, v in params["layers"].items()}}


def _greedy(engine, prompts, n):
    from jaxserve.sampling_params import SamplingParams
    from tests.conftest import drain

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, sp)
    outs = drain(engine)
    return [list(outs[f"p{i}"].outputs[0].token_ids) for i in range(len(prompts))]


def _reference_greedy(cfg, params, prompt, n):
    from jaxserve.model.llama import prepare_params, reference_logits

    p = prepare_params(cfg, params, unroll_layers=False, quantization="none")
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(reference_logits(cfg, p, np.array(ids))[-1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("scheme,fuse", [("q4", None), ("int8", None), ("q4", False)])
def test_engine_on_quantized_weights(scheme, fuse):
    """Greedy tokens of an engine that quantizes float weights at load equal a float
    reference forward over the same (dequantized) weights; update_params with float
    weights quantizes them on the way in (into the fused layout too); no compile after
    warm-up; the weights stay quantized on the device. fuse_projections None (the
    default) fuses q|k|v and gate|up on CPU (`jaxserve.model.fused`)."""
    from jaxserve.engine import LLMEngine, make_engine_config
    from tests.conftest import tiny_params

    cfg, params = tiny_params(seed=4, **CFG_KW)
    config = make_engine_config(cfg, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=4, max_num_batched_tokens=16,
                                attention_backend="xla", min_token_bucket=8, min_seq_bucket=4,
                                strict_compiles=True, quantization=scheme,
                                fuse_projections=fuse)
    engine = LLMEngine(config, params, None, model_name="tiny-q", progress=False)
    placed = engine.runner.params
    qkv, down = ("wq", "w_down") if fuse is False else ("wqkv", "w_gate_up")
    assert (qkv in placed["layers"][0]) and ("wk" in placed["layers"][0]) == (fuse is False)
    wq = placed["layers"][0][qkv]
    assert isinstance(wq, QuantizedWeight) and wq.q.dtype == (np.uint8 if scheme == "q4"
                                                             else np.int8)
    assert isinstance(placed["embed"], QuantizedWeight)  # q8 blocks under every scheme
    prompts = [[1, 5, 9, 22, 40], [1, 7, 7]]
    ref_tree = _float_tree(_quantized_tree(params, scheme))
    want = [_reference_greedy(cfg, ref_tree, p, 6) for p in prompts]
    assert _greedy(engine, prompts, 6) == want

    _, params2 = tiny_params(seed=5, **CFG_KW)
    engine.update_params(params2)  # float weights into the quantized engine
    assert isinstance(engine.runner.params["layers"][1][down], QuantizedWeight)
    want2 = [_reference_greedy(cfg, _float_tree(_quantized_tree(params2, scheme)), p, 6)
             for p in prompts]
    assert want2 != want
    assert _greedy(engine, prompts, 6) == want2
    assert engine.get_stats()["num_compiles_after_warmup"] == 0


@pytest.mark.parametrize("scheme", ["int8", "q8_0", "q4"])
@pytest.mark.parametrize("key,shape", [("wq", (2, 64, 96)), ("embed", (11, 64)),
                                       ("lm_head", (64, 11))])
def test_abstract_quantized_matches_the_real_format(scheme, key, shape):
    """Deviceless compiles trace the same tree structure, shapes and dtypes as a real
    quantized engine, owning no memory."""
    real = quant.quantize_leaf(np.ones(shape, np.float32), scheme, key=key)
    fake = quant.abstract_quantized(shape, scheme, key=key)
    spec = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert jax.tree.structure(fake) == jax.tree.structure(real)
    assert spec(fake) == spec(real)
    assert all(a.strides == (0,) * a.ndim for a in jax.tree.leaves(fake))


def test_a_float_gguf_loads_as_floats_under_auto():
    """A GGUF with no quantized tensor takes the ordinary (cached) load under every
    scheme; the engine then decides what its matrices become."""
    from pathlib import Path

    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.gguf_quant import has_blocks

    path = Path(__file__).parents[1] / "fixtures" / "tiny_gguf" / "tiny-f32.gguf"
    assert not has_blocks(path)
    _, tree, _ = load_model(path, quantization="auto", cache_dir=None, progress=False)
    assert not quant.tree_kinds(tree) and tree["layers"]["wq"].dtype == np.float32


@pytest.mark.parametrize("unroll", [False, True])
def test_q8_0_gguf_blocks_match_transformers_logits(unroll, x_path):
    """The tiny Q8_0 GGUF fixture with its blocks kept (stacked under the scan, or one
    leaf per layer) gives transformers' logits of the same file (tests/fixtures/tiny_gguf):
    within 1e-4 with the activations in f32; within 1e-3 where the kernel's integer path
    quantizes them (prompts of up to `int_rows("q8")` tokens: every layer's products
    carry that quantization's error, up to X_QUANT_REL_ERR each; 4.3e-4 measured here)."""
    from pathlib import Path

    from jaxserve.checkpoint import load_model
    from jaxserve.model.llama import prepare_params, reference_logits

    tiny = Path(__file__).parents[1] / "fixtures" / "tiny_gguf"
    cfg, tree, _ = load_model(tiny / "tiny-q8_0.gguf", quantization="auto", cache_dir=None,
                              progress=False)
    assert quant.tree_kinds(tree) == {"q8"}
    params = prepare_params(cfg, tree, unroll_layers=unroll)
    wq = params["layers"][0]["wq"] if unroll else params["layers"]["wq"]
    assert isinstance(wq, QuantizedWeight)
    gold = np.load(tiny / "logits_q8_0.npz")
    for j in range(3):
        ids = gold[f"ids_{j}"]
        got = reference_logits(cfg, params, ids)
        quantized_x = x_path == "int" and len(ids) <= native_qmatmul.int_rows("q8")
        assert np.abs(got - gold[f"logits_{j}"]).max() < (1e-3 if quantized_x else 1e-4), j


def test_integer_path_is_built_where_the_cpu_has_it():
    """A kernel built on a CPU with AVX-512 VNNI (+BW, VL, F16C) or AVX2 + FMA + F16C has an
    integer path (so the integer cases above cannot all skip where they should run)."""
    if not native_qmatmul.available():
        pytest.skip("no C++ compiler")
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
                    .split(":", 1)[1].split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo")
    want = ("avx512_vnni" if {"avx512_vnni", "avx512bw", "avx512vl", "f16c"} <= flags else
            "avx2" if {"avx2", "fma", "f16c"} <= flags else "")
    assert native_qmatmul.int_path() == want


def test_int_rows_per_format():
    """The integer path's row cut (their measured crossovers, qmatmul.cc): q4 16 and q8 /
    int8 at most 4 on the AVX-512 VNNI path, q4 and q8 8 and int8 3 on the AVX2 one, all
    following `set_int_rows`; an unknown format is an error."""
    path = native_qmatmul.int_path()
    if not path:
        pytest.skip("no integer path here (no compiler, or no AVX-512 VNNI nor AVX2)")
    q4, q8, i8 = {"avx512_vnni": (16, 4, 4), "avx2": (8, 8, 3)}[path]
    before = native_qmatmul.int_rows()
    try:
        assert (native_qmatmul.int_rows("q4"), native_qmatmul.int_rows("q8"),
                native_qmatmul.int_rows("int8")) == (q4, q8, i8)
        assert native_qmatmul.set_int_rows(1) == 1
        assert (native_qmatmul.int_rows("q4"), native_qmatmul.int_rows("q8")) == (1, 1)
        assert native_qmatmul.set_int_rows(1000) == 64  # clamped
        assert (native_qmatmul.int_rows("q8"), native_qmatmul.int_rows("int8")) == (q8, i8)
    finally:
        native_qmatmul.set_int_rows(before)
    with pytest.raises(ValueError, match="kind='q5'"):
        native_qmatmul.int_rows("q5")
