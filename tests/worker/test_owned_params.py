"""Zero-copy params on CPU (`jaxserve.distributed.tensor_parallel.OwnedHostParams`): the host tree handed
over by the CLI becomes the device buffers; a tree passed bare is always copied."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

from conftest import tiny_params
from jaxserve.distributed.tensor_parallel import ALIGN, OwnedHostParams, align_host_leaves

# Buffer sharing is a CPU property (device_put elsewhere always copies to the device).
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU buffer aliasing")


def _misaligned(a: np.ndarray) -> np.ndarray:
    buf = np.empty(a.nbytes + ALIGN + 4, np.uint8)
    off = (-buf.ctypes.data) % ALIGN + 4  # 4 bytes past an aligned address
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_align_host_leaves_copies_only_misaligned_leaves_and_empties_the_input():
    rng = np.random.default_rng(0)
    good = align_host_leaves({"x": rng.standard_normal((8, 16)).astype(np.float32)})["x"]
    bad = _misaligned(rng.standard_normal((3, 5)).astype(np.float32))
    assert good.ctypes.data % ALIGN == 0 and bad.ctypes.data % ALIGN == 4
    tree = {"a": good, "n": {"b": bad}, "s": 3}
    want_b = bad.copy()
    out = align_host_leaves(tree)
    assert tree == {}  # each old leaf was released as soon as its copy existed
    assert out["a"] is good  # aligned already: not copied
    assert out["n"]["b"].ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(out["n"]["b"], want_b)
    assert out["s"] == 3
    ro = good.copy()  # read-only: a view of a file mapped shared, as an F32 GGUF tensor
    ro.flags.writeable = False
    got = align_host_leaves({"ro": ro})["ro"]
    assert got is not ro and got.flags.writeable and got.ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(got, ro)


@cpu_only
def test_device_put_on_cpu_uses_an_aligned_host_buffer_in_place():
    # The jax behaviour OwnedHostParams relies on (and that a bare tree is protected from).
    a = align_host_leaves({"a": np.arange(64, dtype=np.float32).reshape(4, 16)})["a"]
    d = jax.device_put(a)
    assert d.unsafe_buffer_pointer() == a.ctypes.data
    m = _misaligned(a)
    assert jax.device_put(m).unsafe_buffer_pointer() != m.ctypes.data  # misaligned: a copy


def _engine(params):
    from jaxserve.engine import LLMEngine, make_engine_config

    cfg, _ = tiny_params()
    config = make_engine_config(cfg, max_model_len=64, block_size=4, num_kv_blocks=32,
                                max_num_seqs=2, max_num_batched_tokens=8, token_buckets=(8,),
                                seq_buckets=(2,), attention_backend="xla", strict_compiles=True,
                                enable_prompt_logprobs=False)
    return LLMEngine(config, params, progress=False)


def _greedy(engine, prompt):
    from jaxserve.sampling_params import SamplingParams

    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)


@cpu_only
def test_an_owned_tree_is_used_in_place_and_a_bare_tree_is_copied():
    fresh = lambda: jax.tree.map(np.copy, tiny_params()[1])  # noqa: E731 (it is lru_cached)
    host = fresh()
    copied = _engine(host)
    owned_tree = align_host_leaves(fresh())
    wq = owned_tree["layers"]["wq"]  # [L, E, H*D]: each layer's slice is 64-byte aligned
    owned = _engine(OwnedHostParams(owned_tree))
    prompt = [5, 9, 13, 21, 34, 7]
    want = _greedy(copied, prompt)
    assert _greedy(owned, prompt) == want
    # The owned engine's per-layer weights are the host slices themselves ...
    assert owned.runner.params["layers"][1]["wq"].unsafe_buffer_pointer() == wq[1].ctypes.data
    # ... the bare tree's are private copies, even of aligned leaves: the caller's arrays
    # can change without changing the engine
    host = align_host_leaves(host)
    copied = _engine(host)
    assert copied.runner.params["embed"].unsafe_buffer_pointer() != host["embed"].ctypes.data
    host["embed"][...] = 0.0
    host["lm_head"][...] = 0.0
    assert _greedy(copied, prompt) == want


_TP_SCRIPT = """
import jax, numpy as np
from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel, align_host_leaves
tp = TensorParallel(ModelConfig.tiny(), 2)
x = align_host_leaves({"w": np.arange(48 * 8, dtype=np.float32).reshape(48, 8)})["w"]
for private in (False, True):
    for sh in (tp.replicated, tp.sharding(jax.sharding.PartitionSpec(None, "tp"))):
        a = tp.put(x, sh, private=private)
        same = [s.data.unsafe_buffer_pointer() == x.ctypes.data for s in a.addressable_shards]
        print(private, any(same), np.array_equal(np.asarray(a), x))
