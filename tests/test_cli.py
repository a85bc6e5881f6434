"""`jaxserve generate` end to end in a subprocess, on the tiny HF fixture checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_untied"


def greedy_reference(prompt_ids, n):
    from jaxserve.checkpoint import load_model
    from jaxserve.model.llama import reference_logits

    cfg, params, _ = load_model(FIXTURE, cache_dir=None, progress=False)
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(np.argmax(reference_logits(cfg, params, np.asarray(ids))[-1])))
    return ids[len(prompt_ids):]


def test_generate_cli_prints_outputs_and_summary(tmp_path):
    from jaxserve.checkpoint import load_tokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": m})
                                 for i, (p, m) in enumerate([("hello world", 5), ("abc", 3),
                                                            ("the cat", 4)])) + "\n")
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "jaxserve.cli", "generate", f"--model={FIXTURE}",
           f"--prompts_file={prompts}", "--chat=false", "--ignore_eos", "--max_num_seqs=2",
           "--max_num_batched_tokens=16", "--max_model_len=64", "--block_size=4",
           "--num_kv_blocks=64", "--compile_cache_dir=", "--executable_cache_dir=",
           f"--output_json={out_json}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "==== summary ====" in proc.stdout
    assert "requests 3  output tokens 12" in proc.stdout
    assert "compiles after warm-up 0" in proc.stdout
    result = json.loads(out_json.read_text())
    tok = load_tokenizer(FIXTURE, cache_dir=None)
    for rec, (p, m) in zip(result["outputs"], [("hello world", 5), ("abc", 3), ("the cat", 4)]):
        comp = rec["completions"][0]
        assert comp["finish_reason"] == "length"
        assert comp["token_ids"] == greedy_reference(tok.encode(p, add_special_tokens=True), m)
    assert result["summary"]["output_tokens"] == 12
    assert 0.0 <= result["summary"]["padding_fraction"] < 1.0


def test_generate_cli_missing_model_names_the_file(tmp_path):
    cmd = [sys.executable, "-m", "jaxserve.cli", "generate", f"--model={tmp_path / 'nope.gguf'}",
           "--prompt=hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "nope.gguf" in proc.stderr


def test_engine_process_with_several_hosts_is_refused_before_joining():
    """No coordinator is given: the refusal comes before `jax.distributed` is joined."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--engine_process",
           "--num_processes=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]  # absl prints the usage, then the error
    assert last.startswith("--engine_process with --num_processes=2 is not supported")
