"""The 1-minute soak profile: scripts/soak.sh against a tiny-model server on 127.0.0.1.

Mixed traffic (streamed and not, n > 1, aborts, disconnects, bad requests) for
SOAK_SECONDS (60 by default here; `make soak` runs 15 minutes). Passes when
no request got a 5xx or an unexpected status, every scenario ran, and the KV
pool is empty once the server is idle (read from /metrics).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"completion", "chat", "completion_stream", "chat_stream", "n_gt_1", "abort_stream",
             "disconnect", "bad_request"}


def test_one_minute_soak(tmp_path):
    report = tmp_path / "soak.json"
    env = dict(os.environ, SOAK_SECONDS=os.environ.get("SOAK_SECONDS", "60"),
               SOAK_REPORT=str(report), SOAK_CONCURRENCY="6", JAX_PLATFORMS="cpu")
    # Its own process group, so a timeout kills the server too (bash's EXIT trap would not run).
    p = subprocess.Popen(["bash", "scripts/soak.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert report.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert proc.returncode == 0, (r["failed_checks"], proc.stderr[-3000:])
    assert r["num_5xx"] == 0 and not r["errors_by_class"], r
    assert r["kv_blocks_in_use_end"] == 0 and r["health_end"] == 200
    assert set(r["done_by_scenario"]) == SCENARIOS, r["done_by_scenario"]
    assert r["rss_start_mib"] > 0 and r["rss_end_mib"] > 0
