"""Request traces for the benchmarks: load, synthesize, count prompt tokens.

A trace is JSON Lines, one request per line (the format of
`../shared/bench/*.jsonl`):

    {"id": str, "prompt": str, "max_tokens": int, "arrival_s": float}

Runs are greedy with `ignore_eos`, so every request produces exactly
`max_tokens` tokens and a run is comparable across engines. An optional
`"prompt_tokens": int` field fixes the prompt length for the dry run (the
synthetic generator writes it).

The synthetic generator follows the usual serving-benchmark recipe (vLLM's
`benchmark_serving.py` random dataset, Orca's and DistServe's workloads):
lognormal or exponential prompt and output lengths, Poisson arrivals.
Plain Python + NumPy: no jax import here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

# SmolLM2's chat template wraps a user message in a fixed system prompt and
# role markers: 30 tokens measured with the real tokenizer on every prompt of
# ../shared/bench/prompts.txt (len(chat(p)) - len(encode(p)) == 30).
CHAT_OVERHEAD_TOKENS = 30
# Characters per token of English prose under SmolLM2's BPE, fitted on
# ../shared/bench/prompts.txt (4.4-5.5 per prompt, 4.8 mean).
CHARS_PER_TOKEN = 4.8

# Words for synthetic prompts: common English words that SmolLM2's BPE keeps
# as single tokens with a leading space, so n words ~= n tokens.
_WORDS = ("the of and to in is for on that with as it by this be are from at or an was have "
          "not but can more time will all one new about which their has they other many first "
          "when some what there would also into only year these most water over such").split()


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Fields:
      id: unique within the trace.
      prompt: the user message (chat template applied by the engine or server).
      max_tokens: output tokens to generate (exact, since runs ignore EOS), >= 1.
      arrival_s: seconds after the start of the run, >= 0.
      prompt_tokens: prompt length in tokens (chat template included) when
        known; None means "count it with `prompt_token_counter`".
    """

    id: str
    prompt: str
    max_tokens: int
    arrival_s: float = 0.0
    prompt_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["prompt_tokens"] is None:
            del d["prompt_tokens"]
        return d


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number from 1, parsed value) of each non-blank line of a JSONL file.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a line that is not JSON, naming file:line.
    """
    p = Path(path)
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not valid JSON ({e})") from None


def _parse_row(rec: Any, where: str) -> TraceRequest:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a trace line must be a JSON object, got {type(rec).__name__}")
    for key, typ in (("id", str), ("prompt", str)):
        if not isinstance(rec.get(key), typ):
            raise ValueError(f"{where}: field {key!r}={rec.get(key)!r} must be a {typ.__name__}")
    mt = rec.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise ValueError(f"{where}: max_tokens={mt!r} must be an int >= 1")
    arr = rec.get("arrival_s", 0.0)
    if isinstance(arr, bool) or not isinstance(arr, (int, float)) or not math.isfinite(arr) or arr < 0:
        raise ValueError(f"{where}: arrival_s={arr!r} must be a finite number >= 0")
    pt = rec.get("prompt_tokens")
    if pt is not None and (isinstance(pt, bool) or not isinstance(pt, int) or pt < 1):
        raise ValueError(f"{where}: prompt_tokens={pt!r} must be an int >= 1")
    return TraceRequest(rec["id"], rec["prompt"], mt, float(arr), pt)


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a JSONL trace, sorted by arrival time (stable).

    Raises:
      FileNotFoundError: no such file.
      ValueError: a malformed line (the message names file:line and the
        field), duplicate ids, or an empty trace.
    """
    p = Path(path)
    rows = [_parse_row(rec, f"{p}:{n}") for n, rec in iter_jsonl(p)]
    if not rows:
        raise ValueError(f"{p}: the trace has no requests")
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{p}: duplicate request id {dup!r}")
    rows.sort(key=lambda r: r.arrival_s)
    return rows[:limit] if limit is not None else rows


