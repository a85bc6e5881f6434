"""The second virtualenv that holds the CUDA compiler plugin, for deviceless GPU compiles.

`jax-cuda12-plugin` / `jax-cuda12-pjrt` make every plain `import jax` on a machine
without a GPU print a plugin initialisation error (`cuInit(0) failed`) before falling
back to CPU. So they never go into the venv that `make generate` uses: they live in
`.venv-gpu`, beside it, which holds only those two wheels and `nvidia-cuda-nvcc-cu12`
(ptxas), about 240 MB of downloads, and reads everything else (jax, jaxlib, flax, ...)
from the main venv through a `.pth` file, so both see the very same jax. The plugin
wheels are pinned to the main venv's jaxlib version (a plugin of another version is
refused by jax).

`jaxserve compile` runs its compiles with this venv's python (`JAX_PLATFORMS=cpu`);
`make gpu-venv` (and `make test`) build it; `ensure()` builds it on first use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

NVCC_WHEEL = "nvidia-cuda-nvcc-cu12==12.9.86"  # ptxas 12.9: PTX ISA 8.8, sm_90a and sm_80
MARKER = ".installed"


def default_dir() -> Path:
    """`$JAXSERVE_GPU_VENV`, else `.venv-gpu` in the directory above the jaxserve package
    (the repository root of a source checkout)."""
    env = os.environ.get("JAXSERVE_GPU_VENV")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".venv-gpu"


def python(venv: Path | None = None) -> Path:
    return (venv or default_dir()) / "bin" / "python"


def is_ready(venv: Path | None = None) -> bool:
    """Whether the venv was built completely for this jaxlib (its marker names the
    pinned wheels; a main venv upgraded to another jax makes it stale)."""
    marker = (venv or default_dir()) / MARKER
    return marker.is_file() and marker.read_text().split() == requirements()


def requirements() -> list[str]:
    """The pinned wheels: the plugin pair at this jaxlib's version, and ptxas."""
    import importlib.metadata as md

    v = md.version("jaxlib")
    return [f"jax-cuda12-plugin=={v}", f"jax-cuda12-pjrt=={v}", NVCC_WHEEL]


def ensure(venv: Path | None = None, *, quiet: bool = False) -> Path:
    """Build the venv if it is not complete; returns its python.

    Steps: `python -m venv`, a `.pth` line with the running interpreter's
    site-packages (the main venv), then `pip install --no-deps` of `requirements()`.
    The marker is written last, so an interrupted build is redone.

    Raises:
      RuntimeError: venv creation or pip failed (with pip's output tail).
    """
    venv = venv or default_dir()
    if is_ready(venv):
        return python(venv)
    if not quiet:
        print(f"building {venv} for deviceless GPU compiles: {' '.join(requirements())} "
              f"(~240 MB of downloads, once)", file=sys.stderr)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)])
    site = Path(subprocess.check_output(
        [str(python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    # Appended after the venv's own site-packages: the plugin wheels come from here,
    # everything else (jax, jaxlib, jaxserve's dependencies) from the main venv.
    (site / "_jaxserve_main_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python(venv)), "-m", "pip", "install", "-q", "--no-deps", *requirements()])
    (venv / MARKER).write_text(" ".join(requirements()) + "\n")
    return python(venv)


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {r.returncode}):\n{r.stdout[-2000:]}"
                           f"{r.stderr[-2000:]}")


if __name__ == "__main__":  # `make gpu-venv`
    print(ensure())
