"""Tensor parallelism on `jax.sharding`: the mesh, the PartitionSpec of every param, the
sharded KV cache, and attention per shard.

The engine does not write collectives. It places every weight with a
`NamedSharding` over a `Mesh` with axes ('dp', 'tp') (dp is 1 for now, kept so
data parallelism can be added without renaming), gives the AOT programs those
shardings, and lets XLA's SPMD partitioner insert the all-reduces (GSPMD, Xu et
al. 2021). The layout is Megatron-LM's (Shoeybi et al. 2019): column-parallel
q/k/v and gate/up (split over heads / the intermediate dim), row-parallel o and
down (their partial sums are all-reduced), norms replicated. The embedding and
LM head are split over the vocabulary when TP divides it (vocab-parallel, as
vLLM's VocabParallelEmbedding / ParallelLMHead; measured faster than replicated,
notes/parallel.md), else replicated.

KV heads (vLLM's rule): with TP <= K each device holds K / TP KV heads; with
TP > K (TP a multiple of K) each device holds ONE KV head and each head is held
by TP / K devices. The second case is done by repeating every KV head TP / K
times in wk / wv (and bk / bv) when the weights are placed, so the engine runs a
model with K' = TP KV heads (`model_cfg`) whose KV head j is head j // (TP / K)
of the checkpoint: query head h still reads the KV head it reads in the
checkpoint, and each device holds 1 / K of the cache's K heads.

Attention runs per shard through `shard_map` (`ShardedAttention`), for every
backend: each device writes and reads its own KV heads with the (replicated)
block tables, so the paged cache never moves between devices. The xla
backend's page gather views the cache as [L*N, B*K*D], a reshape that merges
the sharded K axis; left to sharding propagation that would all-gather the
cache every layer, so it runs per shard as the Pallas kernels do.

The mesh is built from `jax.devices()` (the global devices), so the same code
serves one process or JAX's multi-controller runtime (`jaxserve.distributed.multihost`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.attention.common import AttentionBackend
from jaxserve.distributed.host_to_device import copy_leaves_to_device
from jaxserve.model.params import empty_aligned

DP_AXIS, TP_AXIS = "dp", "tp"

# One decoder layer's leaves (no [L] axis; the stacked layout prepends None).
# Column-parallel: the output features (heads, or the intermediate dim) are split.
# Row-parallel: the input features are split; XLA all-reduces the partial sums.
LAYER_SPECS: dict[str, P] = {
    "attn_norm": P(None),
    "wq": P(None, TP_AXIS), "wk": P(None, TP_AXIS), "wv": P(None, TP_AXIS),  # [E, H*D | K*D]
    "bq": P(TP_AXIS), "bk": P(TP_AXIS), "bv": P(TP_AXIS),  # [H*D | K*D]
    "q_norm": P(None), "k_norm": P(None),  # [D]
    "wo": P(TP_AXIS, None),  # [H*D, E]
    "mlp_norm": P(None),
    "post_attn_norm": P(None), "post_mlp_norm": P(None),  # [E] (Gemma 3)
    "w_gate": P(None, TP_AXIS), "w_up": P(None, TP_AXIS),  # [E, F]
    "w_down": P(TP_AXIS, None),  # [F, E]
}
# LoRA pool leaves (issue 27, `jaxserve.model.lora`): A [in, S, r] and B [S, r, out] split
# like the projection they attach to: B on `out` for a column-parallel one (x @ A is
# replicated), A on `in` for a row-parallel one (XLA all-reduces x @ A's partial sums).
for _t, _spec in list(LAYER_SPECS.items()):
    if _t.startswith("w"):
        _col = _spec == P(None, TP_AXIS)
        LAYER_SPECS[f"lora_a_{_t}"] = P(None, None, None) if _col else P(TP_AXIS, None, None)
        LAYER_SPECS[f"lora_b_{_t}"] = P(None, None, TP_AXIS) if _col else P(None, None, None)


def top_specs(vocab_parallel: bool) -> dict[str, P]:
    """Specs of the non-layer leaves: embed [V, E], lm_head [E, V], final_norm [E]."""
    if vocab_parallel:
        return {"embed": P(TP_AXIS, None), "lm_head": P(None, TP_AXIS), "final_norm": P(None)}
    return {"embed": P(None, None), "lm_head": P(None, None), "final_norm": P(None)}


KV_CACHE_SPEC = P(None, None, None, TP_AXIS, None)  # [L, N, B, K', D]: split over KV heads
KV_LAYER_SPEC = P(None, None, TP_AXIS, None)  # one layer's [N, B, K', D] (layer-group programs)
HEADS_SPEC = P(None, TP_AXIS, None)  # q [T, H, D], k / v [T, K', D]


def check_tensor_parallel(cfg: ModelConfig, tp: int, num_devices: int, *,
                          vocab_parallel: bool = False) -> None:
    """Validate a TP size against the model's heads and the devices (pure Python, no compile).

    Raises:
      ValueError: tp < 1; tp above the device count; tp not dividing the query heads,
        the intermediate size (or, vocab-parallel, the vocabulary); tp neither dividing
        nor a multiple of the KV heads. Each message names both numbers.
    """
    H, K, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be a positive int")
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_devices} devices jax sees "
                         f"(jax.devices())")
    if H % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={H}")
    if (K % tp) if tp <= K else (tp % K):
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={K}: TP must divide "
                         f"the KV heads, or be a multiple of them (each KV head is then held by "
                         f"TP / K devices)")
    if F % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={F}")
    if vocab_parallel and cfg.vocab_size % tp:
        raise ValueError(f"vocab-parallel tensor_parallel_size={tp} does not divide "
                         f"vocab_size={cfg.vocab_size}")


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many devices hold each KV head: TP / K when TP > K, else 1."""
    return max(1, tp // cfg.num_key_value_heads)


def sharded_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model the TP programs run: K' = K * kv_replicas KV heads (module docstring)."""
    return cfg.replace(num_key_value_heads=cfg.num_key_value_heads * kv_replicas(cfg, tp))


def param_specs(tree: dict, *, vocab_parallel: bool = False) -> dict:
    """The PartitionSpec of every leaf of an engine-layout tree (stacked or unrolled layers;
    leaves may be anything, only the keys are read)."""
    top = top_specs(vocab_parallel)
    out = {k: top[k] for k in tree if k != "layers"}
    layers = tree["layers"]
    if isinstance(layers, (list, tuple)):
        out["layers"] = [{k: LAYER_SPECS[k] for k in lp} for lp in layers]
    else:  # stacked: a leading [L] axis
        out["layers"] = {k: P(None, *LAYER_SPECS[k]) for k in layers}
    return out


def expand_kv_heads(cfg: ModelConfig, lp: dict[str, Any], r: int) -> dict[str, Any]:
    """One layer's (or the stacked layers') weights with each KV head repeated r times:
    wk / wv [.., E, K*D] -> [.., E, K*r*D], bk / bv [.., K*D] -> [.., K*r*D]; head j of the
    result is head j // r of the input (NumPy in -> NumPy out, jax in -> jax out)."""
    if r == 1:
        return lp
    K, D = cfg.num_key_value_heads, cfg.head_dim
    out = dict(lp)
    for name in ("wk", "wv", "bk", "bv"):
        if name in out:
            w = out[name]
            xp = np if isinstance(w, np.ndarray) else jax.numpy
            heads = w.reshape(*w.shape[:-1], K, D)
            out[name] = xp.repeat(heads, r, axis=-2).reshape(*w.shape[:-1], K * r * D)
    return out


def _layer(layer):
    return None if layer is None else jax.numpy.asarray(layer, jax.numpy.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedAttention:
    """An attention backend run per shard under `shard_map`: each device writes and
    attends over its own KV heads (q [T, H, D] and k / v [T, K', D] split on the head
    axis, the cache [L, N, B, K', D] or one layer's [N, B, K', D] on K', the step
    metadata replicated). The inner
    backend sees local shapes (H / TP query heads over K' / TP KV heads) and is unchanged.
    """

    inner: AttentionBackend
    mesh: Mesh | AbstractMesh  # abstract: lowering for another platform (tests)

    @property
    def name(self) -> str:
        return self.inner.name

    def prepare(self, common):
        return self.inner.prepare(common)

    def _per_shard(self, fn: Callable, cache_ndim: int, num_head_args: int, *,
                   returns_cache: bool):
        """fn(k_cache, v_cache, *head-split args, md, layer) under shard_map: caches split
        on their K' axis, the head args on axis 1, md and layer replicated; it returns the
        two caches (returns_cache) or one head-split [T, H, D]."""
        cache = P(*([None] * (cache_ndim - 2)), TP_AXIS, None)
        in_specs = (cache, cache) + (HEADS_SPEC,) * num_head_args + (P(), P())
        out = (cache, cache) if returns_cache else HEADS_SPEC
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out,
                             check_vma=False)

    def write_kv(self, k_cache, v_cache, k, v, md, *, layer):
        """See `AttentionBackend.write_kv`; per shard."""
        fn = lambda kc, vc, k, v, md, li: self.inner.write_kv(kc, vc, k, v, md, layer=li)  # noqa: E731
        return self._per_shard(fn, k_cache.ndim, 2, returns_cache=True)(
            k_cache, v_cache, k, v, md, _layer(layer))

    def attention(self, q, k_cache, v_cache, md, *, layer, sm_scale: float):
        """See `AttentionBackend.attention`; per shard, out [T, H, D] split on H."""
        fn = lambda kc, vc, q, md, li: self.inner.attention(  # noqa: E731
            q, kc, vc, md, layer=li, sm_scale=sm_scale)
        return self._per_shard(fn, k_cache.ndim, 1, returns_cache=False)(
            k_cache, v_cache, q, md, _layer(layer))


class TensorParallel:
    """The mesh and every placement decision of a runner (one object, one place).

    Args:
      cfg: the checkpoint's ModelConfig (its K KV heads).
      tp: tensor_parallel_size; 1 keeps the single-device placement (no mesh).
      vocab_parallel: split embed / lm_head over the vocabulary (True), replicate them
        (False); None: split when tp divides vocab_size (measured faster,
        notes/parallel.md), else replicate.
      devices: the devices of the mesh (default: the first tp of `jax.devices()`,
        the global devices, so one mesh spans every process of a multi-host run).

    Raises:
      ValueError: from `check_tensor_parallel`, or (multi-host) tp != the global device
        count; before anything is placed or compiled.
    """

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, vocab_parallel: bool | None = None,
                 devices: list | None = None):
        devices = list(jax.devices() if devices is None else devices)
        if vocab_parallel is None:
            vocab_parallel = tp > 1 and cfg.vocab_size % tp == 0
        check_tensor_parallel(cfg, tp, len(devices), vocab_parallel=vocab_parallel)
        self.cfg, self.tp, self.vocab_parallel = cfg, tp, vocab_parallel
        self.replicas = kv_replicas(cfg, tp)
        self.model_cfg = sharded_model_config(cfg, tp)  # K' KV heads
        multi = jax.process_count() > 1
        if multi and tp != len(devices):  # every process must hold part of the mesh
            raise ValueError(f"tensor_parallel_size={tp} must equal the {len(devices)} devices "
                             f"of the {jax.process_count()} processes (multi-host runs one "
                             f"TP group; data parallelism is not built)")
        self.devices = devices[:tp]
        self.mesh = (Mesh(np.array(devices[:tp]).reshape(1, tp), (DP_AXIS, TP_AXIS))
                     if tp > 1 or multi else None)
        self._constants: dict[int, Any] = {}  # id of a `constant_array` -> its device copy
        self._batch_target = (self.replicated if self.mesh is not None  # a step's batch goes
                              else jax.sharding.SingleDeviceSharding(jax.devices()[0]))  # where

    # Executable-cache key parts that name where the programs run beyond the process's
    # own devices (a deviceless compile's target, `jaxserve.gpu.deviceless`); none here.
    key_parts: dict = {}

    @property
    def platform(self) -> str:
        """"cpu", "gpu" or "tpu": the platform of the devices the programs run on."""
        p = self.devices[0].platform
        return "gpu" if p in ("gpu", "cuda") else p

    # ---------------------------------------------------------------- specs
    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    @property
    def kv_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, KV_CACHE_SPEC)

    @property
    def kv_layer_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, KV_LAYER_SPEC)

    # ---------------------------------------------------------------- placement
    def place_params(self, tree: dict, *, alias_host: bool = False) -> dict:
        """Engine-layout leaves (cast, unstacked or not; NumPy or jax) -> device arrays.

        KV heads are repeated for TP > K first. Each NumPy leaf is placed shard by
        shard (`jax.make_array_from_callback`): a device receives only its slice, never
        a full replica of a sharded tensor. Without a mesh: `jax.device_put`. On CPU it
        uses a 64-byte-aligned NumPy buffer in place rather than copying it, so with
        `alias_host` (an `OwnedHostParams` tree, the engine's alone) the aligned leaves
        become the device buffers; otherwise each NumPy leaf is first copied into a
        private buffer, so the engine never shares memory with its caller's arrays.
        """
        if self.replicas > 1:
            layers = tree["layers"]
            expand = lambda lp: expand_kv_heads(self.cfg, lp, self.replicas)  # noqa: E731
            tree = dict(tree, layers=[expand(lp) for lp in layers]
                        if isinstance(layers, (list, tuple)) else expand(layers))
        if self.mesh is None:
            if alias_host or jax.default_backend() != "cpu":  # off CPU device_put copies
                return jax.device_put(tree)
            return jax.tree.map(lambda x: jax.device_put(private_host_copy(x)), tree)
        placed = jax.tree.map(lambda x, spec: self.put(x, self.sharding(spec),
                                                       private=not alias_host), tree,
                              param_specs(tree, vocab_parallel=self.vocab_parallel))
        check_no_full_replicas(placed)
        return placed

    @staticmethod
    def put(x: Any, sharding: NamedSharding, *, private: bool = False) -> jax.Array:
        """One leaf on `sharding`: NumPy shard by shard, a jax array resharded by jax.
        private: each CPU shard is first copied (`private_host_copy`), so no device
        buffer is the caller's memory (CPU device_put uses an aligned slice in place)."""
        if isinstance(x, jax.Array):
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        copy = private and sharding.mesh.devices.flat[0].platform == "cpu"
        return jax.make_array_from_callback(
            x.shape, sharding,
            lambda idx: private_host_copy(x[idx]) if copy else np.ascontiguousarray(x[idx]))

    def zeros(self, shape: tuple[int, ...], dtype, sharding: NamedSharding | None) -> jax.Array:
        """A zero array, each device filled with only its shard. On CPU its memory pages
        are handed back to the OS (`release_zero_pages`): the KV cache's resident memory
        then grows only as blocks are written."""
        if sharding is None:
            out = jax.numpy.zeros(shape, dtype)
        else:
            local = sharding.shard_shape(shape)
            out = jax.make_array_from_callback(shape, sharding, lambda idx: np.zeros(local, dtype))
        release_zero_pages(out)
        return out

    def put_batch(self, host: Any) -> Any:
        """A step's host arrays on every device of the mesh (replicated; without a mesh on the
        default device, as `place_params` puts the weights) in one call (`host_to_device`).

        A shared constant leaf (`jaxserve.sample.metadata.constant_array`: the token
        history when no row is penalised, the bitmask when no row has a grammar) is put
        once and its device copy reused, so a step sends only what it computed (issue 24)."""
        from jaxserve.sample.metadata import is_constant_array

        leaves, treedef = jax.tree.flatten(host)
        if any(map(is_constant_array, leaves)):
            host = jax.tree.unflatten(treedef, [self._constant(x) if is_constant_array(x)
                                                else x for x in leaves])
        return self._put_batch(host)

    def _constant(self, x: np.ndarray) -> Any:
        dev = self._constants.get(id(x))  # constant arrays live forever: their ids are unique
        if dev is None:
            dev = self._constants[id(x)] = self._put_batch(x)
        return dev

    def _put_batch(self, host: Any) -> Any:
        if jax.process_count() > 1:  # every process holds the leader's broadcast batch
            return jax.tree.map(lambda x: self.put(x, self.replicated), host)
        out = copy_leaves_to_device(host, self._batch_target)  # `place_params` puts weights
        return jax.device_put(host, self.replicated) if out is None else out

    def fetch(self, tree: Any) -> Any:
        """Replicated device outputs -> NumPy, read from this process's first shard."""
        if self.mesh is None:
            return jax.device_get(tree)
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)

    def shard_attention(self, backend: AttentionBackend) -> AttentionBackend:
        """The backend run per shard under the mesh (`ShardedAttention`), or unchanged."""
        return backend if self.mesh is None else ShardedAttention(backend, self.mesh)

    def describe(self) -> str:
        if self.mesh is None:
            return "tensor_parallel_size=1 (one device)"
        K = self.cfg.num_key_value_heads
        return (f"tensor_parallel_size={self.tp} over {self.mesh.devices.size} devices "
                f"({jax.process_count()} process(es)); {self.cfg.num_attention_heads // self.tp} "
                f"query heads and {self.model_cfg.num_key_value_heads // self.tp} KV head(s) per "
                f"device" + (f", each of the {K} KV heads on {self.replicas} devices"
                             if self.replicas > 1 else "")
                + ("; vocab-parallel embed/lm_head" if self.vocab_parallel else ""))


