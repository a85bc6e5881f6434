"""What the engine hands back to callers (vLLM's `RequestOutput` shape).

One `RequestOutput` per user request; it holds `n` `CompletionOutput`s (one
per sample). Streaming callers read the `delta_*` fields of each step's
output; final callers read the cumulative fields once `finished` is True.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RequestMetrics:
    """Wall-clock timestamps in seconds (time.monotonic) of one request.

    TTFT = first_token_time - arrival_time; TPOT = mean gap between
    successive token_times after the first; E2EL = finished_time - arrival_time.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2el(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a request.

    `logprobs`, when requested, has one dict per output token mapping token
    id -> logprob (the chosen token plus the top-`logprobs` alternatives), from
    the model's raw distribution or, with `EngineConfig.logprobs_mode=
    "processed_logprobs"`, the sampled one. `token_logprobs` (always filled)
    holds the logprob of each sampled token, in the same mode. `finish_reason` is "stop", "length",
    "abort" or "error" once finished, else None; `stop_reason` is the stop
    token id or stop string that ended it (None for EOS and length).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    delta_logprobs: list[dict[int, float]] | None = None
    # The logprob of each sampled token (always recorded; what RL rollouts need).
    token_logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Issue 28: the weight version (LLMEngine.weight_version) each token was sampled under.
    token_weight_versions: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def snapshot(cls, index: int, text: Any, token_ids: Any, delta_text: str,
                 delta_token_ids: list[int], logprobs: Any, delta_logprobs: Any,
                 token_logprobs: Any, cumulative_logprob: float, finish_reason: str | None,
                 stop_reason: int | str | None, error: str | None,
                 token_weight_versions: Any = None) -> "CompletionOutput":
        """The constructor's result for these fields (`token_weight_versions` None: empty),
        a `ListPrefix` stored as is, built without the dataclass's per-field property
        setters: the engine makes one per row per step."""
        self = object.__new__(cls)
        self.__dict__ = {
            "index": index, "_text": text, "_token_ids": token_ids, "delta_text": delta_text,
            "delta_token_ids": delta_token_ids, "_logprobs": logprobs,
            "delta_logprobs": delta_logprobs, "_token_logprobs": token_logprobs,
            "cumulative_logprob": cumulative_logprob, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "error": error,
            "_token_weight_versions": [] if token_weight_versions is None
            else token_weight_versions}
        return self

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without copying a `ListPrefix` the engine stored there."""
        v = self._token_ids
        return v.n if isinstance(v, ListPrefix) else len(v)


class ListPrefix:
    """The first `n` entries of an append-only list (or of a str), copied only when read.

    The engine sets one as a completion's `text`, `token_ids`, `token_logprobs`, `logprobs`
    and `token_weight_versions`, so each step costs O(1) per row instead of a copy of every
    token so far (vLLM V1 hands out its live lists instead); the entries below `n` never
    change (a str never does), so the copy made on first read equals one made at that step.
    """

    __slots__ = ("base", "n")

    def __init__(self, base: list, n: int):
        self.base, self.n = base, n

    def materialize(self) -> list:
        return self.base[:self.n]


class VersionRuns(ListPrefix):
    """Entries [start, n) of a list kept run-length encoded, expanded only when read.

    `base` is a list of (first index, value) runs in increasing index order, only ever
    appended to with indices >= every `n` handed out, so a `VersionRuns` made at one step
    reads the same later. A sample's weight versions (`token_weight_versions`, issue 28)
    change only at a weight update, so the engine records a run per update, not an entry
    per token.
    """

    __slots__ = ("start",)

    def __init__(self, runs: list[tuple[int, int]], n: int, start: int = 0):
        self.base, self.n, self.start = runs, n, start  # (no super() call: one made a row a step)

    def materialize(self) -> list:
        runs, n, out = self.base, self.n, []
        for j, (first, value) in enumerate(runs):
            if first >= n:
                break
            end = runs[j + 1][0] if j + 1 < len(runs) else n
            out += [value] * (min(end, n) - first)
        return out[self.start:]


def _lazy_list(name: str, doc: str) -> property:
    """A property over `_<name>` that turns a stored `ListPrefix` into its list on the
    first read (and keeps that list); anything else is returned as stored."""
    slot = "_" + name

    def get(self: CompletionOutput) -> Any:
        v = getattr(self, slot)
        if isinstance(v, ListPrefix):
            v = v.materialize()
            setattr(self, slot, v)
        return v

    def set_(self: CompletionOutput, value: Any) -> None:
        setattr(self, slot, value)
    return property(get, set_, doc=doc)


# Installed after @dataclass: each field keeps its name, default, repr, eq and asdict (all
# read through the property, which always gives a plain list or str); a ListPrefix is
# stored as is.
_LAZY = ("text", "token_ids", "token_logprobs", "logprobs", "token_weight_versions")
for _name, _doc in (("text", "The output text so far."),
                    ("token_ids", "The output token ids so far."),
                    ("token_logprobs", "The logprob of each output token."),
                    ("logprobs", "Per output token {id: logprob}, when requested, else None."),
                    ("token_weight_versions", "The weight version each token was sampled "
                                              "under.")):
    setattr(CompletionOutput, _name, _lazy_list(_name, _doc))


@dataclass(slots=True)
class RequestOutput:
    """The state of one user request after an engine step (slotted: the engine makes
    one per request per step, `make`; so it takes no attributes beyond its fields)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs=k (vLLM): one entry per prompt token, None for
    # the first, else {prompt token id: logprob, + the top-k alternatives}; set from the
    # first output whose prefill is done. None when not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # f32[P]: the teacher-forced logprob of each prompt token (NaN where not scored: index
    # 0, and below `logprob_start` for `LLM.score`); None when not asked for.
    prompt_token_logprobs: np.ndarray | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @classmethod
    def make(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
             outputs: list[CompletionOutput], finished: bool,
             metrics: RequestMetrics) -> "RequestOutput":
        """The constructor's result (no prompt logprobs), without the dataclass's __init__:
        the engine makes one per request per step."""
        self = object.__new__(cls)
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.outputs, self.finished, self.metrics = outputs, finished, metrics
        self.prompt_logprobs = self.prompt_token_logprobs = None
        return self


@dataclass(frozen=True)
class RolloutBatch:
    """The completions of a batch as padded arrays (R = sum of n over the prompts).

    Row r is sample j of prompt i, prompt-major (r = i*n + j when all n are equal);
    completions are right-padded to L = the longest completion.

    Fields:
      token_ids: i32[R, L] completion token ids; `pad_id` after each completion.
      mask: bool[R, L] True on the completion's tokens (a prefix of each row).
      logprobs: f32[R, L] logprob of each sampled token (0.0 at padding).
      lengths: i32[R] completion lengths (mask.sum(1)); 0 is possible.
      prompt_index: i32[R] the prompt each row samples.
      finish_reasons: R strings ("stop", "length", "abort", "error").
    """

    token_ids: Any
    mask: Any
    logprobs: Any
    lengths: Any
    prompt_index: Any
    finish_reasons: tuple[str, ...]


@dataclass(frozen=True)
class ScoreBatch:
    """Teacher-forced logprobs of a batch of completions (`LLM.score`), right-padded.

    Fields:
      logprobs: f32[B, T] log p(completion[i][t] | prompt[i] + completion[i][:t]) under
        the model's raw distribution; 0.0 at padding. T = the longest completion.
      mask: bool[B, T] True on completion tokens (a prefix of each row).
      lengths: i32[B] completion lengths (0 allowed).
    """

    logprobs: Any
    mask: Any
    lengths: Any


def _ends_with_stop_token(c: CompletionOutput) -> bool:
    # "stop" by EOS (stop_reason None) or a stop token id (an int) sampled that token;
    # a stop string is matched in text, so its last token is an ordinary one.
    return c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and bool(c.token_ids)


def rollout_arrays(outputs: Sequence[RequestOutput], *, pad_id: int = 0,
                   include_stop_token: bool = True, array: str = "numpy") -> RolloutBatch:
    """Pad the final outputs of a batch into a `RolloutBatch` (for RL pipelines).

    Args:
      outputs: finished `RequestOutput`s, in prompt order.
      pad_id: the id written after each completion.
      include_stop_token: keep the EOS / stop token id that ended a "stop"
        completion (vLLM's token_ids do); False drops it, so a completion whose
        first token was EOS has length 0.
      array: "numpy" or "jax" (the arrays are built in NumPy and moved once).

    Raises:
      ValueError: an unfinished output, or array not "numpy"/"jax".
    """
    if array not in ("numpy", "jax"):
        raise ValueError(f"array={array!r} must be 'numpy' or 'jax'")
    rows, owner = [], []
    for i, o in enumerate(outputs):
        if not o.finished:
            raise ValueError(f"outputs[{i}] ({o.request_id!r}) is not finished")
        for c in o.outputs:
            k = len(c.token_ids) - (not include_stop_token and _ends_with_stop_token(c))
            rows.append((c.token_ids[:k], c.token_logprobs[:k], c.finish_reason))
            owner.append(i)
    L = max((len(t) for t, _, _ in rows), default=0)
    ids = np.full((len(rows), L), pad_id, np.int32)
    lps = np.zeros((len(rows), L), np.float32)
    lengths = np.array([len(t) for t, _, _ in rows], np.int32)
    for r, (t, lp, _) in enumerate(rows):
        ids[r, :len(t)], lps[r, :len(t)] = t, lp
    mask = np.arange(L)[None, :] < lengths[:, None]
    host = (ids, mask, lps, lengths, np.array(owner, np.int32))
    if array == "jax":
        import jax

        host = jax.device_put(host)
    return RolloutBatch(*host, finish_reasons=tuple(str(f) for _, _, f in rows))
