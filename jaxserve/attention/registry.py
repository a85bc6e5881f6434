"""`get_attention_backend`: the one place a backend name becomes a backend object.

The choice itself is the pure function `choose_backend(name, platform,
compute_capability, ...)`, so its rules are tested with fake device descriptions
(no GPU needed):

  name            CUDA cc 9.x (Hopper)   cc 8.x, >= 10     CPU                other GPU / TPU
  auto            pallas_mosaic          pallas_triton     xla                xla
  pallas          pallas_mosaic          pallas_triton     pallas_triton (*)  error
  pallas_mosaic   pallas_mosaic          error             interpret only     error
  pallas_triton   pallas_triton          pallas_triton     interpret only     error
  xla             xla                    xla               xla                xla

On Hopper, "auto" and "pallas" take the Triton kernel instead of Mosaic for f32 at
head_dim > 64 and bf16 at head_dim > 128 (Gemma 3's 256), where Mosaic's kernel spills
registers and Triton's does not (ptxas, deviceless: notes/issue25.md, issue31.md); an
explicit "pallas_mosaic" is refused there.

(*) on CPU "pallas" needs interpret=True and means the Triton kernel: it tiles
head_dim 16 (Mosaic needs multiples of 64) and its interpreter is the cheaper
one, so the tiny test models run through it. Mosaic is Hopper only: its kernel
issues WGMMA, an sm_90a instruction that Blackwell (cc 10.x) no longer has, so
cc >= 10 gets the Triton kernel. Triton's Pallas kernels need cc >= 8.0 (bf16 MMA).
"""

from __future__ import annotations

import jax

from jaxserve.config import ModelConfig
from jaxserve.attention.common import AttentionBackend
from jaxserve.attention.xla import XlaBackend

# The Pallas backends are imported when chosen: jax.experimental.pallas (Mosaic GPU
# included) costs ~0.5-0.7 s of a CPU start-up that runs the xla backend.

BACKEND_NAMES = ("auto", "xla", "pallas", "pallas_mosaic", "pallas_triton")
MOSAIC_CC = ((9, 0), (10, 0))  # [lo, hi): WGMMA is sm_90a only
TRITON_MIN_CC = (8, 0)


def _parse_cc(compute_capability: str | tuple[int, int] | None) -> tuple[int, int] | None:
    if compute_capability is None or compute_capability == "":
        return None
    if isinstance(compute_capability, str):
        major, _, minor = compute_capability.partition(".")
        return int(major), int(minor or 0)
    return tuple(int(x) for x in compute_capability)  # type: ignore[return-value]


def _supports(name: str, platform: str, cc: tuple[int, int] | None) -> bool:
    """Whether the GPU kernel of backend `name` compiles for this device (not interpret)."""
    if platform != "gpu" or cc is None:
        return False
    if name == "pallas_mosaic":
        return MOSAIC_CC[0] <= cc < MOSAIC_CC[1]
    return cc >= TRITON_MIN_CC


def choose_backend(name: str, platform: str, compute_capability: str | tuple[int, int] | None,
                   *, interpret: bool = False, device: str | None = None) -> str:
    """The concrete backend ("xla" | "pallas_mosaic" | "pallas_triton") `name` means here.

    Args:
      name: one of BACKEND_NAMES (see the module table).
      platform: `jax.default_backend()`: "cpu", "gpu" (CUDA), "tpu", ...
      compute_capability: the CUDA device's "major.minor" (jax's
        `device.compute_capability`), a (major, minor) pair, or None off CUDA.
      interpret: the Pallas kernels run in their interpreters (any platform).
      device: how error messages name the device, e.g. "NVIDIA H200 (gpu, cc 9.0)".

    Raises:
      ValueError: an unknown name, or a Pallas backend this device cannot run
        (the message names the device and what would run).
    """
    cc = _parse_cc(compute_capability)
    device = device or f"{platform}" + (f" (cc {cc[0]}.{cc[1]})" if cc else "")
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend {name!r} is not one of {BACKEND_NAMES}")
    if name == "xla":
        return name
    best = next((b for b in ("pallas_mosaic", "pallas_triton") if _supports(b, platform, cc)), None)
    if name == "auto":
        return best or "xla"
    if name == "pallas":
        if best is not None:
            return best
        if interpret and platform == "cpu":
            return "pallas_triton"
        raise ValueError(f"attention backend 'pallas' needs a GPU that one of its kernels "
                         f"supports (Mosaic: CUDA cc 9.x, Triton: cc >= 8.0), but the device "
                         f"is {device}; use 'auto' or 'xla'"
                         + ("" if platform == "gpu" else ", or interpret=True on CPU"))
    if _supports(name, platform, cc) or interpret:
        return name
    need = "CUDA compute capability 9.x (Hopper)" if name == "pallas_mosaic" else \
        "CUDA compute capability >= 8.0"
    raise ValueError(f"attention backend {name!r} needs a GPU with {need}, but the device is "
                     f"{device}; use 'auto' or 'xla', or interpret=True for the Pallas "
                     f"interpreter")


