"""LLMEngine: add_request / step / abort over the scheduler and the model runner.

One `step()` is one iteration of continuous batching (Orca, OSDI'22; vLLM
V1's EngineCore): the scheduler plans, the runner executes one bucketed jitted
program, the scheduler applies the sampled tokens and stop rules, and the
incremental detokenizer turns tokens into text and enforces stop strings.

`n > 1` fans a request out into n child requests that share the prompt (and,
with prefix caching, its KV blocks); their outputs come back together in one
`RequestOutput`. The engine is not thread-safe: call it from one thread (the
server runs it in its own loop thread).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.model_runner import CompileCounter, ModelRunner, SampledToken, describe_capacity, resolve_num_kv_blocks
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.sampler import MAX_EOS_TOKEN_IDS
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

def make_engine_config(model: ModelConfig, **engine_args: Any) -> EngineConfig:
    """Distribute flat keyword arguments (vLLM `EngineArgs` style) over the configs.

    Each name must be a field of CacheConfig, SchedulerConfig or EngineConfig
    (`dtype` goes to the ModelConfig).

    Raises:
      ValueError: an unknown argument, or any field validation error.
    """
    if "dtype" in engine_args:
        model = model.replace(dtype=engine_args.pop("dtype"))
    groups: dict[type, dict[str, Any]] = {CacheConfig: {}, SchedulerConfig: {}, EngineConfig: {}}
    for name, value in engine_args.items():
        for cls, kw in groups.items():
            if name in {f.name for f in dataclasses.fields(cls)} and name not in ("model", "cache",
                                                                                   "scheduler"):
                kw[name] = value
                break
        else:
            raise ValueError(f"unknown engine argument {name}={value!r}")
    sched = groups[SchedulerConfig]
    sched.setdefault("max_model_len", min(2048, model.max_position_embeddings))
    return EngineConfig(model=model, cache=CacheConfig(**groups[CacheConfig]),
                        scheduler=SchedulerConfig(**sched), **groups[EngineConfig])


@dataclass
class _Child:
    """Engine-side state of one sample (child request) of a user request."""

    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] | None
    text: str = ""
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    error: str | None = None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics


class LLMEngine:
    """The engine: continuous batching over a paged KV cache with bucketed jitted steps.

    Args:
      config: the engine config; `cache.num_kv_blocks=None` sizes the pool from
        `cache.kv_cache_memory_bytes`.
      params: the model parameter tree (`jaxserve.model.llama` layout).
      tokenizer: a `jaxserve.checkpoint.tokenizer.Tokenizer`-like object, or
        None for token-id-only use (no text, no stop strings).
      warmup: compile every bucket program now (recommended; a serving
        engine must not compile after warm-up).
    """

    def __init__(self, config: EngineConfig, params: dict[str, Any], tokenizer: Any = None, *,
                 model_name: str = "jaxserve", warmup: bool = True, progress: bool = True):
        num_kv_blocks = resolve_num_kv_blocks(config)
        self.config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, num_kv_blocks=num_kv_blocks))
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.bucket_policy = BucketPolicy.from_config(config.scheduler)
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache,
                                   bucket_policy=self.bucket_policy)
        self.runner = ModelRunner(self.config, params, num_kv_blocks=num_kv_blocks,
                                  bucket_policy=self.bucket_policy)
        logger.info(describe_capacity(self.config, num_kv_blocks))
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[str, int]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step_tokens = 0
        eos = set(self.config.model.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        V = self.config.model.vocab_size
        if any(not 0 <= t < V for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids={self.eos_token_ids} must lie in [0, vocab_size={V})")
        if len(self.eos_token_ids) > MAX_EOS_TOKEN_IDS:
            raise ValueError(f"{len(self.eos_token_ids)} EOS ids {self.eos_token_ids}: the sampler "
                             f"supports at most MAX_EOS_TOKEN_IDS={MAX_EOS_TOKEN_IDS}")
        if warmup:
            self.runner.warmup(progress=progress)

    # -------------------------------------------------------------- input
    def _prompt_ids(self, prompt: str | Sequence[int] | None,
                    messages: Sequence[dict[str, Any]] | None) -> tuple[str | None, list[int]]:
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt (text or token ids) and messages")
        if messages is not None:
            self._need_tokenizer("messages")
            if len(messages) == 0:
                raise ValueError("messages is empty: a chat request needs at least one message")
            ids = list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                          tokenize=True))
            return None, ids
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise ValueError(f"prompt must be a str or a sequence of token ids, got "
                             f"{type(prompt).__name__}")
        V = self.config.model.vocab_size
        ids = []
        for t in prompt:
            try:
                if isinstance(t, bool):
                    raise TypeError
                t = operator.index(t)  # ints and NumPy integers
            except TypeError:
                raise ValueError(f"prompt token id {t!r} is not an integer") from None
            if not 0 <= t < V:
                raise ValueError(f"prompt token id {t} is outside [0, vocab_size={V})")
            ids.append(t)
        return None, ids

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this engine was built without one")

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None = None,
                    params: SamplingParams | None = None, *,
                    messages: Sequence[dict[str, Any]] | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> list[int]:
        """Queue a request; return its prompt token ids.

        Raises:
          ValueError: duplicate id, empty prompt, a token id outside the
            vocabulary, a prompt with no room for one output token under
            max_model_len, or a request the KV pool can never hold. Raised
            before anything is queued, so a rejected request leaks nothing.
        """
        if request_id in self._parents:
            raise ValueError(f"request_id={request_id!r} is already in use")
        params = params or SamplingParams()
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the engine's "
                             f"max_logprobs={self.config.max_logprobs}")
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [c for c in child_ids if c in self._child_of]
        if taken:
            raise ValueError(f"request_id={request_id!r}: id {taken[0]!r} belongs to a live request")
        text, ids = self._prompt_ids(prompt, messages)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens): give at least one token")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children: list[_Child] = []
        for i in range(params.n):
            cp = params
            if params.n > 1:
                # vLLM's convention: sample i of a seeded request uses seed + i.
                cp = params.replace(n=1, seed=None if params.seed is None else params.seed + i)
            req = Request(child_ids[i], ids, cp, eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                          priority=priority)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, cp)
            elif cp.stop:
                raise ValueError("SamplingParams.stop needs a tokenizer (stop strings match text)")
            children.append(_Child(req, i, detok, [] if cp.logprobs is not None else None))
        added: list[str] = []
        try:
            for c in children:
                self.scheduler.add_request(c.request)
                added.append(c.request.request_id)
        except Exception:
            for cid in added:
                self.scheduler.abort(cid)
            raise
        self._parents[request_id] = _Parent(request_id, text, ids, children, RequestMetrics(arrival))
        for c in children:
            self._child_of[c.request.request_id] = (request_id, c.index)
        self.prompt_tokens_total += len(ids)
        return ids

    # -------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration; return outputs of requests that progressed.

        A failure inside the device step ends that step's requests with
        finish_reason "error" (and, when the failure consumed the donated KV
        cache, every other live request too, since their KV rows are gone);
        the engine itself stays usable.
        """
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_scheduled_tokens
        now = time.monotonic()
        for sr in out.scheduled:
            p = self._parents[self._child_of[sr.request_id][0]]
            if p.metrics.first_scheduled_time is None:
                p.metrics.first_scheduled_time = now
        if not out.scheduled:
            return []
        try:
            sampled = self.runner.execute(out, self._requests_of(out))
        except Exception as e:  # one bad step fails its requests, never the engine
            return self._fail_step(out, e)
        self.scheduler.update_from_output(out, {rid: t.token_id for rid, t in sampled.items()})
        now = time.monotonic()
        changed: dict[str, None] = {}
        for rid, tok in sampled.items():
            changed[self._child_of[rid][0]] = None
            try:
                self._on_token(rid, tok, now)
            except Exception as e:  # e.g. a detokenizer error: this request alone fails
                logger.exception("output processing failed for %s", rid)
                self._child(rid).error = f"{type(e).__name__}: {e}"
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
        return self._collect(changed)

    def _fail_step(self, out, e: Exception) -> list[RequestOutput]:
        ids = [sr.request_id for sr in out.scheduled]
        if self.runner.kv_cache_lost():
            # The donated cache died with the step: no live request's KV survives.
            ids = [cid for cid in self._child_of if not self._child(cid).request.is_finished]
            self.runner.reset_kv_cache()
        logger.exception("engine step failed; failing %d requests", len(ids))
        for rid in ids:
            self._child(rid).error = f"{type(e).__name__}: {e}"
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.scheduler.kv_cache_manager.reset_prefix_cache()  # cached rows may be garbage now
        return self._collect({self._child_of[r][0]: None for r in ids})

    def _requests_of(self, out) -> dict[str, Request]:
        return {sr.request_id: self._child(sr.request_id).request for sr in out.scheduled}

    def _child(self, rid: str) -> _Child:
        pid, idx = self._child_of[rid]
        return self._parents[pid].children[idx]

    def _on_token(self, rid: str, tok: SampledToken, now: float) -> None:
        c = self._child(rid)
        p = self._parents[self._child_of[rid][0]]
        self.generation_tokens_total += 1
        if p.metrics.first_token_time is None:
            p.metrics.first_token_time = now
        if c.index == 0:
            p.metrics.token_times.append(now)
        c.delta_ids.append(tok.token_id)
        c.cumulative_logprob += tok.logprob
        if c.logprobs is not None:
            k = c.request.sampling_params.logprobs or 0
            entry = {int(t): float(lp) for t, lp in zip(tok.top_ids[:k], tok.top_logprobs[:k])}
            entry[tok.token_id] = tok.logprob
            c.logprobs.append(entry)
            c.delta_logprobs.append(entry)
        if c.detok is not None:
            upd = c.detok.update([tok.token_id], finished=c.request.is_finished)
            c.delta_text += upd.delta_text
            if upd.stop_string is not None:
                c.stop_reason = upd.stop_string
                if not c.request.is_finished:
                    self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                    c.delta_text += c.detok.update([], finished=True).delta_text
                elif c.request.status == RequestStatus.FINISHED_LENGTH:
                    # The stop string completed on the last allowed token: vLLM reports "stop".
                    c.request.status = RequestStatus.FINISHED_STOPPED
        if c.request.is_finished and c.stop_reason is None:
            c.stop_reason = c.request.stop_reason

    def _collect(self, parent_ids: dict[str, None]) -> list[RequestOutput]:
        outs = []
        for pid in parent_ids:
            p = self._parents[pid]
            comps = []
            for c in p.children:
                comps.append(CompletionOutput(
                    index=c.index, text=c.detok.output_text if c.detok else "",
                    token_ids=list(c.request.output_token_ids), delta_text=c.delta_text,
                    delta_token_ids=c.delta_ids,
                    logprobs=None if c.logprobs is None else list(c.logprobs),
                    delta_logprobs=c.delta_logprobs if c.logprobs is not None else None,
                    cumulative_logprob=c.cumulative_logprob,
                    finish_reason=c.request.finish_reason,
                    stop_reason=c.stop_reason, error=c.error))
                c.delta_text, c.delta_ids, c.delta_logprobs = "", [], []
            finished = all(c.request.is_finished for c in p.children)
            if finished:
                p.metrics.finished_time = time.monotonic()
                self._forget(pid)
            outs.append(RequestOutput(pid, p.prompt, p.prompt_token_ids, comps, finished, p.metrics))
        return outs

    def _forget(self, pid: str) -> None:
        for c in self._parents.pop(pid).children:
            self._child_of.pop(c.request.request_id, None)

    # -------------------------------------------------------------- control
    def abort(self, request_id: str) -> bool:
        """Abort a user request in any state; frees its KV blocks. False if unknown."""
        p = self._parents.get(request_id)
        if p is None:
            return False
        for c in p.children:
            self.scheduler.abort(c.request.request_id)
        self._forget(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_stats(self) -> dict[str, Any]:
        """Counters and gauges for metrics endpoints and benchmark summaries."""
        kv = self.scheduler.kv_cache_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            # {T_pad: {"steps", "real_tokens", "padded_tokens", "padding_fraction"}}
            "bucket_stats": self.bucket_policy.stats()["token_buckets"],
            "num_steps": self.runner.num_steps,
            "warmup_programs": self.runner.warmup_programs,
            "warmup_seconds": self.runner.warmup_seconds,
            "num_compiles_after_warmup": self.runner.num_compiles_after_warmup,
            "num_compiles": CompileCounter.count,  # process-wide XLA compilations
            "compile_seconds": CompileCounter.seconds,
            "last_step_tokens": self.last_step_tokens,
        }
