"""The native CPU float matmul (issue 26 item 3, `native_fmatmul`): both layouts against a
float64 NumPy product on odd shapes (the "kn" one serial and threaded), the routing in
`linear` (tied head and layers at <= 8 rows), several products of one x in one call
(`fmatmul_many`, the same bits as one call each), and
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
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16):  # the kn kernel takes x's rows 4 at a time
            x = rng.standard_normal((m, k)).astype(np.float32)
            want = x.astype(np.float64) @ w_nk.astype(np.float64).T
            got = np.asarray(fn(x, w))
            assert got.shape == (m, n) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fmatmul_kn_threads_and_batch_do_not_change_bits():
    """The "kn" kernel's K split does not depend on the threads (serial and threaded give
    the same bits), and a row of y depends on its row of x alone: every row of an M-row
    product equals that row's one-row product bit for bit (batch-invariant, M = 1-9 and
    16: one row streamed, from 5 rows blocks of 8, 7, 6 and 5, below that of 4, 3, 2 and
    1), on a width with 16-, 8- and 1-column strips."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2000, 537)).astype(np.float32)  # 4 MB, 32 tasks: threaded
    x = rng.standard_normal((16, 2000)).astype(np.float32)
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
    rows = np.concatenate([np.asarray(fn(x[i:i + 1], w)) for i in range(16)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 16):
        np.testing.assert_array_equal(np.asarray(fn(x[:m], w)), rows[:m], err_msg=f"M = {m}")
    want = x.astype(np.float64) @ w
    np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_fmatmul_stream_order_keeps_bits(layout):
    """Reading W in the streaming orders (`set_stream_order`, the default: "kn" at one row
    streams W's rows through an L1 buffer in column passes of 2048, from 5 rows (13 = 8 +
    5) one pass a chunk in 8-column strips; "nk" one row of W at a time up to 4 rows)
    gives the same bits as the register tiles alone, on widths past one pass (4111: two
    full passes, a partial third of 8 columns (a 16-column tile strip and an 8-column one)
    and a 7-column scalar tail) and below it, K with a short last
    chunk (203 = 25 chunks of 8 and one of 3) and a one-row last chunk (201); and the
    streamed result matches float64."""
    fn = jax.jit(lambda x, w: native_fmatmul.fmatmul(x, w, layout=layout))
    rng = np.random.default_rng(5)
    try:
        for n, k in ((4111, 203), (61, 201), (2048, 64), (5, 9)):
            w_nk = rng.standard_normal((n, k)).astype(np.float32)
            w = w_nk if layout == "nk" else np.ascontiguousarray(w_nk.T)
            for m in (1, 2, 5, 6, 7, 8, 13):
                x = rng.standard_normal((m, k)).astype(np.float32)
                assert native_fmatmul.set_stream_order(False) is False
                tiles = np.asarray(fn(x, w))
                assert native_fmatmul.set_stream_order(True) is True
                streamed = np.asarray(fn(x, w))
                np.testing.assert_array_equal(streamed, tiles, err_msg=f"{n=} {k=} {m=}")
                want = x.astype(np.float64) @ w_nk.astype(np.float64).T
                np.testing.assert_allclose(streamed, want, rtol=1e-5,
                                           atol=1e-5 * np.abs(want).max())
    finally:
        native_fmatmul.set_stream_order(True)


def test_fmatmul_kn_past_the_scratch_cap_keeps_every_row_of_w():
    """Past 64 MiB of partial sums (here 104 tasks x [420, 420] = 73 MB) the K split's tasks
    run one by one through one buffer: all of K counted (the first version used only the
    first task's 64 rows of W) and the same bits as the threaded split (each row equals
    its one-row product, which stays under the cap)."""
    rng = np.random.default_rng(12)
    m, k, n = 420, 6720, 420
    assert (k // 64 - 1) * m * n * 4 > 64 << 20 > (k // 64 - 1) * 1 * n * 4
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    fn = jax.jit(lambda x, w: native_fmatmul.fmatmul(x, w, layout="kn"))
    got = np.asarray(fn(x, w))
    want = x.astype(np.float64) @ w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for i in (0, 201, 419):
        np.testing.assert_array_equal(got[i], np.asarray(fn(x[i:i + 1], w))[0])


def test_fmatmul_many_equals_one_call_each(kn_threads):
    """Several "kn" products of one x in one call (`fmatmul_many`: q, k, v; gate, up): each
    the same bits as its own `fmatmul` call (serial or threaded, whatever the other weights
    are), within 1e-5 of float64, at M = 1-9; past the scratch cap too (one by one)."""
    rng = np.random.default_rng(13)
    k = 200  # 4 tasks along K, the last of 8 rows
    ws = [rng.standard_normal((k, n)).astype(np.float32) for n in (67, 13, 131, 1)]
    one = jax.jit(lambda x, w: native_fmatmul.fmatmul(x, w, layout="kn"))
    many = jax.jit(native_fmatmul.fmatmul_many)
    for m in (1, 2, 3, 4, 5, 8, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        for group in (ws[:2], ws[1:], ws):
            got = many(x, group)
            assert len(got) == len(group)
            for w, y in zip(group, got):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(one(x, w)))
                want = x.astype(np.float64) @ w
                np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5,
                                           atol=1e-5 * np.abs(want).max())
    # Past the 64 MiB cap of partials together: one call each, as alone. N = 120 and 300
    # (21 and 52 MB) are each under it (threaded); N = 420 (73 MB) alone runs one by one,
    # here after a narrower product (its buffer sized by its own width).
    m, k = 420, 6720
    big = {n: rng.standard_normal((k, n)).astype(np.float32) for n in (120, 300, 420)}
    x = rng.standard_normal((m, k)).astype(np.float32)
    for group in ((120, 420), (300, 120)):
        ws_big = [big[n] for n in group]
        for w, y in zip(ws_big, many(x, ws_big)):
            np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-4,
                                       atol=1e-3)
            np.testing.assert_array_equal(np.asarray(y)[7], np.asarray(one(x[7:8], w))[0])


