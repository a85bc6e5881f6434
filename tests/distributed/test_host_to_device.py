"""`copy_leaves_to_device` (a step's host batch in one call into jaxlib) against
`jax.device_put`, the reference it replaces in `TensorParallel.put_batch`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.distributed import host_to_device
from jaxserve.distributed.host_to_device import copy_leaves_to_device
from jaxserve.distributed.tensor_parallel import TensorParallel

ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _batch(rng) -> dict:
    return {"ids": rng.integers(-5, 50_000, (7,), dtype=np.int32),
            "table": rng.integers(0, 99, (3, 5), dtype=np.int32),
            "seeds": rng.integers(0, 2**32 - 1, (3, 2), dtype=np.uint32),
            "temps": rng.random((3,), dtype=np.float32),
            "mask": np.array([True, False, True]),
            "half": rng.random((2, 4)).astype(np.float16),
            "empty": np.zeros((0, 3), np.int32),
            "dev": jnp.arange(4, dtype=jnp.int32)}


def test_same_values_dtypes_and_shapes_as_device_put():
    if host_to_device._SHARD_ARGS is None:
        pytest.skip("this jaxlib has no shard_args: put_batch uses jax.device_put")
    host = _batch(np.random.default_rng(0))
    got, want = copy_leaves_to_device(host, ONE), jax.device_put(host)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(g, jax.Array) and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert got["dev"] is host["dev"]  # a device leaf is kept, not copied again


def test_the_host_may_reuse_its_arrays_at_once():
    """Each leaf is copied: writing the host array after the put leaves the device's."""
    if host_to_device._SHARD_ARGS is None:
        pytest.skip("this jaxlib has no shard_args")
    ids = np.arange(64, dtype=np.int32)  # 256 bytes: CPU device_put could alias it
    got = copy_leaves_to_device({"ids": ids}, ONE)
    ids[:] = -1
    np.testing.assert_array_equal(np.asarray(got["ids"]), np.arange(64))


@pytest.mark.parametrize("leaf", [np.arange(3, dtype=np.int64), np.ones(2, np.float64),
                                  [1, 2], 3.0])
def test_leaves_it_does_not_take_fall_back_to_device_put(leaf):
    """64-bit arrays (which `jax.device_put` canonicalizes to 32 bits), lists and Python
    scalars: None here, and `put_batch` still places them as `jax.device_put` does."""
    host = {"x": leaf, "y": np.zeros(2, np.int32)}
    assert copy_leaves_to_device(host, ONE) is None
    got, want = TensorParallel(ModelConfig.tiny(), 1).put_batch(host), jax.device_put(host)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_put_batch_takes_the_fast_path_on_one_device(monkeypatch):
    if host_to_device._SHARD_ARGS is None:
        pytest.skip("this jaxlib has no shard_args")
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real(*a, **k))
    host = {"ids": np.arange(5, dtype=np.int32), "t": np.ones(3, np.float32)}
    got = TensorParallel(ModelConfig.tiny(), 1).put_batch(host)
    assert calls == []  # jax.device_put not called
    np.testing.assert_array_equal(np.asarray(got["ids"]), np.arange(5))
