"""The device side of async scheduling with output placeholders (issue 24; vLLM V1's).

When the engine plans step n+1 before step n's tokens are back, each decode row of n+1
reads `PLACEHOLDER_TOKEN_ID` as its input. `PlaceholderFeed` keeps what is needed to
fill those in on the device: the last launched plan and its head's token ids, padded to
i32[S_max] whatever that step's seq bucket (`programs._head_fn`), and one tiny compiled
`merge_placeholders` per token bucket. The host never waits for step n's tokens to
launch step n+1; the device runs the two in order.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from jaxserve.worker.programs import merge_placeholders
from jaxserve.worker.runner import RowError, RowResult


class PlaceholderFeed:
    """What a `ModelRunner` keeps between launches to feed placeholder rows.

    Args:
      sharding: the sharding of the step arrays: replicated over a mesh, else the one
        device's (a compile-only GPU's too, `jaxserve.gpu.deviceless`).
      max_seq_bucket: S_max, the length of the head's padded token ids.
    """

    def __init__(self, sharding: Any, max_seq_bucket: int):
        self.sharding, self.max_seq_bucket = sharding, max_seq_bucket
        self.last_out: SchedulerOutput | None = None  # the last launched plan
        self.last_ids: Any = None  # its head's token ids, i32[S_max] on the device
        self._merges: dict[int, Any] = {}

    def forget(self) -> None:
        """Nothing launched can be read any more (a step with no launch, a failure)."""
        self.last_out = self.last_ids = None

    def program(self, t_pad: int) -> Any:
        """The compiled `merge_placeholders` of token bucket t_pad (made once, ~ms;
        `ModelRunner.warmup` makes every bucket's)."""
        prog = self._merges.get(t_pad)
        if prog is None:
            ids = jax.ShapeDtypeStruct((t_pad,), jnp.int32, sharding=self.sharding)
            prev = jax.ShapeDtypeStruct((self.max_seq_bucket,), jnp.int32, sharding=self.sharding)
            prog = self._merges[t_pad] = jax.jit(merge_placeholders, out_shardings=self.sharding
                                                 ).lower(ids, ids, prev).compile()
        return prog

    def merge(self, t_pad: int, input_ids: Any, src: Any) -> Any:
        """input_ids i32[t_pad] on the device with the placeholders filled in from the
        last launch (`src` from `sources`, on the device)."""
        return self.program(t_pad)(input_ids, src, self.last_ids)

    def sources(self, out: SchedulerOutput, input_ids: np.ndarray,
                results: dict[str, RowResult]) -> np.ndarray | None:
        """i32[T_pad]: for each placeholder of `input_ids` (the plan's laid-out ids), the
        row of the last launched plan whose sampled token it is, -1 elsewhere; None when
        there is nothing to read. A placeholder with no such row (its request's every row
        of that plan failed on the host, so nothing was launched) reads token 0 and its
        row fails (a `RowError` in `results`); the other rows run."""
        if not (input_ids[:out.num_scheduled_tokens] == PLACEHOLDER_TOKEN_ID).any():
            return None
        prev = self.last_out if self.last_ids is not None else None
        where = {} if prev is None else {sr.request_id: i for i, sr in enumerate(prev.scheduled)
                                         if sr.sample}
        src = np.full(input_ids.shape, -1, np.int32)
        t = 0
        for sr in out.scheduled:
            t += len(sr.token_ids)
            if sr.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                i = where.get(sr.request_id)
                if i is None:
                    input_ids[t - 1] = 0
                    results.setdefault(sr.request_id, RowError(
                        f"row {sr.request_id!r} reads a token no launched step samples"))
                else:
                    src[t - 1] = i
        return src if prev is not None else None
