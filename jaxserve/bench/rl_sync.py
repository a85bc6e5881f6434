"""An RL-shaped loop with a weight update every few engine steps, per pause mode (issue 28).

    python scripts/bench_rl_sync.py --steps=48 --update_every=4 --out=rl_sync.json

Asynchronous RL keeps rollouts in flight while the trainer pushes weights. Here 8
prompts x n=4 rollouts (temperature 1, `max_tokens` each, EOS ignored) are kept in
flight on SmolLM2: a group that finishes is sent again at once. Every `update_every`
engine steps the weights are swapped (A, B, A, ...; B is A scaled by 1 + 1e-3) with
`update_params(params, in_flight=mode)`. Reported per mode ("abort", "wait", "keep",
"retract"):

- useful tokens/s: tokens of rollouts that finished normally, over wall time
  (weight swaps included);
- discarded tokens per update: tokens of rollouts an update failed ("abort"),
  which the trainer must generate again;
- recomputed tokens per update: tokens whose KV an update threw away so they are
  prefilled again ("retract": prompt + tokens so far);
- the rollouts finished, and how many of them mix weight versions.

`wait` discards nothing but stops admitting new rollouts while it drains, so its
cost shows in tokens/s. The counts come from the outputs the engine returns (and
`token_weight_versions`), not from the scheduler.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Sequence

from jaxserve.engine.pause import PAUSE_MODES
from jaxserve.sampling_params import SamplingParams

PROMPTS = ["Write a haiku about rain.", "What is 17 times 23?", "Name three prime numbers.",
           "Explain gravity to a child.", "Give a synonym for happy.", "Translate 'cat' to French.",
           "List two colors of the sky.", "Why do leaves fall?"]


def run_mode(engine: Any, mode: str, weights: Sequence[Any], prompt_ids: Sequence[list[int]],
             *, n: int = 4, max_tokens: int = 24, update_every: int = 4,
             steps: int = 48) -> dict[str, Any]:
    """Run the loop for `steps` engine steps under one pause mode; the counts.

    Args:
      engine: an idle `LLMEngine` over a runner that can swap weights.
      weights: the parameter trees the updates cycle through (weights[0] is loaded first).
      prompt_ids: token ids of the prompts, kept in flight as groups of `n` rollouts.

    Raises:
      ValueError: an unknown mode, or fewer than 2 weight trees.
    """
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r} must be one of {PAUSE_MODES}")
    if len(weights) < 2:
        raise ValueError(f"got {len(weights)} weight trees; the updates need at least 2")
    engine.update_params(weights[0])
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    live: dict[str, int] = {}  # request id -> tokens generated so far (all n samples)
    prompt_of: dict[str, int] = {}
    counter = iter(range(10**9))

    def submit(i: int) -> None:
        rid = f"rl-{mode}-{next(counter)}"
        engine.add_request(rid, prompt_ids[i], sp)
        live[rid], prompt_of[rid] = 0, i

    for i in range(len(prompt_ids)):
        submit(i)
    c = dict(useful=0, discarded=0, recomputed=0, finished=0, mixed=0, updates=0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for out in engine.step():
            if out.request_id not in live:
                continue
            toks = sum(len(o.token_ids) for o in out.outputs)
            live[out.request_id] = toks
            if not out.finished:
                continue
            del live[out.request_id]
            if any(o.finish_reason == "error" for o in out.outputs):
                c["discarded"] += toks
            else:
                c["useful"] += toks
                c["finished"] += len(out.outputs)
                c["mixed"] += sum(len(set(o.token_weight_versions)) > 1 for o in out.outputs)
            submit(prompt_of.pop(out.request_id))
        if step % update_every == 0:
            if mode == "retract":  # their prompt + tokens so far are prefilled again
                c["recomputed"] += sum(len(prompt_ids[prompt_of[r]]) * n + t
                                       for r, t in live.items() if t)
            c["updates"] += 1
            engine.update_params(weights[c["updates"] % len(weights)], in_flight=mode)
    wall = time.perf_counter() - t0
    for rid in list(live):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    u = max(c["updates"], 1)
    return {"mode": mode, "steps": steps, "update_every": update_every, "wall_s": round(wall, 3),
            "useful_tokens": c["useful"], "useful_tokens_per_s": round(c["useful"] / wall, 1),
            "discarded_tokens_per_update": round(c["discarded"] / u, 1),
            "recomputed_tokens_per_update": round(c["recomputed"] / u, 1),
            "rollouts_finished": c["finished"], "rollouts_mixed_versions": c["mixed"],
            "updates": c["updates"]}


def perturbed(params: Any, scale: float = 1e-3) -> Any:
    """`params` with every floating leaf scaled by 1 + scale (NumPy copies)."""
    import jax
    import numpy as np

    def f(x: Any) -> Any:
        a = np.asarray(x)
        return a * np.asarray(1 + scale, a.dtype) if np.issubdtype(a.dtype, np.floating) else a
    return jax.tree.map(f, params)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf / HF dir (default: SmolLM2)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--update_every", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=24)
    ap.add_argument("--modes", default=",".join(PAUSE_MODES))
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config

    cfg, params, tok = load_model(resolve_model_path(args.model), dtype="float32")
    config = make_engine_config(cfg, max_model_len=128, block_size=16, num_kv_blocks=512,
                                max_num_seqs=32, max_num_batched_tokens=128,
                                token_buckets=(32, 128), seq_buckets=(32,),
                                enable_prompt_logprobs=False)
    engine = LLMEngine(config, params, tok, model_name="bench-rl")
    ids = [tok.encode(p) for p in PROMPTS]
    weights = [params, perturbed(params)]
    rows = []
    for mode in args.modes.split(","):
        row = run_mode(engine, mode, weights, ids, max_tokens=args.max_tokens,
                       update_every=args.update_every, steps=args.steps)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
