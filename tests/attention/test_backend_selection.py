"""Backend selection (`--attention_backend`) from fake device descriptions: no GPU needed.

`choose_backend(name, platform, compute_capability, interpret=)` is the whole rule
table of jaxserve/model/attention/registry.py; `get_attention_backend` adds only
the real device's description and the backend's own shape checks, which must
raise before anything is traced or compiled.
"""

from __future__ import annotations

import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.attention import get_attention_backend
from jaxserve.attention.pallas_mosaic import PallasMosaicBackend
from jaxserve.attention.registry import BACKEND_NAMES, choose_backend

H200, A100, B200, T4 = ("gpu", "9.0"), ("gpu", "8.0"), ("gpu", "10.0"), ("gpu", "7.5")
CPU, TPU = ("cpu", None), ("tpu", None)


@pytest.mark.parametrize("device,auto,pallas", [
    (H200, "pallas_mosaic", "pallas_mosaic"),
    (("gpu", (9, 0)), "pallas_mosaic", "pallas_mosaic"),  # a (major, minor) pair works too
    (A100, "pallas_triton", "pallas_triton"),
    (("gpu", "8.9"), "pallas_triton", "pallas_triton"),  # Ada
    (B200, "pallas_triton", "pallas_triton"),  # no WGMMA on Blackwell: not Mosaic
])
def test_auto_and_pallas_pick_the_best_kernel_for_the_gpu(device, auto, pallas):
    assert choose_backend("auto", *device) == auto
    assert choose_backend("pallas", *device) == pallas
    assert choose_backend("xla", *device) == "xla"


def test_cpu_and_old_gpus_fall_back_to_xla_under_auto():
    for device in (CPU, TPU, T4, ("gpu", None)):  # ("gpu", None): a GPU without CUDA cc (ROCm)
        assert choose_backend("auto", *device) == "xla"
        assert choose_backend("auto", *device, interpret=True) == "xla"


def test_forced_backends_on_supported_gpus():
    assert choose_backend("pallas_mosaic", *H200) == "pallas_mosaic"
    assert choose_backend("pallas_triton", *H200) == "pallas_triton"
    assert choose_backend("pallas_triton", *A100) == "pallas_triton"


def test_interpret_mode_runs_any_pallas_backend_on_cpu():
    # "pallas" on CPU means the Triton kernel: it tiles head_dim 16 (the registry's doc).
    assert choose_backend("pallas", *CPU, interpret=True) == "pallas_triton"
    assert choose_backend("pallas_mosaic", *CPU, interpret=True) == "pallas_mosaic"
    assert choose_backend("pallas_triton", *CPU, interpret=True) == "pallas_triton"
    assert choose_backend("pallas_mosaic", *A100, interpret=True) == "pallas_mosaic"


@pytest.mark.parametrize("name,device,match", [
    ("pallas_mosaic", A100, r"'pallas_mosaic' needs a GPU with CUDA compute capability 9.x.*"
                            r"'NVIDIA X' \(gpu, cc 8.0\)"),
    ("pallas_mosaic", B200, r"9.x \(Hopper\).*cc 10.0"),
    ("pallas_mosaic", CPU, r"needs a GPU.*'NVIDIA X' \(cpu\).*interpret=True"),
    ("pallas_triton", T4, r"compute capability >= 8.0.*cc 7.5"),
    ("pallas_triton", CPU, r"needs a GPU.*\(cpu\)"),
    ("pallas", CPU, r"'pallas' needs a GPU.*\(cpu\).*interpret=True on CPU"),
    ("pallas", T4, r"'pallas' needs a GPU.*cc 7.5"),
    ("pallas", TPU, r"'pallas' needs a GPU.*\(tpu\)"),
])
def test_unavailable_choices_name_the_device(name, device, match):
    platform, cc = device
    desc = f"'NVIDIA X' ({platform}" + (f", cc {cc})" if cc else ")")
    with pytest.raises(ValueError, match=match):
        choose_backend(name, platform, cc, device=desc)


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"'flash' is not one of \('auto', 'xla', 'pallas', "
                                         r"'pallas_mosaic', 'pallas_triton'\)"):
        choose_backend("flash", *H200)
    assert set(BACKEND_NAMES) == {"auto", "xla", "pallas", "pallas_mosaic", "pallas_triton"}


def test_this_cpu_machine():
    cfg = ModelConfig.tiny(head_dim=64)
    assert get_attention_backend("auto", cfg, block_size=16).name == "xla"
    be = get_attention_backend("pallas_mosaic", cfg, block_size=16, interpret=True)
    assert isinstance(be, PallasMosaicBackend) and be.interpret and be.dtype == "float32"
    with pytest.raises(ValueError, match=r"'pallas_mosaic' needs a GPU.*'cpu' \(cpu\)"):
        get_attention_backend("pallas_mosaic", cfg, block_size=16)


