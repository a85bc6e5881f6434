"""Host-side adapter loading and the slot manager (jaxserve.lora), no device: PEFT's
layout and scale by hand, the checks, and LRU slots."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import tiny_params
from lora.helpers import random_adapter, to_peft_state_dict
from lora.peft_dir import write_peft_dir

from jaxserve.lora import LoRARequest
from jaxserve.lora.adapter import from_flat_state_dict, from_tree, load_peft_dir, lora_scaling
from jaxserve.lora.manager import LoRASlots


def test_scaling_is_peft_s():
    assert lora_scaling(16, 8) == 2.0
    assert lora_scaling(16, 4, use_rslora=True) == 8.0


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_dir_flat_dict_and_tree_agree(tmp_path, rslora):
    cfg, _ = tiny_params()
    tree = random_adapter(cfg, 4, seed=1, targets=["wq", "w_down"])
    a = load_peft_dir(cfg, str(write_peft_dir(tmp_path / "a", tree, rank=4, use_rslora=rslora)),
                      max_rank=16)
    b = from_flat_state_dict(cfg, to_peft_state_dict(tree), scaling=2.0, max_rank=16)
    c = from_tree(cfg, tree, max_rank=16)
    for ad in (a, b, c):
        assert ad.rank == 4 and sorted(ad.weights) == ["w_down", "wq"]
        A, B = ad.weights["wq"]
        np.testing.assert_allclose(A, tree["wq"]["lora_a"], rtol=1e-6)
        np.testing.assert_allclose(B, 2.0 * tree["wq"]["lora_b"], rtol=1e-6)  # scale folded in


def test_peft_options_we_do_not_serve_are_refused(tmp_path):
    cfg, _ = tiny_params()
    d = write_peft_dir(tmp_path / "d", random_adapter(cfg, 2, seed=2, targets=["wq"]), rank=2)
    conf = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_peft_dir(cfg, str(d), max_rank=16)


def test_slots_lru_and_allowed_dir(tmp_path):
    cfg, _ = tiny_params()
    writes = []
    slots = LoRASlots(cfg, max_loras=2, max_rank=8, write=lambda s, a: writes.append((s, a)),
                      allowed_dir=str(tmp_path / "ok"))
    d = write_peft_dir(tmp_path / "no", random_adapter(cfg, 2, seed=3, targets=["wv"]), rank=2)
    with pytest.raises(ValueError, match="outside the allowed directory"):
        slots.add(LoRARequest("x", 1, str(d)))
    for i in (1, 2, 3):
        slots.add(LoRARequest(f"a{i}", i, random_adapter(cfg, 2, seed=i, targets=["wv"])))
    assert slots.acquire(1, in_use=()) == 1 and slots.acquire(2, in_use=()) == 2
    slots.acquire(1, in_use=())  # 1 is now the most recently used: 2 is evicted next
    assert slots.acquire(3, in_use=()) == 2 and slots.slot_of(2) == 0
    assert slots.acquire(2, in_use={3}) == 1  # 3 is in use: 1 goes, although more recent
    with pytest.raises(ValueError, match="all max_loras=2 LoRA slots"):
        slots.acquire(1, in_use={2, 3})
    assert [s for s, _ in writes] == [1, 2, 2, 1]
    k = slots.cache_key(2)
    slots.update("a2", random_adapter(cfg, 2, seed=9, targets=["wv"]))
    assert slots.cache_key(2) != k and slots.version(2) == 1


@pytest.mark.parametrize("scheme", ["q8_0", "q4", "int8"])
def test_lora_delta_adds_over_quantized_base_weights(scheme):
    """Issue 27 item 6: `lora.project` over a quantized base projection equals the
    dequantized base matmul plus each token's own adapter product, in float64 numpy
    (slot 0 tokens get the base alone)."""
    import jax.numpy as jnp

    from jaxserve.model import quant
    from jaxserve.model.lora import project

    rng = np.random.default_rng(3)
    K, N, S, r, T = 64, 48, 2, 4, 6
    w = rng.normal(size=(K, N)).astype(np.float32)
    qw = quant.quantize_leaf(w, scheme, key="wq")
    assert quant.is_quantized(qw)
    wd = quant.dequantize_leaf(qw, key="wq").astype(np.float64)
    a = rng.normal(size=(K, S, r)).astype(np.float32)
    b = rng.normal(size=(S, r, N)).astype(np.float32)
    h = rng.normal(size=(T, K)).astype(np.float32)
    slots = np.array([0, 1, 2, 1, 0, 2], np.int32)
    lp = {"wq": qw, "lora_a_wq": jnp.asarray(a), "lora_b_wq": jnp.asarray(b)}
    got = np.asarray(project(jnp.asarray(h), lp, "wq", jnp.asarray(slots)))
    want = h.astype(np.float64) @ wd
    for t, s in enumerate(slots):
        if s:
            want[t] += h[t].astype(np.float64) @ a[:, s - 1, :] @ b[s - 1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    base = np.asarray(project(jnp.asarray(h), lp, "wq", None))
    np.testing.assert_allclose(base, h.astype(np.float64) @ wd, rtol=1e-4, atol=1e-3)
