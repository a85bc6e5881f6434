"""Greedy agreement of llama.cpp, jaxserve and HF on the shipped SmolLM2 Q4_1 file (issue 26).

Runs `llama-server` (the build `make bench-compare` uses; CPU, one slot, `-t 2`,
otherwise default settings) on checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf and
sends each of the 32 chat-templated prompts of
tests/fixtures/smollm2/greedy32_golden.json as token ids to /completion: 16 new
tokens, temperature 0 with top_k 1, `n_probs` 2 for the chosen token's logprob,
no prompt cache. Then (unless --no-jaxserve) runs the jaxserve engine on the
same file with its Q4_1 blocks kept (quantization="auto") on the same ids.
Prints the agreement counts under the near-tie rule (equal up to the first step
whose HF top-2 gap is below 1e-3) and the chosen-token logprob drift against HF;
writes everything to --out (JSON) for the notes.

    PYTHONPATH=. .venv/bin/python scripts/compare_greedy_llamacpp.py --out /tmp/greedy32_cmp.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import httpx

from jaxserve.bench.servers import free_port, start_server, stop_server
from tests.model.test_quant_real_model import GOLDEN32, greedy32_agreement, greedy32_outputs
from tests.model.test_real_model import agree_until_near_tie

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# <|im_end|>, SmolLM2's end-of-generation token (tokenizer.ggml.eos_token_id)
EOS = 2
BIN = Path.home() / ".cache" / "jaxserve" / "llama.cpp" / "build-0.3.36" / "bin" / "llama-server"


def chosen_logprobs(body: dict) -> list[float]:
    """The chosen tokens' logprobs from /completion's `completion_probabilities`."""
    out = []
    for step in body.get("completion_probabilities", []):
        if "logprob" in step:  # newer servers: {id, logprob, top_logprobs}
            out.append(float(step["logprob"]))
        else:  # older ones: {content, probs: [{tok_str, prob}]}, chosen first under top_k 1
            out.append(math.log(max(step["probs"][0]["prob"], 1e-30)))
    return out


def llamacpp_run(client, url: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens after `prompt`, EOS not stopping, as HF's golden (eos_token_id=None).

    llama.cpp's ignore_eos masks the EOS logit, which would change the greedy
    token where EOS wins; so EOS stops the request (this build returns the EOS
    in "tokens"), and the rest is asked for again with the EOS in the prompt.
    """
    ids, lps = [], []
    while len(ids) < n:
        r = client.post(url, json={
            "prompt": prompt + ids, "n_predict": n - len(ids), "temperature": 0.0, "top_k": 1,
            "n_probs": 2, "cache_prompt": False, "return_tokens": True, "add_special": False})
        r.raise_for_status()
        body = r.json()
        got, got_lps = body["tokens"], chosen_logprobs(body)
        ids += got
        lps += got_lps[:len(got)]
        if len(ids) < n and body.get("stop_type") != "eos":
            raise RuntimeError(f"llama-server stopped early: {body.get('stop_type')=}")
        if len(ids) < n and (not got or got[-1] != EOS):  # builds that leave the EOS out
            ids.append(EOS)
            lps.append(float("nan"))
    return ids, lps


def llamacpp_greedy(golden: dict) -> list[tuple[list[int], list[float]]]:
    port = free_port()
    cmd = [str(BIN), "-m", str(MODEL), "--port", str(port), "-np", "1", "-t", "2"]
    proc = start_server(cmd, port, Path("/tmp/llamacpp_smollm2_greedy32.log"), timeout_s=300)
    try:
        with httpx.Client(timeout=300) as client:
            return [llamacpp_run(client, f"http://127.0.0.1:{port}/completion", run["prompt_ids"],
                                 golden["max_new_tokens"]) for run in golden["runs"]]
    finally:
        stop_server(proc)


def jaxserve_greedy(golden: dict) -> list[tuple[list[int], list[float]]]:
    from jaxserve.checkpoint import load_model
    from jaxserve.engine import LLMEngine, make_engine_config

    cfg, params, tok = load_model(MODEL, dtype="float32", quantization="auto")
    config = make_engine_config(cfg, max_model_len=128, block_size=16, num_kv_blocks=48,
                                max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32),
                                seq_buckets=(4,), attention_backend="xla", quantization="auto")
    engine = LLMEngine(config, params, tok, model_name="smollm2-q4_1", progress=False)
    return greedy32_outputs(engine, golden)


def pairwise(a: list, b: list, golden: dict) -> dict:
    """a vs b: prompts with all tokens equal, and equal but for a divergence at a step whose
    HF top-2 gap is a near tie (the test's rule, with b in place of HF's tokens)."""
    exact, up_to_tie = 0, 0
    for (x, _), (y, _), run in zip(a, b, golden["runs"], strict=True):
        exact += x == y
        up_to_tie += agree_until_near_tie(x, y, run["top2_logit_gap"])[0]
    return {"exact": exact, "equal_up_to_hf_near_tie": up_to_tie, "of": len(a)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/greedy32_cmp.json")
    ap.add_argument("--no-jaxserve", action="store_true")
    a = ap.parse_args()
    golden = json.loads(GOLDEN32.read_text())
    res = {"llamacpp": llamacpp_greedy(golden)}
    report = {"llamacpp_vs_hf": greedy32_agreement(res["llamacpp"], golden)}
    if not a.no_jaxserve:
        res["jaxserve_q4"] = jaxserve_greedy(golden)
        report["jaxserve_q4_vs_hf"] = greedy32_agreement(res["jaxserve_q4"], golden)
        report["jaxserve_q4_vs_llamacpp"] = pairwise(res["jaxserve_q4"], res["llamacpp"], golden)
    for k, v in report.items():
        print(k, json.dumps(v))
    Path(a.out).write_text(json.dumps({"report": report, "outputs": res}))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
