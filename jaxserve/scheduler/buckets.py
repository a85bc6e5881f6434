"""Token-count and sequence-count buckets: the few shapes that get compiled.

Each step's ragged token axis is padded up to the smallest token bucket that
holds it, and its sequence axis to the smallest sequence bucket; each
(T_pad, S_pad) pair is one jitted program compiled at warm-up. This is the
JAX analogue of vLLM's CUDA-graph capture sizes and of the token-count
padding of vLLM's TPU backend (tpu-inference). Padding never truncates:
a count above the largest bucket is an error, never a silent slice (the
C24 failure class).

Builders: `pow2_buckets`, `pow2_linear_buckets`, or an explicit list. The
offline optimiser that fits buckets to a trace lives with the benchmarks
(`jaxserve.bench.bucket_fit`).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from jaxserve.config import SchedulerConfig


def check_positive_int(name: str, v: object) -> None:
    """Raise ValueError naming `name` unless v is a positive int (bools rejected)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")


def _validate_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    b = tuple(int(x) for x in buckets)
    if not b:
        raise ValueError(f"{name}={b} must not be empty")
    for x in buckets:
        check_positive_int(f"{name} entry", x)
    if list(b) != sorted(set(b)):
        raise ValueError(f"{name}={b} must be strictly increasing")
    return b


def pow2_buckets(max_size: int, min_size: int = 1) -> tuple[int, ...]:
    """Powers of two from the smallest one >= min_size, below max_size, then max_size.

    >>> pow2_buckets(317, 8)
    (8, 16, 32, 64, 128, 256, 317)

    Raises:
      ValueError: a non-positive size.
    """
    check_positive_int("max_size", max_size)
    check_positive_int("min_size", min_size)
    out = []
    p = 1
    while p < min_size:
        p *= 2
    while p < max_size:
        out.append(p)
        p *= 2
    out.append(int(max_size))
    return tuple(out)


