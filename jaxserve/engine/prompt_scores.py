"""Prompt logprobs of one user request, kept by the output processor until complete."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.worker.runner import PromptLogprobs


@dataclass
class PromptScores:
    """Prompt logprobs of one user request, stored by prompt index (chunks and re-prefills
    after a preemption write their own indices; a rewrite is the same value).

    `SamplingParams.prompt_logprobs` (vLLM's) and `LLM.score`'s teacher-forced scores."""

    start: int                 # first scored prompt index (>= 1)
    k: int | None              # SamplingParams.prompt_logprobs; None: scores only (LLM.score)
    logprobs: np.ndarray       # f32[P], NaN until scored
    top_ids: np.ndarray        # i32[P, k]
    top_logprobs: np.ndarray   # f32[P, k]
    done: np.ndarray           # bool[P]
    entries: list[dict[int, float] | None] | None = None  # built once complete

    @classmethod
    def empty(cls, start: int, k: int | None, num_prompt_tokens: int) -> "PromptScores":
        """Nothing scored yet, for a prompt of P = `num_prompt_tokens` tokens."""
        P, w = num_prompt_tokens, k or 0
        return cls(start, k, np.full(P, np.nan, np.float32), np.zeros((P, w), np.int32),
                   np.zeros((P, w), np.float32), np.zeros(P, bool))

    @property
    def complete(self) -> bool:
        return bool(self.done[self.start:].all())

    def store(self, pl: PromptLogprobs) -> None:
        """Write one step's scores at their prompt indices."""
        sl = slice(pl.start, pl.start + len(pl.logprobs))
        self.logprobs[sl] = pl.logprobs
        w = self.top_ids.shape[1]
        self.top_ids[sl] = pl.top_ids[:, :w]
        self.top_logprobs[sl] = pl.top_logprobs[:, :w]
        self.done[sl] = True

    def entries_for(self, prompt: list[int]) -> list[dict[int, float] | None]:
        """vLLM's prompt_logprobs list: None before `start`, else {token: lp, top-k...}."""
        if self.entries is None:
            out: list[dict[int, float] | None] = [None] * self.start
            for j in range(self.start, len(prompt)):
                e = {int(t): float(v) for t, v in zip(self.top_ids[j], self.top_logprobs[j])}
                e[prompt[j]] = float(self.logprobs[j])
                out.append(e)
            self.entries = out
        return self.entries
