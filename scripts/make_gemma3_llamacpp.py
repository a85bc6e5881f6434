"""Write tests/fixtures/gemma3/llamacpp_tokens.json: llama.cpp's greedy tokens on Gemma 3 270M.

The same Q4_K_M file as the HF golden (checkpoints/gemma-3-270m-q4_k_m.gguf), run by
`llama-server` (built by `jaxserve.bench.servers.ensure_llama_build`, the build `make
bench-compare` uses), CPU, one slot. Each short prompt of
tests/fixtures/gemma3/greedy_golden.json goes in as token ids (BOS included) to
/completion with top_k 1 (greedy), 6 new tokens, no prompt cache; the returned token ids
are written with the golden's first 6 for comparison. llama.cpp computes with quantized
activations (Q8 dot products of the Q4_K/Q5_0/Q6_K weights), so a near-tie may part it
from the float32 references; the test allows one prompt of four to differ.

    PYTHONPATH=. .venv/bin/python scripts/make_gemma3_llamacpp.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

from jaxserve.bench.servers import free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "gemma3" / "greedy_golden.json"
OUT = ROOT / "tests" / "fixtures" / "gemma3" / "llamacpp_tokens.json"
BIN = Path.home() / ".cache" / "jaxserve" / "llama.cpp" / "build-0.3.36" / "bin" / "llama-server"
N = 6


def main() -> None:
    cases = json.loads(GOLDEN.read_text())["cases"][:4]
    port = free_port()
    cmd = [str(BIN), "-m", str(ROOT / "checkpoints" / "gemma-3-270m-q4_k_m.gguf"), "--port",
           str(port), "-c", "2048", "-np", "1", "-t", "2", "--no-warmup"]
    proc = start_server(cmd, port, Path("/tmp/llamacpp_gemma3.log"), timeout_s=300)
    rows = []
    try:
        with httpx.Client(timeout=300) as client:
            for case in cases:
                r = client.post(f"http://127.0.0.1:{port}/completion", json={
                    "prompt": case["prompt_ids"], "n_predict": N, "top_k": 1, "temperature": 0.0,
                    "cache_prompt": False, "return_tokens": True, "add_special": False})
                r.raise_for_status()
                got = r.json()["tokens"]
                rows.append({"prompt_ids": case["prompt_ids"], "llamacpp": got,
                             "hf_golden": case["greedy"][:N], "agree": got == case["greedy"][:N]})
                print(rows[-1])
    finally:
        stop_server(proc)
    OUT.write_text(json.dumps({"source": f"llama-server ({BIN.parent.parent.name}), "
                                         f"{os.cpu_count()} CPUs, top_k 1", "cases": rows},
                              indent=1))
    print(f"wrote {OUT}: {sum(r['agree'] for r in rows)}/{len(rows)} prompts agree")


if __name__ == "__main__":
    main()