@dataclasses.dataclass(frozen=True)
class OwnedHostParams:
    """A host (NumPy) parameter tree handed over to the engine for good.

    On one CPU device the runner then uses its 64-byte-aligned leaves as the device
    buffers (`jax.device_put` on CPU does not copy those) instead of copying them: no
    transient second copy of the weights (~513 MiB on SmolLM2 fp32) and no copy
    time. The params cache's memory-mapped `.npy` leaves are aligned already. The caller must neither keep nor mutate the tree afterwards; research code
    that passes its own arrays passes them bare and gets a copy, as before.
    `jaxserve.cli.build_engine` wraps the tree `load_model` returned (after
    `align_host_leaves`).
    """

    tree: Any


ALIGN = 64  # bytes: XLA:CPU's minimum alignment for a buffer it does not own


_MADV_DONTNEED = 4  # Linux <sys/mman.h>
_madvise: Any = None


def release_zero_pages(x: jax.Array) -> int:
    """Hand the whole memory pages of an all-zero CPU array back to the OS; the bytes released.

    `madvise(MADV_DONTNEED)` on a private anonymous mapping (where XLA:CPU's allocator
    puts its buffers) drops the pages, and the next read of one maps a zero page: the
    array's values stay zero and it stops counting in the process's RSS until a page is
    written. The paged KV cache is ~520 MiB allocated up front; this makes its resident
    size follow the KV blocks in use, as llama.cpp's lazily touched buffers do (the
    side-by-side's peak-RSS row, notes/perf.md). Only the pages wholly inside each
    shard's buffer are released; a no-op (0) off Linux or for non-CPU shards.

    Precondition (not checked): x is all zero and this process alone holds its buffers
    (`TensorParallel.zeros` has just made it). On any other array the released pages
    would read back as zeros. With transparent huge pages set to "always" (this VM:
    "madvise"), a write may fault in a 2 MiB page and khugepaged may collapse released
    ranges, so the saving depends on that setting.
    """
    global _madvise
    if not sys.platform.startswith("linux"):
        return 0
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _madvise = libc.madvise
        except (OSError, AttributeError):
            _madvise = False
    if not _madvise:
        return 0
    page = mmap.PAGESIZE
    released = 0
    for shard in x.addressable_shards:
        buf = shard.data
        if buf.devices().pop().platform != "cpu":
            continue
        buf.block_until_ready()
        try:
            ptr, n = buf.unsafe_buffer_pointer(), buf.nbytes
        except (RuntimeError, ValueError, AttributeError):  # no raw pointer: leave it resident
            continue
        start, end = -(-ptr // page) * page, (ptr + n) // page * page
        if end > start and _madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += end - start
    return released


def align_host_leaves(tree: Any, align: int = ALIGN) -> Any:
    """The same nested-dict tree with every NumPy leaf at an `align`-byte address, so
    that `jax.device_put` on CPU can use it (and each [L, ...] leaf's per-layer
    slices, when their size is a multiple of `align`) in place. Only misaligned leaves are
    copied, one at a time: the tree's dicts are emptied as it goes, so the old leaf is
    freed before the next copy (peak: one leaf). Non-NumPy leaves are kept as they are.
    """
    if not isinstance(tree, dict):
        return _aligned(tree, align)
    out = {}
    for k in list(tree):
        out[k] = align_host_leaves(tree.pop(k), align)
    return out


def _aligned(x: Any, align: int) -> Any:
    # A read-only leaf is a view of a file mapped shared (e.g. an F32 tensor of the GGUF
    # itself): copied, so that rewriting that file can never change a served weight.
    if not isinstance(x, np.ndarray) or (x.ctypes.data % align == 0 and x.flags.c_contiguous
                                         and x.flags.writeable):
        return x
    return private_host_copy(x, align)


def private_host_copy(x: Any, align: int = ALIGN) -> Any:
    """A NumPy leaf copied into a fresh `align`-byte-aligned buffer (CPU `device_put`
    then takes that private copy as it is, without a second copy); other leaves as
    they are."""
    if not isinstance(x, np.ndarray):
        return x
    y = empty_aligned(x.shape, x.dtype, align)
    y[...] = x
    return y


def check_no_full_replicas(tree: Any) -> None:
    """Assert from `addressable_shards` that every leaf sharded over a mesh axis of size
    > 1 holds only its slice on each device (shard shape == `sharding.shard_shape`).

    Raises:
      RuntimeError: naming the leaf, its global shape and the offending shard.
    """
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        want = a.sharding.shard_shape(a.shape)
        for s in a.addressable_shards:
            if s.data.shape != want:
                raise RuntimeError(f"{jax.tree_util.keystr(path)} {a.shape}: device {s.device} "
                                   f"holds {s.data.shape}, expected its shard {want}")


def shard_report(tree: Any) -> dict[str, Any]:
    """Per-device bytes and per-leaf shard shapes of a tree of device arrays (tests,
    notes): {"bytes_per_device": {device id: bytes}, "shards": {path: [shape per shard]}}."""
    per_dev: dict[int, int] = {}
    shards: dict[str, list] = {}
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards[jax.tree_util.keystr(path)] = [tuple(s.data.shape) for s in a.addressable_shards]
        for s in a.addressable_shards:
            per_dev[s.device.id] = per_dev.get(s.device.id, 0) + s.data.nbytes
    return {"bytes_per_device": per_dev, "shards": shards}
