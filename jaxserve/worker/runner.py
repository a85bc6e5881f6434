"""The engine–runner seam: what `LLMEngine` asks of whatever executes a step.

vLLM V1 splits its engine core from a model executor/worker the same way:
the core schedules, the runner turns one plan into sampled tokens. Two
classes implement `Runner`: `jaxserve.worker.model_runner.ModelRunner` (the model,
the KV cache and the bucket programs) and `jaxserve.worker.fake_runner.FakeRunner`
(scripted tokens, no model). Plain Python + NumPy: no jax import here, so the
fake stays usable where jax must not be loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np

if TYPE_CHECKING:
    from jaxserve.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class PromptLogprobs:
    """Teacher-forced logprobs of prompt tokens start .. start + m - 1 (prompt indices),
    from the rows of one step (a chunk yields its own positions; a re-prefill after a
    preemption yields the same positions again, so the receiver stores them by index).

    Prompt token j's logprob comes from the logits at position j - 1, so j >= 1.
    Always the model's raw distribution (log_softmax of the logits), as in vLLM.
    """

    start: int
    logprobs: np.ndarray      # f32[m] logprob of each prompt token
    top_ids: np.ndarray       # i32[m, max_logprobs]
    top_logprobs: np.ndarray  # f32[m, max_logprobs]


NO_TOP_IDS = np.zeros(0, np.int32)
NO_TOP_LOGPROBS = np.zeros(0, np.float32)
NO_TOP_IDS.flags.writeable = NO_TOP_LOGPROBS.flags.writeable = False


@dataclass(slots=True)
class SampledToken:
    """One sampled token for one row: id, its raw logprob, and top alternatives;
    `prompt` holds the row's prompt logprobs when it was a scoring row. The runners hand
    every row of a step one shared empty pair of top arrays when no request of theirs
    asked for logprobs (`RequestStates.num_logprobs`): nothing reads them then.

    Treated as immutable. Slotted and not frozen: a runner makes one per row per step, and
    a frozen dataclass's __init__ pays one object.__setattr__ a field (~2x the cost)."""

    token_id: int
    logprob: float
    top_ids: np.ndarray      # i32[max_logprobs] (or i32[0], see above)
    top_logprobs: np.ndarray  # f32[max_logprobs] (or f32[0])
    prompt: PromptLogprobs | None = None


@dataclass(frozen=True)
class RowError:
    """A failure of one row's host work (e.g. its sampling metadata): that request
    alone fails, with `message` as its error; the rest of the batch goes on."""

    message: str


# A row that samples gives a SampledToken; a scoring row that does not sample (a prefill
# chunk) gives its PromptLogprobs alone.
RowResult = Union[SampledToken, RowError, PromptLogprobs]


@dataclass
class RunnerStats:
    """Compile and bucket counters of one runner.

    Fields:
      num_steps: steps executed (empty plans excluded).
      warmup_programs: programs warm-up made ready.
      warmup_seconds: wall seconds of warm-up.
      programs_built: programs XLA compiled in this process (persistent-cache misses).
      programs_loaded: programs loaded from the persistent compile cache.
      compile_seconds: wall seconds spent lowering + compiling/loading programs.
      compile_seconds_by_family: the same split by family ("stack", "head", "score").
      late_compiles: programs a step needed that warm-up had not built.
      steps_by_shape: {(T_pad, S_pad): steps run at that shape}.
      programs_restored: programs deserialized from the executable cache (no trace,
        no compile; `jaxserve.worker.executable_cache`).
      programs_ready: programs built so far (progressive warm-up: of warmup_programs).
      ready_seconds: wall seconds from warm-up start to ready (serving may begin).
      warmup_done: every warm-up program is ready (false while progressive warm-up
        still compiles in the background).
    """

    num_steps: int = 0
    warmup_programs: int = 0
    warmup_seconds: float = 0.0
    programs_built: int = 0
    programs_loaded: int = 0
    compile_seconds: float = 0.0
    compile_seconds_by_family: dict[str, float] = field(default_factory=dict)
    late_compiles: int = 0
    steps_by_shape: dict[tuple[int, int], int] = field(default_factory=dict)
    programs_restored: int = 0
    programs_ready: int = 0
    ready_seconds: float = 0.0
    warmup_done: bool = False

    def record_step(self, t_pad: int, s_pad: int) -> None:
        """Count one executed step at bucket shape (t_pad, s_pad)."""
        self.num_steps += 1
        self.steps_by_shape[(t_pad, s_pad)] = self.steps_by_shape.get((t_pad, s_pad), 0) + 1


