"""Host-side state of one request (one sample of a user request).

A request is its token list (prompt + generated output) plus
`num_computed_tokens`, the length of the prefix whose KV is in the cache.
The scheduler hands it tokens until `num_computed_tokens` catches up with
`num_tokens`; chunked prefill, decode and the re-prefill after a preemption
are the same operation (vLLM V1's "no phases" scheduler). Derived values are
properties, as in nano-vllm's `Sequence`. Plain Python: no jax here.
"""

from __future__ import annotations

import enum
import random
import time
from typing import Sequence

from jaxserve.sampling_params import SamplingParams

_SEED_RNG = random.SystemRandom()


class TokenCounts:
    """`num_prompt_tokens` / `num_output_tokens` of an object with `prompt_token_ids` and
    `output_token_ids` (the scheduler's `Request`, the runner's `CachedRequestState`)."""

    __slots__ = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. The FINISHED_* values are terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # in the waiting queue again, its KV freed (recompute on resume)
    FINISHED_STOPPED = 3  # EOS or a stop token id / stop string
    FINISHED_LENGTH = 4  # max_tokens reached (or max_model_len)
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        """OpenAI finish_reason of a status: "stop" | "length" | "abort" | "error" | None."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def is_finished(status: RequestStatus) -> bool:
    """True for the terminal FINISHED_* statuses."""
    return status >= RequestStatus.FINISHED_STOPPED


class Request(TokenCounts):
    """One sequence to generate: prompt, output so far, and scheduling state.

    Args:
      request_id: unique among live requests (a child of an n>1 request has
        its own id).
      prompt_token_ids: the prompt, >= 1 token (the scheduler rejects an
        empty prompt with ValueError).
      sampling_params: how to sample; `n` is handled by the engine (one
        Request per sample).
      eos_token_ids: token ids that end the request (unless
        `sampling_params.ignore_eos`); the EOS token is appended to the output.
      arrival_time: seconds (time.monotonic); now when None. Ties in the
        priority policy are broken by it.
      priority: lower value runs first under the "priority" policy.
      logprob_start: None, or the first prompt index j >= 1 whose teacher-forced
        logprob this request must report (prompt_logprobs: 1; `LLM.score`: the
        completion's first index). Positions it needs are never prefix-cache
        hits (`KVCacheManager.get_computed_blocks`).
      max_tokens: effective output limit. None takes
        `sampling_params.max_tokens`; the scheduler then clamps it to
        `max_model_len - num_prompt_tokens` (None means exactly that).

    `seed` is `sampling_params.seed`, or drawn at random here when None, so a
    request's samples derive from (seed, output position) and do not change
    when it is batched differently or preempted.
    """

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
                 "arrival_time", "priority", "max_tokens", "output_token_ids", "all_token_ids",
                 "num_computed_tokens", "status", "stop_reason", "num_preemptions", "num_step_retries",
                 "seed", "grammar", "logprob_start",
                 "block_hashes", "_stop_ids", "_eos_ids", "lora_int_id", "lora_slot",
                 "cache_key", "num_output_placeholders", "__weakref__")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, eos_token_ids: Sequence[int] = (),
                 arrival_time: float | None = None, priority: int = 0,
                 max_tokens: int | None = None, logprob_start: int | None = None):
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.max_tokens = sampling_params.max_tokens if max_tokens is None else max_tokens
        self.output_token_ids: list[int] = []
        # prompt + output in one list, so a chunk is one slice (read it, never mutate it).
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_step_retries = 0  # whole-step failures this request was retried after
        # Sampling rows planned whose token has not come back yet (vLLM's name): 1 between
        # schedule() and update_from_output(); 2 while async scheduling plans step n+1 before
        # step n's token is back, the token n+1 reads being a placeholder (issue 24).
        self.num_output_placeholders = 0
        self.logprob_start = logprob_start
        seed = sampling_params.seed
        self.seed: int = _SEED_RNG.getrandbits(63) if seed is None else seed
        # Structured output: a `jaxserve.structured_output.GrammarMatcher`, set by the engine
        # before the request reaches the scheduler; advanced only by accepted tokens.
        self.grammar = None
        # Prefix-cache hash of each full block of all_token_ids, filled lazily by
        # the KV cache manager (chain: hash(parent hash, block tokens)).
        self.block_hashes: list[bytes] = []
        # LoRA (issue 27, set by the engine): the adapter id (0: base model), its device
        # slot, and the prefix-cache root key (adapter id and version; None: base model).
        self.lora_int_id, self.lora_slot, self.cache_key = 0, 0, None
        self._eos_ids = frozenset(() if sampling_params.ignore_eos else self.eos_token_ids)
        self._stop_ids = frozenset(sampling_params.stop_token_ids)

    # ------------------------------------------------------------ derived
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" | "error" once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    @property
    def min_tokens(self) -> int:
        return self.sampling_params.min_tokens

    @property
    def last_output_on_its_way(self) -> bool:
        """A plan made ahead is waiting for this request's last token by max_tokens (a
        placeholder): it finishes by length when that token is applied."""
        ph = self.num_output_placeholders
        return ph > 0 and len(self.output_token_ids) + ph >= self.max_tokens

    # ------------------------------------------------------------ mutation
    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_and_check(self, token_id: int) -> RequestStatus | None:
        """`append_output_token` then `check_stop`, with a fast path for the usual no-stop case."""
        out = self.output_token_ids
        out.append(token_id)
        self.all_token_ids.append(token_id)
        if len(out) < self.max_tokens and token_id not in self._eos_ids \
                and token_id not in self._stop_ids:
            return None
        return self.check_stop()

    def check_stop(self) -> RequestStatus | None:
        """Stop rule for the token just appended (vLLM order), or None to go on.

        EOS (unless ignore_eos) and `stop_token_ids` end the request only once
        `min_tokens` outputs exist; then `max_tokens` gives FINISHED_LENGTH.
        Sets `stop_reason` to the stop token id (None for EOS, as vLLM does).
        """
        n = len(self.output_token_ids)
        if n >= self.sampling_params.min_tokens:
            last = self.output_token_ids[-1]
            if last in self._eos_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self._stop_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")


def resolve_max_tokens(request: Request, max_model_len: int, block_size: int,
                       usable_blocks: int) -> int:
    """A new request's effective max_tokens, as vLLM resolves it: None becomes
    `max_model_len - num_prompt_tokens`; a larger value is clamped to it.

    Raises:
      ValueError: an empty prompt, a prompt of >= max_model_len tokens (no position
        left for an output), max_tokens < 1, or prompt + max_tokens needing more KV
        blocks of `block_size` tokens than the pool's `usable_blocks` (it could never run).
    """
    rid = request.request_id
    P, M, B = request.num_prompt_tokens, max_model_len, block_size
    if P == 0:
        raise ValueError(f"request {rid!r}: the prompt is empty (0 tokens); at least 1 is needed")
    if P >= M:
        raise ValueError(f"request {rid!r}: prompt length {P} must be < max_model_len={M} "
                         "(one position is needed for the first output token)")
    mt = request.max_tokens
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise ValueError(f"request {rid!r}: max_tokens={mt!r} must be an int >= 1")
    mt = M - P if mt is None else min(mt, M - P)
    # The last output token is never fed back, so positions 0 .. P + mt - 2 hold KV.
    need = -(-(P + mt - 1) // B)
    usable = usable_blocks
    if need > usable:
        raise ValueError(
            f"request {rid!r}: prompt {P} + max_tokens {mt} needs {need} KV blocks of "
            f"{B} tokens, but the pool has {usable} usable blocks (num_kv_blocks="
            f"{usable + 1} incl. the null block); lower max_tokens or raise num_kv_blocks")
    return mt
