"""The Tunix rollout adapter (jaxserve.integrations.tunix) against a local copy of the
shape of Tunix's `BaseRollout` (google-tunix 0.1.7, tunix/rl/rollout/base_rollout.py):
google-tunix does not import here (its package __init__ pulls in tensorflow_datasets,
grain, orbax, qwix, ...), so the methods' parameter names are copied below.
Scripted FakeRunner tokens make the expected arrays exact (see test_research_arrays)."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from jaxserve.integrations.tunix import JaxserveRollout, RolloutOutput, sampling_params_for
from test_research_arrays import EOS, eos_after, fake_llm

# BaseRollout's abstract methods and their parameters (after self), from Tunix 0.1.7.
TUNIX_SHAPE = {
    "generate": ["prompts", "rollout_config", "kwargs"],
    "get_per_token_logps": ["prompt_tokens", "completion_tokens"],
    "update_params": ["params", "filter_types"],
    "pad_id": [], "eos_id": [], "model": [],
}
TUNIX_OUTPUT_FIELDS = ["text", "logits", "tokens", "left_padded_prompt_tokens", "logprobs"]


@dataclasses.dataclass
class RolloutConfig:  # the fields of Tunix's RolloutConfig the adapter reads
    max_tokens_to_generate: int = 64
    temperature: float = 0.9
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: object = None
    max_prompt_length: int = 64
    eos_tokens: list[int] | None = None
    return_logprobs: bool = False


def test_adapter_has_tunix_rollout_shape():
    for name, params in TUNIX_SHAPE.items():
        sig = inspect.signature(getattr(JaxserveRollout, name))
        assert list(sig.parameters)[1:] == params, name
    assert [f.name for f in dataclasses.fields(RolloutOutput)] == TUNIX_OUTPUT_FIELDS


def test_generate_fills_rollout_output_exactly():
    # eos_after puts EOS at output position = the first prompt token the engine saw.
    # "c" = [6] -> 6 ordinary tokens, capped at 5; "b a a b" = [5, 3, 4, 3, 4, 3, 5] (no BOS
    # in the tiny tokenizer) is cut to its last 3 tokens [4, 3, 5] BEFORE generating, so
    # 4 ordinary tokens 10..13 ("ghij") then EOS (the uncut prompt would give 5, no EOS).
    ro = JaxserveRollout(fake_llm(eos_after))
    cfg = RolloutConfig(max_tokens_to_generate=5, temperature=0.7, seed=np.int32(3),
                        max_prompt_length=3, return_logprobs=True)
    out = ro.generate(["c", "b a a b"], cfg)
    assert isinstance(out, RolloutOutput) and out.logits == []
    assert out.left_padded_prompt_tokens.tolist() == [[0, 0, 6], [4, 3, 5]]  # last 3 kept
    assert [t.tolist() for t in out.tokens] == [[10, 11, 12, 13, 14], [10, 11, 12, 13, EOS]]
    assert out.text == ["ghijk", "ghij"]  # the EOS text is not output
    want = np.float32([-(p + 1) / 8 for p in range(5)])
    for lp in out.logprobs:
        np.testing.assert_array_equal(lp, want)
    assert ro.pad_id() == 0 and ro.eos_id() == EOS and ro.model() is None


def test_rollout_config_mapping_and_unsupported_paths():
    sp = sampling_params_for(RolloutConfig(top_p=None, top_k=None, seed=5, eos_tokens=[7]), 2)
    assert (sp.top_p, sp.top_k, sp.seed, sp.stop_token_ids, sp.logprobs) == (1.0, 0, 7, (7,), None)
    ro = JaxserveRollout(fake_llm())
    with pytest.raises(ValueError, match="same B"):
        ro.get_per_token_logps(np.zeros((1, 2), np.int32), np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] is empty"):
        ro.get_per_token_logps(np.zeros((1, 2), np.int32), np.ones((1, 2), np.int32))
    with pytest.raises(ValueError, match="filter_types"):
        ro.update_params({}, filter_types=(object,))
    with pytest.raises(TypeError, match="FakeRunner has no update_params"):
        ro.update_params({})
    with pytest.raises(ValueError, match="unsupported arguments"):
        ro.generate(["a"], RolloutConfig(), echo=True)


def _fake_score(t: int) -> float:
    # jaxserve.worker.scoring.fake_scores: the fake runner's teacher-forced score of token t.
    return np.float32(-0.1 * (1 + t % 5))


def test_get_per_token_logps_through_score():
    # Prompts left-padded with pad_id 0; completions up to and including the first EOS (2),
    # or all of the row; the fake's scores of the completion tokens, 0 after the completion.
    ro = JaxserveRollout(fake_llm())
    prompts = np.array([[0, 0, 6], [4, 3, 5]], np.int32)
    comps = np.array([[10, 11, EOS, 0], [12, 13, 14, 15]], np.int32)
    got = ro.get_per_token_logps(prompts, comps)
    want = np.array([[_fake_score(10), _fake_score(11), _fake_score(EOS), 0],
                     [_fake_score(t) for t in (12, 13, 14, 15)]], np.float32)
    assert got.shape == (2, 4) and got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    assert not ro.llm.engine.has_unfinished_requests()


def test_get_per_token_logps_on_the_tiny_model_equals_generate_logprobs():
    """Rollout logprobs at temperature 1 (Tunix's old-policy logps) equal the adapter's
    teacher-forced ones on a real model: the PPO/GRPO ratio starts at exactly 1."""
    from test_research_score import ARGS, module
    from conftest import tiny_tokenizer
    from jaxserve import LLM

    ro = JaxserveRollout(LLM.from_module(module(), tiny_tokenizer(), **ARGS))
    cfg = RolloutConfig(max_tokens_to_generate=12, temperature=1.0, seed=4,
                        max_prompt_length=8, return_logprobs=True)
    out = ro.generate(["the quick", "brown fox jumps"], cfg)
    C = max(len(t) for t in out.tokens)
    comps = np.full((2, C), ro.pad_id(), np.int32)
    for i, t in enumerate(out.tokens):
        comps[i, :len(t)] = t
    got = np.asarray(ro.get_per_token_logps(out.left_padded_prompt_tokens, comps))
    for i, (t, lp) in enumerate(zip(out.tokens, out.logprobs)):
        np.testing.assert_allclose(got[i, :len(t)], lp, atol=1e-4)
