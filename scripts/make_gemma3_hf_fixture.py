"""Write tests/fixtures/tiny_gemma3/: a random-init tiny HF `Gemma3ForCausalLM` and its
transformers goldens (issue 31, the HF safetensors Gemma 3 loader).

Runs in the fixture venv (checkpoints/fixture_venv: torch + transformers); imports nothing
from jaxserve, so every number comes from HF transformers' Gemma3ForCausalLM (float32,
eager attention, CPU). Usage:

  checkpoints/fixture_venv/bin/python scripts/make_gemma3_hf_fixture.py --out tests/fixtures

The config has mutually distinct sizes (V=75, E=48, F=88, H=4, K=2, D=32: H*D != E),
three sliding layers (window 6) and one global, query_pre_attn_scalar 24 (!= D),
final-logit soft-capping 5, and distinct RoPE bases (local 2e4, global 1e6). Every
weight, the norms included, is N(0, 0.2^2): HF stores Gemma's norm weight w and applies
(1 + w), so a loader that forgets the +1 (or adds it twice) fails loudly.

Writes (as scripts/make_golden.py writes its families): config.json,
generation_config.json, model.safetensors (tied embeddings), the tiny byte-level BPE
tokenizer, logits.npz (ids_<j> i32[T], logits_<j> f32[T, V] for T = 5, 9, 13: two
longer than the window) and greedy.json (16 greedy tokens from two prompts, each longer
than the window, with the top-2 logit gap of each step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import CHATML, greedy_for, logits_for, tiny_tokenizer  # noqa: E402

KW = dict(vocab_size=75, hidden_size=48, intermediate_size=88, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=6,
          layer_types=["sliding_attention", "sliding_attention", "full_attention",
                       "sliding_attention"],
          query_pre_attn_scalar=24, final_logit_softcapping=5.0, rms_norm_eps=1e-6,
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}},
          tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=1,
          eos_token_id=2, pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    d = ap.parse_args().out / "tiny_gemma3"
    shutil.rmtree(d, ignore_errors=True)
    cfg = Gemma3TextConfig(attn_implementation="eager", **KW)
    torch.manual_seed(500)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(d, safe_serialization=True)
    tok = tiny_tokenizer(KW["vocab_size"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}, indent=1))
    np.savez(d / "logits.npz", **logits_for(model, KW["vocab_size"], seed=31))
    runs = greedy_for(model, tok)
    assert all(len(r["prompt_ids"]) > KW["sliding_window"] for r in runs), runs
    (d / "greedy.json").write_text(json.dumps(
        {"source": f"transformers {__import__('transformers').__version__} Gemma3ForCausalLM"
                   ", float32, eager attention, greedy by full forwards", "runs": runs}, indent=1))
    print(f"wrote {d}: {sorted(p.name for p in d.iterdir())}")


if __name__ == "__main__":
    main()
