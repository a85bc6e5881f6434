"""Host half of sampling: per-row parameters -> padded NumPy arrays (no jax).

`make_sampling_metadata` builds a step's `SamplingMetadata` from one `SamplingRow`
per scheduled row; `jaxserve.sample.sampler` registers the class as a jax pytree
and consumes it inside the jitted head program (vLLM's `v1/sample/metadata.py` /
`sampler.py` split). The engine reads the limits here without importing jax.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from jaxserve.validation import MAX_LOGIT_BIAS

# vLLM's _SAMPLING_EPS: temperatures below it are greedy.
SAMPLING_EPS = 1e-5
# At most this many EOS ids per model (Llama 3 has 3; generation configs rarely list more).
MAX_EOS_TOKEN_IDS = 8
# Width of SamplingMetadata.suppress_ids: stop_token_ids + eos ids.
SUPPRESS_WIDTH = MAX_STOP_TOKEN_IDS + MAX_EOS_TOKEN_IDS
# Largest-logit window for top-k / top-p thresholds before falling back to bisection.
DEFAULT_TOP_WINDOW = 256
# vLLM's logprobs modes that return logprobs (its *_logits modes are not supported).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters at a padded row count S (all array leaves).

    Built on the host by `make_sampling_metadata` (NumPy leaves), device_put with the
    rest of the step batch. Padding rows are greedy with no penalty.
    """

    temperature: Any  # f32[S]; < 1e-5 means greedy
    top_k: Any  # i32[S]; 0 or -1 = off, >= V same as off, 1 = greedy
    top_p: Any  # f32[S] in (0, 1]; 1 = off
    min_p: Any  # f32[S] in [0, 1]; 0 = off
    rng_key: Any  # u32[S, 2]; raw threefry key data of the request's seed (hi, lo)
    output_pos: Any  # i32[S]; index of the output token being sampled (folded into the key)
    repetition_penalty: Any  # f32[S]; 1 = off
    presence_penalty: Any  # f32[S]; 0 = off
    frequency_penalty: Any  # f32[S]; 0 = off
    token_history: Any  # i32[S, max_model_len]; prompt ids then output ids, -1 = empty
    prompt_lens: Any  # i32[S]; token_history[:, :prompt_lens] are prompt tokens
    suppress_ids: Any  # i32[S, SUPPRESS_WIDTH]; ids masked to -inf (min_tokens), -1 = none
    logit_bias_ids: Any  # i32[S, MAX_LOGIT_BIAS]; biased ids, padding entries 0
    logit_bias_values: Any  # f32[S, MAX_LOGIT_BIAS]; added to the logits, padding 0
    allowed_bitmask: Any  # i32[S, ceil(V/32)] (or [S, 0]: no mask); -1 = all allowed


@dataclasses.dataclass(slots=True)
class SamplingRow:
    """Host-side description of one row to sample (one request, or one of its n samples).

    `seed` is already resolved (the engine draws one for unseeded requests and derives
    a distinct one per sample when n > 1). `output_pos` is the number of output tokens
    that sample already has, i.e. the index of the token being sampled.
    """

    params: SamplingParams
    seed: int
    output_pos: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()
    allowed: np.ndarray | None = None  # i32[ceil(V/32)]: the grammar's bitmask row, or None


def uses_penalties(p: SamplingParams) -> bool:
    """Whether `p` has a repetition, presence or frequency penalty (its row reads the
    request's token history)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# id -> every array `constant_array` ever made, held here so that no id is ever reused by
# another object. lru_cache alone does not: two threads missing the same key at once (the
# warm-up's compile threads laying out padding batches) both run the function, only one
# result is cached, and the other died with its id still registered; a later batch array
# born at that address was then taken for a constant and swapped for a stale device copy
# ("compiled with int32[4] and called with float32[4]"; silent when the dtypes matched).
_CONSTANTS: dict[int, np.ndarray] = {}


def is_constant_array(x: object) -> bool:
    """Whether `x` is one of `constant_array`'s shared arrays (not merely read-only)."""
    return _CONSTANTS.get(id(x)) is x


