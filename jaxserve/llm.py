"""`LLM`: offline batched generation for research code (vLLM's `LLM` API).

    from jaxserve import LLM, SamplingParams
    llm = LLM()                                   # the default SmolLM2 model
    outs = llm.generate(["Hello", "Why is the sky blue?"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

All prompts go into one engine at once, so they share steps through
continuous batching; outputs come back in input order.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.engine.input_processor import is_array, split_padded
from jaxserve.errors import EngineSleepingError
from jaxserve.outputs import RequestOutput, RolloutBatch, ScoreBatch, rollout_arrays
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.validation import is_int

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def _is_single_prompt(p: Any) -> bool:
    if isinstance(p, str):
        return True
    if is_array(p):
        return p.ndim <= 1  # a 1-D token array; a 0-d one fails in the input processor
    if isinstance(p, Sequence) and len(p) > 0:
        # A token-id list or a chat conversation (list of message dicts) is one prompt.
        return all(is_int(x) for x in p) or all(isinstance(x, dict) for x in p)
    return False


def _prompt_list(prompts: Any, lengths: Any, mask: Any) -> list:
    """The prompts one by one: a [B, T] array is split by `lengths`/`mask`."""
    if is_array(prompts) and prompts.ndim == 2:
        return split_padded(prompts, lengths=lengths, mask=mask)
    if lengths is not None or mask is not None:
        raise ValueError("prompt_lengths / prompt_mask go with a padded int[B, T] prompt array")
    return [prompts] if _is_single_prompt(prompts) else list(prompts)


def _token_rows(x: Any, lengths: Any, name: str) -> list[list[int]]:
    """Rows of token ids (lists of ints) from a padded int[B, T] array, a list of rows,
    or one flat row."""
    if is_array(x) and x.ndim == 2:
        return [r.tolist() for r in split_padded(x, lengths=lengths)]
    if lengths is not None:
        raise ValueError(f"{name}: lengths go with a padded int[B, T] array")
    rows = [x] if (is_array(x) and x.ndim == 1) or (
        isinstance(x, Sequence) and len(x) > 0 and all(is_int(t) for t in x)) else list(x)
    out = []
    for i, r in enumerate(rows):
        a = np.asarray(r)
        if a.size and (a.ndim != 1 or not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"{name}[{i}] must be 1-D integer token ids, got shape {a.shape} "
                             f"dtype {a.dtype}")
        out.append([int(t) for t in a.reshape(-1)])
    return out


class LLM:
    """Load a model and generate from Python, no server needed.

    Args:
      model: a .gguf file or an HF directory; None for the default SmolLM2
        model fetched by `make model`.
      dtype: "float32" or "bfloat16"; None: the platform's (bf16 on a GPU / TPU, f32 on
        CPU: `jaxserve.config.platform_dtype`).
      compile_cache_dir: JAX's persistent compilation cache (None, the default: off;
        the executable cache supersedes it, and on XLA:CPU a program loaded from
        JAX's cache cannot be stored in the executable cache).
      executable_cache_dir: serialized compiled programs (None: off), so a second
        process skips tracing them too (`jaxserve.worker.executable_cache`). Warm-up is
        full by default (`warmup="progressive"` is an engine argument).
      engine: an already-built `LLMEngine` (then `model` is ignored).
      quantization: weight-only quantization, vLLM's argument: "auto" (default: the
        checkpoint's own; a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks stay blocks), "none"
        (full precision), "int8" | "q8_0" | "q4" (float matrices quantized at load;
        see `jaxserve.model.quant`).
      **engine_args: CacheConfig / SchedulerConfig / EngineConfig fields,
        e.g. block_size=16, num_kv_blocks=512, max_num_seqs=32,
        max_num_batched_tokens=256, attention_backend="xla".

    Raises:
      FileNotFoundError: the model is missing (the message names `make model`).
      ValueError: a bad engine argument or quantization (e.g. "q4" of a file with no
        4-bit tensors), before any compile.
    """

    def __init__(self, model: str | None = None, *, dtype: str | None = None,
                 quantization: str = "auto",
                 compile_cache_dir: str | None = None,
                 executable_cache_dir: str | None = "checkpoints/executable_cache",
                 engine: LLMEngine | None = None, **engine_args: Any):
        if engine is not None and (model is not None or engine_args or quantization != "auto"):
            raise ValueError(f"LLM(engine=...) takes no model or engine arguments, got "
                             f"model={model!r}, {sorted(engine_args)}")
        if engine is None:
            from jaxserve.checkpoint import load_model
            from jaxserve.checkpoint.default import resolve_model_path
            from jaxserve.worker.compile import enable_compilation_cache

            enable_compilation_cache(compile_cache_dir)
            path = resolve_model_path(model)
            cfg, params, tokenizer = load_model(path, dtype=dtype, quantization=quantization)
            config = make_engine_config(cfg, quantization=quantization, **engine_args)
            engine = LLMEngine(config, params, tokenizer, model_name=str(path),
                               executable_cache_dir=executable_cache_dir)
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def from_module(cls, module: Any, tokenizer: Any = None, *, cfg: ModelConfig | None = None,
                    model_name: str = "module", **engine_args: Any) -> "LLM":
        """An engine over in-memory weights, e.g. the policy a JAX trainer holds.

        Args:
          module: a `jaxserve.model.llama.Llama` NNX module, its `nnx.State`, or
            the canonical parameter tree (NumPy or jax leaves). The weights go
            through the one `prepare_params` transform: no disk round trip and
            one engine-layout copy (none of the module's arrays is mutated, so
            training can go on and `update_params` can send the next step's).
          tokenizer: a `jaxserve.checkpoint.tokenizer.Tokenizer`-like object, or
            None for token-id prompts only.
          cfg: the ModelConfig; taken from `module.cfg` when `module` is a Llama.
          **engine_args: as for `LLM(...)` (block_size, num_kv_blocks, ...,
            `dtype` overrides cfg.dtype).

        Raises:
          ValueError: no cfg for a state/tree, a bad engine argument, or a
            parameter tree that does not match cfg (naming the leaf's path).
        """
        cfg = cfg if cfg is not None else getattr(module, "cfg", None)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"LLM.from_module: pass cfg=ModelConfig(...) for a "
                             f"{type(module).__name__} (only a Llama module carries its cfg)")
        config = make_engine_config(cfg, **engine_args)
        return cls(engine=LLMEngine(config, module, tokenizer, model_name=model_name))

    def update_params(self, params: Any, in_flight: str = "abort") -> int:
        """Swap the weights without recompiling; the new weight version (see
        `LLMEngine.update_params`: validation, prefix cache, requests in flight,
        the pause mode `in_flight`)."""
        return self.engine.update_params(params, in_flight=in_flight)

    # LoRA (issue 27, vLLM's names; `jaxserve.engine.lora.EngineLoRA`)
    def add_lora(self, lora_request: Any) -> bool:
        """Register (load and check) a `LoRARequest`'s adapter; False if already there."""
        return self.engine.lora.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (ValueError while a live request uses it)."""
        return self.engine.lora.remove_lora(lora_int_id)

    def list_loras(self) -> list:
        """The registered adapters' `LoRARequest`s."""
        return self.engine.lora.list_loras()

    def update_lora(self, name: str, weights: Any, in_flight: str = "abort") -> int:
        """Swap only an adapter's A/B (RL sync; no recompile); its new version. `weights`:
        PEFT's flat state dict or the in-memory tree (`EngineLoRA.update_lora`)."""
        return self.engine.lora.update_lora(name, weights, in_flight=in_flight)

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause the engine between steps (`LLMEngine.pause_generation`, issue 28)."""
        self.engine.pause_generation(mode)

    def resume_generation(self) -> None:
        """Resume after `pause_generation`; ValueError when not paused."""
        self.engine.resume_generation()

    def sleep(self, level: int = 1, *, mode: str = "abort",
              discard_weights: bool = False) -> None:
        """Free device memory until `wake_up()`: level 1 the KV cache, level 2 also the
        weights (to host memory, or dropped with `discard_weights`: send new ones with
        `update_params` first). See `LLMEngine.sleep`; `generate` raises while asleep."""
        self.engine.sleep(level, mode=mode, discard_weights=discard_weights)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what `sleep` freed (`tags`: "weights", "kv_cache"; None: both)."""
        self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    @property
    def weight_version(self) -> int:
        """0 for the weights the engine was built with, +1 per `update_params`."""
        return self.engine.weight_version

    def _submit(self, prompts: Prompt | Sequence[Prompt],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                lengths: Any = None, mask: Any = None,
                priority: int | Sequence[int] = 0, lora_request: Any = None,
                final_only: bool = False) -> list[str]:
        self._check_awake()
        plist = _prompt_list(prompts, lengths, mask)
        # A scalar priority applies to every prompt; a list gives one per prompt (vLLM).
        prlist = [priority] * len(plist) if is_int(priority) else list(priority)
        if len(prlist) != len(plist):
            raise ValueError(f"got {len(prlist)} priorities for {len(plist)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            splist = [sampling_params or SamplingParams()] * len(plist)
        else:
            splist = list(sampling_params)
            if len(splist) != len(plist):
                raise ValueError(f"got {len(splist)} SamplingParams for {len(plist)} prompts")
        if final_only:  # vLLM's LLM.generate: no per-step outputs for a caller who drains
            final = {id(sp): sp.replace(output_kind=RequestOutputKind.FINAL_ONLY)
                     for sp in splist}
            splist = [final[id(sp)] for sp in splist]
        # One LoRARequest (or None: the base model) for all prompts, or one per prompt (vLLM).
        lrs = list(lora_request) if isinstance(lora_request, (list, tuple)) \
            else [lora_request] * len(plist)
        if len(lrs) != len(plist):
            raise ValueError(f"got {len(lrs)} lora_requests for {len(plist)} prompts")
        ids = []
        try:
            for i, (p, sp, pr, lr) in enumerate(zip(plist, splist, prlist, lrs)):
                rid = f"gen-{next(self._ids)}"
                try:
                    if (not isinstance(p, str) and not is_array(p) and len(p) > 0
                            and all(isinstance(m, dict) for m in p)):
                        self.engine.add_request(rid, params=sp, messages=p, priority=pr,
                                                lora_request=lr)
                    else:
                        self.engine.add_request(rid, p, sp, priority=pr, lora_request=lr)
                except ValueError as e:  # name the row of the batch
                    raise ValueError(f"prompts[{i}]: {e}") from e
                ids.append(rid)
        except Exception:
            for rid in ids:  # all-or-nothing: a bad prompt leaves no half-submitted batch
                self.engine.abort(rid)
            raise
        return ids

    def _check_awake(self) -> None:
        """EngineSleepingError while asleep: nothing would step the requests."""
        if self.engine.is_sleeping:
            raise EngineSleepingError(f"the engine is asleep (level "
                                      f"{self.engine.sleeper.state.level}); call "
                                      f"llm.wake_up() before generating or scoring")

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        *, priority: int | Sequence[int] = 0,
                        lora_request: Any = None) -> Iterator[RequestOutput]:
        """Yield each step's `RequestOutput`s (with deltas) until all prompts finish
        (`priority` and `lora_request` as for `generate`)."""
        pending = set(self._submit(prompts, sampling_params, priority=priority,
                                   lora_request=lora_request))
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:  # a consumer that stops early leaks nothing
                self.engine.abort(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_lengths: Any = None, prompt_mask: Any = None,
                 return_arrays: str | None = None, use_tqdm: bool = True,
                 priority: int | Sequence[int] = 0, lora_request: Any = None
                 ) -> list[RequestOutput] | tuple[list[RequestOutput], RolloutBatch]:
        """Generate for every prompt; return final outputs in input order.

        Every request runs with `output_kind=RequestOutputKind.FINAL_ONLY` (as in vLLM):
        no per-step `RequestOutput` is assembled (`generate_stream` gives those).

        Each prompt is a string, token ids (a list of Python/NumPy ints, or a
        1-D NumPy/jax integer array), or a chat conversation (list of
        {"role", "content"} dicts, chat template applied). A batch of token
        prompts may also be one right-padded int[B, T] array: row i is
        prompts[i, :prompt_lengths[i]], or the 1s of prompt_mask[i] (which must
        be a prefix mask, 1...1 0...0); with neither, every row is full length.

        With return_arrays="numpy" or "jax" the result is (outputs, batch):
        `batch` is `rollout_arrays(outputs, array=return_arrays)`, the padded
        completion ids, mask, per-token logprobs and finish reasons (one row
        per sample, prompt-major); call `jaxserve.outputs.rollout_arrays`
        yourself for a pad id or to drop the stop token.

        `priority` (one int for all prompts, or one per prompt; lower runs
        first) needs an engine built with scheduling_policy="priority"; under
        "fcfs" a non-zero value is a ValueError, as in vLLM.

        `lora_request` (issue 27): a `jaxserve.LoRARequest` for every prompt, or a list
        with one per prompt (None: the base model); needs an engine with max_loras > 0.
        An adapter not yet registered is loaded (`add_lora`) on first use.

        Raises:
          ValueError: a bad prompt (the message names the row `prompts[i]` and,
            for a token id, its position) or sampling parameter, a non-prefix
            mask, or a SamplingParams list whose length differs from the
            prompts'; nothing is queued then.
        """
        ids = self._submit(prompts, sampling_params, prompt_lengths, prompt_mask, priority,
                           lora_request, final_only=True)
        results = self._drain(ids, "generate", use_tqdm)
        if return_arrays is not None:
            return results, rollout_arrays(results, array=return_arrays)
        return results

    def _drain(self, ids: list[str], desc: str, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request in `ids` finished; outputs in `ids` order
        (an interrupted drain aborts the unfinished ones)."""
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc=desc, disable=not use_tqdm) as bar:
            try:
                while any(r is None for r in results):
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            bar.update(1)
            finally:
                for rid, r in zip(ids, results):
                    if r is None:
                        self.engine.abort(rid)
        return results  # type: ignore[return-value]

    def score(self, prompt_ids: Any, completion_ids: Any, *, prompt_lengths: Any = None,
              completion_lengths: Any = None, array: str = "numpy",
              use_tqdm: bool = False, lora_request: Any = None) -> ScoreBatch:
        """Teacher-forced logprobs of given completions (RL importance ratios, evaluation).

        Row i runs prompt_ids[i] + completion_ids[i] through the same paged engine as
        prefill work (batched, chunked by max_num_batched_tokens, bucketed; one greedy
        token is sampled at the end and dropped), and reports
        log_softmax(logits at position t - 1)[token t] for every completion token:
        the model's raw distribution, so at temperature 1 with no filtering these equal
        the `token_logprobs` that `generate` reported for a sampled completion, up to
        the rounding of different step shapes (with quantized weights on a CPU with
        an integer path, `native_qmatmul.int_rows`, small steps quantize activations to
        ~16 bits: differences up to ~1e-3, notes/issue26_q4.md).
        Prompt positions may come from the prefix cache; completion positions never do.

        Args:
          prompt_ids, completion_ids: B rows each: lists of token ids, 1-D NumPy/jax
            integer arrays, or one right-padded int[B, T] array (cut by
            prompt_lengths / completion_lengths, int[B]). One flat list of ints is one row.
          array: "numpy" or "jax" for the returned arrays.
          lora_request: score under this LoRA adapter (every row; None: the base model).

        Returns: `ScoreBatch` (logprobs f32[B, T], mask bool[B, T], lengths i32[B]).

        Raises:
          ValueError: different row counts, an empty prompt, a bad token id (naming the
            row and position), prompt + completion >= max_model_len, scoring off
            (enable_prompt_logprobs=False).
          RuntimeError: a row's request failed in the engine (e.g. a weight update).
        """
        if array not in ("numpy", "jax"):
            raise ValueError(f"array={array!r} must be 'numpy' or 'jax'")
        self._check_awake()
        if not self.engine.config.enable_prompt_logprobs:
            raise ValueError("score() needs an engine built with enable_prompt_logprobs=True")
        prompts = _token_rows(prompt_ids, prompt_lengths, "prompt_ids")
        comps = _token_rows(completion_ids, completion_lengths, "completion_ids")
        if len(prompts) != len(comps):
            raise ValueError(f"{len(prompts)} prompt rows but {len(comps)} completion rows")
        greedy_one = SamplingParams(max_tokens=1, temperature=0.0,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        ids, rows = [], []
        try:
            for i, (p, c) in enumerate(zip(prompts, comps)):
                if not p:
                    raise ValueError(f"prompt_ids[{i}] is empty: the first completion token "
                                     "is scored by the logits after at least one prompt token")
                if not c:
                    continue  # nothing to score: an all-padding row
                rid = f"score-{next(self._ids)}"
                try:
                    self.engine.add_request(rid, p + c, greedy_one, logprob_start=len(p),
                                            lora_request=lora_request)
                except ValueError as e:
                    raise ValueError(f"row {i} (prompt_ids[{i}] + completion_ids[{i}]): {e}") from e
                ids.append(rid)
                rows.append(i)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        outs = self._drain(ids, "score", use_tqdm)
        L = max((len(c) for c in comps), default=0)
        lps = np.zeros((len(comps), L), np.float32)
        lengths = np.array([len(c) for c in comps], np.int32)
        for i, o in zip(rows, outs):
            err = o.outputs[0].error
            if err is not None or o.prompt_token_logprobs is None:
                raise RuntimeError(f"score row {i} failed: {err}")
            lps[i, :lengths[i]] = o.prompt_token_logprobs[len(prompts[i]):]
        host = (lps, np.arange(L)[None, :] < lengths[:, None], lengths)
        if array == "jax":
            import jax

            host = jax.device_put(host)
        return ScoreBatch(*host)
