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
