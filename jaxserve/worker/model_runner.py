"""Runs one scheduled step: bucket-shaped host arrays -> its AOT-compiled programs.

Per step (DESIGN.md "Data flow of one engine step"): the scheduler's plan is
laid out as NumPy arrays at the bucket shape (T_pad, S_pad) (`jaxserve.worker.input_batch`),
moved to the device with ONE `device_put` as a typed `StepBatch`, run through
the compiled program for that shape (the KV cache donated so XLA updates it in
place), and the sampled ids come back with ONE device-to-host copy.

Programs are ahead-of-time executables (`jit(...).lower(...).compile()`) in two
families that add rather than multiply (T + S programs, not T x S): the layer
stack per token bucket T_pad (embedding, decoder layers, final norm, and the
gather of the rows whose logits are wanted, at the largest seq bucket; with
unrolled layers an embed, a G-layer program called L / G times on per-layer
weight and KV buffers, and a final program: `jaxserve.worker.layer_stack`), and the
head per seq bucket S_pad (LM head + sampler over the first S_pad gathered rows).
The two run back to back; the gathered rows stay on the device. All are built
at warm-up: the analogue of vLLM's CUDA-graph capture sizes, with the split of
tpu-inference's separate model / compute_logits / sample jits. Holding them
explicitly makes the accounting exact:
each is counted as built by XLA or loaded from the persistent compile cache
(jax's public `jax.monitoring` event '/jax/compilation_cache/cache_hits'), and
a step whose shape has no program is a counted late compile, logged as the
bug it is (or refused with `strict_compiles`).

Start-up (issue 12): with `EngineConfig.warmup="progressive"` warm-up returns once
the smallest token bucket's programs are ready and builds the rest in a background
thread, capping the scheduler's token budget (`BucketPolicy.token_cap`) at the
largest ready bucket meanwhile; with an executable cache (`enable_executable_cache`,
`jaxserve.worker.executable_cache`) a restart deserializes each program instead of tracing,
lowering and compiling it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import math
import threading
import time
import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.worker.input_batch import build_batch
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.worker.executable_cache import ExecutableCache, program_key_parts
from jaxserve.worker.layer_stack import LayerStackProgram, embed_fn, final_fn, layers_fn
from jaxserve.attention import AttentionBackend, CommonAttentionMetadata, get_attention_backend
from jaxserve.model.llama import compute_logits, paged_attn, prepare_params, run_layers
from jaxserve.distributed.tensor_parallel import OwnedHostParams, TensorParallel
from jaxserve.scheduler.request import Request
from jaxserve.worker.runner import RowError, RowResult, RunnerStats, SampledToken
from jaxserve.worker.scoring import merge_scores, scoring_plan, split_scores
from jaxserve.sample.sampler import SamplingMetadata, SamplingRow, make_sampling_metadata, sample
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


# ------------------------------------------------------------ compile accounting
class CacheHits:
    """Persistent compile-cache hits seen by the calling thread (a `jax.monitoring` listener).

    jax records '/jax/compilation_cache/cache_hits' in the thread that asked
    for the executable, so a per-thread count read around one `.compile()`
    says exactly whether that program was loaded rather than built, even
    while another thread compiles.
    """

    _EVENT = "/jax/compilation_cache/cache_hits"
    _local = threading.local()
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                jax.monitoring.register_event_listener(cls._on_event)
                cls._installed = True

    @classmethod
    def _on_event(cls, event: str, **kw: Any) -> None:
        if event == cls._EVENT:
            cls._local.n = cls.count() + 1

    @classmethod
    def count(cls) -> int:
        return getattr(cls._local, "n", 0)


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
    from jaxserve.testing import faults  # crash-safety tests: die mid-write when JAXSERVE_FAULT says so

    faults.arm_compile_cache()


_EXECUTABLE_CACHE_DIR: str | None = None


def enable_executable_cache(cache_dir: str | None) -> None:
    """Runners built from now on keep their compiled programs in `cache_dir`
    (`jaxserve.worker.executable_cache`: a restart then skips tracing too; None or '': off)."""
    global _EXECUTABLE_CACHE_DIR
    _EXECUTABLE_CACHE_DIR = str(cache_dir) if cache_dir else None


_WARMING_RUNNERS: "weakref.WeakSet[ModelRunner]" = weakref.WeakSet()
# Progressive warm-up is ready once every token bucket up to this many tokens is built
# (`BucketPolicy.program_stages(ready_tokens=)`): with the default buckets from 1 token,
# a 1-token cap would prefill a prompt one token a step until the next stages compile.
READY_TOKENS = 8


@atexit.register
def _stop_background_warmups() -> None:
    """At exit, let an in-flight background compile finish (XLA aborts the process when
    the interpreter is torn down under a compiling thread); later programs are skipped."""
    for runner in list(_WARMING_RUNNERS):
        runner.close(timeout=None)


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


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


def describe_capacity(config: EngineConfig, num_kv_blocks: int) -> str:
    """One line: KV capacity in blocks, tokens and max_model_len sequences."""
    tokens = (num_kv_blocks - 1) * config.cache.block_size
    seqs = tokens / config.scheduler.max_model_len
    mib = num_kv_blocks * kv_bytes_per_block(config.model, config.cache.block_size) / 2**20
    return (f"KV cache: {num_kv_blocks} blocks x {config.cache.block_size} tokens = {tokens} tokens "
            f"({mib:.1f} MiB), {seqs:.1f} concurrent sequences of max_model_len="
            f"{config.scheduler.max_model_len}")


# ------------------------------------------------------------ the step
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The step's inputs at bucket shape (T = T_pad, S = S_pad); NumPy leaves on the
    host, device arrays after the one `device_put`."""

    input_ids: Any  # i32[T] token ids; padding 0
    positions: Any  # i32[T] position of each token; padding 0
    attn_md: Any  # the attention backend's metadata (`backend.prepare`), a registered dataclass
    logits_indices: Any  # i32[S] flat token index of each row's last token; padding 0
    sampling: SamplingMetadata  # per-row sampling parameters, [S] leading axis


