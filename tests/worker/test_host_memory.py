"""`jaxserve.worker.host_memory`: a fixed mmap threshold returns freed large buffers to the OS."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxserve.worker import host_memory

# In a fresh interpreter: one 16 MiB malloc + free (glibc's dynamic threshold then rises
# to 16 MiB), then five 6 MiB buffers touched and freed. RssAnon (KiB) before and after
# the frees: with the dynamic threshold the 30 MiB sit in the heap (trim threshold 32 MiB).
_PROBE = """
import ctypes, json, sys
from jaxserve.worker import host_memory
if sys.argv[1] == "fix":
    assert host_memory.fix_mmap_threshold()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])
big = libc.malloc(16 << 20); ctypes.memset(big, 1, 16 << 20); libc.free(big)
bufs = [libc.malloc(6 << 20) for _ in range(5)]
for b in bufs:
    ctypes.memset(b, 1, 6 << 20)
before = anon()
for b in bufs:
    libc.free(b)
print(json.dumps({"freed_kib": before - anon()}))
"""


def _freed_kib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])["freed_kib"]


def _glibc() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc(),
                    reason="glibc malloc only")
def test_fixed_threshold_returns_freed_buffers():
    # the control: glibc's default keeps them, so the probe can tell the two apart
    assert _freed_kib("default") < 8 << 10
    assert _freed_kib("fix") >= 28 << 10  # 30 MiB of 6 MiB buffers back to the OS


def test_no_mallopt_reports_false(monkeypatch):
    class NotGlibc:  # a libc without mallopt (musl, macOS)
        pass
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: NotGlibc())
    assert host_memory.fix_mmap_threshold() is False