"""


@cpu_only
def test_tensor_parallel_placement_copies_a_bare_tree():
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split() for ln in proc.stdout.split("\n") if ln.strip()]
    # Not private: CPU device_put takes the aligned, contiguous replicated slice in place
    # (what `private` exists to prevent); private: no shard is the caller's memory.
    assert rows[0] == ["False", "True", "True"]
    assert rows[2:] == [["True", "False", "True"]] * 2


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("RssAnon:")) / 1024


def _resident_bytes(x) -> int:
    """Bytes of x's buffer in resident pages, by mincore(2) (whole pages inside it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    ptr, n = x.unsafe_buffer_pointer(), x.nbytes
    start, end = -(-ptr // page) * page, (ptr + n) // page * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(jax.default_backend() != "cpu" or not sys.platform.startswith("linux"),
                    reason="madvise of CPU buffers (Linux)")
def test_zero_kv_pages_are_released_and_read_back_as_zero_then_fill_in_place():
    import jax.numpy as jnp

    from jaxserve.distributed.tensor_parallel import TensorParallel, release_zero_pages

    tp = TensorParallel(tiny_params()[0], 1)
    before = _rss_anon_mib()
    x = tp.zeros((256, 64, 1024), jnp.float32, None)  # 64 MiB, as one layer's K cache
    x.block_until_ready()
    assert _resident_bytes(x) == 0  # released: no page of it is resident ...
    assert float(x.max()) == float(x.min()) == 0.0  # ... and it still reads as zeros
    # (a read maps the shared zero page, which mincore counts but RSS does not)
    assert _rss_anon_mib() - before < 32
    ptr = x.unsafe_buffer_pointer()
    write = jax.jit(lambda c, i: c.at[i].set(7.0), donate_argnums=0)  # a KV write, donated
    y = write(x, 3)
    assert y.unsafe_buffer_pointer() == ptr  # updated in place, as the layer programs do
    assert float(y[3].min()) == float(y[3].max()) == 7.0
    assert _rss_anon_mib() - before < 32  # the write made only row 3's 256 KiB resident
    assert float(jnp.abs(y[:3]).max()) == 0.0 and float(jnp.abs(y[4:]).max()) == 0.0
    # The release is page-granular: only the pages wholly inside the buffer, and a small
    # (sub-page) array releases nothing.
    assert release_zero_pages(jnp.zeros((100,), jnp.float32)) == 0
    assert release_zero_pages(jnp.zeros((4096,), jnp.float32)) >= 4096 * 4 - 2 * 4096


@pytest.mark.skipif(jax.default_backend() != "cpu" or not sys.platform.startswith("linux"),
                    reason="madvise of CPU buffers (Linux)")
def test_an_engine_kv_cache_is_resident_only_where_written(monkeypatch):
    from jaxserve.distributed import tensor_parallel as parallel
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.kv_cache import kv_bytes_per_block

    cfg, _ = tiny_params()
    blocks = (96 << 20) // kv_bytes_per_block(cfg, 4)  # a ~96 MiB pool of 4-token blocks

    def engine():
        config = make_engine_config(cfg, max_model_len=64, block_size=4, num_kv_blocks=blocks,
                                    max_num_seqs=2, max_num_batched_tokens=8,
                                    token_buckets=(8,), seq_buckets=(2,), attention_backend="xla",
                                    strict_compiles=True, enable_prompt_logprobs=False)
        return LLMEngine(config, jax.tree.map(np.copy, tiny_params()[1]), progress=False)

    prompt = [5, 9, 13, 21, 34, 7]
    lazy = engine()
    caches = jax.tree.leaves(lazy.runner.kv_cache)
    total = sum(c.nbytes for c in caches)
    # The warm-up's padding steps write only the null block 0: ~1 page per buffer.
    assert sum(_resident_bytes(c) for c in caches) <= len(caches) * 2 * 4096 < total // 100
    got = _greedy(lazy, prompt)
    # 6 prompt + 5 generated tokens write 3 blocks per layer buffer: a page or two each.
    resident = sum(_resident_bytes(c) for c in jax.tree.leaves(lazy.runner.kv_cache))
    assert resident <= len(caches) * 6 * 4096, resident
    monkeypatch.setattr(parallel, "release_zero_pages", lambda x: 0)  # a touched, zeroed pool
    assert got == _greedy(engine(), prompt)
