"""A real PEFT adapter on SmolLM2 against HF transformers + peft (issue 27).

tests/fixtures/smollm2_lora/ is written by scripts/make_lora_fixture.py in the fixture
venv: peft's rank-4 LoRA on q_proj and v_proj with non-zero B (random init, then 8 Adam
steps), saved with save_pretrained, and HF + peft's 16 greedy tokens (and the base
model's) on the first chat prompt of the SmolLM2 golden fixture. The engine loads the
directory as it is and must reproduce HF + peft's tokens, which differ from the base's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve import LoRARequest
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # needs the fetched SmolLM2 file (`make model`)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "smollm2_lora"


def test_peft_adapter_matches_hf_peft_greedy():
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config

    golden = json.loads((FIXTURE / "greedy.json").read_text())
    assert min(golden["lora_top2_logit_gap"]) > 0.05  # no near-tie excuses needed
    cfg, params, tok = load_model(resolve_model_path(None), dtype="float32")
    config = make_engine_config(cfg, max_model_len=128, block_size=16, num_kv_blocks=24,
                                max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(2, 32),
                                seq_buckets=(2,), attention_backend="xla", max_loras=1,
                                max_lora_rank=4, enable_prompt_logprobs=False)
    eng = LLMEngine(config, params, tok, model_name="smollm2", progress=False)
    sp = SamplingParams(max_tokens=len(golden["lora_greedy_ids"]), temperature=0.0,
                        ignore_eos=True)
    eng.add_request("lora", golden["prompt_ids"], sp,
                    lora_request=LoRARequest("peft", 1, str(FIXTURE)))
    eng.add_request("base", golden["prompt_ids"], sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert list(outs["lora"].outputs[0].token_ids) == golden["lora_greedy_ids"]
    assert list(outs["base"].outputs[0].token_ids) == golden["base_greedy_ids"]
    assert golden["lora_greedy_ids"] != golden["base_greedy_ids"]
