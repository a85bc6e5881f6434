"""The default dtype follows the platform (issue 25 item 3): bf16 on a GPU / TPU and for
`jaxserve compile --target`, f32 on CPU, for every model family; an explicit dtype wins."""

from __future__ import annotations

import jax
import pytest

from jaxserve.config import HF_FAMILIES, ModelConfig, platform_dtype
from jaxserve.engine import make_engine_config
from jaxserve.gpu.command import GPU_DTYPE, model_config

HF = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2)


def _families():
    for name, (arch, _) in HF_FAMILIES.items():
        yield name, ModelConfig.from_hf_dict(dict(HF, architectures=[arch], model_type=name))


def test_cpu_default_is_float32_everywhere():
    assert jax.default_backend() == "cpu" and platform_dtype() == "float32"
    assert ModelConfig.tiny().dtype == ModelConfig.smollm2_135m().dtype == "float32"
    assert {name: cfg.dtype for name, cfg in _families()} == dict.fromkeys(HF_FAMILIES, "float32")
    # None keeps the model's dtype; a value replaces it
    assert make_engine_config(ModelConfig.tiny(), dtype=None).model.dtype == "float32"
    assert make_engine_config(ModelConfig.tiny(), dtype="bfloat16").model.dtype == "bfloat16"


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerator_default_is_bfloat16_for_every_family(monkeypatch, platform):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    assert platform_dtype() == "bfloat16"
    assert ModelConfig.tiny().dtype == "bfloat16"
    assert ModelConfig.tiny(dtype="float32").dtype == "float32"  # explicit wins
    assert {name: cfg.dtype for name, cfg in _families()} == dict.fromkeys(HF_FAMILIES,
                                                                          "bfloat16")


def test_compile_target_defaults_to_bfloat16_on_this_cpu():
    assert GPU_DTYPE == "bfloat16"
    assert model_config(None, "llama3-8b", dtype=GPU_DTYPE).dtype == "bfloat16"
    assert model_config(None, "smollm2-135m", dtype="float32").dtype == "float32"
