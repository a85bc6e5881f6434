"""Sleep and wake of an LLMEngine (issue 28): free the device memory between rollout
phases for a trainer that shares the device, and bring it back without a restart or
a recompile (vLLM's `sleep(level, mode)` / `wake_up(tags)`, SGLang's
`release_memory_occupation` / `resume_memory_occupation`).

Sleeping is a pause (`jaxserve.engine.pause`) that also frees the runner's buffers:
the running requests are handled by the pause `mode` ("abort", "wait" or "retract";
"keep" cannot be, since their KV is freed), the prefix cache is forgotten, then the
runner frees the KV cache (level 1) and moves or drops the weights (level 2,
`jaxserve.worker.sleep`). Requests added while asleep wait for the wake, or, with
`reject_new`, are refused at once (`EngineSleepingError`). No jax here: the runner
does the device work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from jaxserve.engine.pause import Pauser, check_mode
from jaxserve.errors import EngineSleepingError

SLEEP_TAGS = ("weights", "kv_cache")  # what wake_up(tags) may name, as in vLLM


@dataclass(frozen=True)
class SleepState:
    """How the engine sleeps: its level, whether new requests are refused, and whether
    the sleep made its own pause (False: it slept inside a caller's pause)."""

    level: int
    reject_new: bool
    own_pause: bool


class Sleeper:
    """Sleep state of one LLMEngine; the engine calls it.

    Args:
      scheduler: the engine's `Scheduler`; pauser: its `Pauser`; runner: its runner
        (sleeping needs `sleep`, `wake_up`, `is_sleeping` on it: `ModelRunner`, `FakeRunner`).
    """

    def __init__(self, scheduler: Any, pauser: Pauser, runner: Any):
        self.scheduler, self.pauser, self.runner = scheduler, pauser, runner
        self.state: SleepState | None = None

    @property
    def is_sleeping(self) -> bool:
        return self.state is not None

    def sleep(self, level: int, *, mode: str, reject_new: bool, discard_weights: bool,
              abort_message: str, pending: list) -> None:
        """Pause with `mode`, forget the prefix cache, free the runner's buffers; the
        pause's outputs (aborted / finished requests) are appended to `pending`.

        Raises:
          ValueError: already asleep, a bad level or mode ("keep"), discard_weights below
            level 2, or a caller's pause that left requests holding KV.
          TypeError: the runner cannot sleep.
        """
        if self.state is not None:
            raise ValueError(f"sleep(level={level}): already asleep (level "
                             f"{self.state.level}); call wake_up() first")
        if check_mode(mode) == "keep":
            raise ValueError("sleep(mode='keep'): sleeping frees the KV cache, so running "
                             "requests cannot keep theirs; use 'abort', 'wait' or 'retract'")
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r} must be 1 (free the KV cache) or 2 "
                             "(also move the weights off the device)")
        if discard_weights and level != 2:
            raise ValueError(f"discard_weights=True needs level=2, got level={level}")
        if getattr(self.runner, "sleep", None) is None:
            raise TypeError(f"{type(self.runner).__name__} cannot sleep")
        own = not self.pauser.paused
        if not own and self.scheduler.running:
            raise ValueError(f"sleep: generation is paused (mode {self.pauser.mode!r}) with "
                             f"{len(self.scheduler.running)} running requests holding KV; "
                             "resume first, or pause with 'abort' or 'retract'")
        if own:
            pending += self.pauser.pause(mode, abort_message)
        try:
            held = self.scheduler.kv_cache_manager.num_used_blocks
            if held:  # a pause mode that left KV held would lose it here
                raise RuntimeError(f"sleep: {held} KV blocks are still held after the pause")
            self.scheduler.reset_prefix_cache()  # the cached blocks' contents go with the pool
            self.runner.sleep(level, discard_weights=discard_weights)
        except BaseException:
            if getattr(self.runner, "is_sleeping", False):  # a partial sleep: undo it
                try:
                    self.runner.wake_up(SLEEP_TAGS)
                except Exception:  # cannot undo (e.g. weights dropped): stay asleep,
                    self.state = SleepState(level, bool(reject_new), own)  # wake_up works
                    raise
            if own:
                self.pauser.resume()
            raise
        self.state = SleepState(level, bool(reject_new), own)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what `tags` names (None: everything, SLEEP_TAGS); once nothing is left
        asleep, end the sleep (and its own pause: queued requests start).

        Raises:
          ValueError: not asleep, an unknown tag, or discarded weights not replaced.
        """
        if self.state is None:
            raise ValueError("wake_up: the engine is not asleep")
        tags = SLEEP_TAGS if tags is None else tuple(tags)
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad or not tags:
            raise ValueError(f"wake_up tags={list(tags)}: expected a non-empty subset of "
                             f"{SLEEP_TAGS}")
        self.runner.wake_up(tags)
        if not self.runner.is_sleeping:
            own, self.state = self.state.own_pause, None
            if own:
                self.pauser.resume()

    def check_admit(self, request_id: str) -> None:
        """Raise EngineSleepingError when asleep with reject_new (else nothing)."""
        if self.state is not None and self.state.reject_new:
            raise EngineSleepingError(
                f"request {request_id!r} refused: the engine is asleep (level "
                f"{self.state.level}, reject_new=True); call wake_up() first")

    def stats(self) -> dict[str, Any]:
        """is_sleeping, sleep_level (0 awake) and the runner's device bytes held."""
        mem = getattr(self.runner, "memory", None)
        return {"is_sleeping": self.state is not None,
                "sleep_level": 0 if self.state is None else self.state.level,
                **(mem() if mem is not None else {})}
