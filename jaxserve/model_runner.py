"""Runs one scheduled step: bucket-shaped host arrays -> one jitted program.

Per step (DESIGN.md "Data flow of one engine step"): the scheduler's plan is
flattened into NumPy arrays at the bucket shape (T_pad, S_pad), moved to the
device with ONE `device_put`, run through the jitted step for that shape (the
KV cache donated so XLA updates it in place), and the sampled ids come back
with ONE device-to-host copy. Each (T_pad, S_pad) pair is compiled once at
warm-up, the analogue of vLLM's CUDA-graph capture sizes; a compile after
warm-up is counted and logged as a bug.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.model import attention
from jaxserve.model.llama import check_params, forward_paged, unstack_layers
from jaxserve.request import Request
from jaxserve.sampler import SamplingRow, make_sampling_metadata, sample
from jaxserve.scheduler.batch import build_batch
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


# ------------------------------------------------------------ compile accounting
class CompileCounter:
    """Counts XLA backend compilations process-wide through `jax.monitoring`.

    jax emits '/jax/core/compile/backend_compile_duration' once per program
    actually compiled (a persistent-cache hit emits none), so the count is the
    number of programs built and the sum is the seconds spent building them.
    """

    _EVENT = "/jax/core/compile/backend_compile_duration"
    _lock = threading.Lock()
    count = 0
    seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kw: Any) -> None:
        if event == cls._EVENT:
            with cls._lock:
                cls.count += 1
                cls.seconds += duration


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache in `cache_dir` (None: leave off).

    Thresholds are lowered to zero so that even the small CPU programs are
    cached: a restart then skips XLA compilation entirely.
    """
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ------------------------------------------------------------ KV sizing
def kv_bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
    """Bytes of K plus V for one block across all layers."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def resolve_num_kv_blocks(config: EngineConfig) -> int:
    """`num_kv_blocks` from the config, or from the KV memory budget.

    Raises:
      ValueError: the budget cannot hold even one `max_model_len` sequence.
    """
    cache = config.cache
    per_block = kv_bytes_per_block(config.model, cache.block_size)
    need = math.ceil(config.scheduler.max_model_len / cache.block_size) + 1  # + null block
    n = cache.num_kv_blocks
    if n is None:
        n = cache.kv_cache_memory_bytes // per_block
        if n < need:
            raise ValueError(
                f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds {n} blocks of "
                f"{per_block} bytes; one max_model_len={config.scheduler.max_model_len} sequence "
                f"needs {need} (raise the budget or lower max_model_len)")
    return int(n)


# ------------------------------------------------------------ the jitted step
@dataclass(frozen=True)
class SampledToken:
    """One sampled token for one request: id, its raw logprob, and top alternatives."""

    token_id: int
    logprob: float
    top_ids: np.ndarray      # i32[max_logprobs]
    top_logprobs: np.ndarray  # f32[max_logprobs]


def _step_fn(cfg: ModelConfig, backend: str, max_logprobs: int, params, kv_cache, batch):
    """Pure step: forward over the padded batch, logits at logits_indices, sample."""
    logits, kv_cache = forward_paged(cfg, params, batch["input_ids"], batch["positions"], kv_cache,
                                     batch["attn"], batch["logits_indices"], backend=backend)
    out = sample(logits, batch["sampling"], max_logprobs=max_logprobs)
    return out, kv_cache


class ModelRunner:
    """Owns the device state (params, KV cache) and the per-bucket jitted step.

    Args:
      config: the engine config (model, cache, scheduler limits).
      params: the parameter tree (see `jaxserve.model.llama`), any array type.
      num_kv_blocks: pool size N; the cache is 2 x [L, N, B, K, D] in cfg.dtype.
      bucket_policy: the (T_pad, S_pad) shapes this runner may be asked for.
    """

    def __init__(self, config: EngineConfig, params: dict[str, Any], *, num_kv_blocks: int,
                 bucket_policy: BucketPolicy):
        CompileCounter.install()
        self.config = config
        self.cfg = config.model
        self.block_size = config.cache.block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_blocks_per_seq = math.ceil(config.scheduler.max_model_len / self.block_size)
        self.bucket_policy = bucket_policy
        backend = config.attention_backend
        self.backend = attention.default_backend() if backend == "auto" else backend
        dt = jnp.dtype(self.cfg.dtype)
        check_params(self.cfg, params)  # a clear ValueError now, not a tracing error at warm-up
        if config.unroll_layers:
            params = unstack_layers(params)  # host-side views when params are NumPy
        self.params = jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, dt), params))
        self.kv_cache = self._zero_kv_cache()
        self._step = jax.jit(functools.partial(_step_fn, self.cfg, self.backend, config.max_logprobs),
                             donate_argnums=(1,))
        self.warmup_seconds = 0.0
        self.warmup_programs = 0
        self.compiles_at_warmup: int | None = None
        self.num_steps = 0
        self._warned_compiles = 0

    def _zero_kv_cache(self) -> tuple[jax.Array, jax.Array]:
        shape = (self.cfg.num_hidden_layers, self.num_kv_blocks, self.block_size,
                 self.cfg.num_key_value_heads, self.cfg.head_dim)
        dt = jnp.dtype(self.cfg.dtype)
        return jnp.zeros(shape, dt), jnp.zeros(shape, dt)

    def kv_cache_lost(self) -> bool:
        """True when a failed step consumed the donated KV cache (its buffers are deleted)."""
        return any(a.is_deleted() for a in self.kv_cache)

    def reset_kv_cache(self) -> None:
        """Fresh zeroed caches after a failure; every cached KV row is gone."""
        self.kv_cache = self._zero_kv_cache()

    # -------------------------------------------------------- host-side arrays
    def _host_batch(self, out: SchedulerOutput, requests: dict[str, Request]) -> dict[str, Any]:
        b = build_batch(out, block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq)
        md = attention.make_attention_metadata(
            slot_mapping=b.slot_mapping, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
            block_table=b.block_table, num_seqs=b.num_seqs, block_size=self.block_size,
            num_queries_per_kv=self.cfg.num_queries_per_kv)
        rows: list[SamplingRow | None] = []
        for sr in out.scheduled:
            r = requests[sr.request_id]
            rows.append(SamplingRow(params=r.sampling_params, seed=r.seed, output_pos=sr.output_pos,
                                    prompt_token_ids=r.prompt_token_ids,
                                    output_token_ids=r.output_token_ids,
                                    eos_token_ids=r.eos_token_ids))
        smd = make_sampling_metadata(rows, num_rows=out.seq_bucket,
                                     max_model_len=self.config.scheduler.max_model_len)
        return {"input_ids": b.input_ids, "positions": b.positions, "attn": md,
                "logits_indices": b.logits_indices, "sampling": smd}

    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> dict[str, SampledToken]:
        """Run one step; return the sampled token of each request with `sample=True`.

        Args:
          out: the scheduler's plan; requests: request_id -> Request for its rows.
        Raises:
          ValueError: a plan the bucket or block table cannot hold (from build_batch);
          any device error of the step (the caller checks `kv_cache_lost()`).
        """
        if not out.scheduled:
            return {}
        host = self._host_batch(out, requests)
        result, self.kv_cache = self._step(self.params, self.kv_cache, jax.device_put(host))
        ids, lps, top_ids, top_lps = jax.device_get(
            (result.token_ids, result.logprobs, result.top_ids, result.top_logprobs))
        self.num_steps += 1
        self._check_compiles()
        return {sr.request_id: SampledToken(int(ids[i]), float(lps[i]), top_ids[i], top_lps[i])
                for i, sr in enumerate(out.scheduled) if sr.sample}

    # -------------------------------------------------------- warm-up
    def warmup(self, *, progress: bool = True) -> None:
        """Compile every (T_pad, S_pad) program the bucket policy can produce.

        Each program runs once on an all-padding batch (every token writes to
        the null block, no sequence is real), which has exactly the shapes
        and pytree structure of a real step.
        """
        shapes = self.bucket_policy.all_shapes()
        c0, t0 = CompileCounter.count, time.perf_counter()
        for t_pad, s_pad in tqdm(shapes, desc="warm-up (compile buckets)", disable=not progress):
            empty = SchedulerOutput(scheduled=(), num_scheduled_tokens=0, token_bucket=t_pad,
                                    seq_bucket=s_pad, preempted_ids=(), finished_ids=(), step=-1)
            host = self._host_batch(empty, {})
            result, self.kv_cache = self._step(self.params, self.kv_cache, jax.device_put(host))
            jax.block_until_ready(result.token_ids)
        self.warmup_seconds = time.perf_counter() - t0
        self.warmup_programs = len(shapes)
        self.compiles_at_warmup = self._step._cache_size()
        logger.info("warm-up: %d programs in %.1f s (%d compiled, the rest from the compile cache)",
                    len(shapes), self.warmup_seconds, CompileCounter.count - c0)

    @property
    def num_compiles_after_warmup(self) -> int:
        """Step programs traced and compiled since warm-up ended (the tests assert 0).

        Counted from the jitted step's own cache, so other jitted code in the
        process (tests, a second engine) does not count.
        """
        if self.compiles_at_warmup is None:
            return 0
        return self._step._cache_size() - self.compiles_at_warmup

    def _check_compiles(self) -> None:
        late = self.num_compiles_after_warmup
        if late > self._warned_compiles:
            logger.warning("%d program(s) compiled after warm-up: a bucket shape or pytree "
                           "structure escaped warm-up", late)
            self._warned_compiles = late

    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size


def describe_capacity(config: EngineConfig, num_kv_blocks: int) -> str:
    """One line: KV capacity in blocks, tokens and max_model_len sequences."""
    tokens = (num_kv_blocks - 1) * config.cache.block_size
    seqs = tokens / config.scheduler.max_model_len
    mib = num_kv_blocks * kv_bytes_per_block(config.model, config.cache.block_size) / 2**20
    return (f"KV cache: {num_kv_blocks} blocks x {config.cache.block_size} tokens = {tokens} tokens "
            f"({mib:.1f} MiB), {seqs:.1f} concurrent sequences of max_model_len="
            f"{config.scheduler.max_model_len}")