def save_trace(rows: Iterable[TraceRequest], path: str | Path) -> None:
    """Write a trace as JSON Lines."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r.to_json()) + "\n")


def _lengths(rng: np.random.Generator, dist: str, mean: float, n: int, lo: int, hi: int,
             sigma: float) -> np.ndarray:
    if dist == "lognormal":
        # Parameterized by the mean of the lengths: E[X] = exp(mu + sigma^2 / 2).
        mu = math.log(mean) - sigma ** 2 / 2
        x = rng.lognormal(mu, sigma, n)
    elif dist == "exponential":
        x = rng.exponential(mean, n)
    elif dist == "fixed":
        x = np.full(n, float(mean))
    else:
        raise ValueError(f"length distribution {dist!r} must be lognormal|exponential|fixed")
    return np.clip(np.round(x), lo, hi).astype(int)


def synthetic_trace(num_requests: int, *, request_rate: float = 4.0,
                    prompt_dist: str = "lognormal", prompt_mean: float = 32.0,
                    output_dist: str = "exponential", output_mean: float = 96.0,
                    sigma: float = 0.8, min_len: int = 4, max_prompt: int = 1024,
                    max_output: int = 512, seed: int = 0) -> list[TraceRequest]:
    """A reproducible synthetic trace.

    Args:
      num_requests: >= 1.
      request_rate: mean arrivals per second (Poisson: exponential gaps);
        inf puts every arrival at 0.
      prompt_dist / output_dist: "lognormal" (sigma = `sigma`), "exponential"
        or "fixed", each with the given mean in tokens, clipped to
        [min_len, max_prompt] / [min_len, max_output].
      seed: NumPy Generator seed.

    Returns requests whose prompt is `prompt_tokens - CHAT_OVERHEAD_TOKENS`
    common words (one BPE token each) and whose `prompt_tokens` is the target
    length including the chat template.

    Raises:
      ValueError: a non-positive count, rate, mean or bound, or an unknown
        distribution.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (inf: all at once)")
    for name, v in (("prompt_mean", prompt_mean), ("output_mean", output_mean), ("sigma", sigma)):
        if not v > 0:
            raise ValueError(f"{name}={v} must be > 0")
    if not 1 <= min_len <= min(max_prompt, max_output):
        raise ValueError(f"min_len={min_len} must be in [1, min(max_prompt, max_output)]")
    rng = np.random.default_rng(seed)
    body = _lengths(rng, prompt_dist, prompt_mean, num_requests, min_len, max_prompt, sigma)
    outs = _lengths(rng, output_dist, output_mean, num_requests, min_len, max_output, sigma)
    if math.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / request_rate, num_requests - 1))])
    rows = []
    for i in range(num_requests):
        words = [_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(int(body[i]))]
        rows.append(TraceRequest(f"syn{i}", " ".join(words), int(outs[i]), round(float(arrivals[i]), 4),
                                 int(body[i]) + CHAT_OVERHEAD_TOKENS))
    return rows


def approx_prompt_tokens(prompt: str, *, chat: bool = True) -> int:
    """Approximate token count of a prompt without a tokenizer.

    ceil(len(prompt) / CHARS_PER_TOKEN), plus the chat template's fixed
    CHAT_OVERHEAD_TOKENS when `chat`. On ../shared/bench/prompts.txt this is
    within 3 tokens of SmolLM2's real count for every prompt.
    """
    n = max(1, math.ceil(len(prompt) / CHARS_PER_TOKEN))
    return n + (CHAT_OVERHEAD_TOKENS if chat else 0)


def prompt_token_counter(tokenizer: Any | None, *, chat: bool = True) -> Callable[[TraceRequest], int]:
    """A function giving a request's prompt length in tokens.

    Order: the request's own `prompt_tokens`; else the tokenizer (chat
    template applied when `chat`, as `jaxserve generate` and the chat
    endpoint do); else `approx_prompt_tokens`.
    """
    def count(r: TraceRequest) -> int:
        if r.prompt_tokens is not None:
            return r.prompt_tokens
        if tokenizer is None:
            return approx_prompt_tokens(r.prompt, chat=chat)
        if chat:
            return len(tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}],
                                                     add_generation_prompt=True, tokenize=True))
        return len(tokenizer.encode(r.prompt, add_special_tokens=True))
    return count


def load_default_tokenizer() -> Any | None:
    """SmolLM2's tokenizer from the default GGUF (no weights read), or None if absent."""
    from jaxserve.checkpoint.default import DEFAULT_MODEL_PATH

    if not DEFAULT_MODEL_PATH.is_file():
        return None
    from jaxserve.checkpoint import load_tokenizer

    return load_tokenizer(DEFAULT_MODEL_PATH)


def percentiles(xs: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean", "median", "p90", "p99", ...} of xs (NaN for an empty list)."""
    a = np.asarray(list(xs), dtype=float)
    out = {"mean": float(a.mean()) if a.size else float("nan")}
    for q in qs:
        key = "median" if q == 50 else f"p{q:g}"
        out[key] = float(np.percentile(a, q)) if a.size else float("nan")
    return out
