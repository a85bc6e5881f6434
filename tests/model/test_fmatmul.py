"""The native CPU float matmul (issue 26 item 3, `native_fmatmul`): both layouts against a
float64 NumPy product on odd shapes (the "kn" one serial and threaded), the routing in
`linear` (tied head, layers at <= 2 rows), and
that the executable cache keys on the kernel and its thresholds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model import linear, native_fmatmul

pytestmark = pytest.mark.skipif(not native_fmatmul.available(), reason="no C++ compiler")

# N not a multiple of the nk task size (32 rows) nor of 8; K not a multiple of 8, nor of
# the kn task size (64 rows of W): K = 200 is three full tasks and one of 8 rows.
SHAPES = [(67, 45), (131, 576), (9, 13), (200, 1), (33, 200)]


@pytest.fixture(params=["serial", "threaded"])
def kn_threads(request):
    """The "kn" kernel with small products on the calling thread (the default) or every
    product split over the pool (`set_kn_serial_bytes(0)`); restored afterwards."""
    before = native_fmatmul.kn_serial_bytes()
    if request.param == "threaded":
        native_fmatmul.set_kn_serial_bytes(0)
    yield request.param
    native_fmatmul.set_kn_serial_bytes(before)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_fmatmul_matches_float64(layout, kn_threads):
    if layout == "nk" and kn_threads == "threaded":
        pytest.skip("the nk kernel has no serial switch")
    fn = jax.jit(lambda x, w: native_fmatmul.fmatmul(x, w, layout=layout))
    for n, k in SHAPES:
        rng = np.random.default_rng(n * k)
        w_nk = rng.standard_normal((n, k)).astype(np.float32)
        w = w_nk if layout == "nk" else np.ascontiguousarray(w_nk.T)
        for m in (1, 2, 3, 7, 8):
            x = rng.standard_normal((m, k)).astype(np.float32)
            want = x.astype(np.float64) @ w_nk.astype(np.float64).T
            got = np.asarray(fn(x, w))
            assert got.shape == (m, n) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fmatmul_kn_threads_and_batch_do_not_change_bits():
    """The "kn" kernel's K split does not depend on the threads (serial and threaded give
    the same bits), and a row of y depends on its row of x alone (M = 1 and M = 2 agree
    bit for bit: batch-invariant)."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2000, 520)).astype(np.float32)  # 4 MB, 32 tasks: threaded
    x = rng.standard_normal((2, 2000)).astype(np.float32)
    fn = jax.jit(lambda x, w: native_fmatmul.fmatmul(x, w, layout="kn"))
    before = native_fmatmul.kn_serial_bytes()
    assert before == 1 << 19
    base = np.asarray(fn(x, w))
    try:
        assert native_fmatmul.set_kn_serial_bytes(1 << 40) == 1 << 40
        np.testing.assert_array_equal(np.asarray(fn(x, w)), base)
        assert native_fmatmul.set_kn_serial_bytes(0) == 0
        for _ in range(3):  # whichever thread takes which task
            np.testing.assert_array_equal(np.asarray(fn(x, w)), base)
    finally:
        native_fmatmul.set_kn_serial_bytes(before)
    np.testing.assert_array_equal(np.asarray(fn(x[1:], w)), base[1:])
    want = x.astype(np.float64) @ w
    np.testing.assert_allclose(base, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fmatmul_rejects_bad_shapes():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="layout="):
        native_fmatmul.fmatmul(x, jnp.zeros((4, 8)), layout="kk")
    with pytest.raises(ValueError, match="does not match"):
        native_fmatmul.fmatmul(x, jnp.zeros((4, 9), jnp.float32), layout="nk")
    with pytest.raises(ValueError, match="f32"):
        native_fmatmul.fmatmul(x, jnp.zeros((4, 8), jnp.bfloat16), layout="nk")


def _targets(fn, *args) -> str:
    # a fresh lambda each time: jit caches traces per function, and the thresholds are read
    # at trace time
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def test_routing_tied_head_and_layers(monkeypatch):
    rng = np.random.default_rng(5)
    embed = rng.standard_normal((67, 48)).astype(np.float32)
    w = rng.standard_normal((48, 30)).astype(np.float32)
    head = lambda h, e: linear.head_matrix_product(h, e, tied=True)  # noqa: E731
    for m in (1, 3, 5):
        h = rng.standard_normal((m, 48)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(jax.jit(head)(h, embed)), h @ embed.T,
                                   rtol=1e-5, atol=1e-5)
        native = m <= linear.HEAD_NATIVE_MAX_ROWS
        assert ("jaxserve_fmatmul_nk" in _targets(head, h, embed)) == native, m
        # bf16 activations never take the f32 kernel
        assert "jaxserve_fmatmul" not in _targets(head, h.astype(jnp.bfloat16), embed)
    x = rng.standard_normal((2, 48)).astype(np.float32)
    assert linear.FLOAT_NATIVE_MAX_ROWS == 2  # layers: the "kn" kernel up to 2 rows
    assert "jaxserve_fmatmul_kn" in _targets(linear.linear, x, w)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a, b: linear.linear(a, b))(x, w)), x @ w, rtol=1e-5,
                               atol=1e-5)
    x3 = rng.standard_normal((3, 48)).astype(np.float32)
    assert "jaxserve_fmatmul" not in _targets(linear.linear, x3, w)
    monkeypatch.setattr(linear, "FLOAT_NATIVE_MAX_ROWS", 0)
    assert "jaxserve_fmatmul" not in _targets(linear.linear, x, w)


def test_executable_cache_keys_on_the_kernel_and_thresholds(monkeypatch):
    from jaxserve.worker import executable_cache

    before = executable_cache._static_parts()["native_cpu_fmatmul"]
    assert native_fmatmul.status() in before
    monkeypatch.setattr(linear, "HEAD_NATIVE_MAX_ROWS", 0)
    assert executable_cache._static_parts()["native_cpu_fmatmul"] != before
