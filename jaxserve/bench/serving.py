"""`jaxserve bench serve`: a load generator for any OpenAI-compatible server.

    jaxserve bench serve --base_url=http://127.0.0.1:8000/v1 \
        --trace=../shared/bench/ragged64.jsonl --request_rate=4 --goodput ttft:2000 tpot:100

Works against jaxserve, vLLM and llama.cpp's `llama-server` alike: it only
uses `POST /v1/completions` or `/v1/chat/completions` with `stream=true`,
parses the Server-Sent Events itself (httpx async streaming) and sends the
vLLM extra body field `ignore_eos` next to `max_tokens`. The metric
definitions follow vLLM's `benchmarks/benchmark_serving.py` (and DistServe,
OSDI'24, for goodput):

- TTFT: request sent -> first chunk with non-empty text.
- ITL: gaps between successive text chunks.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), requests with >= 2 tokens.
- E2EL: request sent -> stream finished.
- output tokens: `usage.completion_tokens` of the final chunk when the server
  sends it (we ask with `stream_options.include_usage`); otherwise the number
  of text chunks (one token per chunk, which over-merges when a server packs
  several tokens into one chunk). The source is recorded per request.
- goodput: requests per second that finished AND met every SLO given
  (`--goodput ttft:MS tpot:MS e2el:MS`).

A request fails on a non-200 status, a transport error, an `error` object in
the stream, or a stream that ends without `[DONE]` or a finish_reason. Failed
requests are counted and listed with their error; they do not enter the
latency percentiles, and the completed/failed counts always sum to the
number sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from jaxserve.bench.traces import TraceRequest, load_trace, percentiles, synthetic_trace

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; `error` is None on success."""

    id: str
    max_tokens: int
    send_s: float = 0.0              # when it was sent, seconds since the run began
    success: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" | "chunks"
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (seconds).

    Raises:
      ValueError: an unknown metric or a value that is not a positive number.
    """
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, val = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput item {item!r} must be METRIC:MS with METRIC in {SLO_KEYS}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput item {item!r}: {val!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput item {item!r}: the SLO must be > 0 ms")
        slos[key] = ms / 1e3
    return slos


def arrival_offsets(rows: Sequence[TraceRequest], request_rate: float | None, burstiness: float,
                    seed: int) -> list[float]:
    """Send times in seconds from the start.

    request_rate None: the trace's own `arrival_s`. inf: all at 0. Otherwise
    gaps drawn from Gamma(shape=burstiness, scale=1/(rate*burstiness)), whose
    mean is 1/rate; burstiness 1 is a Poisson process, < 1 burstier, > 1
    more regular.
    """
    if request_rate is None:
        return [r.arrival_s for r in rows]
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (inf sends everything at once)")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness} must be > 0")
    if math.isinf(request_rate):
        return [0.0] * len(rows)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), len(rows))
    gaps[0] = 0.0
    return list(np.cumsum(gaps))


def _body(row: TraceRequest, *, endpoint: str, model: str, ignore_eos: bool,
          temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": row.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": float(temperature)}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": row.prompt}]
    else:
        body["prompt"] = row.prompt
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in chunk.get("choices") or ():
        if endpoint == "chat":
            text += (ch.get("delta") or {}).get("content") or ""
        else:
            text += ch.get("text") or ""
        finish = ch.get("finish_reason") or finish
    return text, finish


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], res: RequestResult,
                endpoint: str, t_start: float) -> None:
    """Stream one request into `res` (never raises)."""
    t0 = time.perf_counter()
    res.send_s = t0 - t_start
    last = t0
    chunks, usage_tokens, done = 0, None, False
    try:
        async with client.stream("POST", url, json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                text, finish = _chunk_text(chunk, endpoint)
                now = time.perf_counter()
                if text:
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    res.text += text
                res.finish_reason = finish or res.finish_reason
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    res.prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return
    res.e2el = time.perf_counter() - t0
    if not done and res.finish_reason is None:
        res.error = "stream ended without [DONE] or a finish_reason"
        return
    if usage_tokens is not None:
        res.output_tokens, res.output_tokens_source = usage_tokens, "usage"
    else:
        res.output_tokens, res.output_tokens_source = chunks, "chunks"
    if res.output_tokens == 0 or res.ttft is None:
        res.error = "no output tokens"
        return
    res.success = True


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first id of GET {base_url}/models, or "default" when the server has no such route."""
    try:
        r = await client.get(f"{base_url}/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


async def run_requests(rows: Sequence[TraceRequest], *, base_url: str, endpoint: str = "chat",
                       model: str | None = None, request_rate: float | None = None,
                       burstiness: float = 1.0, max_concurrency: int | None = None,
                       ignore_eos: bool = True, temperature: float = 0.0, seed: int = 0,
                       timeout_s: float = 600.0, api_key: str | None = None
                       ) -> tuple[list[RequestResult], float, str]:
    """Send every request on its schedule; return (results in trace order, duration_s, model).

    Raises:
      ValueError: a bad endpoint, rate, burstiness or concurrency.
    """
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint={endpoint!r} must be 'chat' or 'completions'")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    offsets = arrival_offsets(rows, request_rate, burstiness, seed)
    base_url = base_url.rstrip("/")
    url = f"{base_url}/chat/completions" if endpoint == "chat" else f"{base_url}/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(rows)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 headers=headers) as client:
        model = model or await resolve_model(client, base_url)
        results = [RequestResult(r.id, r.max_tokens) for r in rows]
        t_start = time.perf_counter()

        async def one(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:  # --max_concurrency: the arrival waits for a free slot
                body = _body(rows[i], endpoint=endpoint, model=model, ignore_eos=ignore_eos,
                             temperature=temperature)
                await _send(client, url, body, results[i], endpoint, t_start)

        await asyncio.gather(*(one(i) for i in range(len(rows))))
        duration = time.perf_counter() - t_start
    return results, duration, model


def _meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """All SLOs met; a 1-token request has no TPOT and is judged on the others."""
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    for k, limit in slos.items():
        if k == "tpot" and got[k] is None:
            continue
        if got[k] is None or got[k] > limit:
            return False
    return True


def summarize(results: Sequence[RequestResult], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate metrics; latencies in milliseconds, throughputs per second of wall time.

    Every sent request is either `completed` or `failed`; failures keep their
    error text under `errors`.
    """
    ok = [r for r in results if r.success]
    bad = [r for r in results if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    vals = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
            "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    s: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(bad),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_throughput": out_tokens / duration_s if duration_s > 0 else float("nan"),
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tokens_source": sorted({r.output_tokens_source for r in ok}),
        "expected_output_tokens": sum(r.max_tokens for r in results),
    }
    for m in METRICS:
        s[f"{m}_ms"] = {k: v * 1e3 for k, v in percentiles(vals[m]).items()}
    if slos:
        good = [r for r in ok if _meets_slos(r, slos)]
        s["goodput"] = {"slos_ms": {k: v * 1e3 for k, v in slos.items()}, "good_requests": len(good),
                        "request_goodput": len(good) / duration_s if duration_s > 0 else float("nan")}
    errors: dict[str, int] = {}
    for r in bad:
        errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    s["errors"] = errors
    return s


def print_table(s: dict[str, Any]) -> None:
    """The summary as a fixed-width table on stdout."""
    print(f"{'requests sent':<28}{s['num_requests']:>12}")
    print(f"{'completed':<28}{s['completed']:>12}")
    print(f"{'failed':<28}{s['failed']:>12}")
    print(f"{'duration (s)':<28}{s['duration_s']:>12.2f}")
    print(f"{'request throughput (req/s)':<28}{s['request_throughput']:>12.2f}")
    print(f"{'output throughput (tok/s)':<28}{s['output_throughput']:>12.1f}")
    print(f"{'output tokens':<28}{s['total_output_tokens']:>12}  (source: "
          f"{'/'.join(s['output_tokens_source']) or '-'})")
    if "goodput" in s:
        g = s["goodput"]
        print(f"{'goodput (req/s)':<28}{g['request_goodput']:>12.2f}  ({g['good_requests']} met "
              + ", ".join(f"{k}<={v:g}ms" for k, v in g["slos_ms"].items()) + ")")
    print(f"{'metric (ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for m in METRICS:
        d = s[f"{m}_ms"]
        print(f"{m.upper():<12}" + "".join(f"{d[k]:>10.1f}" for k in ("mean", "median", "p90", "p99")))
    for err, n in s["errors"].items():
        print(f"  failed x{n}: {err}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base_url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", default=None, help="model name to send (default: first of GET /models)")
    p.add_argument("--trace", default=None, help="JSONL trace; without it a synthetic trace is made")
    p.add_argument("--num_prompts", type=int, default=None, help="use the first N requests")
    p.add_argument("--synthetic_requests", type=int, default=64)
    p.add_argument("--synthetic_output_mean", type=float, default=96.0)
    p.add_argument("--synthetic_prompt_mean", type=float, default=32.0)
    p.add_argument("--request_rate", type=float, default=None,
                   help="requests/s (inf: all at once); default: the trace's arrival_s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max_concurrency", type=int, default=None)
    p.add_argument("--ignore_eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. --goodput ttft:2000 tpot:100 e2el:30000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout_s", type=float, default=600.0)
    p.add_argument("--api_key", default=None)
    p.add_argument("--output_json", default=None)
    p.add_argument("--save_per_request", action=argparse.BooleanOptionalAction, default=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (argv: the arguments after `bench serve`). Returns 0, or 1 if any request failed."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    slos = parse_goodput(args.goodput)
    if args.trace:
        rows = load_trace(args.trace, limit=args.num_prompts)
    else:
        rows = synthetic_trace(args.num_prompts or args.synthetic_requests,
                               request_rate=args.request_rate or 4.0,
                               prompt_mean=args.synthetic_prompt_mean,
                               output_mean=args.synthetic_output_mean, seed=args.seed)
    results, duration, model = asyncio.run(run_requests(
        rows, base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, timeout_s=args.timeout_s,
        api_key=args.api_key))
    s = summarize(results, duration, slos)
    cfg = {k: v for k, v in vars(args).items() if k != "api_key"}
    cfg["model"] = model
    print_table(s)
    if args.output_json:
        doc = {"config": cfg, "summary": s}
        if args.save_per_request:
            doc["requests"] = [{k: v for k, v in asdict(r).items() if k != "text"} | {"tpot": r.tpot}
                               for r in results]
        Path(args.output_json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.output_json}")
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
