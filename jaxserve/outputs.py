"""What the engine hands back to callers (vLLM's `RequestOutput` shape).

One `RequestOutput` per user request; it holds `n` `CompletionOutput`s (one
per sample). Streaming callers read the `delta_*` fields of each step's
output; final callers read the cumulative fields once `finished` is True.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    id -> logprob (the chosen token plus the top-`logprobs` alternatives), all
    from the model's raw distribution. `finish_reason` is "stop", "length",
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
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one user request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
