"""Multi-host tensor parallelism on this machine: two processes on 127.0.0.1 with 2 fake
CPU devices each, joined by `jax.distributed` (gloo CPU collectives), TP = 4 across them.

Process 0 runs the engine and broadcasts each step's host arrays; process 1 runs the
same programs in lock-step (`jaxserve.distributed.multihost`). The greedy tokens must equal the
TP = 1 engine's in this (one-device) process, and both processes must exit 0 after
the leader's stop.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(out: str) -> dict:
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_two_processes_tp4_same_tokens_as_tp1_and_clean_exit():
    from jaxserve.engine import LLMEngine, make_engine_config
    from tests.conftest import tiny_params
    from tests.distributed.test_tensor_parallel import assert_same_runs
    from tests.distributed.tp_worker import PROMPTS, TINY_ENGINE, TINY_HEADS, _run

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.multihost_worker", str(port), str(i)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in (0, 1)]
    # The TP = 1 reference, here, while the children compile.
    cfg, params = tiny_params(**TINY_HEADS)
    ref = _run(LLMEngine(make_engine_config(cfg, attention_backend="xla", **TINY_ENGINE), params,
                         None, progress=False), PROMPTS)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    leader, follower = (_result(o) for o in outs)
    assert leader["global_devices"] == follower["global_devices"] == 4
    assert leader["local_devices"] == follower["local_devices"] == 2
    assert_same_runs(leader["runs"], ref)
    assert leader["preemptions"] > 0
    # Lock-step: the follower ran exactly the leader's steps, no late compiles anywhere.
    assert follower["steps"] == leader["steps"] > 0
    assert leader["late"] == follower["late"] == 0
    # Each process holds only its 2 devices' shards (H*D / 4 columns of wq each).
    assert leader["wq_shards"] == follower["wq_shards"] == [[48, 16], [48, 16]]
    assert len(leader["local_param_bytes"]) == 2


@pytest.mark.slow  # three CLI processes compiling (~1.5 min on this CPU)
def test_cli_generate_two_processes_tp2_same_tokens_as_one(tmp_path):
    """`jaxserve generate --num_processes=2 --process_id=i --coordinator_address=...` with
    one fake device per process and --tensor_parallel_size=2 (6 query / 2 KV heads of the
    tiny HF fixture) prints the same greedy tokens as a single-process TP = 1 run."""
    common = ["--model=tests/fixtures/tiny_untied", "--chat=false", "--prompt=hello",
              "--prompt=abc", "--max_tokens=8", "--ignore_eos", "--max_num_batched_tokens=16",
              "--max_num_seqs=4", "--token_buckets=16", "--seq_buckets=4", "--max_model_len=64",
              "--num_kv_blocks=32", "--block_size=4", "--attention_backend=xla",
              "--compile_cache_dir=", "--params_cache_dir=", "--executable_cache_dir=",
              "--print_outputs=false"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cli = [sys.executable, "-m", "jaxserve.cli", "generate"] + common
    mh = [f"--coordinator_address=127.0.0.1:{_free_port()}", "--num_processes=2",
          "--tensor_parallel_size=2"]
    runs = [subprocess.Popen(cli + mh + [f"--process_id={i}", f"--output_json={tmp_path}/p{i}.json"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for i in (0, 1)]
    runs.append(subprocess.Popen(cli + [f"--output_json={tmp_path}/ref.json"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=900)[0] for p in runs]
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in runs] == [0, 0, 0], "\n".join(o[-2000:] for o in outs)
    assert "follower 1: stop after" in outs[1]
    assert not (tmp_path / "p1.json").exists()  # the follower serves nothing

    def ids(name):
        d = json.loads((tmp_path / name).read_text())
        return [c["token_ids"] for o in d["outputs"] for c in o["completions"]]

    assert ids("p0.json") == ids("ref.json")
    assert all(len(t) == 8 for t in ids("ref.json"))
