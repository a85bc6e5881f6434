"""The Tunix rollout adapter with a LoRA policy (issue 27): rollouts and per-token
logprobs run on the adapter, and a LoRA-only `update_params(..., filter_types=...)`
swaps just its A/B: afterwards both equal the model merged by hand with the new A/B."""

from __future__ import annotations

import numpy as np

from conftest import tiny_engine, tiny_params
from lora.helpers import merged_params, random_adapter, to_peft_state_dict
from integrations.test_research_tunix import RolloutConfig

from jaxserve import LLM, LoRARequest
from jaxserve.integrations.tunix import JaxserveRollout
from jaxserve.model.llama import reference_logits


def _ref_logps(params, prompt, comp):
    cfg, _ = tiny_params()
    logits = reference_logits(cfg, params, np.array(prompt + comp)).astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    rows = lp[len(prompt) - 1:-1]
    return rows.argmax(-1), rows[np.arange(len(comp)), comp]


def test_lora_only_update_and_rollouts_on_the_adapter():
    eng = tiny_engine(max_loras=2, max_lora_rank=16)
    cfg, params = tiny_params()
    t0, t1 = random_adapter(cfg, 8, seed=80), random_adapter(cfg, 8, seed=81)
    ro = JaxserveRollout(LLM(engine=eng), lora_request=LoRARequest("policy", 9, t0))
    rc = RolloutConfig(max_tokens_to_generate=6, temperature=0.0, max_prompt_length=16,
                       return_logprobs=True)
    try:
        for tree in (t0, t1):
            out = ro.generate(["hello world"], rc)
            prompt = out.left_padded_prompt_tokens[0]
            prompt = prompt[prompt != ro.pad_id()].tolist()
            comp = out.tokens[0].tolist()
            greedy, ref = _ref_logps(merged_params(params, tree), prompt, comp)
            assert greedy.tolist() == comp
            np.testing.assert_allclose(out.logprobs[0], ref, atol=1e-4)
            scored = np.asarray(ro.get_per_token_logps(out.left_padded_prompt_tokens,
                                                       np.array([comp], np.int32)))
            np.testing.assert_allclose(scored[0], ref, atol=1e-4)
            # Tunix's LoRA-only sync (filter_types=(nnx.LoRAParam,)): PEFT's flat names here
            ro.update_params(to_peft_state_dict(t1), filter_types=("LoRAParam",))
        assert eng.lora.slots.version(9) == 2
    finally:
        eng.lora.remove_lora(9)
