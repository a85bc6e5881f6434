"""The deviceless compile's plain-Python parts, on the suite's own venv (no plugin):
targets, ptxas report parsing, the memory-fit check, presets, abstract weights, and
the refusals that come before any compile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import make_engine_config
from jaxserve.gpu import compile as gpu_compile
from jaxserve.gpu.report import custom_calls, parse_ptxas
from jaxserve.gpu.targets import load_target, target_names

# ptxas -v output as XLA logs it for a Pallas Triton kernel (sm_80, captured 2026-12-02
# from `jaxserve compile`'s log: the fp32 prefill tile before the retiling).
PTXAS_LOG = """\
I1202 10:47:09.316745    8397 subprocess_compilation.cc:349] ptxas warning : Registers are spilled to local memory in function 'ragged_paged_attention_bq16_gp4_ppc4_bs16_d64', 10528 bytes spill stores, 17656 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'ragged_paged_attention_bq16_gp4_ppc4_bs16_d64' for 'sm_80'
ptxas info    : Function properties for ragged_paged_attention_bq16_gp4_ppc4_bs16_d64
    4160 bytes stack frame, 10528 bytes spill stores, 17656 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 4160 bytes cumulative stack size, 432 bytes cmem[0]
ptxas info    : Compile time = 2437.841 ms

