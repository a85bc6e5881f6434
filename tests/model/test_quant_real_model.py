"""The shipped SmolLM2 Q4_1 file served with its blocks kept quantized (issue 26)
against HF transformers' greedy golden (made from the same Q4_1 weights)."""

from __future__ import annotations


import numpy as np
import pytest

from tests.model.test_real_model import assert_reproduces_hf_greedy

pytestmark = pytest.mark.slow  # needs the fetched SmolLM2 file (`make model`)


def test_q4_1_blocks_engine_reproduces_hf_greedy():
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.model.quant import QuantizedWeight, dequantize

    from jaxserve.checkpoint.gguf_quant import has_blocks

    path = resolve_model_path(None)
    assert has_blocks(path)
    cfg, params, tok = load_model(path, dtype="float32", quantization="auto")
    wq = params["layers"]["wq"]
    assert isinstance(wq, QuantizedWeight) and wq.kind == "q4"
    # the blocks are the file's: dequantized, they are the full-precision loader's weights
    _, full, _ = load_model(path, dtype="float32")
    np.testing.assert_array_equal(np.swapaxes(dequantize(wq.layer(3)), 0, 1),
                                  full["layers"]["wq"][3])
    np.testing.assert_array_equal(dequantize(params["embed"]), full["embed"])
    del full
    config = make_engine_config(cfg, max_model_len=128, block_size=16, num_kv_blocks=48,
                                max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32),
                                seq_buckets=(4,), attention_backend="xla", quantization="auto")
    engine = LLMEngine(config, params, tok, model_name="smollm2-q4_1", progress=False)
    assert_reproduces_hf_greedy(engine)
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    assert sum(x.nbytes for x in __import__("jax").tree.leaves(engine.runner.params)) < 120e6
