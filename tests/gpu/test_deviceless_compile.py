"""Deviceless GPU compiles of the tiny model's engine programs (issue 25 item 5).

`ModelConfig.tiny(head_dim=64)` (both kernels tile head_dim 64) is compiled for
sm_90a (H200: the Mosaic GPU kernel) and sm_80 (A100: the Triton kernel), each
through `jaxserve.gpu.compile.compile_for_target` (a worker in the plugin venv with
JAX_PLATFORMS=cpu). A decode bucket (T = 2 <= 2 S) and a mixed one (T = 8) get the
kernel's two tile shapes. Needs `.venv-gpu` (`make gpu-venv`; `make test` builds it):
skipped without it. Run alone with `.venv/bin/python -m pytest -k deviceless`.
"""

from __future__ import annotations

import json
import pickle

import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import make_engine_config
from jaxserve.gpu import venv as gpu_venv
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.worker.executable_cache import MAGIC, SUFFIX, ExecutableCache

pytestmark = pytest.mark.skipif(not gpu_venv.is_ready(), reason="no .venv-gpu (make gpu-venv)")

CASES = {"h200": ("pallas_mosaic", "mosaic_gpu_v2", "sm_90a", "ragged_paged_attention_mosaic"),
         "a100": ("pallas_triton", "__gpu$xla.gpu.triton", "sm_80", "ragged_paged_attention_bq")}


def tiny_config(dtype: str = "bfloat16"):
    cfg = ModelConfig.tiny(head_dim=64, dtype=dtype)
    return make_engine_config(cfg, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                              token_buckets=(2, 8), seq_buckets=(2,), num_kv_blocks=16,
                              enable_prompt_logprobs=False)


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    from jaxserve.gpu.compile import compile_for_target

    target = request.param
    cache = tmp_path_factory.mktemp(f"exe_{target}")
    rep = compile_for_target(tiny_config(), target, executable_cache_dir=str(cache))
    return target, rep, cache


def test_deviceless_compile_covers_the_warmup_set_with_the_pallas_kernel(compiled):
    target, rep, _ = compiled
    backend, call, arch, kernel = CASES[target]
    config = tiny_config()
    # exactly the programs warm-up builds (BucketPolicy's set; no score family here), and
    # the placeholder merge of each token bucket (async scheduling's, on by default on GPU)
    keys = BucketPolicy.from_config(config.scheduler).program_keys(score=False)
    assert sorted(keys) == [("head", 2), ("stack", 2), ("stack", 8)]
    keys += [("merge_placeholders", 2), ("merge_placeholders", 8)]
    assert sorted(map(tuple, rep["keys"])) == sorted(keys)
    assert sorted(tuple(p["key"]) for p in rep["programs"]) == sorted(keys)
    assert rep["failed"] == [] and rep["backend"] == backend and rep["sm"] == arch
    L, N, B, K, D = 2, 16, 16, 2, 64
    for p in rep["programs"]:
        parts = {x["part"]: x for x in p["parts"]}
        if p["key"][0] == "merge_placeholders":  # ids i32[T], sources i32[T], head ids i32[S_max]
            T, S_max = p["key"][1], 2  # the config's max_num_seqs
            assert parts[""]["memory"]["argument"] == 4 * (2 * T + S_max), parts[""]["memory"]
            assert not any(k["pallas"] for k in p["kernels"]), p["kernels"]
            continue
        if p["key"][0] == "head":
            assert not any(c in parts[""]["custom_calls"] for c in CASES[target][1:2])
            continue
        # GPU default: all L layers in one program, between the embed and final programs
        assert set(parts) == {"embed", "layers", "final"} and rep["layers_per_program"] == L
        assert call in parts["layers"]["custom_calls"]
        assert call not in parts["embed"]["custom_calls"]
        # the layers program's arguments hold the whole bf16 KV cache and the L layers' weights
        kv = 2 * L * N * B * K * D * 2
        cfg = config.model
        E, H, F = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
        weights = L * 2 * (2 * E + E * H * D + 2 * E * K * D + H * D * E + 3 * E * F)
        arg = parts["layers"]["memory"]["argument"]
        assert kv + weights <= arg <= kv + weights + 4096, (arg, kv + weights)
        kernels = [k for k in p["kernels"] if k["pallas"] and k["kernel"].startswith(kernel)]
        assert kernels, p["kernels"]
        for k in kernels:
            assert k["arch"] == arch and 0 < k["registers"] <= 255
            assert k["spill_bytes"] == 0 and k["spill_load_bytes"] == 0, k
    # decode (T = 2) and mixed (T = 8) buckets take different tiles: two kernels
    names = {k["kernel"] for p in rep["programs"] for k in p["kernels"]
             if k["pallas"] and k["kernel"].startswith(kernel)}
    assert len(names) == 2, names


def test_deviceless_executables_round_trip_through_the_cache(compiled):
    # the pytree classes the pickled in/out trees name
    import jaxserve.attention.pallas_mosaic  # noqa: F401
    import jaxserve.attention.pallas_triton  # noqa: F401
    import jaxserve.worker.programs  # noqa: F401

    target, rep, cache = compiled
    files = sorted(cache.glob(f"*{SUFFIX}"))
    # one entry per compiled program: the head, and embed / layers / final per stack
    assert len(files) == 1 + 3 * 2, [f.name for f in files]
    for f in files:
        assert f.read_bytes().startswith(MAGIC)
        header, payload = ExecutableCache._read(f)  # length and sha256 checked
        key = header["key"]
        assert key["target"] == target and key["backend"] == "gpu"
        kind = {"h200": "NVIDIA H200", "a100": "NVIDIA A100-SXM4-80GB"}[target]
        assert key["device_kind"] == kind
        assert key["jax_cuda12_plugin"] and key["device_count"] == 1
        blob, in_tree, out_tree = pickle.loads(payload)
        assert isinstance(blob, bytes) and len(blob) > 1000
        assert in_tree.num_leaves > 0 and out_tree.num_leaves > 0
    json.dumps(rep)  # the --json report is plain JSON


def test_deviceless_tensor_parallel_compiles_on_a_two_gpu_topology():
    from jaxserve.gpu.compile import compile_for_target

    cfg = ModelConfig.tiny(head_dim=64, dtype="bfloat16")  # 6 query / 2 KV heads: 3 + 1 per GPU
    config = make_engine_config(cfg, max_num_seqs=2, max_num_batched_tokens=2, max_model_len=64,
                                token_buckets=(2,), seq_buckets=(2,), num_kv_blocks=16,
                                enable_prompt_logprobs=False, tensor_parallel_size=2)
    rep = compile_for_target(config, "h200")
    assert rep["failed"] == [] and [tuple(p["key"]) for p in rep["programs"]] == [
        ("stack", 2), ("head", 2), ("merge_placeholders", 2)]
    layers = next(x for x in rep["programs"][0]["parts"] if x["part"] == "layers")
    assert "mosaic_gpu_v2" in layers["custom_calls"]
    assert "all-reduce" in layers["collectives"]  # the row-parallel o / down projections
    # per GPU: half the KV heads of the bf16 cache [L, N, B, K, D] and of the layer weights
    L, N, B, K, D = 2, 16, 16, 2, 64
    E, H, F = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    kv = 2 * L * N * B * K * D * 2 // 2
    weights = L * 2 * (2 * E + (E * H * D + 2 * E * K * D + H * D * E + 3 * E * F) // 2)
    assert kv + weights <= layers["memory"]["argument"] <= kv + weights + 4096
    assert all(k["spill_bytes"] == 0 for p in rep["programs"] for k in p["kernels"] if k["pallas"])
