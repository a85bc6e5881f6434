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
tpu-inference's separate model / compute_logits / sample jits. Holding them explicitly
makes the accounting exact: each is counted as built by XLA or loaded from the persistent
compile cache (jax's `jax.monitoring` event '/jax/compilation_cache/cache_hits'), and a
step whose shape has no program is a counted late compile (or, `strict_compiles`, refused).

Start-up (issue 12): a "progressive" warm-up (ready at the smallest bucket, `token_cap`
capped meanwhile); an executable cache (`jaxserve.worker.executable_cache`) for restarts."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import CommonAttentionMetadata, get_attention_backend
from jaxserve.config import EngineConfig, max_blocks_per_seq
from jaxserve.distributed.tensor_parallel import OwnedHostParams, TensorParallel
from jaxserve.model.fused import resolve_fuse
from jaxserve.model.llama import prepare_params
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.worker.compile import CacheHits, ProgramKey, ProgramTable, aot_compile
from jaxserve.worker.executable_cache import ExecutableCache, program_key_parts
from jaxserve.worker.input_batch import (CachedRequestState, RequestStates, build_batch,
                                        plan_sampling_metadata)
from jaxserve.worker.kv_cache import describe_capacity, resolve_num_kv_blocks
from jaxserve.worker.layer_stack import LayerStackProgram, embed_fn, final_fn, layers_fn
from jaxserve.worker.lora import LoRAPool
from jaxserve.worker.programs import StepBatch, _head_fn, _score_fn, _spec, _stack_fn
from jaxserve.worker.placeholders import PlaceholderFeed
from jaxserve.worker.pending import ModelPending
from jaxserve.worker.runner import RowError, RowResult, RunnerStats
from jaxserve.worker.scoring import scoring_plan
from jaxserve.worker.sleep import RunnerSleep
from jaxserve.worker.warmup import Warmup

logger = logging.getLogger(__name__)


class ModelRunner:
    """The real `Runner`: device state (params, KV cache) and the AOT programs: one
    layer stack per token bucket and one head (LM head + sampler) per seq bucket.

    Args:
      config: the engine config (model, cache, scheduler limits, backend).
      params: the canonical parameter tree (`jaxserve.model.llama`), any array type; always
        copied, except an `OwnedHostParams` tree on one CPU device (its aligned leaves used).
      bucket_policy: the (T_pad, S_pad) shapes this runner may be asked for.
      strict_compiles: raise instead of compiling when a step after warm-up
        needs a program warm-up did not build (None: `config.strict_compiles`).
      vocab_parallel: with TP, split embed / lm_head over the vocabulary (True) or
        replicate them (False); None: split when TP divides the vocabulary (faster in
        notes/parallel.md's measurements).
      executable_cache_dir: where compiled programs are serialized and restored
        (None or '': off). A constructor argument, never a process global.
      step_listener: called as (T_pad, S_pad, host batch) before each device step, once
        its programs exist (multi-host: the leader's broadcast); `set_step_listener`
        attaches one later.
      tensor_parallel: the placement to use instead of `TensorParallel(config)` over
        `jax.devices()`; `jaxserve.gpu.deviceless.DevicelessTensorParallel` places
        abstract arrays on compile-only GPUs, so the runner builds its programs for a
        GPU that is not here (nothing is executed then).

    The pool size N is `config.cache.num_kv_blocks`, or what
    `kv_cache_memory_bytes` holds; the cache (`kv_cache`) is, in config.kv_dtype, (L K
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
                 executable_cache_dir: str | None = None,
                 step_listener: Callable[[int, int, StepBatch], None] | None = None,
                 tensor_parallel: TensorParallel | None = None):
        CacheHits.install()
        self.config = config
        self.cfg = config.model
        self.tp = tensor_parallel or TensorParallel(self.cfg, config.tensor_parallel_size,
                                                    vocab_parallel=vocab_parallel)  # validates
        self.model_cfg = self.tp.model_cfg  # what the programs run (K' KV heads)
        if self.tp.mesh is not None:
            logger.info(self.tp.describe())
        # Multi-host: called with (T_pad, S_pad, host batch) before each device step
        # (`jaxserve.distributed.multihost.Leader.send_step` broadcasts it to the followers).
        self.step_listener = step_listener
        self.block_size = config.cache.block_size
        self.num_kv_blocks = resolve_num_kv_blocks(config)
        logger.info(describe_capacity(config, self.num_kv_blocks))
        self.max_blocks_per_seq = max_blocks_per_seq(config.scheduler.max_model_len, self.block_size)
        self.requests = RequestStates(self.max_blocks_per_seq)  # the running requests
        self.bucket_policy = bucket_policy
        self.max_seq_bucket = bucket_policy.seq_buckets[-1]  # the stack's row dimension
        self.backend = self.tp.shard_attention(get_attention_backend(
            config.attention_backend, self.model_cfg, block_size=self.block_size,
            interpret=config.attention_interpret, device=self.tp.devices[0]))
        owned = isinstance(params, OwnedHostParams)  # the caller gave the tree away
        self.params = prepare_params(  # quantization (issue 26) checked before any compile
            self.cfg, params.tree if owned else params, unroll_layers=config.unroll_layers,
            fuse=resolve_fuse(config, self.tp.platform),
            place=functools.partial(self.tp.place_params, alias_host=owned),
            quantization=config.quantization, tensor_parallel_size=config.tensor_parallel_size)
        self.lora = LoRAPool.attach_to(self)  # issue 27: LoRA slots in the params (or None)
        # Layer-group programs (`jaxserve.worker.layer_stack`) with unrolled layers; the scan keeps
        # the one-program stack over the stacked [L, ...] weights and cache.
        self.group = None
        if config.unroll_layers:
            self.group = config.layers_per_program or (
                1 if self.tp.platform == "cpu" else self.cfg.num_hidden_layers)
        self.kv_cache = self._zero_kv_cache()
        stack_sh, head_sh, score_sh = self._jit_shardings()
        self._stack_jit = jax.jit(functools.partial(_stack_fn, self.model_cfg, self.backend),
                                  donate_argnums=(1,), **stack_sh)
        if self.group is not None:
            emb_sh, lay_sh, fin_sh = self._group_shardings()
            # functools.partial: a callable of this runner's own, as the other programs
            # (JAX's in-memory caches are per callable; the compile accounting is per runner)
            self._embed_jit = jax.jit(functools.partial(embed_fn, self.model_cfg), **emb_sh)
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
        ph = config.async_placeholders  # None: on unless the device is this CPU
        self.placeholders = self.tp.platform != "cpu" if ph is None else bool(ph)
        self.feed = PlaceholderFeed(  # what a plan made ahead reads (issue 24)
            self.tp.replicated if self.tp.mesh is not None
            else jax.sharding.SingleDeviceSharding(self.tp.devices[0]), self.max_seq_bucket)
        # ("stack", T_pad), ("head", S_pad) and ("score", T_pad) -> jax.stages.Compiled
        self._stats = RunnerStats()
        self.programs = ProgramTable(
            self._make, self._stats,
            strict=config.strict_compiles if strict_compiles is None else strict_compiles)
        self._warmup = Warmup(self.programs, bucket_policy, compile_threads=config.compile_threads,
                              score=self.score_enabled)
        # Programs are lowered on specs, never on the live (donated, swappable) buffers.
        self._param_specs = jax.tree.map(_spec, self.params)
        self._kv_specs = jax.tree.map(_spec, self.kv_cache)
        self._exec_cache = ExecutableCache(executable_cache_dir) if executable_cache_dir else None
        self.sleeper = RunnerSleep(self)  # sleep / wake_up (issue 28)

    @property
    def token_cap(self) -> int | None:
        """The largest ready token bucket during a progressive warm-up, else None."""
        return self._warmup.token_cap

    @property
    def strict_compiles(self) -> bool:
        """Refuse (True) or count and build (False) a program warm-up did not build."""
        return self.programs.strict

    @strict_compiles.setter
    def strict_compiles(self, value: bool) -> None:
        self.programs.strict = bool(value)

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
                dict(in_shardings=(lps, [kv] * g, [kv] * g, r, r, r, r, r),
                     out_shardings=(r, [kv] * g, [kv] * g)),
                dict(in_shardings=(r, r, r), out_shardings=(r, r)))

    def _zero_kv_cache(self) -> tuple:
        """Zeroed K and V caches: each [L, N, B, K', D] for the scan, or (layer-group
        programs) a tuple of L per-layer [N, B, K', D] buffers."""
        L = self.cfg.num_hidden_layers
        shape = (self.num_kv_blocks, self.block_size, self.model_cfg.num_key_value_heads,
                 self.cfg.head_dim)
        dt = jnp.dtype(self.config.kv_dtype)  # --kv_cache_dtype; "auto": cfg.dtype
        if self.group is not None:
            return tuple(tuple(self.tp.zeros(shape, dt, self.tp.kv_layer_sharding)
                               for _ in range(L)) for _ in range(2))
        return tuple(self.tp.zeros((L, *shape), dt, self.tp.kv_sharding) for _ in range(2))

    def set_step_listener(self, listener: Callable[[int, int, StepBatch], None] | None) -> None:
        """Attach (or with None detach) the step listener (see the class docstring)."""
        self.step_listener = listener

    def reset(self) -> bool:
        """After a failed step: a fresh zeroed cache if the failure consumed the donated
        one (any of its buffers is deleted); True then, since every cached KV row is gone."""
        self.feed.forget()  # a failed step's ids are nobody's input
        if self.sleeper.is_sleeping or not any(a.is_deleted()
                                               for a in jax.tree.leaves(self.kv_cache)):
            return False
        self.kv_cache = self._zero_kv_cache()
        return True

    def update_params(self, params: Any) -> None:
        """Swap in new weights (a `Llama`, its `nnx.State` or a canonical tree) between steps.

        They go through the one `prepare_params`, then must match the live engine
        layout leaf for leaf (shape, dtype); a leaf placed otherwise (e.g. on a training
        mesh) is resharded to the engine's sharding with `jax.device_put`, so every AOT
        program runs them unchanged (no recompile); float weights into quantized leaves
        are quantized. On any error the old weights stay.

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
                             place=self.lora.place if self.lora else self.tp.place_params,
                             like=self.params)
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
        self.sleeper.params_sent()

    set_lora = LoRAPool.write_to  # (slot, adapter or None): a LoRA slot written, no compile

    def sleep(self, level: int, *, discard_weights: bool = False) -> None:
        """Free the KV cache (level 1) and the weights (level 2); see
        `jaxserve.worker.sleep.RunnerSleep.sleep`. Programs are kept."""
        self.sleeper.sleep(level, discard_weights=discard_weights)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Restore what `tags` names ("weights", "kv_cache"); no recompile."""
        self.sleeper.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.sleeper.is_sleeping

    def memory(self) -> dict:
        """Device bytes held by the KV cache and the weights (`RunnerSleep.memory`)."""
        return self.sleeper.memory()

    def stats(self) -> RunnerStats:
        """Programs built / loaded / late, compile and warm-up seconds, steps per shape."""
        return self._stats

    # -------------------------------------------------------- host-side arrays
    def _host_batch(self, out: SchedulerOutput, rows: list[CachedRequestState | None]
                    ) -> tuple[StepBatch, dict[str, RowError]]:
        """The step's host arrays, and the rows whose own host work failed (`rows`: each
        plan row's state, None for a row already failed).

        The token layout and attention metadata use the largest seq bucket (the
        layer stack's programs exist per T_pad only); only the sampling rows use S_pad.
        """
        b = build_batch(dataclasses.replace(out, seq_bucket=self.max_seq_bucket),
                        block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
                        table=self.requests.block_table, slots=self.requests.table_rows(rows))
        common = CommonAttentionMetadata(slot_mapping=b.slot_mapping,
                                         query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                                         block_table=b.block_table, num_seqs=b.num_seqs)
        attn_md = self.backend.prepare(common)
        sampling, errors = plan_sampling_metadata(
            out, rows, max_model_len=self.config.scheduler.max_model_len,
            vocab_size=self.cfg.vocab_size)
        return StepBatch(input_ids=b.input_ids, positions=b.positions, attn_md=attn_md,
                         logits_indices=b.logits_indices, sampling=sampling,
                         lora_slots=self.lora and self.lora.token_slots(out, rows)), errors

    def placeholders_ok(self) -> bool:
        """Whether the engine may plan the next step before this one's tokens are back
        (`jaxserve.worker.runner.Runner.placeholders_ok`): `placeholders` on
        (`EngineConfig.async_placeholders`; by default off on CPU), no step listener (a
        multi-host follower has no step to read the tokens from), and no request held
        whose sampling reads its outputs on the host (penalties) or that scores its prompt."""
        return (self.placeholders and self.step_listener is None
                and self.requests.plan_ahead_ok())

    def execute(self, out: SchedulerOutput) -> dict[str, RowResult]:
        """Run one step (see `jaxserve.worker.runner.Runner.execute`).

        Raises:
          ValueError: a plan the bucket or block table cannot hold (from build_batch).
          RuntimeError: with `strict_compiles`, a shape warm-up did not build.
          Any device error of the step (the caller then calls `reset()`).
        """
        return self.dispatch(out).result()

    def dispatch(self, out: SchedulerOutput) -> ModelPending:
        """`execute`'s host half and its programs' launch (JAX dispatches asynchronously);
        the handle's `result()` fetches the tokens (`Runner.dispatch`). Raises as `execute`."""
        states, missing = self.requests.update(out)  # first: drops what the plan ended
        if out.scheduled and self.sleeper.is_sleeping:
            raise RuntimeError("ModelRunner.execute: the runner is asleep; wake_up() first")
        if not out.scheduled:
            return ModelPending(self, out, {}, None, None)  # nothing to compute
        host, errors = self._host_batch(out, states)
        results: dict[str, RowResult] = {rid: RowError(m) for rid, m in missing.items()}
        results.update(errors)
        ids_from = self.feed.sources(out, host.input_ids, results)
        if len(results) == len(out.scheduled):
            self.feed.forget()  # nothing launched: nothing to read
            return ModelPending(self, out, results, None, None)
        plan = scoring_plan(out, self.requests)
        if plan is not None and not self.score_enabled:
            for rid, *_ in plan.spans:
                results.setdefault(rid, RowError("prompt logprobs need an engine started with "
                                                 "enable_prompt_logprobs=True in one process"))
            plan = None
        if self.step_listener is not None:  # multi-host: the followers run the same step
            self.programs.get(("stack", out.token_bucket))  # a refusal here reaches no follower
            self.programs.get(("head", out.seq_bucket))
            self.step_listener(out.token_bucket, out.seq_bucket, host)
        launched = self.launch_host_batch(host, out.token_bucket, out.seq_bucket,
                                          targets=None if plan is None else plan.targets,
                                          ids_from=ids_from)
        self.feed.last_out = out
        return ModelPending(self, out, results, plan, launched)

    def run_host_batch(self, host: StepBatch, t_pad: int, s_pad: int, *,
                       targets: np.ndarray | None = None) -> tuple[Any, ...]:
        """The device half of a step: a host batch at (t_pad, s_pad) -> its programs ->
        NumPy (token_ids [S], logprobs [S], top_ids [S, k], top_logprobs [S, k], scored).
        `targets` i32[t_pad] (a `ScoringPlan`'s): also run the ("score", t_pad) program
        on the hidden rows; `scored` is then its (target logprobs [T], top ids [T, k],
        top logprobs [T, k]), else (). Multi-host followers call it with the batch the
        leader broadcast (and never with targets: scoring is one-process only)."""
        return self.tp.fetch(self.launch_host_batch(host, t_pad, s_pad, targets=targets))

    def launch_host_batch(self, host: StepBatch, t_pad: int, s_pad: int, *,
                          targets: np.ndarray | None = None,
                          ids_from: np.ndarray | None = None) -> tuple[Any, ...]:
        """`run_host_batch` without the fetch: the step's device arrays, still computing.
        `ids_from` i32[t_pad] (`PlaceholderFeed.sources`): placeholder inputs take the
        token ids the last launched step sampled, on the device."""
        stack = self.programs.get(("stack", t_pad))
        head = self.programs.get(("head", s_pad))
        score = self.programs.get(("score", t_pad)) if targets is not None else None
        if ids_from is None:
            dev = self.tp.put_batch(host)
        else:
            dev, src = self.tp.put_batch((host, ids_from))
            dev = dataclasses.replace(dev, input_ids=self.feed.merge(t_pad, dev.input_ids, src))
        rows, self.kv_cache, hidden = stack(self.params, self.kv_cache,
                                            dataclasses.replace(dev, sampling=None))
        # rows [S_max, E] never leave the device; nor do the padded ids a plan made ahead reads
        res, self.feed.last_ids = head(self.params, rows, dev.sampling)
        scored = () if score is None else score(self.params, hidden, self.tp.put_batch(targets))
        return (res.token_ids, res.logprobs, res.top_ids, res.top_logprobs, scored)

    # -------------------------------------------------------- programs
    def padding_batch(self, t_pad: int, s_pad: int) -> StepBatch:
        """An all-padding host batch at (t_pad, s_pad): a real step's shapes and pytree
        structure (warm-up lowers on it; multi-host sizes and decodes its broadcast by it)."""
        empty = SchedulerOutput(scheduled=(), num_scheduled_tokens=0, token_bucket=t_pad,
                                seq_bucket=s_pad, preempted_ids=(), finished_ids=(), step=-1)
        return self._host_batch(empty, [])[0]

    def _example_args(self, key: tuple[str, int]) -> tuple[Any, tuple]:
        """(jitted function, example arguments as specs / padding host arrays) of a program."""
        family, size = key
        if family == "stack":
            host = self.padding_batch(size, self.max_seq_bucket)
            return self._stack_jit, (self._param_specs, self._kv_specs,
                                     dataclasses.replace(host, sampling=None))
        if family == "head":
            host = self.padding_batch(1, size)
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
        host = self.padding_batch(t_pad, self.max_seq_bucket)
        g, p = self.group, self._param_specs
        x = jax.ShapeDtypeStruct((t_pad, self.cfg.hidden_size), p["embed"].dtype)
        return {"embed": (self._embed_jit, (p["embed"], host.input_ids)),
                "layers": (self._layers_jit, (p["layers"][:g], list(self._kv_specs[0][:g]),
                                              list(self._kv_specs[1][:g]), x, host.positions,
                                              host.attn_md,
                                              jax.ShapeDtypeStruct((g,), jnp.int32),
                                              host.lora_slots)),
                "final": (self._final_jit, (p["final_norm"], x, host.logits_indices))}

    def _compile(self, family: str, size: int, fn: Any, args: tuple) -> tuple[Any, str]:
        """(program, how) of one program (`jaxserve.worker.compile.aot_compile`), keyed in
        the executable cache by this runner's config, backend and shapes."""
        parts = None
        if self._exec_cache is not None:
            parts = program_key_parts(self.config, family, size, args,
                                      backend_name=type(self.backend).__name__,
                                      extra={"num_kv_blocks": self.num_kv_blocks,
                                             "max_seq_bucket": self.max_seq_bucket,
                                             **self.tp.key_parts})
        return aot_compile(fn, args, exec_cache=self._exec_cache, key_parts=parts)

    def _make(self, key: ProgramKey) -> tuple[Any, str]:
        """(program, how) for `key`: a layer-group stack is its three parts, counted as
        one program (built if any part was built). Thread-safe (`ProgramTable.build`)."""
        if key[0] == "stack" and self.group is not None:
            parts = {name: self._compile(f"stack.{name}", key[1], fn, args)
                     for name, (fn, args) in self._group_stack_args(key[1]).items()}
            kinds = {k for _, k in parts.values()}
            kind = next(k for k in ("built", "loaded", "restored") if k in kinds)
            return LayerStackProgram(embed=parts["embed"][0], layers=parts["layers"][0],
                                     final=parts["final"][0], group=self.group), kind
        return self._compile(key[0], key[1], *self._example_args(key))

    def _rows_spec(self) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the stack's gathered rows [S_max, E]. Layer-group stacks:
        the final program traced abstractly (cheap). The one-program stack: read off a
        built stack program, else traced abstractly."""
        t_pad = self.bucket_policy.token_buckets[0]
        if self.group is not None:  # the final program alone: no layer is traced
            fn, args = self._group_stack_args(t_pad)["final"]
            s = jax.eval_shape(fn, *args)[0]
        else:
            built = self.programs.of_family("stack")  # the warm-up thread may be adding
            if built:
                s = built[0].out_info[0]
            else:
                host = self.padding_batch(t_pad, self.max_seq_bucket)
                s = jax.eval_shape(self._stack_jit, self._param_specs, self._kv_specs,
                                   dataclasses.replace(host, sampling=None))[0]
        # Shape and dtype only (the head's shardings are explicit): the same spec however
        # it was found, so the head's executable-cache key never depends on build order.
        return jax.ShapeDtypeStruct(s.shape, s.dtype)

    def warmup_keys(self) -> list[ProgramKey]:
        """Every program warm-up builds, in its order (`Warmup.keys`)."""
        return self._warmup.keys()

    def warmup(self, *, progress: bool = True, mode: str | None = None) -> None:
        """Build every program the bucket policy can request (`jaxserve.worker.warmup.Warmup.run`;
        mode None: `config.warmup`), and the placeholder merge of each token bucket."""
        if self.placeholders_ok():  # tiny: ~ms each, outside the program table's accounting
            for t_pad in self.bucket_policy.token_buckets:
                self.feed.program(t_pad)
        self._warmup.run(progress=progress, mode=mode or getattr(self.config, "warmup", "full"))

    def wait_warmup(self, timeout: float | None = None) -> bool:
        """Block until warm-up's last program is ready (or it failed); True if all are."""
        return self._warmup.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop a background warm-up after the program it is building (joins the thread)."""
        self._warmup.close(timeout)