def test_fmatmul_many_rejects_bad_input():
    x = jnp.zeros((2, 8), jnp.float32)
    w = jnp.zeros((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="1..4 weights"):
        native_fmatmul.fmatmul_many(x, [w] * 5)
    with pytest.raises(ValueError, match="1..4 weights"):
        native_fmatmul.fmatmul_many(x, [])
    with pytest.raises(ValueError, match=r"f32 weights \[8, N\]"):
        native_fmatmul.fmatmul_many(x, [w, jnp.zeros((9, 4), jnp.float32)])
    with pytest.raises(ValueError, match="f32 weights"):
        native_fmatmul.fmatmul_many(x, [w.astype(jnp.bfloat16)])


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
    assert linear.HEAD_NATIVE_MAX_ROWS == 8
    for m in (1, 3, 8, 9):
        h = rng.standard_normal((m, 48)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(jax.jit(head)(h, embed)), h @ embed.T,
                                   rtol=1e-5, atol=1e-5)
        native = m <= linear.HEAD_NATIVE_MAX_ROWS
        assert ("jaxserve_fmatmul_nk" in _targets(head, h, embed)) == native, m
        # bf16 activations never take the f32 kernel
        assert "jaxserve_fmatmul" not in _targets(head, h.astype(jnp.bfloat16), embed)
    x = rng.standard_normal((8, 48)).astype(np.float32)
    assert linear.FLOAT_NATIVE_MAX_ROWS == 8  # layers: the "kn" kernel up to 8 rows
    assert "jaxserve_fmatmul_kn" in _targets(linear.linear, x, w)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a, b: linear.linear(a, b))(x, w)), x @ w, rtol=1e-5,
                               atol=1e-5)
    x9 = rng.standard_normal((9, 48)).astype(np.float32)
    assert "jaxserve_fmatmul" not in _targets(linear.linear, x9, w)
    # several products of one x: one kn_many call up to 8 rows, XLA's dots past it
    w2 = rng.standard_normal((48, 7)).astype(np.float32)
    many = lambda a, b, c: linear.linear_many(a, (b, c))  # noqa: E731
    assert "jaxserve_fmatmul_kn_many" in _targets(many, x, w, w2)
    for y, ww in zip(jax.jit(many)(x, w, w2), (w, w2)):
        np.testing.assert_allclose(np.asarray(y), x @ ww, rtol=1e-5, atol=1e-5)
    assert "jaxserve_fmatmul" not in _targets(many, x9, w, w2)
    # lowered for a GPU: XLA's dots, in the weights' order
    cuda = jax.jit(lambda *a: many(*a)).trace(x, w, w2).lower(lowering_platforms=("cuda",))
    assert "jaxserve_fmatmul" not in cuda.as_text()
    assert [o.shape for o in cuda.out_info] == [(8, 30), (8, 7)]
    monkeypatch.setattr(linear, "FLOAT_NATIVE_MAX_ROWS", 0)
    assert "jaxserve_fmatmul" not in _targets(linear.linear, x, w)
    assert "jaxserve_fmatmul" not in _targets(many, x, w, w2)


def test_executable_cache_keys_on_the_kernel_and_thresholds(monkeypatch):
    from jaxserve.worker import executable_cache

    before = executable_cache._static_parts()["native_cpu_fmatmul"]
    assert native_fmatmul.status() in before
    monkeypatch.setattr(linear, "HEAD_NATIVE_MAX_ROWS", 0)
    assert executable_cache._static_parts()["native_cpu_fmatmul"] != before
    monkeypatch.setattr(linear, "HEAD_NATIVE_MAX_ROWS", 8)
    assert executable_cache._static_parts()["native_cpu_fmatmul"] == before
    monkeypatch.setattr(linear, "FLOAT_NATIVE_MANY", False)
    assert executable_cache._static_parts()["native_cpu_fmatmul"] != before