def describe_device(dev: jax.Device) -> tuple[str, str | None, str]:
    """(platform, compute capability or None, a name for messages) of a jax device (a
    compile-only device of a deviceless GPU topology too: its platform is "gpu")."""
    platform = "gpu" if dev.platform in ("gpu", "cuda") else dev.platform
    cc = getattr(dev, "compute_capability", None)
    return platform, cc, f"{dev.device_kind!r} ({platform}" + (f", cc {cc})" if cc else ")")


def get_attention_backend(name: str, cfg: ModelConfig, *, block_size: int,
                          interpret: bool = False,
                          device: jax.Device | None = None) -> AttentionBackend:
    """The attention backend called `name`, built for `cfg`'s heads and the KV page size.

    Args:
      name: one of BACKEND_NAMES; "auto" and "pallas" resolve by `choose_backend`
        on the default jax device.
      cfg: the model; its H / K, head_dim and dtype fix the Pallas tiles.
      block_size: B, tokens per KV page.
      interpret: run Pallas kernels in the Pallas interpreters (CPU tests).
      device: the device the programs run on (default `jax.devices()[0]`); a deviceless
        compile passes its compile-only GPU (`jaxserve.gpu.deviceless`).

    Raises:
      ValueError: an unknown name; a Pallas backend the device cannot run outside
        interpret mode (naming the device); or heads / head_dim / page size the
        kernel cannot tile. All before any trace or compile.
    """
    platform, cc, where = describe_device(device or jax.devices()[0])
    chosen = choose_backend(name, platform, cc, interpret=interpret, device=where)
    if chosen == "pallas_mosaic" and not interpret:
        chosen = _mosaic_or_triton(name, cfg)
    if chosen == "xla":
        return XlaBackend(block_size=block_size)
    kw = dict(block_size=block_size, num_queries_per_kv=cfg.num_queries_per_kv,
              head_dim=cfg.head_dim, interpret=interpret)
    if chosen == "pallas_mosaic":
        from jaxserve.attention.pallas_mosaic import PallasMosaicBackend

        return PallasMosaicBackend(dtype=cfg.dtype, **kw)
    from jaxserve.attention.pallas_triton import PallasTritonBackend

    return PallasTritonBackend(dtype=cfg.dtype, **kw)


def _mosaic_or_triton(name: str, cfg: ModelConfig) -> str:
    """"pallas_mosaic", or "pallas_triton" for "auto" / "pallas" where the Mosaic kernel
    would spill registers (f32 at head_dim > 64, bf16 at head_dim > 128: `rpm.spill_free`)
    and the Triton kernel does not (notes/issue25.md, issue31.md); an explicit
    "pallas_mosaic" there is refused."""
    from jaxserve.attention.kernels import ragged_paged_attention_mosaic as rpm

    if rpm.spill_free(cfg.head_dim, cfg.dtype):
        return "pallas_mosaic"
    if name in ("auto", "pallas"):
        return "pallas_triton"
    raise ValueError(f"attention backend 'pallas_mosaic' spills registers at dtype={cfg.dtype} "
                     f"head_dim={cfg.head_dim} (spill-free up to head_dim "
                     f"{rpm.F32_MAX_HEAD_DIM} in f32, {rpm.BF16_MAX_HEAD_DIM} in bf16); use "
                     f"'auto' (the Triton kernel) or 'pallas_triton'")