def _stack_fn(cfg: ModelConfig, backend: AttentionBackend, params, kv_cache, batch: StepBatch):
    """Layer-stack program (one per T_pad): the decoder over the padded tokens, then the
    final-normed hidden rows at logits_indices, f32/cfg.dtype [S_max, E], the cache, and
    all final-normed hidden rows [T_pad, E] (the score program's input; they stay on the
    device). `batch.sampling` is None here. Equals `llama.forward_paged` up to the LM head."""
    hidden, kv_cache = run_layers(cfg, params, batch.input_ids, batch.positions,
                                  paged_attn(cfg, batch.attn_md, backend), kv_cache)
    return hidden[batch.logits_indices], kv_cache, hidden


def _score_fn(cfg: ModelConfig, k: int, params, hidden, targets):
    """Score program (one per T_pad, only in steps with scoring rows): LM head over every
    hidden row [T_pad, E], log_softmax, then each row's target logprob f32[T_pad] and the
    top-k ids i32[T_pad, k] / logprobs f32[T_pad, k] (k = max_logprobs; raw logprobs, as
    vLLM's prompt_logprobs). `targets` i32[T_pad] (`jaxserve.worker.scoring.ScoringPlan`)."""
    logits = compute_logits(cfg, params, hidden)  # f32[T_pad, V]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [T_pad]
    tgt = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if k == 0:
        t = logits.shape[0]
        return tgt, jnp.zeros((t, 0), jnp.int32), jnp.zeros((t, 0), jnp.float32)
    top_l, top_i = jax.lax.top_k(logits, k)
    return tgt, top_i.astype(jnp.int32), top_l - lse[:, None]


def _head_fn(cfg: ModelConfig, max_logprobs: int, logprobs_mode: str, params, rows,
             sampling: SamplingMetadata):
    """Head program (one per S_pad): LM head over the first S_pad of the gathered rows
    [S_max, E] (S_pad is the sampling metadata's leading size), then the sampler."""
    s_pad = jax.tree.leaves(sampling)[0].shape[0]
    return sample(compute_logits(cfg, params, rows[:s_pad]), sampling, max_logprobs=max_logprobs,
                  logprobs_mode=logprobs_mode)


