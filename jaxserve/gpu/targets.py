"""GPU targets of deviceless compiles: one `GpuTargetConfigProto` text file per GPU.

The files (`jaxserve/gpu/targets/<name>.txtpb`) say in their header where their
numbers come from (spec sheets until a lent GPU's own `target_config` replaces
them). Only `cuda_compute_capability` decides the generated code; the SMEM and
register limits feed XLA's heuristics, and `device_memory_size` is what the fit
check (`check_fits`) holds a model to. Plain Python: no jax import.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

TARGET_DIR = Path(__file__).resolve().parent / "targets"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU a program can be compiled for without it.

    Fields:
      name: the file stem, e.g. "h200".
      text: the target config in protobuf text form (comments included).
      compute_capability: (major, minor), e.g. (9, 0); Hopper compiles for sm_90a.
      device_kind: jax's device_kind of that GPU, e.g. "NVIDIA H200".
      memory_bytes: device memory one GPU offers (`device_memory_size`).
      smem_optin_bytes: shared memory one block may opt into.
    """

    name: str
    text: str
    compute_capability: tuple[int, int]
    device_kind: str
    memory_bytes: int
    smem_optin_bytes: int

    @property
    def sm(self) -> str:
        """ptxas's architecture name: sm_90a on Hopper (WGMMA), else sm_<major><minor>."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def target_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in TARGET_DIR.glob("*.txtpb")))


def _field(text: str, name: str, path: str) -> str:
    m = re.search(rf"^\s*{name}\s*:\s*(\S+)", text, re.M)
    if m is None:
        raise ValueError(f"{path}: no {name} field")
    return m.group(1).strip('"')


def load_target(name: str) -> GpuTarget:
    """The target called `name` (case-insensitive).

    Raises:
      ValueError: an unknown name (listing the known ones) or a file without the
        fields above.
    """
    key = str(name).strip().lower()
    path = TARGET_DIR / f"{key}.txtpb"
    if not key or not re.fullmatch(r"[a-z0-9_]+", key) or not path.is_file():
        raise ValueError(f"unknown GPU target {name!r}; known targets: {', '.join(target_names())}")
    text = path.read_text()
    body = re.sub(r"#.*", "", text)
    cc = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", body)
    if cc is None:
        raise ValueError(f"{path}: no cuda_compute_capability")
    desc = re.search(r'device_description_str:\s*"([^"]+)"', body)
    return GpuTarget(name=key, text=text, compute_capability=(int(cc.group(1)), int(cc.group(2))),
                     device_kind=desc.group(1) if desc else key,
                     memory_bytes=int(_field(body, "device_memory_size", str(path))),
                     smem_optin_bytes=int(_field(body, "shared_memory_per_block_optin", str(path))))
