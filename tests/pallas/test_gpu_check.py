"""scripts/gpu_check.py: the CPU dry run passes, and its comparison catches bad outputs."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.fixture(scope="module")
def gpu_check():
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_passes(gpu_check, capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count(" OK") == 4 and "PASS" in out
    assert "decode       pallas" in out and "mixed        xla" in out


def test_compare_flags_nan_and_error(gpu_check):
    ref = np.ones((4, 2, 3))
    assert gpu_check.compare("same", ref.copy(), ref, 4, 1e-5)
    bad = ref.copy()
    bad[1, 0, 0] = np.nan
    assert not gpu_check.compare("nan", bad, ref, 4, 1e-5)
    assert gpu_check.compare("nan in padding", bad, ref, 1, 1e-5)
    assert not gpu_check.compare("off", ref + 1e-3, ref, 4, 1e-5)


def test_without_gpu_the_full_check_refuses(gpu_check):
    assert gpu_check.main([]) == 2