@functools.lru_cache(maxsize=None)  # one per (S bucket, width): a handful, never evicted
def constant_array(shape: tuple[int, ...], value: int, dtype: str) -> np.ndarray:
    """A read-only array filled with `value`, shared by every caller (never written).

    `make_sampling_metadata` hands one out for the token history when no row is
    penalised, for the bitmask when no row has a grammar, for the suppressed ids when no
    row is under min_tokens and for logit_bias when no row has one; the runner's
    `TensorParallel.put_batch` keeps such arrays on the device, so a step does not
    copy them again (at 256 rows and max_model_len 2048 they are 2 MiB + 1.5 MiB).
    """
    a = np.full(shape, value, np.dtype(dtype))
    a.flags.writeable = False
    _CONSTANTS[id(a)] = a  # kept for good (see _CONSTANTS): its id stays its own
    return a


def _filled(shape: tuple[int, int], written: bool, value: int = -1,
            dtype: str = "int32") -> np.ndarray:
    """An array of `value`: a fresh one when some row will write into it, else the shared
    read-only `constant_array` (kept on the device by the runner)."""
    return np.full(shape, value, dtype) if written else constant_array(shape, value, dtype)


def _suppress_and_bias(live: list[SamplingRow], S: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """suppress_ids i32[S, SUPPRESS_WIDTH] (-1), logit_bias_ids i32 / values f32
    [S, MAX_LOGIT_BIAS] (0): fresh arrays when some row is under min_tokens / has a
    logit_bias, else the shared constants that stay on the device (150 KiB a step at 64
    rows otherwise)."""
    suppress = _filled((S, SUPPRESS_WIDTH), any(
        len(r.output_token_ids) < r.params.min_tokens for r in live))
    biased = any(r.params.logit_bias for r in live)
    return (suppress, _filled((S, MAX_LOGIT_BIAS), biased, 0, "int32"),
            _filled((S, MAX_LOGIT_BIAS), biased, 0, "float32"))


def _fill_token_lists(i: int, row: SamplingRow, max_model_len: int, history: np.ndarray,
                      prompt_lens: np.ndarray, suppress: np.ndarray, bias_ids: np.ndarray,
                      bias_values: np.ndarray) -> None:
    """Row i's token-id inputs: penalty history, min_tokens suppression, logit_bias.

    Raises:
      ValueError: a penalised history longer than max_model_len, or more than
        MAX_LOGIT_BIAS logit_bias entries.
    """
    p = row.params
    if uses_penalties(p):
        n_prompt, n_out = len(row.prompt_token_ids), len(row.output_token_ids)
        if n_prompt + n_out > max_model_len:
            raise ValueError(
                f"rows[{i}] history of {n_prompt}+{n_out} tokens exceeds "
                f"max_model_len={max_model_len}")
        history[i, :n_prompt] = np.asarray(row.prompt_token_ids, np.int32)
        history[i, n_prompt:n_prompt + n_out] = np.asarray(row.output_token_ids, np.int32)
        prompt_lens[i] = n_prompt
    if len(row.output_token_ids) < p.min_tokens:
        # vLLM: min_tokens suppresses the tokens that would stop the request; with
        # ignore_eos EOS does not stop it, so EOS stays sampleable (DESIGN.md).
        ids = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(row.eos_token_ids))
        suppress[i, :len(ids)] = ids
    if p.logit_bias:
        if len(p.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"rows[{i}] has {len(p.logit_bias)} logit_bias entries, "
                             f"at most MAX_LOGIT_BIAS={MAX_LOGIT_BIAS}")
        pairs = np.asarray(p.logit_bias, np.float64)  # [n, 2]; ids < 2**31 are exact
        bias_ids[i, :len(pairs)] = pairs[:, 0]
        bias_values[i, :len(pairs)] = pairs[:, 1]


_INT32_MAX = 2**31 - 1


def _check_rows(idx: list[int], live: list[SamplingRow]) -> None:
    """Raise ValueError naming the first row whose seed, output_pos or EOS ids are out of
    range (see `make_sampling_metadata`)."""
    for i, row in zip(idx, live):
        if not 0 <= row.seed < 2**64:
            raise ValueError(f"rows[{i}].seed={row.seed} must be in [0, 2**64)")
        if not 0 <= row.output_pos < 2**31:
            raise ValueError(f"rows[{i}].output_pos={row.output_pos} must be in [0, 2**31)")
        if len(row.eos_token_ids) > MAX_EOS_TOKEN_IDS:
            raise ValueError(
                f"rows[{i}].eos_token_ids has {len(row.eos_token_ids)} ids, "
                f"at most MAX_EOS_TOKEN_IDS={MAX_EOS_TOKEN_IDS}")


