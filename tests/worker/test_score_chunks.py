"""The score program in row chunks (issue 31: Gemma 3's 262k vocabulary) equals one pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.worker import programs


def test_chunked_score_rows_equal_the_one_pass(monkeypatch):
    cfg = ModelConfig.tiny(dtype="float32")
    rng = np.random.default_rng(0)
    params = {"embed": jnp.asarray(rng.standard_normal((67, 48)), jnp.float32),
              "lm_head": jnp.asarray(rng.standard_normal((48, 67)), jnp.float32)}
    h = jnp.asarray(rng.standard_normal((20, 48)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, 67, 20), jnp.int32)
    # both passes on XLA's dot: at <= 8 rows an untied f32 head takes the native CPU kernel
    # (`linear.FLOAT_NATIVE_MAX_ROWS`), whose sums round differently from XLA's
    from jaxserve.model import linear
    monkeypatch.setattr(linear, "FLOAT_NATIVE_MAX_ROWS", 0)
    whole = programs._score_fn(cfg, 5, params, h, tg)
    monkeypatch.setattr(programs, "SCORE_CHUNK_ELEMENTS", 67 * 6)  # 6-row chunks, 20 rows
    chunked = programs._score_fn(cfg, 5, params, h, tg)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the log-softmax of the target, by hand
    lg = np.asarray(h, np.float64) @ np.asarray(params["lm_head"], np.float64)
    ref = lg[np.arange(20), np.asarray(tg)] - np.log(np.exp(lg).sum(-1))
    np.testing.assert_allclose(np.asarray(chunked[0]), ref, rtol=1e-4, atol=1e-4)