I1202 10:47:09.548606    7251 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'input_reduce_fusion_6' for 'sm_90a'
ptxas info    : Function properties for input_reduce_fusion_6
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 1 barriers, 16640 bytes smem, 376 bytes cmem[0]
"""


def test_targets_name_their_gpu_and_limits():
    assert target_names() == ("a100", "h100", "h200")
    h200, h100, a100 = load_target("H200"), load_target("h100"), load_target("a100")
    assert (h200.compute_capability, h200.sm, h200.device_kind) == ((9, 0), "sm_90a", "NVIDIA H200")
    assert (a100.compute_capability, a100.sm) == ((8, 0), "sm_80")
    assert h100.device_kind == "NVIDIA H100 80GB HBM3" and h100.sm == "sm_90a"
    # spec sheets: 141 GB H200 (140.4 GiB usable), 80 GB H100 / A100; 227 / 163 KiB opt-in SMEM
    assert h200.memory_bytes == 150754820096 and a100.memory_bytes == 85094301696
    assert h200.smem_optin_bytes == 227 * 1024 and a100.smem_optin_bytes == 163 * 1024
    for t in (h200, h100, a100):
        assert t.text.lstrip().startswith("#") and "Spec-sheet" in t.text  # says its source


@pytest.mark.parametrize("bad", ["h999", "", "../h200", "H200 "])
def test_unknown_target_is_refused_naming_the_known_ones(bad):
    if bad == "H200 ":  # surrounding blanks are forgiven
        assert load_target(bad).name == "h200"
        return
    with pytest.raises(ValueError, match="known targets: a100, h100, h200"):
        load_target(bad)


def test_parse_ptxas_reads_registers_spills_and_smem():
    rows = parse_ptxas(PTXAS_LOG)
    assert rows == [
        {"kernel": "ragged_paged_attention_bq16_gp4_ppc4_bs16_d64", "arch": "sm_80",
         "registers": 32, "spill_bytes": 10528, "spill_load_bytes": 17656, "stack_bytes": 4160,
         "smem_bytes": 0},
        {"kernel": "input_reduce_fusion_6", "arch": "sm_90a", "registers": 24, "spill_bytes": 0,
         "spill_load_bytes": 0, "stack_bytes": 0, "smem_bytes": 16640}]


def test_collectives_are_read_off_the_compiled_hlo():
    from jaxserve.gpu.report import collectives

    hlo = ("%all-reduce-start = f32[4]{0} all-reduce-start(%x), replica_groups={{0,1}}\n"
           "%ag = f32[8]{0} all-gather(%y), dimensions={0}\n"
           "%fusion = f32[4]{0} fusion(%all-reduce-done), calls=%f\n")
    assert collectives(hlo) == ["all-reduce", "all-gather"]
    assert collectives("%a = f32[2] add(%x, %y)") == []


def test_custom_calls_lists_distinct_targets():
    hlo = ('%a = f32[2] custom-call(%x), custom_call_target="mosaic_gpu_v2", x\n'
           '%b = f32[2] custom-call(%y), custom_call_target="mosaic_gpu_v2"\n'
           '%c = f32[2] custom-call(%y), custom_call_target="__gpu$xla.gpu.triton"\n')
    assert custom_calls(hlo) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"]


def test_memory_need_of_llama3_8b_matches_its_parameter_count():
    cfg = ModelConfig.llama3_8b(dtype="bfloat16")
    config = make_engine_config(cfg, num_kv_blocks=1001, block_size=16)
    need = gpu_compile.memory_need(config)
    # 8,030,261,248 parameters (Meta-Llama-3-8B), 2 bytes each
    assert need["params_bytes"] == 8_030_261_248 * 2
    # K + V, 32 layers x 16 tokens x 8 heads x 128 x 2 bytes per block
    assert need["kv_cache_bytes"] == 1001 * 2 * 32 * 16 * 8 * 128 * 2
    tp4 = gpu_compile.memory_need(make_engine_config(cfg, num_kv_blocks=1001,
                                                     tensor_parallel_size=4))
    assert tp4["params_bytes"] == 8_030_261_248 * 2 // 4


def test_a_model_that_does_not_fit_is_refused_with_the_missing_amount():
    cfg = ModelConfig.llama3_8b(dtype="bfloat16")
    config = make_engine_config(cfg, kv_cache_memory_bytes=80_000 * 2**20)
    with pytest.raises(ValueError) as e:
        gpu_compile.compile_for_target(config, "a100")  # refused before any venv or compile
    need = 8_030_261_248 * 2 + (80_000 * 2**20 // 131072) * 131072
    missing = (need - 85094301696) / 2**30
    assert f"{missing:.2f} GiB missing" in str(e.value) and "A100" in str(e.value)
    gpu_compile.check_fits(config, load_target("h200"))  # 141 GB holds it


def test_model_config_presets_and_config_json(tmp_path):
    assert gpu_compile.model_config_from("llama3-8b", dtype="bfloat16").head_dim == 128
    assert gpu_compile.model_config_from("tiny-d64", dtype="float32").head_dim == 64
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = gpu_compile.model_config_from(str(tmp_path), dtype="bfloat16")
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.dtype) == (3, 64, "bfloat16")
    with pytest.raises(ValueError, match="neither a preset"):
        gpu_compile.model_config_from("llama9", dtype="bfloat16")


def test_abstract_params_have_real_shapes_and_no_memory():
    from jaxserve.gpu.deviceless import abstract_params
    from jaxserve.model.params import param_shapes

    cfg = ModelConfig.llama3_8b(dtype="bfloat16")
    tree, shapes = abstract_params(cfg), param_shapes(cfg)
    assert tree["layers"]["w_gate"].shape == tuple(shapes["layers"]["w_gate"]) == (32, 4096, 14336)
    assert tree["embed"].dtype.name == "bfloat16"
    leaves = [tree["embed"], tree["lm_head"], *tree["layers"].values()]
    assert all(x.strides == (0,) * x.ndim for x in leaves)  # one element of memory each
    assert not np.asarray(tree["layers"]["wq"][3]).any()


def test_a_pallas_kernel_is_named_by_its_call_not_by_its_operands():
    from jaxserve.gpu.report import is_pallas, pallas_lines

    hlo = ('%custom-call.3 = bf16[8,2,64]{2,1,0} custom-call(%input_concatenate_fusion, %p), '
           'custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(layers_fn)/'
           'ragged_paged_attention_bq4_gp4_ppc4_bs16_d64_w4/pallas_call"}, '
           'backend_config={name = "ragged_paged_attention_bq4_gp4_ppc4_bs16_d64_w4"}\n'
           '%input_concatenate_fusion = bf16[8,2,64]{2,1,0} fusion(%a, %b), kind=kLoop\n')
    lines = pallas_lines(hlo)
    assert len(lines) == 1
    assert is_pallas("ragged_paged_attention_bq4_gp4_ppc4_bs16_d64_w4", lines)
    assert not is_pallas("input_concatenate_fusion", lines)
    assert not is_pallas("ragged_paged_attention_bq4", lines)  # a prefix is another kernel