def _fill_bitmask(bitmask: np.ndarray, idx: list[int], live: list[SamplingRow],
                  vocab_size: int | None) -> None:
    """Write each grammar row's bitmask into row idx[j] of `bitmask`.

    Raises:
      ValueError: a grammar row without vocab_size.
    """
    for i, row in zip(idx, live):
        if row.allowed is not None:
            if vocab_size is None:
                raise ValueError(f"rows[{i}] has a grammar bitmask but make_sampling_metadata "
                                 "got no vocab_size for it")
            bitmask[i] = row.allowed


def make_sampling_metadata(
    rows: Sequence[SamplingRow | None], *, num_rows: int, max_model_len: int,
    vocab_size: int | None = None,
) -> SamplingMetadata:
    """Build padded NumPy sampling arrays for one step.

    Args:
      rows: one entry per scheduled sequence slot; None (and slots past len(rows)) are
        padding rows: greedy, no penalty, no suppression.
      num_rows: S_pad, the bucketed row count (>= len(rows)).
      max_model_len: width of the token history; prompt+output of a penalised row must fit.
      vocab_size: V of the allowed-token bitmask [S, ceil(V/32)] (all ones except the
        rows that bring theirs in `allowed`); None: a [S, 0] bitmask (no grammar rows).

    Returns:
      SamplingMetadata with NumPy leaves of the shapes documented on the class.

    Raises:
      ValueError: len(rows) > num_rows, a seed outside [0, 2**64), a negative output_pos,
        more than MAX_EOS_TOKEN_IDS eos ids, more than MAX_LOGIT_BIAS logit_bias entries,
        a penalised row whose history exceeds max_model_len, or a grammar row without
        vocab_size (or whose bitmask row is not ceil(vocab_size/32) words).
    """
    if len(rows) > num_rows:
        raise ValueError(f"len(rows)={len(rows)} exceeds num_rows={num_rows}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len} must be >= 1")
    S = num_rows
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    rng_key = np.zeros((S, 2), np.uint32)
    output_pos = np.zeros(S, np.int32)
    rep = np.ones(S, np.float32)
    pres = np.zeros(S, np.float32)
    freq = np.zeros(S, np.float32)
    idx = [i for i, r in enumerate(rows) if r is not None]
    live = [rows[i] for i in idx]
    penalised = any(uses_penalties(r.params) for r in live)
    history = _filled((S, max_model_len), penalised)
    prompt_lens = np.zeros(S, np.int32)
    suppress, bias_ids, bias_values = _suppress_and_bias(live, S)
    bitmask = _filled((S, 0 if vocab_size is None else (vocab_size + 31) // 32),
                      any(r.allowed is not None for r in live))
    _check_rows(idx, live)
    # Column by column: one NumPy assignment a field, not one a row and field.
    if live:
        # rows 0..n-1 (no padding row among them, the usual plan) as a slice
        sel = slice(0, len(idx)) if idx[-1] == len(idx) - 1 else idx
        ps = [r.params for r in live]
        temperature[sel] = [p.temperature for p in ps]
        # top_k >= V is "off" (the validator already turns it into 0); the clamp keeps a
        # params object that skipped the validator from overflowing the int32 array.
        top_k[sel] = [min(p.top_k, _INT32_MAX) for p in ps]
        top_p[sel] = [p.top_p for p in ps]
        min_p[sel] = [p.min_p for p in ps]
        seeds = [r.seed for r in live]
        rng_key[sel, 0] = [x >> 32 for x in seeds]
        rng_key[sel, 1] = [x & 0xFFFFFFFF for x in seeds]
        output_pos[sel] = [r.output_pos for r in live]
        rep[sel] = [p.repetition_penalty for p in ps]
        pres[sel] = [p.presence_penalty for p in ps]
        freq[sel] = [p.frequency_penalty for p in ps]
    if penalised or not is_constant_array(suppress) or not is_constant_array(bias_ids):
        for i, row in zip(idx, live):
            _fill_token_lists(i, row, max_model_len, history, prompt_lens, suppress,
                              bias_ids, bias_values)
    if not is_constant_array(bitmask):  # some row has a grammar
        _fill_bitmask(bitmask, idx, live, vocab_size)
    return SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, rng_key=rng_key,
        output_pos=output_pos, repetition_penalty=rep, presence_penalty=pres,
        frequency_penalty=freq, token_history=history, prompt_lens=prompt_lens,
        suppress_ids=suppress, logit_bias_ids=bias_ids, logit_bias_values=bias_values,
        allowed_bitmask=bitmask)
