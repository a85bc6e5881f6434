"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against HF transformers golden files.

Needs checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf: `make model` fetches it
(`make test` does so first). A missing file fails with that instruction.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.checkpoint import load_model, resolve_model_path
from jaxserve.checkpoint.layout import tree_nbytes
from jaxserve.config import ModelConfig
from jaxserve.model.llama import reference_logits

from .conftest import FIXTURES

GOLDEN = json.loads((FIXTURES / "smollm2" / "greedy_golden.json").read_text())


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model_path(None)  # FileNotFoundError naming `make model` when absent
    return load_model(path, progress=False)  # default params cache: fast after the first run


def test_config_matches_published_smollm2(smollm2):
    cfg, params, tok = smollm2
    want = ModelConfig.smollm2_135m()
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(cfg, f) == getattr(want, f), f
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert "lm_head" not in params
    assert tree_nbytes(params) == 4 * 134_515_008  # fp32; 134.5M params (tied embeddings)
    assert tok.vocab_size == cfg.vocab_size


@pytest.mark.slow
def test_greedy_continuations_match_transformers(smollm2):
    """Teacher-forced logits over prompt + HF's 32 greedy tokens: our argmax must equal HF's
    token wherever HF's top-2 gap exceeds 1e-2 (smaller gaps are float-order ties), and the
    prompt's last-position top-20 logits must agree to 2e-3."""
    cfg, params, _ = smollm2
    checked = 0
    for run in GOLDEN["runs"]:
        prompt, greedy = run["prompt_ids"], run["greedy_ids"]
        ids = np.array(prompt + greedy[:-1], np.int32)
        logits = reference_logits(cfg, params, ids)  # [T, V]
        top = run["prompt_last_top20"]
        np.testing.assert_allclose(logits[len(prompt) - 1, top["ids"]], top["logits"], atol=2e-3)
        steps = logits[len(prompt) - 1:]  # row k predicts greedy[k]
        for k, (tok_id, gap) in enumerate(zip(greedy, run["top2_logit_gap"])):
            if gap > 1e-2:
                assert int(np.argmax(steps[k])) == tok_id, (run["greedy_text"], k)
                checked += 1
    assert checked >= 100
