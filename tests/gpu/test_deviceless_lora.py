"""Issue 27: the LoRA step programs in the deviceless GPU compile (H200: Mosaic, A100:
Triton). The tiny model with max_loras=2, max_lora_rank=8 compiles every warm-up
program for the GPU, and the layers program's arguments hold the KV cache, the
weights and exactly the adapter pool (A [in, S, r] and B [S, r, out] per target
projection and layer, bf16). Needs `.venv-gpu` (skipped without it)."""

from __future__ import annotations

import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import make_engine_config
from jaxserve.gpu import venv as gpu_venv
from jaxserve.lora.adapter import target_shapes

pytestmark = pytest.mark.skipif(not gpu_venv.is_ready(), reason="no .venv-gpu (make gpu-venv)")


@pytest.mark.parametrize("target", ["h200", "a100"])
def test_lora_programs_compile_deviceless(target):
    from jaxserve.gpu.compile import compile_for_target

    cfg = ModelConfig.tiny(head_dim=64, dtype="bfloat16")
    S, r = 2, 8
    config = make_engine_config(cfg, max_num_seqs=2, max_num_batched_tokens=2, max_model_len=64,
                                token_buckets=(2,), seq_buckets=(2,), num_kv_blocks=16,
                                enable_prompt_logprobs=False, max_loras=S, max_lora_rank=r)
    rep = compile_for_target(config, target)
    assert rep["failed"] == [] and [tuple(p["key"]) for p in rep["programs"]] == [
        ("stack", 2), ("head", 2), ("merge_placeholders", 2)]
    layers = next(x for x in rep["programs"][0]["parts"] if x["part"] == "layers")
    L, N, B, K, D = 2, 16, 16, 2, 64
    E, H, F = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    kv = 2 * L * N * B * K * D * 2
    weights = L * 2 * (2 * E + E * H * D + 2 * E * K * D + H * D * E + 3 * E * F)
    pool = L * 2 * S * r * sum(i + o for i, o in target_shapes(cfg).values())
    arg = layers["memory"]["argument"]
    assert kv + weights + pool <= arg <= kv + weights + pool + 4096, (arg, kv + weights + pool)
