"""Tensor parallelism (jaxserve/parallel.py) on fake CPU devices.

The TP checks need `XLA_FLAGS=--xla_force_host_platform_device_count=4` before
jax initialises, while the rest of the suite runs on one device, so they run in
one child process per group (`tests/distributed/tp_worker.py`) and are asserted here. The
reference for TP = 2 and 4 is the same engine at TP = 1 (no mesh), itself pinned
to HF transformers by tests/model/test_real_model.py; TP = 3 on SmolLM2 is checked
against HF's golden greedy tokens directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.distributed.tensor_parallel import check_tensor_parallel, expand_kv_heads

ROOT = Path(__file__).resolve().parents[2]
H, K, E, F, D, L, V = 8, 2, 48, 80, 8, 2, 68  # tests/distributed/tp_worker.py's tiny model


def run_worker(group: str, timeout: float = 900) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "tests.distributed.tp_worker", group], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"worker {group} failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def xla():
    return run_worker("xla")


def assert_same_runs(got: list, want: list, tol: float = 1e-4) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["ids"] == w["ids"], f"request {i}: {g['ids']} != TP=1 {w['ids']}"
        if None not in (w.get("prompt"), g.get("prompt")):  # prompt logprobs: score programs, sharded
            np.testing.assert_allclose(g["prompt"], w["prompt"], atol=tol)
            assert any(w["prompt"]), "the prompt logprobs must have been scored"
        for step, (gd, wd) in enumerate(zip(g["logprobs"], w["logprobs"], strict=True)):
            assert gd.keys() == wd.keys(), f"request {i} step {step}: top ids differ"
            for tok in wd:
                assert abs(gd[tok] - wd[tok]) < tol, (i, step, tok, gd[tok], wd[tok])


# ---------------------------------------------------------------- in this process
def test_bad_sizes_name_both_numbers():
    cfg = ModelConfig.tiny(num_attention_heads=H, num_key_value_heads=K)
    check_tensor_parallel(cfg, 4, 4)  # TP > K, a multiple of K: KV heads replicated
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide "
                                         "num_attention_heads=8"):
        check_tensor_parallel(cfg, 3, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 exceeds the 4 devices"):
        check_tensor_parallel(cfg, 8, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 and num_key_value_heads=3"):
        check_tensor_parallel(ModelConfig.tiny(num_attention_heads=12, num_key_value_heads=3,
                                               intermediate_size=96), 4, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and num_key_value_heads=3"):
        check_tensor_parallel(ModelConfig.tiny(num_attention_heads=6, num_key_value_heads=3), 2, 4)
    with pytest.raises(ValueError, match="does not divide vocab_size=67"):
        check_tensor_parallel(cfg.replace(vocab_size=67), 2, 4, vocab_parallel=True)
    with pytest.raises(ValueError, match="positive int"):
        check_tensor_parallel(cfg, 0, 4)


def test_kv_head_replication_is_head_j_of_j_div_r():
    cfg = ModelConfig.tiny(num_attention_heads=H, num_key_value_heads=K)
    rng = np.random.default_rng(0)
    lp = {"wk": rng.normal(size=(L, E, K * D)), "wv": rng.normal(size=(L, E, K * D)),
          "bk": rng.normal(size=(L, K * D)), "wq": rng.normal(size=(L, E, H * D))}
    out = expand_kv_heads(cfg, lp, 2)
    assert out["wq"] is lp["wq"]
    for name in ("wk", "wv", "bk"):
        w, x = lp[name], out[name]
        assert x.shape[-1] == 4 * D
        for j in range(4):  # head j of the expanded weight is head j // 2 of the checkpoint
            np.testing.assert_array_equal(x[..., j * D:(j + 1) * D],
                                          w[..., (j // 2) * D:(j // 2 + 1) * D])


# ---------------------------------------------------------------- child process: xla
def test_tp2_tp4_same_tokens_and_logprobs_as_tp1(xla):
    assert xla["devices"] == 4
    ref = xla["tp"]["1"]
    assert ref["preemptions"] > 0, "the workload must preempt (recompute) to test it under TP"
    for tp in ("2", "4", "4r"):
        r = xla["tp"][tp]
        assert_same_runs(r["runs"], ref["runs"])
        # one per bucket: stacks (1, 8, 16), heads (1, 4), score (1, 8, 16)
        assert r["late"] == 0 and r["programs"] == ref["programs"] == 8
        assert r["t1_steps"] > 0  # one-token steps ran sharded
        assert r["free"] == r["total"]  # nothing leaked
        assert r["preemptions"] == ref["preemptions"]


def test_shard_shapes(xla):
    for name in ("2", "4", "4r"):
        tp, vocab = int(name[0]), not name.endswith("r")
        r = xla["tp"][name]
        assert r["vocab_parallel"] == vocab
        l0 = r["layer0"]
        kv_local = max(1, K // tp)  # KV heads per device (each head on tp / K devices when tp > K)
        want = {"wq": [E, H * D // tp], "wk": [E, kv_local * D], "wv": [E, kv_local * D],
                "wo": [H * D // tp, E], "w_gate": [E, F // tp], "w_up": [E, F // tp],
                "w_down": [F // tp, E], "attn_norm": [E], "mlp_norm": [E]}
        for name, shape in want.items():
            assert l0[name] == [shape] * tp, (tp, name, l0[name])
        assert r["embed"] == [[V // tp if vocab else V, E]] * tp  # vocab-parallel or replicated
        assert r["lm_head"] == [[E, V // tp if vocab else V]] * tp
        assert r["kv_layers"] == L
        assert r["kv_shape"] == [16, 4, max(K, tp), D]
        assert r["kv_shards"] == [[16, 4, kv_local, D]] * tp


def test_bytes_per_device(xla):
    ref = xla["tp"]["1"]
    (p1,), (kv1,) = ref["param_bytes"].values(), ref["kv_bytes"].values()
    f4 = 4  # float32
    norms = f4 * (E + L * 2 * E)  # final_norm, 2 norms per layer: replicated
    vocab = f4 * V * E * 2  # embed, lm_head
    q_o_mlp = f4 * L * (2 * E * H * D + 3 * E * F)
    k_v = f4 * L * 2 * E * K * D
    assert p1 == norms + vocab + q_o_mlp + k_v
    for name in ("2", "4", "4r"):
        tp, r = int(name[0]), xla["tp"][name]
        assert len(r["param_bytes"]) == tp
        v = vocab if name.endswith("r") else vocab // tp
        for dev, b in r["param_bytes"].items():
            assert b == norms + v + q_o_mlp // tp + k_v // min(tp, K), (name, dev, b)
        for dev, b in r["kv_bytes"].items():
            assert b == kv1 // min(tp, K), (tp, dev, b, kv1)


def test_update_params_keeps_programs(xla):
    for tp in ("2", "4"):
        r = xla["tp"][tp]
        assert r["late_after_update"] == 0
        assert r["trained_sharded_leaves"] > 0  # the update really came from another mesh
        assert r["param_shardings_kept"]  # resharded to the engine's layout
        assert_same_runs(r["after_update"], xla["tp"]["1"]["runs"][:2])


def test_bad_sizes_error_before_any_compile(xla):
    errs = xla["errors"]
    assert errs["3"]["msg"] == "tensor_parallel_size=3 does not divide num_attention_heads=8"
    assert "tensor_parallel_size=8 exceeds the 4 devices" in errs["8"]["msg"]
    assert errs["3"]["compiles"] == errs["8"]["compiles"] == 0


# ---------------------------------------------------------------- SmolLM2, TP = 3
@pytest.mark.slow
def test_smollm2_tp3_reproduces_hf_greedy():
    from tests.model.test_real_model import GOLDEN, agree_until_near_tie

    r = run_worker("smollm2", timeout=1800)
    golden = json.loads(GOLDEN.read_text())
    for i, (got, run) in enumerate(zip(r["ids"], golden["runs"], strict=True)):
        ok, where = agree_until_near_tie(got, run["greedy_ids"], run["top2_logit_gap"])
        assert ok, f"prompt {i} diverges from HF at step {where}: {got} vs {run['greedy_ids']}"
    assert r["late"] == 0
    assert r["kv_layers"] == 30 and r["kv_shards"] == [[48, 16, 1, 64]] * 3  # one of the 3 KV heads per device
    assert r["layer0"]["wq"] == [[576, 3 * 64]] * 3
    assert r["vocab_parallel"] and r["embed"] == [[49152 // 3, 576]] * 3  # tied: embed is the head


# ---------------------------------------------------------------- Pallas per shard
@pytest.mark.slow  # the Pallas interpreter: ~2.5 min for three engines on this CPU
def test_pallas_triton_per_shard_interpret_same_tokens_as_tp1_xla():
    r = run_worker("pallas")
    ref = r["tp"]["1"]
    assert ref["backend"] == "xla"
    for tp in ("2", "4"):
        got = r["tp"][tp]
        assert (got["backend"], got["sharded"]) == ("pallas_triton", "ShardedAttention")
        assert_same_runs(got["runs"], ref["runs"])
        assert got["late"] == 0


def _lower_sharded_stack(kernel: str, tp: int, *, per_layer: bool = False) -> str:
    """The runner's one-program layer stack (`_stack_fn`, stacked cache), or with
    per_layer its layer-group program (`layer_stack.layers_fn` over all L layers, one
    [N, B, K', D] cache per layer), sharded over an abstract ('dp', 'tp') mesh of H200s,
    with the Pallas kernel per shard, lowered for CUDA (no GPU needed; the abstract
    device gives the Triton lowering its compute capability)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
    from jax.sharding import PartitionSpec as Pspec

    from jaxserve.distributed import tensor_parallel as parallel
    from jaxserve.attention.pallas_mosaic import PallasMosaicBackend
    from jaxserve.attention.pallas_triton import PallasTritonBackend
    from jaxserve.model.llama import param_shapes
    from jaxserve.worker.programs import StepBatch, _stack_fn
    from tests.attention.cases import empty_common

    cfg = ModelConfig.tiny(num_attention_heads=H, num_key_value_heads=K, head_dim=64,
                           dtype="bfloat16")
    mc = parallel.sharded_model_config(cfg, tp)
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1, tp), ("dp", "tp"), (AxisType.Auto,) * 2, abstract_device=dev)
    sds = jax.ShapeDtypeStruct
    shapes = param_shapes(mc)
    tree = {k: v for k, v in shapes.items() if k != "layers"}
    tree["layers"] = [{k: s[1:] for k, s in shapes["layers"].items()}] * L  # unrolled layout
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    p_sh = jax.tree.map(lambda s, spec: NamedSharding(mesh, spec), tree,
                        parallel.param_specs(tree), is_leaf=is_shape)
    p_spec = jax.tree.map(lambda s, sh: sds(s, jnp.bfloat16, sharding=sh), tree, p_sh,
                          is_leaf=is_shape)
    g = mc.num_queries_per_kv
    inner = (PallasTritonBackend(block_size=16, num_queries_per_kv=g, head_dim=64)
             if kernel == "triton" else
             PallasMosaicBackend(block_size=16, num_queries_per_kv=g, head_dim=64,
                                 dtype="bfloat16"))
    be = parallel.ShardedAttention(inner, mesh)
    t, s, pages, blocks = 64, 8, 8, 32
    md = be.prepare(empty_common(t, s, pages))
    rep, kv = NamedSharding(mesh, Pspec()), NamedSharding(mesh, parallel.KV_CACHE_SPEC)
    cache = sds((L, blocks, 16, mc.num_key_value_heads, 64), jnp.bfloat16, sharding=kv)
    i32 = lambda n: sds((n,), jnp.int32, sharding=rep)  # noqa: E731
    batch = StepBatch(input_ids=i32(t), positions=i32(t), logits_indices=i32(s), sampling=None,
                      attn_md=jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=rep), md))
    if per_layer:  # the engine's layer-group program (G = L here): per-layer caches
        from jaxserve.worker.layer_stack import layers_fn

        kvl = NamedSharding(mesh, parallel.KV_LAYER_SPEC)
        caches = [sds((blocks, 16, mc.num_key_value_heads, 64), jnp.bfloat16, sharding=kvl)] * L
        x = sds((t, mc.hidden_size), jnp.bfloat16, sharding=rep)
        fn = jax.jit(functools.partial(layers_fn, mc, be), donate_argnums=(1, 2),
                     in_shardings=(p_sh["layers"], [kvl] * L, [kvl] * L, rep, rep, rep, rep),
                     out_shardings=(rep, [kvl] * L, [kvl] * L))
        with jax.sharding.use_abstract_mesh(mesh):
            return fn.trace(p_spec["layers"], caches, caches, x, batch.positions,
                            batch.attn_md, i32(L)).lower(lowering_platforms=("cuda",)).as_text()
    fn = jax.jit(functools.partial(_stack_fn, mc, be), donate_argnums=(1,),
                 in_shardings=(p_sh, (kv, kv), rep), out_shardings=(rep, (kv, kv), rep))
    with jax.sharding.use_abstract_mesh(mesh):
        return fn.trace(p_spec, (cache, cache), batch).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("kernel,tp,local,per_layer", [
    ("triton", 2, "bq16_gp4", False), ("triton", 4, "bq32_gp2", True),
    ("mosaic", 2, "bq32_gp4", True)])
def test_sharded_step_lowers_for_cuda(kernel, tp, local, per_layer):
    from tests.attention.test_lowering import TRITON_CALL
    from tests.attention.test_mosaic_lowering import MOSAIC_CALL

    text = _lower_sharded_stack(kernel, tp, per_layer=per_layer)
    assert f"mhlo.num_partitions = {tp}" in text
    # write_kv + attention per layer, each a manual (per-shard) computation
    assert text.count("sdy.manual_computation") == 2 * L
    if kernel == "triton":
        assert text.count(TRITON_CALL) == 2  # the KV write and the attention kernel
        # Local shapes: one KV head per device (K / TP, or 1 when replicated) and
        # H / K' query heads per KV head.
        assert f"ragged_paged_attention_{local}_ppc4_bs16_d64" in text
        assert "kv_cache_update_k1_d64" in text
    else:
        assert text.count(MOSAIC_CALL) == 1
        assert f"ragged_paged_attention_mosaic_{local}_ck64_d64" in text
