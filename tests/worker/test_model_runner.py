"""The real `ModelRunner` behind the Runner seam: exact compile accounting (built vs
loaded from the persistent cache) and late compiles. Per-row failure isolation on this
runner is tested in tests/engine/test_isolation.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import tiny_engine
from jaxserve.scheduler.scheduler import MAX_STEP_RETRIES
from engine.test_engine import assert_idle_and_clean, cached_reference, greedy, prompt_of, run_all

REPO = Path(__file__).resolve().parents[2]


def test_late_compile_is_counted_and_strict_mode_refuses():
    # One token bucket and one seq bucket: 3 programs (a stack and a score program for T=16,
    # a head for S=4), so
    # dropping the head forces the next step to compile it late. The suite runs strict
    # (conftest's tiny_engine sets strict_compiles=True), so the engine refuses by default.
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(16,),
                         seq_buckets=(4,))
    runner = engine.runner
    assert engine.config.strict_compiles and runner.strict_compiles
    assert runner.stats().warmup_programs == 3
    assert sorted(runner.programs.programs) == [("head", 4), ("score", 16), ("stack", 16)]
    P = prompt_of(9, salt=50)
    late0 = runner.stats().late_compiles
    del runner.programs.programs[("head", 4)]
    out = run_all(engine, [("strict", P, greedy(3))])["strict"].outputs[0]
    assert out.finish_reason == "error" and "strict_compiles" in out.error
    assert "no head program for bucket 4" in out.error
    refused = 1 + MAX_STEP_RETRIES  # the failed step's row is retried, refused each time
    assert runner.stats().late_compiles == late0 + refused
    assert engine.get_stats()["num_compiles_after_warmup"] == late0 + refused
    runner.strict_compiles = False
    try:
        out = run_all(engine, [("late", P, greedy(3))])["late"].outputs[0]
    finally:
        runner.strict_compiles = True
    assert out.token_ids == cached_reference(tuple(P), 3)  # compiled late, still correct
    assert runner.stats().late_compiles == late0 + refused + 1
    assert sorted(runner.programs.programs) == [("head", 4), ("score", 16), ("stack", 16)]  # late one kept
    assert_idle_and_clean(engine)


_CACHE_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    from conftest import tiny_params
    from jaxserve.engine import make_engine_config
    from jaxserve.worker.compile import enable_compilation_cache
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.scheduler.buckets import BucketPolicy

    enable_compilation_cache(sys.argv[1])
    cfg, params = tiny_params()
    config = make_engine_config(cfg, max_model_len=64, block_size=4, num_kv_blocks=32,
                                max_num_seqs=2, max_num_batched_tokens=8, token_buckets=(4, 8),
                                seq_buckets=(2,), attention_backend="xla")
    policy = BucketPolicy.from_config(config.scheduler)
    for _ in range(2):
        runner = ModelRunner(config, params, bucket_policy=policy)
        runner.warmup(progress=False)
        st = runner.stats()
        print(json.dumps([st.warmup_programs, st.programs_built, st.programs_loaded]))
""")


def test_compile_count_tells_built_from_loaded(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(tmp_path / "cc")], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = [json.loads(ln) for ln in proc.stdout.strip().splitlines()[-2:]]
    # Two token buckets + one seq bucket = 5 programs: 2 stacks + 1 head + 2 score programs.
    assert first == [5, 5, 0]   # an empty cache: all built by XLA
    assert second == [5, 0, 5]  # the same programs again: all loaded from the cache
