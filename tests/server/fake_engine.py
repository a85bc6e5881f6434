"""A scripted stand-in for `LLMEngine` (JetStream's mock-engine habit).

Same interface as `jaxserve.engine.LLMEngine` (add_request / step / abort /
has_unfinished_requests / get_stats / tokenizer / config), with arithmetic a
test can check by hand:

* Tokenizer: byte-level, BOS-less (GPT-2-like, so C12's empty prompt really is
  0 tokens). ids 0..255 are UTF-8 bytes, 256 = <eos>, 257 = <bos> (used only by
  the chat template). vocab_size 258.
* Tokens: sample i's next token is `(last + s) % 258`, `last` being the last
  prompt/output token. s = 1 when greedy (temperature 0 or top_k 1); with a
  seed, s = 2 + (seed + i) % 5 (sample i uses seed + i, vLLM's convention);
  unseeded sampling draws s from 2..6. So prompt "a" greedy gives "bcdef...".
* Logprobs: the chosen token has logprob -0.1*s; the j-th alternative
  (last + s + j) % 258 has -(0.1*s + j), j = 1..k.
* Scheduling: FCFS (or priority), at most max_num_seqs running, chunked
  prefill within max_num_batched_tokens (no token until the last chunk), one
  token per running sample per step. EOS and stop-token ids count as
  generated tokens but add no text (vLLM).
* Text: jaxserve.detokenizer.IncrementalDetokenizer (UTF-8 safe, stop strings).
* KV pool: `num_kv_blocks - 1` usable blocks of block_size tokens; a request
  reserves ceil(prompt/B) + n * ceil(max_new/B) blocks on admission and frees
  them on finish or abort, so a leak shows in `num_free_blocks`.
* Fault injection: a prompt containing b"STEPFAIL" makes `step()` raise while
  that request is running; b"REQFAIL" makes that request finish with
  finish_reason "error".
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams

EOS, BOS, VOCAB = 256, 257, 258


class ByteTokenizer:
    """Byte-level tokenizer with the duck-typed jaxserve Tokenizer methods."""

    vocab_size = VOCAB
    eos_token_id = EOS
    bos_token_id = BOS
    all_special_ids = [EOS, BOS]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append("<eos>" if t == EOS else "<bos>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([t], skip_special_tokens=False) for t in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        ids = [BOS] + self.encode(text) if messages or add_generation_prompt else []
        return ids if tokenize else self.decode(ids, skip_special_tokens=False)


@dataclass
class _Sample:
    index: int
    step: int
    out: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_ids: list[int] = field(default_factory=list)
    delta_lps: list[dict[int, float]] = field(default_factory=list)
    delta_text: str = ""


@dataclass
class _Req:
    rid: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    priority: int
    samples: list[_Sample]
    metrics: RequestMetrics
    blocks: int
    num_computed: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def fake_config(*, max_model_len: int = 64, block_size: int = 4, num_kv_blocks: int = 257,
                max_num_seqs: int = 16, max_num_batched_tokens: int = 32,
                policy: str = "fcfs") -> EngineConfig:
    model = ModelConfig.tiny(vocab_size=VOCAB, bos_token_id=BOS, eos_token_ids=(EOS,),
                             max_position_embeddings=max(512, max_model_len))
    return EngineConfig(model=model,
                        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks),
                        scheduler=SchedulerConfig(max_model_len=max_model_len,
                                                  max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens,
                                                  policy=policy))


class FakeEngine:
    """Scripted engine; see the module docstring for the arithmetic.

    Args:
      config: an `EngineConfig` (see `fake_config`).
      step_delay: seconds each `step()` sleeps, standing in for device time.
      model_name: reported name.
    """

    def __init__(self, config: EngineConfig | None = None, *, step_delay: float = 0.001,
                 model_name: str = "fake-model"):
        t0 = time.monotonic()
        self.config = config or fake_config()
        self.model_name = model_name
        self.tokenizer = ByteTokenizer()
        self.step_delay = step_delay
        sc = self.config.scheduler
        self.buckets = [b for b in (8, 16, 32, 64, 128, 256, 512) if b < sc.max_num_batched_tokens]
        self.buckets.append(sc.max_num_batched_tokens)
        self.bucket_stats = {b: {"steps": 0, "real_tokens": 0, "padded_tokens": 0}
                             for b in self.buckets}
        self.num_total_blocks = self.config.cache.num_kv_blocks - 1  # block 0 is the null block
        self.num_free_blocks = self.num_total_blocks
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step_tokens = 0
        self.num_steps = 0
        self.aborted: list[str] = []
        self._rng = random.Random()
        self.warmup_seconds = time.monotonic() - t0

    # ------------------------------------------------------------------ API
    def add_request(self, request_id, prompt=None, params=None, *, messages=None, priority=0,
                    arrival_time=None) -> list[int]:
        params = params or SamplingParams()
        if any(r.rid == request_id for r in self.waiting + self.running):
            raise ValueError(f"request_id={request_id!r} is already in use")
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if messages is not None:
            if not messages:
                raise ValueError("messages is empty")
            ids = self.tokenizer.apply_chat_template(messages)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < VOCAB]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is not in [0, vocab_size={VOCAB})")
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        M = self.config.scheduler.max_model_len
        if len(ids) >= M:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={M} leaves no room "
                             "for an output token")
        max_new = M - len(ids) if params.max_tokens is None else min(params.max_tokens,
                                                                     M - len(ids))
        B = self.config.cache.block_size
        blocks = math.ceil(len(ids) / B) + params.n * math.ceil(max_new / B)
        if blocks > self.num_total_blocks:
            raise ValueError(f"request needs {blocks} KV blocks; the pool has "
                             f"{self.num_total_blocks}")
        samples = []
        for i in range(params.n):
            if params.is_greedy:
                s = 1
            elif params.seed is not None:
                s = 2 + (params.seed + i) % 5
            else:
                s = self._rng.randint(2, 6)
            cp = params.replace(n=1, seed=None if params.seed is None else params.seed + i)
            samples.append(_Sample(i, s, logprobs=[] if params.logprobs is not None else None,
                                   detok=IncrementalDetokenizer(self.tokenizer, ids, cp)))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.waiting.append(_Req(request_id, prompt if isinstance(prompt, str) else None, ids,
                                 params, max_new, priority, samples, RequestMetrics(arrival),
                                 blocks))
        self.prompt_tokens_total += len(ids)
        return ids

    def abort(self, request_id: str) -> bool:
        for lst in (self.waiting, self.running):
            for r in lst:
                if r.rid == request_id:
                    lst.remove(r)
                    if lst is self.running:
                        self.num_free_blocks += r.blocks
                    self.aborted.append(request_id)
                    return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self._admit()
        for r in self.running:
            if b"STEPFAIL" in bytes(t for t in r.prompt_ids if t < 256):
                raise RuntimeError(f"scripted step failure caused by {r.rid}")
        now = time.monotonic()
        budget = self.config.scheduler.max_num_batched_tokens
        outputs = []
        for r in list(self.running):
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            if r.num_computed < len(r.prompt_ids):
                chunk = min(len(r.prompt_ids) - r.num_computed, budget)
                if chunk == 0:
                    continue
                budget -= chunk
                r.num_computed += chunk
                if r.num_computed < len(r.prompt_ids):
                    continue  # mid-prefill: no token yet
            else:
                live = sum(s.finish_reason is None for s in r.samples)
                if live > budget:
                    continue
                budget -= live
            for s in r.samples:
                if s.finish_reason is None:
                    self._emit(r, s, now)
            outputs.append(self._output(r))
            if r.finished:
                r.metrics.finished_time = time.monotonic()
                self.running.remove(r)
                self.num_free_blocks += r.blocks
        used = self.config.scheduler.max_num_batched_tokens - budget
        self.last_step_tokens = used
        if used:
            b = next(b for b in self.buckets if b >= used)
            self.bucket_stats[b]["steps"] += 1
            self.bucket_stats[b]["real_tokens"] += used
            self.bucket_stats[b]["padded_tokens"] += b - used
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        return outputs

    def get_stats(self) -> dict:
        return {
            "num_running": len(self.running), "num_waiting": len(self.waiting),
            "kv_cache_usage": 1 - self.num_free_blocks / self.num_total_blocks,
            "num_free_blocks": self.num_free_blocks, "num_total_blocks": self.num_total_blocks,
            "num_preemptions": 0, "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0,
            "bucket_stats": {b: dict(v) for b, v in self.bucket_stats.items()},
            "num_compiles": len(self.buckets), "compile_seconds": 0.0,
            "warmup_seconds": self.warmup_seconds, "num_compiles_after_warmup": 0,
            "last_step_tokens": self.last_step_tokens, "num_steps": self.num_steps,
        }

    # ------------------------------------------------------------------ internals
    def _admit(self) -> None:
        if self.config.scheduler.policy == "priority":
            self.waiting.sort(key=lambda r: (r.priority, r.metrics.arrival_time))
        while (self.waiting and len(self.running) < self.config.scheduler.max_num_seqs
               and self.waiting[0].blocks <= self.num_free_blocks):
            r = self.waiting.pop(0)
            self.num_free_blocks -= r.blocks
            self.running.append(r)

    def _emit(self, r: _Req, s: _Sample, now: float) -> None:
        last = s.out[-1] if s.out else r.prompt_ids[-1]
        tok = (last + s.step) % VOCAB
        s.out.append(tok)
        s.delta_ids.append(tok)
        self.generation_tokens_total += 1
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = now
        if s.index == 0:
            r.metrics.token_times.append(now)
        if s.logprobs is not None:
            k = r.params.logprobs or 0
            lp = {(last + s.step + j) % VOCAB: -(0.1 * s.step + j) for j in range(1, k + 1)}
            lp[tok] = -0.1 * s.step
            s.logprobs.append(lp)
            s.delta_lps.append(lp)
        p = r.params
        if b"REQFAIL" in bytes(t for t in r.prompt_ids if t < 256):
            s.finish_reason, s.error = "error", "scripted request failure"
        elif len(s.out) > p.min_tokens and tok == EOS and not p.ignore_eos:
            s.finish_reason = "stop"
        elif len(s.out) > p.min_tokens and tok in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", tok
        elif len(s.out) >= r.max_new:
            s.finish_reason = "length"
        # Text and stop strings through the engine's own incremental detokenizer.
        # A stop token's text is not output (vLLM), so it is not fed in.
        fed = [] if s.stop_reason == tok and not p.include_stop_str_in_output else [tok]
        upd = s.detok.update(fed, finished=s.finish_reason is not None)
        s.delta_text += upd.delta_text
        if upd.stop_string is not None and s.finish_reason in (None, "length"):
            s.finish_reason, s.stop_reason = "stop", upd.stop_string
            s.delta_text += s.detok.update([], finished=True).delta_text

    def _output(self, r: _Req) -> RequestOutput:
        comps = []
        for s in r.samples:
            comps.append(CompletionOutput(
                index=s.index, text=s.detok.output_text, token_ids=list(s.out),
                delta_text=s.delta_text, delta_token_ids=s.delta_ids, logprobs=s.logprobs,
                delta_logprobs=s.delta_lps if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason, error=s.error))
            s.delta_text, s.delta_ids, s.delta_lps = "", [], []
        return RequestOutput(r.rid, r.prompt, r.prompt_ids, comps, r.finished, r.metrics)
