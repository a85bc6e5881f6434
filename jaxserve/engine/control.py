"""`LLMEngine`'s pause and sleep calls (issue 28): vLLM's `pause_generation` /
`resume_generation` / `sleep` / `wake_up`, between two steps, over
`jaxserve.engine.pause.Pauser` and `jaxserve.engine.sleep.Sleeper`."""

from __future__ import annotations

from typing import Sequence


class EngineControl:
    """Mixin of `jaxserve.engine.core.LLMEngine` (its `_drain`, `_pending`, `pauser`,
    `sleeper` and `weight_version`)."""

    def pause_generation(self, mode: str = "abort", *, _new_version: int | None = None) -> None:
        """Pause between two steps (vLLM's `pause_generation`, SGLang's abort /
        in_place / retract); `step()` then schedules nothing until `resume_generation()`.

        Modes for the requests in flight: "abort" fails them (finish_reason "error");
        "wait" admits nobody new and runs this engine's own steps until the running
        ones finish; "keep" leaves them with their KV, to go on after resume (over
        new weights if `update_params` ran meanwhile); "retract" preempts them by
        recompute, so after resume they rerun prompt + tokens so far. Outputs of
        requests that ended come back from the next `step()` calls.

        Raises:
          ValueError: an unknown mode, or already paused.
        """
        self._drain()
        new = self.weight_version + 1 if _new_version is None else _new_version
        msg = (f"weights updated from version {self.weight_version} to {new} while the "
               f"request was in flight" if _new_version is not None else
               f"generation paused (mode 'abort') at weight version {self.weight_version}")
        self._pending += self.pauser.pause(mode, msg)

    def resume_generation(self) -> None:
        """Resume after `pause_generation`. Raises ValueError when not paused, or when
        the pause is a sleep's (`wake_up` ends that one)."""
        if self.sleeper.is_sleeping and self.sleeper.state.own_pause:
            raise ValueError("resume_generation: the engine is asleep; call wake_up()")
        self.pauser.resume()

    def sleep(self, level: int = 1, *, mode: str = "abort", reject_new: bool = False,
              discard_weights: bool = False) -> None:
        """Free device memory until `wake_up()` (vLLM's `sleep(level, mode)`; issue 28).

        Level 1 frees the KV cache; level 2 also moves the weights to host memory, or
        drops them with `discard_weights` (send new ones with `update_params` before
        waking). First pauses with `mode` ("abort" fails the requests in flight, "wait"
        drains them, "retract" requeues them to recompute after the wake); the prefix
        cache is forgotten. Requests added while asleep wait for the wake, unless
        `reject_new` (then `add_request` raises `EngineSleepingError`). Compiled
        programs stay: waking recompiles nothing. See `jaxserve.engine.sleep`.

        Raises:
          ValueError: already asleep, level not 1 or 2, mode "keep" or unknown,
            discard_weights below level 2, or a caller's pause holding KV.
          TypeError: the runner cannot sleep.
        """
        self._drain()
        self.sleeper.sleep(level, mode=mode, reject_new=reject_new,
                           discard_weights=discard_weights, pending=self._pending,
                           abort_message=f"the engine went to sleep (level {level}) at "
                                         f"weight version {self.weight_version}")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what `sleep` freed: `tags` a subset of ("weights", "kv_cache") (vLLM's),
        None for both; generation resumes once both are back.

        Raises:
          ValueError: not asleep, an unknown tag, or discarded weights never replaced.
        """
        self.sleeper.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        """True between `sleep` and the `wake_up` that restores everything."""
        return self.sleeper.is_sleeping

    @property
    def is_paused(self) -> bool:
        """True between `pause_generation` and `resume_generation` (vLLM's `is_paused`)."""
        return self.pauser.paused