def pow2_linear_buckets(max_size: int, gap: int, min_size: int = 1) -> tuple[int, ...]:
    """Powers of two up to `gap`, then multiples of `gap`, then max_size.

    Bounds the padding of large steps to < gap tokens while keeping the
    bucket count small for small steps (the scheme of vLLM's TPU backend).

    >>> pow2_linear_buckets(317, 64, 8)
    (8, 16, 32, 64, 128, 192, 256, 317)

    Raises:
      ValueError: a non-positive size or gap.
    """
    check_positive_int("max_size", max_size)
    check_positive_int("gap", gap)
    check_positive_int("min_size", min_size)
    out = [b for b in pow2_buckets(max_size, min_size) if b <= gap and b < max_size]
    covered = out[-1] if out else min_size - 1  # largest count the pow2 part covers
    nxt = (covered // gap + 1) * gap  # first multiple of gap above it
    while nxt < max_size:
        out.append(nxt)
        nxt += gap
    out.append(int(max_size))
    return tuple(sorted(set(out)))


def _smallest_fit(buckets: Sequence[int], n: int, name: str, kind: str) -> int:
    """The smallest of the sorted `buckets` >= n; ValueError (naming `name`) outside
    [1, largest]."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets) or n < 1:
        raise ValueError(f"{name}={n} must be in [1, largest {kind} bucket={buckets[-1]}]")
    return buckets[i]


class BucketPolicy:
    """Pads (num_tokens, num_seqs) to (T_pad, S_pad) and counts padding per bucket.

    Args:
      token_buckets: strictly increasing positive ints; the largest is the
        step's token capacity (max_num_batched_tokens).
      seq_buckets: strictly increasing positive ints; the largest is the
        step's sequence capacity (>= max_num_seqs).

    Raises:
      ValueError: empty, non-increasing or non-positive bucket lists.
    """

    def __init__(self, token_buckets: Sequence[int], seq_buckets: Sequence[int]):
        self.token_buckets = _validate_buckets("token_buckets", token_buckets)
        self.seq_buckets = _validate_buckets("seq_buckets", seq_buckets)
        self._steps = {b: 0 for b in self.token_buckets}
        self._real = {b: 0 for b in self.token_buckets}
        self._seq_steps = {b: 0 for b in self.seq_buckets}

    @classmethod
    def from_config(cls, cfg: SchedulerConfig) -> "BucketPolicy":
        """Explicit lists from the config, else the configured builder.

        Tokens: "pow2" -> pow2_buckets(max_num_batched_tokens, min_token_bucket);
        "pow2_linear" -> pow2_linear_buckets(max_num_batched_tokens, bucket_gap,
        min_token_bucket). Sequences: pow2_buckets(max_num_seqs, min_seq_bucket)
        (min_seq_bucket clamped to max_num_seqs).
        """
        tb = cfg.token_buckets
        if tb is None:
            if cfg.bucket_policy == "pow2":
                tb = pow2_buckets(cfg.max_num_batched_tokens, cfg.min_token_bucket)
            else:
                tb = pow2_linear_buckets(cfg.max_num_batched_tokens, cfg.bucket_gap,
                                         cfg.min_token_bucket)
        sb = cfg.seq_buckets
        if sb is None:
            sb = pow2_buckets(cfg.max_num_seqs, min(cfg.min_seq_bucket, cfg.max_num_seqs))
        return cls(tb, sb)

    def check_limits(self, cfg: SchedulerConfig) -> None:
        """Raise ValueError unless the largest token bucket equals
        max_num_batched_tokens and the largest seq bucket is >= max_num_seqs."""
        if self.token_buckets[-1] != cfg.max_num_batched_tokens:
            raise ValueError(f"largest token bucket {self.token_buckets[-1]} must equal "
                             f"max_num_batched_tokens={cfg.max_num_batched_tokens}")
        if self.seq_buckets[-1] < cfg.max_num_seqs:
            raise ValueError(f"largest seq bucket {self.seq_buckets[-1]} must be >= "
                             f"max_num_seqs={cfg.max_num_seqs}")

    @property
    def max_num_seqs(self) -> int:
        return self.seq_buckets[-1]

    def pad_tokens(self, num_tokens: int) -> int:
        """Smallest token bucket >= num_tokens. Raises ValueError above the largest."""
        return _smallest_fit(self.token_buckets, num_tokens, "num_tokens", "token")

    def pad_seqs(self, num_seqs: int) -> int:
        """Smallest sequence bucket >= num_seqs. Raises ValueError above the largest."""
        return _smallest_fit(self.seq_buckets, num_seqs, "num_seqs", "seq")

    def pad(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """(T_pad, S_pad) for a step of num_tokens tokens over num_seqs sequences.

        Raises:
          ValueError: num_seqs > num_tokens (every sequence has >= 1 token), or
            a count outside [1, largest bucket]: never a silent truncation.
        """
        if num_seqs > num_tokens:
            raise ValueError(f"num_seqs={num_seqs} exceeds num_tokens={num_tokens}: "
                             "each scheduled sequence has at least one token")
        return self.pad_tokens(num_tokens), self.pad_seqs(num_seqs)

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every (T_pad, S_pad) that `pad` can return: the warm-up set.

        A step with s sequences has t >= s tokens. Token bucket T_i covers
        t in (T_{i-1}, T_i] and seq bucket S_j covers s in (S_{j-1}, S_j], so
        the pair is reachable iff some s in that range is <= some t in that
        range, i.e. iff S_{j-1} + 1 <= T_i (with S_0 = 0). Exactly those pairs
        are returned, so warm-up compiles nothing unreachable and misses nothing.
        """
        shapes = []
        for t in self.token_buckets:
            prev = 0
            for s in self.seq_buckets:
                if prev + 1 <= t:
                    shapes.append((t, s))
                prev = s
        return shapes

    def program_keys(self, *, score: bool = False) -> list[tuple[str, int]]:
        """The runner's warm-up set, per program family: ("stack", T) for every token
        bucket and ("head", S) for every seq bucket that `pad` can return (T + S programs),
        and with `score` (prompt logprobs / scoring on) ("score", T) per token bucket.

        Exactly the projections of `all_shapes()`: every token bucket is reachable
        (one sequence of t tokens; a scoring step can have any T_pad), and seq bucket
        S_j iff S_{j-1} + 1 <= the largest token bucket.
        """
        shapes = self.all_shapes()
        stacks = sorted({t for t, _ in shapes})
        heads = sorted({s for _, s in shapes})
        scores = [("score", t) for t in stacks] if score else []
        return [("stack", t) for t in stacks] + [("head", s) for s in heads] + scores

    # Program families whose size is a token bucket (T_pad); every other family is sized
    # by a seq bucket and is built before the engine reports ready (a family missing
    # here is merely built early: still correct). Another family per T_pad adds its name.
    TOKEN_FAMILIES = ("stack", "score")

    def program_stages(self, *, score: bool = False, ready_tokens: int = 1
                       ) -> list[tuple[int, list[tuple[str, int]]]]:
        """`program_keys(score=score)` grouped for progressive warm-up: [(token_cap, keys)], in order.

        Stage i holds the programs first needed once steps may hold up to token bucket
        T_i tokens: T_i's token-bucket programs (the stack) and the seq-bucket programs
        (the heads) of the seq buckets first reachable at T_i (S_j with S_{j-1} + 1 <= T_i,
        as in `all_shapes`). Once stages 0..i are built, every step of at most T_i tokens
        has all its programs, so the scheduler may plan up to `token_cap = T_i`. A key
        of neither kind lands in stage 0 (built before ready: never missing).
        `ready_tokens`: stage 0 also takes every stage of a token bucket <= ready_tokens,
        so the first cap is at least that (the runner passes 8: with buckets from 1 token
        a server that is ready at a 1-token cap would prefill one token a step).
        """
        shapes = self.all_shapes()
        seen: set[tuple[str, int]] = set()
        stages: list[tuple[int, list[tuple[str, int]]]] = []
        for t_i in self.token_buckets:
            reach = {s for t, s in shapes if t <= t_i}
            stage = [k for k in self.program_keys(score=score) if k not in seen and (
                k[1] == t_i if k[0] in self.TOKEN_FAMILIES else k[1] in reach)]
            seen.update(stage)
            stages.append((t_i, stage))
        stages[0][1].extend(k for k in self.program_keys(score=score) if k not in seen)
        while len(stages) > 1 and stages[1][0] <= ready_tokens:
            cap, keys = stages.pop(1)
            stages[0] = (cap, stages[0][1] + keys)
        return stages

    def token_budget(self, token_cap: int | None = None) -> int:
        """Most tokens one step may hold: the largest token bucket, or `token_cap` (the
        largest bucket progressive warm-up has built so far) when given."""
        return self.token_buckets[-1] if token_cap is None else min(token_cap,
                                                                    self.token_buckets[-1])

    # ------------------------------------------------------------ counters
    def record(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """Pad and count one step: steps and real tokens per token bucket."""
        t_pad, s_pad = self.pad(num_tokens, num_seqs)
        self._steps[t_pad] += 1
        self._real[t_pad] += num_tokens
        self._seq_steps[s_pad] += 1
        return t_pad, s_pad

    def reset_stats(self) -> None:
        for d in (self._steps, self._real, self._seq_steps):
            for key in d:
                d[key] = 0

    def stats(self) -> dict:
        """Per-bucket counters since construction (or reset_stats).

        Returns {"token_buckets": {T: {"steps", "real_tokens", "padded_tokens",
        "padding_fraction"}}, "seq_buckets": {S: steps}, "steps", "real_tokens",
        "padded_tokens", "padding_fraction"}; padded_tokens = T * steps counts
        every slot the device computed, padding_fraction = 1 - real / padded.
        """
        per = {}
        for b in self.token_buckets:
            steps, real = self._steps[b], self._real[b]
            padded = b * steps
            per[b] = {"steps": steps, "real_tokens": real, "padded_tokens": padded,
                      "padding_fraction": (1 - real / padded) if padded else 0.0}
        steps = sum(self._steps.values())
        real = sum(self._real.values())
        padded = sum(v["padded_tokens"] for v in per.values())
        return {"token_buckets": per, "seq_buckets": dict(self._seq_steps), "steps": steps,
                "real_tokens": real, "padded_tokens": padded,
                "padding_fraction": (1 - real / padded) if padded else 0.0}

    def __repr__(self) -> str:
        return f"BucketPolicy(token_buckets={self.token_buckets}, seq_buckets={self.seq_buckets})"