class ModelRunner:
    """The real `Runner`: device state (params, KV cache) and the AOT programs: one
    layer stack per token bucket and one head (LM head + sampler) per seq bucket.

    Args:
      config: the engine config (model, cache, scheduler limits, backend).
      params: the canonical parameter tree (see `jaxserve.model.llama`), any array type;
        always copied, except a `jaxserve.distributed.tensor_parallel.OwnedHostParams` tree on one CPU
        device, whose aligned NumPy leaves become the device buffers.
      bucket_policy: the (T_pad, S_pad) shapes this runner may be asked for.
      strict_compiles: raise instead of compiling when a step after warm-up
        needs a program warm-up did not build (None: `config.strict_compiles`).
      vocab_parallel: with TP, split embed / lm_head over the vocabulary (True) or
        replicate them (False); None: split when TP divides the vocabulary (faster in
        notes/parallel.md's measurements).
      executable_cache_dir: where compiled programs are serialized and restored
        (None: the `enable_executable_cache` default; '': off).

    The pool size N is `config.cache.num_kv_blocks`, or what
    `kv_cache_memory_bytes` holds; the cache (`kv_cache`) is, in cfg.dtype, (L K
    buffers, L V buffers) of [N, B, K, D] each with unrolled layers (layer-group
    programs), or 2 x [L, N, B, K, D] for the scan.
    With `config.tensor_parallel_size` > 1 params and cache are sharded over a
    mesh (`jaxserve.distributed.tensor_parallel`; K becomes K' = max(K, TP) when KV heads are
    replicated) and the programs compile with those shardings.

    Raises:
      ValueError: a TP size the heads or the devices do not allow, before any compile.
    """

    def __init__(self, config: EngineConfig, params: Any, *, bucket_policy: BucketPolicy,
                 strict_compiles: bool | None = None, vocab_parallel: bool | None = None,
                 executable_cache_dir: str | None = None):
        CacheHits.install()
        self.config = config
        self.cfg = config.model
        self.tp = TensorParallel(self.cfg, config.tensor_parallel_size,  # validates first
                                 vocab_parallel=vocab_parallel)
        self.model_cfg = self.tp.model_cfg  # what the programs run (K' KV heads)
        if self.tp.mesh is not None:
            logger.info(self.tp.describe())
        self.leader = None  # multi-host: `jaxserve.distributed.multihost.Leader`, broadcasts each step
        self.block_size = config.cache.block_size
        self.num_kv_blocks = resolve_num_kv_blocks(config)
        logger.info(describe_capacity(config, self.num_kv_blocks))
        self.max_blocks_per_seq = math.ceil(config.scheduler.max_model_len / self.block_size)
        self.bucket_policy = bucket_policy
        self.strict_compiles = config.strict_compiles if strict_compiles is None else strict_compiles
        self.max_seq_bucket = bucket_policy.seq_buckets[-1]  # the stack's row dimension
        self.backend = self.tp.shard_attention(get_attention_backend(
            config.attention_backend, self.model_cfg, block_size=self.block_size,
            interpret=config.attention_interpret))
        owned = isinstance(params, OwnedHostParams)  # the caller gave the tree away
        self.params = prepare_params(
            self.cfg, params.tree if owned else params, unroll_layers=config.unroll_layers,
            place=functools.partial(self.tp.place_params, alias_host=owned))
        # Layer-group programs (`jaxserve.worker.layer_stack`) with unrolled layers; the scan keeps
        # the one-program stack over the stacked [L, ...] weights and cache.
        self.group = None
        if config.unroll_layers:
            self.group = config.layers_per_program or (
                1 if jax.default_backend() == "cpu" else self.cfg.num_hidden_layers)
        self.kv_cache = self._zero_kv_cache()
        stack_sh, head_sh, score_sh = self._jit_shardings()
        self._stack_jit = jax.jit(functools.partial(_stack_fn, self.model_cfg, self.backend),
                                  donate_argnums=(1,), **stack_sh)
        if self.group is not None:
            emb_sh, lay_sh, fin_sh = self._group_shardings()
            # functools.partial: a callable of this runner's own, as the other programs
            # (JAX's in-memory caches are per callable; the compile accounting is per runner)
            self._embed_jit = jax.jit(functools.partial(embed_fn), **emb_sh)
            self._layers_jit = jax.jit(functools.partial(layers_fn, self.model_cfg, self.backend),
                                       donate_argnums=(1, 2), **lay_sh)
            self._final_jit = jax.jit(functools.partial(final_fn, self.model_cfg), **fin_sh)
        self._head_jit = jax.jit(functools.partial(_head_fn, self.model_cfg, config.max_logprobs,
                                                   config.logprobs_mode), **head_sh)
        # Scoring (prompt logprobs) needs its program run in lock-step on every process;
        # multi-host serves without it (a clear per-row error, below).
        self.score_enabled = config.enable_prompt_logprobs and jax.process_count() == 1
        self._score_jit = jax.jit(functools.partial(_score_fn, self.model_cfg,
                                                    config.max_logprobs), **score_sh)
        # ("stack", T_pad), ("head", S_pad) and ("score", T_pad) -> jax.stages.Compiled
        self._programs: dict[tuple[str, int], Any] = {}
        self._warm = False  # warm-up started serving: a missing program is a late compile
        self._stats = RunnerStats()
        self._stats_lock = threading.Lock()  # the background warm-up thread counts too
        self._warmup_done = threading.Event()
        self._stop_warmup = threading.Event()
        self._warmup_thread: threading.Thread | None = None
        # Programs are lowered on specs, never on the live (donated, swappable) buffers.
        self._param_specs = jax.tree.map(_spec, self.params)
        self._kv_specs = jax.tree.map(_spec, self.kv_cache)
        cache_dir = _EXECUTABLE_CACHE_DIR if executable_cache_dir is None else executable_cache_dir
        self._exec_cache = ExecutableCache(cache_dir) if cache_dir else None

    def _jit_shardings(self) -> tuple[dict, dict, dict]:
        """Explicit in/out shardings of the stack and head programs under a mesh: params
        and cache as placed, the step batch and every output replicated."""
        if self.tp.mesh is None:
            return {}, {}, {}
        ps = jax.tree.map(lambda a: a.sharding, self.params)
        kv, r = (self.tp.kv_sharding,) * 2, self.tp.replicated
        return (dict(in_shardings=(ps, kv, r), out_shardings=(r, kv, r)),
                dict(in_shardings=(ps, r, r), out_shardings=r),
                dict(in_shardings=(ps, r, r), out_shardings=r))

    def _group_shardings(self) -> tuple[dict, dict, dict]:
        """Explicit shardings of the embed / layers / final programs under a mesh: weights
        and per-layer caches as placed, activations and step metadata replicated."""
        if self.tp.mesh is None:
            return {}, {}, {}
        g, r, kv = self.group, self.tp.replicated, self.tp.kv_layer_sharding
        lps = jax.tree.map(lambda a: a.sharding, self.params["layers"][:g])
        return (dict(in_shardings=(self.params["embed"].sharding, r), out_shardings=r),
                dict(in_shardings=(lps, [kv] * g, [kv] * g, r, r, r),
                     out_shardings=(r, [kv] * g, [kv] * g)),
                dict(in_shardings=(r, r, r), out_shardings=(r, r)))

    def _zero_kv_cache(self) -> tuple:
        """Zeroed K and V caches: each [L, N, B, K', D] for the scan, or (layer-group
        programs) a tuple of L per-layer [N, B, K', D] buffers."""
        L = self.cfg.num_hidden_layers
        shape = (self.num_kv_blocks, self.block_size, self.model_cfg.num_key_value_heads,
                 self.cfg.head_dim)
        dt = jnp.dtype(self.cfg.dtype)
        if self.group is not None:
            return tuple(tuple(self.tp.zeros(shape, dt, self.tp.kv_layer_sharding)
                               for _ in range(L)) for _ in range(2))
        return tuple(self.tp.zeros((L, *shape), dt, self.tp.kv_sharding) for _ in range(2))

    def reset(self) -> bool:
        """After a failed step: a fresh zeroed cache if the failure consumed the donated
        one (any of its buffers is deleted); True then, since every cached KV row is gone."""
        if not any(a.is_deleted() for a in jax.tree.leaves(self.kv_cache)):
            return False
        self.kv_cache = self._zero_kv_cache()
        return True

    def update_params(self, params: Any) -> None:
        """Swap in new weights (a `Llama`, its `nnx.State` or a canonical tree) between steps.

        They go through the one `prepare_params`, then must match the live engine
        layout leaf for leaf (shape, dtype); a leaf placed otherwise (e.g. on a
        training mesh) is resharded to the engine's sharding with `jax.device_put`,
        so every AOT program runs them unchanged: nothing is recompiled. On any
        error the old weights stay.

        Raises:
          ValueError: a missing/extra/mis-shaped/non-floating leaf (from
            `prepare_params`) or a layout mismatch, naming the leaf's path; or a
            multi-host run (num_processes > 1).
        """
        if jax.process_count() > 1:  # the followers would keep serving the old weights
            raise ValueError(f"update_params is not supported across {jax.process_count()} "
                             f"processes (multi-host)")
        if isinstance(params, OwnedHostParams):  # a swap between steps: always a copy
            params = params.tree
        new = prepare_params(self.cfg, params, unroll_layers=self.config.unroll_layers,
                             place=self.tp.place_params)
        old_leaves, old_def = jax.tree_util.tree_flatten_with_path(self.params)
        new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
        if old_def != new_def:
            raise ValueError(f"update_params: tree structure {new_def} != engine's {old_def}")
        placed = []
        for (path, o), (_, n) in zip(old_leaves, new_leaves):
            if (o.shape, o.dtype) != (n.shape, n.dtype):
                raise ValueError(f"update_params: leaf {jax.tree_util.keystr(path)} is "
                                 f"{n.shape} {n.dtype}, the engine's is {o.shape} {o.dtype}")
            placed.append(n if n.sharding == o.sharding else jax.device_put(n, o.sharding))
        self.params = jax.tree_util.tree_unflatten(old_def, placed)

    def stats(self) -> RunnerStats:
        """Programs built / loaded / late, compile and warm-up seconds, steps per shape."""
        return self._stats

    # -------------------------------------------------------- host-side arrays
    def _host_batch(self, out: SchedulerOutput, requests: Mapping[str, Request]
                    ) -> tuple[StepBatch, dict[str, RowError]]:
        """The step's host arrays, and the rows whose own host work failed.

        The token layout and attention metadata use the largest seq bucket (the
        layer stack's programs exist per T_pad only); only the sampling rows use S_pad.
        """
        b = build_batch(dataclasses.replace(out, seq_bucket=self.max_seq_bucket),
                        block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq)
        common = CommonAttentionMetadata(slot_mapping=b.slot_mapping,
                                         query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                                         block_table=b.block_table, num_seqs=b.num_seqs)
        attn_md = self.backend.prepare(common)
        sampling, errors = self._sampling_metadata(out, requests)
        return StepBatch(input_ids=b.input_ids, positions=b.positions, attn_md=attn_md,
                         logits_indices=b.logits_indices, sampling=sampling), errors

    def _sampling_metadata(self, out: SchedulerOutput, requests: Mapping[str, Request]
                           ) -> tuple[SamplingMetadata, dict[str, RowError]]:
        """Sampling arrays for the plan's rows; a row that cannot be written fails alone.

        The whole batch is built in one call; only when that raises is each
        row tried by itself, and the failing ones become padding rows.
        """
        M, V = self.config.scheduler.max_model_len, self.cfg.vocab_size
        rows: list[SamplingRow | None] = []
        for sr in out.scheduled:
            r = requests[sr.request_id]
            rows.append(SamplingRow(params=r.sampling_params, seed=r.seed, output_pos=sr.output_pos,
                                    prompt_token_ids=r.prompt_token_ids,
                                    output_token_ids=r.output_token_ids,
                                    eos_token_ids=r.eos_token_ids,
                                    grammar=r.grammar if sr.sample else None))  # fills its bitmask
        try:
            return make_sampling_metadata(rows, num_rows=out.seq_bucket, max_model_len=M,
                                          vocab_size=V), {}
        except Exception:  # find the rows at fault; the rest of the batch goes on
            pass
        errors: dict[str, RowError] = {}
        for i, sr in enumerate(out.scheduled):
            try:
                make_sampling_metadata([rows[i]], num_rows=1, max_model_len=M, vocab_size=V)
            except Exception as e:
                errors[sr.request_id] = RowError(f"{type(e).__name__}: {e}")
                rows[i] = None
        return make_sampling_metadata(rows, num_rows=out.seq_bucket, max_model_len=M,
                                      vocab_size=V), errors

    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, RowResult]:
        """Run one step (see `jaxserve.worker.runner.Runner.execute`).

        Raises:
          ValueError: a plan the bucket or block table cannot hold (from build_batch).
          RuntimeError: with `strict_compiles`, a shape warm-up did not build.
          Any device error of the step (the caller then calls `reset()`).
        """
        if not out.scheduled:
            return {}
        host, errors = self._host_batch(out, requests)
        results: dict[str, RowResult] = dict(errors)
        if len(errors) == len(out.scheduled):
            return results  # nothing left to compute
        plan = scoring_plan(out, requests)
        if plan is not None and not self.score_enabled:
            for rid, *_ in plan.spans:
                results.setdefault(rid, RowError("prompt logprobs need an engine started with "
                                                 "enable_prompt_logprobs=True in one process"))
            plan = None
        if self.leader is not None:  # multi-host: the followers run the same step
            self._program(("stack", out.token_bucket))  # a refusal here reaches no follower
            self._program(("head", out.seq_bucket))
            self.leader.send_step(out.token_bucket, out.seq_bucket, host)
        ids, lps, top_ids, top_lps, scored = self.run_host_batch(
            host, out.token_bucket, out.seq_bucket,
            targets=None if plan is None else plan.targets)
        st = self._stats
        st.num_steps += 1
        shape = (out.token_bucket, out.seq_bucket)
        st.steps_by_shape[shape] = st.steps_by_shape.get(shape, 0) + 1
        for i, sr in enumerate(out.scheduled):
            if sr.sample and not isinstance(results.get(sr.request_id), RowError):
                results[sr.request_id] = SampledToken(int(ids[i]), float(lps[i]), top_ids[i],
                                                      top_lps[i])
        if plan is not None:
            merge_scores(results, split_scores(plan, *scored))
        return results

    def run_host_batch(self, host: StepBatch, t_pad: int, s_pad: int, *,
                       targets: np.ndarray | None = None) -> tuple[Any, ...]:
        """The device half of a step: a host batch at (t_pad, s_pad) -> its programs ->
        NumPy (token_ids [S], logprobs [S], top_ids [S, k], top_logprobs [S, k], scored).
        `targets` i32[t_pad] (a `ScoringPlan`'s): also run the ("score", t_pad) program
        on the hidden rows; `scored` is then its (target logprobs [T], top ids [T, k],
        top logprobs [T, k]), else (). Multi-host followers call it with the batch the
        leader broadcast (and never with targets: scoring is one-process only)."""
        stack = self._program(("stack", t_pad))
        head = self._program(("head", s_pad))
        score = self._program(("score", t_pad)) if targets is not None else None
        dev = self.tp.put_batch(host)
        rows, self.kv_cache, hidden = stack(self.params, self.kv_cache,
                                            dataclasses.replace(dev, sampling=None))
        res = head(self.params, rows, dev.sampling)  # rows [S_max, E] never leave the device
        scored = () if score is None else score(self.params, hidden, self.tp.put_batch(targets))
        return self.tp.fetch((res.token_ids, res.logprobs, res.top_ids, res.top_logprobs, scored))

    # -------------------------------------------------------- programs
    def _padding_batch(self, t_pad: int, s_pad: int) -> StepBatch:
        """An all-padding host batch at (t_pad, s_pad): a real step's shapes and structure."""
        empty = SchedulerOutput(scheduled=(), num_scheduled_tokens=0, token_bucket=t_pad,
                                seq_bucket=s_pad, preempted_ids=(), finished_ids=(), step=-1)
        return self._host_batch(empty, {})[0]

    def _example_args(self, key: tuple[str, int]) -> tuple[Any, tuple]:
        """(jitted function, example arguments as specs / padding host arrays) of a program."""
        family, size = key
        if family == "stack":
            host = self._padding_batch(size, self.max_seq_bucket)
            return self._stack_jit, (self._param_specs, self._kv_specs,
                                     dataclasses.replace(host, sampling=None))
        if family == "head":
            host = self._padding_batch(1, size)
            return self._head_jit, (self._param_specs, self._rows_spec(), host.sampling)
        if family == "score":
            rows = self._rows_spec()
            return self._score_jit, (self._param_specs,
                                     jax.ShapeDtypeStruct((size, rows.shape[1]), rows.dtype),
                                     jax.ShapeDtypeStruct((size,), jnp.int32))
        raise ValueError(f"unknown program family {family!r} (key {key})")

    def _group_stack_args(self, t_pad: int) -> dict[str, tuple[Any, tuple]]:
        """{part: (jitted function, example arguments)} of a token bucket's layer-group
        stack (`jaxserve.worker.layer_stack`): the embed, G-layer and final programs."""
        host = self._padding_batch(t_pad, self.max_seq_bucket)
        g, p = self.group, self._param_specs
        x = jax.ShapeDtypeStruct((t_pad, self.cfg.hidden_size), p["embed"].dtype)
        return {"embed": (self._embed_jit, (p["embed"], host.input_ids)),
                "layers": (self._layers_jit, (p["layers"][:g], list(self._kv_specs[0][:g]),
                                              list(self._kv_specs[1][:g]), x, host.positions,
                                              host.attn_md)),
                "final": (self._final_jit, (p["final_norm"], x, host.logits_indices))}

    def _compile(self, family: str, size: int, fn: Any, args: tuple) -> tuple[Any, str]:
        """(program, how): restored from the executable cache (no trace), else lowered
        and compiled: "built" by XLA or "loaded" from JAX's persistent compile cache."""
        hits0 = CacheHits.count()
        parts = None
        if self._exec_cache is not None:
            parts = program_key_parts(self.config, family, size, args,
                                      backend_name=type(self.backend).__name__,
                                      extra={"num_kv_blocks": self.num_kv_blocks,
                                             "max_seq_bucket": self.max_seq_bucket})
            program = self._exec_cache.load(parts)
            if program is not None:
                return program, "restored"
        program = fn.lower(*args).compile()
        kind = "loaded" if CacheHits.count() > hits0 else "built"
        # Only a fresh XLA compile is stored: on XLA:CPU an executable that came out of
        # JAX's compile cache re-serializes without its JIT-compiled kernels and fails
        # at run time ("Function wrapped_iota not found"). It is stored once a compile
        # is real (`make clean-cache`, or a cold compile-cache dir).
        if parts is not None and kind == "built":
            self._exec_cache.store(parts, program)
        return program, kind

    def _build(self, key: tuple[str, int]) -> Any:
        """Make one program ready (`_compile`; a layer-group stack is its three parts,
        counted as one program: built if any part was built). Thread-safe: the
        background warm-up thread builds too."""
        t0 = time.perf_counter()
        if key[0] == "stack" and self.group is not None:
            parts = {name: self._compile(f"stack.{name}", key[1], fn, args)
                     for name, (fn, args) in self._group_stack_args(key[1]).items()}
            kinds = {k for _, k in parts.values()}
            kind = next(k for k in ("built", "loaded", "restored") if k in kinds)
            program = LayerStackProgram(embed=parts["embed"][0], layers=parts["layers"][0],
                                        final=parts["final"][0], group=self.group)
        else:
            program, kind = self._compile(key[0], key[1], *self._example_args(key))
        with self._stats_lock:
            st = self._stats
            dt = time.perf_counter() - t0
            st.compile_seconds += dt
            st.compile_seconds_by_family[key[0]] = st.compile_seconds_by_family.get(key[0], 0.) + dt
            if kind == "restored":
                st.programs_restored += 1
            elif kind == "loaded":
                st.programs_loaded += 1
            else:
                st.programs_built += 1
            self._programs[key] = program
            st.programs_ready = len(self._programs)
        return program

    def _rows_spec(self) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the stack's gathered rows [S_max, E]. Layer-group stacks:
        the final program traced abstractly (cheap). The one-program stack: read off a
        built stack program, else traced abstractly."""
        t_pad = self.bucket_policy.token_buckets[0]
        if self.group is not None:  # the final program alone: no layer is traced
            fn, args = self._group_stack_args(t_pad)["final"]
            s = jax.eval_shape(fn, *args)[0]
        else:
            with self._stats_lock:  # the warm-up thread may be adding programs
                built = [p for (family, _), p in self._programs.items() if family == "stack"]
            if built:
                s = built[0].out_info[0]
            else:
                host = self._padding_batch(t_pad, self.max_seq_bucket)
                s = jax.eval_shape(self._stack_jit, self._param_specs, self._kv_specs,
                                   dataclasses.replace(host, sampling=None))[0]
        # Shape and dtype only (the head's shardings are explicit): the same spec however
        # it was found, so the head's executable-cache key never depends on build order.
        return jax.ShapeDtypeStruct(s.shape, s.dtype)

    def _program(self, key: tuple[str, int]) -> Any:
        program = self._programs.get(key)
        if program is not None:
            return program
        if self._warm:
            with self._stats_lock:
                self._stats.late_compiles += 1
            if self.strict_compiles:
                raise RuntimeError(f"no {key[0]} program for bucket {key[1]}: warm-up built "
                                   f"{sorted(self._programs)} (strict_compiles)")
            logger.error("late compile: no warm-up %s program for bucket %d; a shape escaped "
                         "BucketPolicy.program_keys() or the progressive warm-up cap "
                         "(%d late so far)", key[0], key[1], self._stats.late_compiles)
        return self._build(key)

    def warmup(self, *, progress: bool = True, mode: str | None = None) -> None:
        """Build (or restore / load) every program the bucket policy can request
        (`BucketPolicy.program_keys()`: T_pad stacks + S_pad heads, and T_pad score
        programs with `enable_prompt_logprobs`).

        Each is lowered on an all-padding batch (every token writes to the null
        block, no sequence is real), which has exactly the shapes and pytree
        structure of a real step.

        mode (None: `config.warmup`):
          "full": returns once every program is ready.
          "progressive": returns once stage 0 of `BucketPolicy.program_stages()` is
            ready (the programs of every token bucket up to `READY_TOKENS` = 8 tokens and
            the seq-bucket programs a step of that many tokens can need)
            with the policy's `token_cap` at that bucket; a daemon thread builds the
            larger token buckets in order and raises the cap as each one is ready (the
            scheduler never plans a step whose program is missing; a step never waits
            for a compile). Warm-up ends when the last program is ready
            (`wait_warmup`, `stats().warmup_done`); `strict_compiles` still refuses any
            program outside the warm-up set.
        """
        mode = mode or getattr(self.config, "warmup", "full")
        if mode not in ("full", "progressive"):
            raise ValueError(f"warmup mode={mode!r} must be 'full' or 'progressive'")
        stages = self.bucket_policy.program_stages(score=self.score_enabled,
                                                   ready_tokens=READY_TOKENS)
        total = sum(len(keys) for _, keys in stages)
        st = self._stats
        st.warmup_programs = total
        counts0 = (st.programs_built, st.programs_loaded, st.programs_restored)
        t0 = time.perf_counter()
        now = stages if mode == "full" or len(stages) == 1 else stages[:1]
        bar = tqdm(total=sum(len(k) for _, k in now), desc="warm-up (compile buckets)",
                   disable=not progress)
        for cap, keys in now:
            self._build_all(keys, bar)
            self.bucket_policy.token_cap = cap
        bar.close()
        st.ready_seconds = time.perf_counter() - t0
        self._warm = True
        rest = stages[len(now):]
        if not rest:
            self._finish_warmup(t0, counts0)
            return
        logger.info("ready with %d of %d programs in %.1f s (steps capped at %d tokens); "
                    "compiling the other %d in the background", st.programs_ready, total,
                    st.ready_seconds, self.bucket_policy.token_budget,
                    total - st.programs_ready)
        self._warmup_thread = threading.Thread(target=self._background_warmup,
                                               args=(rest, t0, counts0),
                                               name="jaxserve-warmup", daemon=True)
        _WARMING_RUNNERS.add(self)
        self._warmup_thread.start()

    def _build_all(self, keys: list[tuple[str, int]], bar: Any) -> None:
        """Build the missing ones of `keys` on `config.compile_threads` threads (XLA:CPU
        compiles a program on one core; `_build` is thread-safe), ticking `bar`."""
        todo = [k for k in keys if k not in self._programs]
        bar.update(len(keys) - len(todo))
        n = min(self.config.compile_threads, len(todo))
        if n <= 1:
            for key in todo:
                self._build(key)
                bar.update(1)
            return
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="jaxserve-compile") as ex:
            futures = [ex.submit(self._build, key) for key in todo]
            try:
                for f in concurrent.futures.as_completed(futures):
                    f.result()  # the first failure raises here ...
                    bar.update(1)
            except BaseException:
                ex.shutdown(cancel_futures=True)  # ... and the queued builds are dropped
                raise

    def _background_warmup(self, stages, t0: float, counts0: tuple[int, int, int]) -> None:
        try:
            self._background_stages(stages, t0, counts0)
        finally:  # stopped (close), failed or done: wait_warmup() never hangs
            self._warmup_done.set()

    def _background_stages(self, stages, t0: float, counts0: tuple[int, int, int]) -> None:
        try:
            for cap, keys in stages:
                for key in keys:
                    if self._stop_warmup.is_set():
                        return
                    if key not in self._programs:
                        self._build(key)
                self.bucket_policy.token_cap = cap  # ints: one atomic store, read per step
            self._finish_warmup(t0, counts0)
        except Exception:  # noqa: BLE001 - serving goes on at the cap reached so far
            logger.exception("background warm-up failed; steps stay capped at %d tokens",
                             self.bucket_policy.token_budget)
            self._warmup_done.set()

    def _finish_warmup(self, t0: float, counts0: tuple[int, int, int]) -> None:
        st = self._stats
        self.bucket_policy.token_cap = None  # every bucket is ready
        st.warmup_seconds = time.perf_counter() - t0
        st.warmup_done = True
        self._warmup_done.set()
        built, loaded, restored = (st.programs_built - counts0[0], st.programs_loaded - counts0[1],
                                   st.programs_restored - counts0[2])
        logger.info("warm-up: %d programs in %.1f s (%d compiled by XLA, %d loaded from the "
                    "compile cache, %d restored from the executable cache)", st.warmup_programs,
                    st.warmup_seconds, built, loaded, restored)

    def wait_warmup(self, timeout: float | None = None) -> bool:
        """Block until warm-up's last program is ready (or it failed); True if all are."""
        self._warmup_done.wait(timeout)
        return self._stats.warmup_done

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop a background warm-up after the program it is building (joins the thread)."""
        self._stop_warmup.set()
        t = self._warmup_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