@pytest.mark.parametrize("change,match", [
    (dict(head_dim=32), "head_dim=32 to be a multiple of 64"),
    (dict(head_dim=320), "head_dim=320 to be a multiple of 64 and <= 256"),
    (dict(block_size=12), "block_size=12 to be a multiple of 8"),
    (dict(block_size=24), r"pages_per_chunk \* block_size=48 to be a multiple of 64"),
    (dict(dtype="float16"), "bfloat16 and float32, got dtype=float16"),
])
def test_mosaic_shapes_it_cannot_tile_fail_at_construction(change, match):
    kw = dict(block_size=16, num_queries_per_kv=3, head_dim=64, interpret=True) | change
    with pytest.raises(ValueError, match=match):
        PallasMosaicBackend(**kw)


def test_engine_with_an_untileable_head_dim_fails_before_any_compile():
    # The runner builds its backend before it prepares params or compiles a program,
    # so this fails with the kernel's message before any trace.
    from conftest import tiny_params, tiny_tokenizer

    cfg, params = tiny_params()  # head_dim 8
    for name in ("pallas_mosaic", "pallas_triton"):
        config = make_engine_config(cfg, max_model_len=64, block_size=16, num_kv_blocks=8,
                                    max_num_seqs=2, max_num_batched_tokens=16,
                                    attention_backend=name, attention_interpret=True)
        with pytest.raises(ValueError, match="head_dim=8"):
            LLMEngine(config, params, tiny_tokenizer(), model_name="tiny", progress=False)
    config = make_engine_config(cfg, max_model_len=64, block_size=16, num_kv_blocks=8,
                                max_num_seqs=2, max_num_batched_tokens=16,
                                attention_backend="pallas_mosaic")
    with pytest.raises(ValueError, match="needs a GPU"):
        LLMEngine(config, params, tiny_tokenizer(), model_name="tiny", progress=False)


class _FakeGpu:
    """What `describe_device` reads of a jax device (a deviceless compile passes a
    compile-only one the same way)."""

    def __init__(self, cc: str, kind: str):
        self.platform, self.compute_capability, self.device_kind = "gpu", cc, kind


@pytest.mark.parametrize("dtype,head_dim,name,want", [
    ("bfloat16", 128, "auto", "pallas_mosaic"),
    ("float32", 64, "auto", "pallas_mosaic"),
    ("float32", 128, "auto", "pallas_triton"),  # Mosaic spills there (68 B), Triton does not
    ("float32", 128, "pallas", "pallas_triton"),
    ("float32", 128, "pallas_triton", "pallas_triton"),
    ("bfloat16", 128, "auto", "pallas_mosaic"),
    ("bfloat16", 256, "auto", "pallas_triton"),  # Gemma 3 (issue 31): 560 B of spills
])
def test_hopper_takes_triton_where_mosaic_would_spill(dtype, head_dim, name, want):
    cfg = ModelConfig.tiny(head_dim=head_dim, dtype=dtype)
    be = get_attention_backend(name, cfg, block_size=16, device=_FakeGpu("9.0", "NVIDIA H200"))
    assert be.name == want and be.dtype == dtype


def test_explicit_mosaic_where_it_spills_is_refused_but_interpret_still_runs():
    cfg = ModelConfig.tiny(head_dim=128, dtype="float32")
    with pytest.raises(ValueError, match=r"'pallas_mosaic' spills registers at dtype=float32 "
                                         r"head_dim=128.*'auto'"):
        get_attention_backend("pallas_mosaic", cfg, block_size=16,
                              device=_FakeGpu("9.0", "NVIDIA H200"))
    be = get_attention_backend("pallas_mosaic", cfg, block_size=16, interpret=True)
    assert be.name == "pallas_mosaic"  # the kernel itself stays testable on CPU


def test_triton_launch_follows_tile_dtype_and_head_dim():
    from jaxserve.attention.pallas_triton import (PallasTritonBackend, choose_num_warps,
                                                  chunk_keys_for)

    # 64-row (prefill) tiles and f32 x d128 take 8 warps; 16-row bf16 / f32 d64 tiles 4
    assert [choose_num_warps(m, d, dt) for m, d, dt in (
        (16, 64, "bfloat16"), (64, 64, "bfloat16"), (16, 64, "float32"), (64, 64, "float32"),
        (16, 128, "bfloat16"), (64, 128, "bfloat16"), (16, 128, "float32"),
        (64, 128, "float32"))] == [4, 8, 4, 8, 4, 8, 8, 8]
    assert chunk_keys_for(128, "float32") == 32 and chunk_keys_for(128, "bfloat16") == 64
    kw = dict(num_queries_per_kv=4, head_dim=128)
    assert PallasTritonBackend(block_size=16, dtype="float32", **kw).pages_per_chunk == 2
    assert PallasTritonBackend(block_size=16, dtype="bfloat16", **kw).pages_per_chunk == 4
    assert PallasTritonBackend(block_size=64, dtype="float32", **kw).pages_per_chunk == 1
    assert PallasTritonBackend(block_size=16, chunk_keys=128, **kw).pages_per_chunk == 8