class PendingStep(Protocol):
    """A step dispatched to the device whose results are not fetched yet (`Runner.dispatch`)."""

    def result(self) -> dict[str, RowResult]:
        """Wait for the step and return what `Runner.execute` returns. Call once.

        Raises: any failure of the whole step (as `Runner.execute`)."""


class DoneStep:
    """A `PendingStep` whose results are already known (a runner with no `dispatch`)."""

    __slots__ = ("_results",)

    def __init__(self, results: dict[str, RowResult]):
        self._results = results

    def result(self) -> dict[str, RowResult]:
        return self._results


class Runner(Protocol):
    """Executes the scheduler's plans; owns the device state (or a fake of it).

    `num_kv_blocks` is the KV pool size N the runner holds (block 0 is the null
    block); the engine builds its scheduler over exactly that pool. `token_cap` is the
    largest token bucket whose programs are ready while a progressive warm-up builds
    the rest (None: every bucket); the engine passes it to `Scheduler.schedule`.
    """

    num_kv_blocks: int
    token_cap: int | None

    def warmup(self, *, progress: bool = True) -> None:
        """Make every program the bucket policy can request ready (compile or load)."""

    def execute(self, out: "SchedulerOutput") -> dict[str, RowResult]:
        """Run one plan; the plan is all the runner reads of the scheduler.

        Args:
          out: the scheduler's plan. The runner keeps its own copy of each running
            request (`jaxserve.worker.input_batch.RequestStates`): added from
            `out.scheduled_new_reqs`, extended with the tokens it samples, dropped
            with `out.finished_ids` / `out.preempted_ids`; the structured-output
            rows' bitmask is `out.grammar`.
        Returns: request_id -> SampledToken for every row with `sample=True`
          whose host work succeeded (its `.prompt` set when the row scored
          prompt positions), request_id -> PromptLogprobs for a non-sampling row
          that scored prompt positions (`jaxserve.worker.scoring.score_span`), and
          request_id -> RowError for every row whose own host work failed.
        Raises: any failure of the whole step (device error, bad plan); the
          caller then calls `reset()` and retries the step's rows once.
        """

    def dispatch(self, out: "SchedulerOutput") -> PendingStep:
        """`execute` in two halves (vLLM's async scheduling; issue 24): lay out the plan
        and launch its programs, returning before the device finishes; the handle's
        `result()` then waits and returns what `execute` would. Results are fetched in
        dispatch order. With `placeholders_ok()` the engine may dispatch the next plan
        before fetching this one: its rows whose input is `PLACEHOLDER_TOKEN_ID` read the
        token this step samples for the same request (on the device, never the host).
        Otherwise the next step is planned after `result()`, overlapping the device step
        with the output processing only.
        Optional: the engine wraps `execute` in a `DoneStep` for a runner without it.

        Raises: a failure of the host half (a bad plan); device failures surface in
          `result()`.
        """

    def placeholders_ok(self) -> bool:
        """Optional: whether the next plan may be dispatched before this step's tokens are
        fetched (see `dispatch`); False or absent: never."""

    def reset(self) -> bool:
        """Recover after `execute` raised; True when the KV cache had to be rebuilt
        (every cached KV row is gone, so every running request is recomputed)."""

    def stats(self) -> RunnerStats:
        """The runner's compile and per-shape step counters."""
