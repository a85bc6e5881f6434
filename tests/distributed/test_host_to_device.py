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


def _aligned(n: int) -> np.ndarray:
    """i32[n] at a 64-byte-aligned address: the buffers CPU jaxlib keeps as device memory."""
    buf = np.empty(4 * n + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + 4 * n].view(np.int32)
    out[:] = np.arange(n)
    assert out.ctypes.data % 64 == 0
    return out


def test_the_host_may_reuse_its_arrays_at_once():
    """Each leaf is copied: writing the host array after the put leaves the device's. An
    aligned array is the case that matters (jaxlib would otherwise keep it as the buffer)."""
    if host_to_device._SHARD_ARGS is None:
        pytest.skip("this jaxlib has no shard_args")
    for n in (16, 64, 1000):
        ids = _aligned(n)
        got = copy_leaves_to_device({"ids": ids}, ONE)
        ids[:] = -1
        np.testing.assert_array_equal(np.asarray(got["ids"]), np.arange(n))


def test_arrays_are_committed_to_the_target_and_other_placements_fall_back():
    if host_to_device._SHARD_ARGS is None:
        pytest.skip("this jaxlib has no shard_args")
    got = copy_leaves_to_device({"a": np.arange(3, dtype=np.int32)}, ONE)["a"]
    assert got.sharding == ONE and got.committed
    # a device leaf on another sharding is the caller's to place: None, and put_batch
    # then uses jax.device_put for the whole tree, as before
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    named = jax.device_put(np.zeros(2, np.float32), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    assert named.sharding != ONE
    assert copy_leaves_to_device({"a": np.ones(2, np.int32), "b": named}, ONE) is None
    assert copy_leaves_to_device({"a": np.ones(2, np.int32), "b": got}, ONE) is not None


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
