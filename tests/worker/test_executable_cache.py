"""The serialized-executable cache (jaxserve/executable_cache.py, issue 12): a restart in a
fresh process builds 0 programs and gives the same tokens; a damaged entry is rebuilt and
replaced; a key change (dtype, bucket set) misses, with a log line naming the change.

Each phase runs in its own Python process (the point is a restart), with JAX's persistent
compilation cache off, so `built` counts real XLA compiles and `restored` counts programs
deserialized without any trace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    sys.path.insert(0, "tests")
    logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
    logging.getLogger("jaxserve.worker.executable_cache").setLevel(logging.DEBUG)
    from conftest import tiny_params
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.sampling_params import SamplingParams

    cache_dir, overrides = sys.argv[1], json.loads(sys.argv[2])
    if len(sys.argv) > 3:
        from jaxserve.worker.compile import enable_compilation_cache
        enable_compilation_cache(sys.argv[3])
    cfg, params = tiny_params()
    args = dict(max_model_len=64, block_size=4, num_kv_blocks=32, max_num_seqs=2,
                max_num_batched_tokens=8, token_buckets=(4, 8), seq_buckets=(2,),
                attention_backend="xla", strict_compiles=True,
                enable_prompt_logprobs=False)  # stack + head programs only: counts below
    args.update({k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
    engine = LLMEngine(make_engine_config(cfg, **args), params, progress=False,
                       executable_cache_dir=cache_dir)
    st = engine.runner.stats()
    engine.add_request("a", [5, 9, 13, 21, 34, 7, 11], SamplingParams(temperature=0, max_tokens=4,
                                                                     ignore_eos=True))
    first = [o.outputs[0].token_ids for o in engine.step()]  # the prefill step samples token 1
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    print("RESULT " + json.dumps({"built": st.programs_built, "loaded": st.programs_loaded,
                                  "restored": st.programs_restored, "total": st.warmup_programs,
                                  "first": first[0], "tokens": out[0].outputs[0].token_ids,
                                  "late": engine.runner.stats().late_compiles}))
""")


def _run(cache_dir: Path, compile_cache: Path | None = None, **overrides) -> tuple[dict, str]:
    extra = [str(compile_cache)] if compile_cache else []
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(cache_dir), json.dumps(overrides),
                           *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    cache = tmp_path_factory.mktemp("exec_cache")
    res, log = _run(cache)
    assert (res["built"], res["restored"], res["total"]) == (3, 0, 3), res
    # A layer-group stack is three entries (jaxserve.worker.layer_stack): embed, layers, final.
    assert sorted(p.name.split("_")[0] for p in cache.glob("*.jxe")) == [
        "head",
        "stack.embed", "stack.embed", "stack.final", "stack.final", "stack.layers",
        "stack.layers"]
    assert not list(cache.glob(".*.tmp")), "a temporary file was left behind"
    return cache, res


def test_restart_builds_nothing_and_gives_the_same_tokens(cold):
    cache, first = cold
    res, _ = _run(cache)
    assert (res["built"], res["loaded"], res["restored"]) == (0, 0, 3), res
    assert res["first"] == first["first"] and res["tokens"] == first["tokens"]
    assert res["late"] == 0


def test_a_truncated_or_corrupt_entry_is_rebuilt_and_replaced(cold):
    cache, first = cold
    stack4 = next(cache.glob("stack.layers_4_*.jxe"))  # one part: the stack is rebuilt
    good = stack4.read_bytes()
    stack4.write_bytes(good[: len(good) // 2])  # truncated, as by a crash mid-copy
    res, log = _run(cache)
    assert (res["built"], res["restored"]) == (1, 2), res
    assert "unusable" in log and "truncated" in log and stack4.name in log
    assert res["tokens"] == first["tokens"]
    # Replaced by a whole entry (a rebuilt program's serialization may differ from the
    # first by a few bytes, so the proof is that the next start restores every entry).
    assert stack4.stat().st_size > len(good) // 2
    res, _ = _run(cache)
    assert (res["built"], res["restored"]) == (0, 3), res
    flipped = bytearray(stack4.read_bytes())
    flipped[-100] ^= 0xFF  # same length, one byte of the executable changed
    stack4.write_bytes(bytes(flipped))
    res, log = _run(cache)
    assert (res["built"], res["restored"]) == (1, 2), res
    assert "sha256 mismatch" in log and res["tokens"] == first["tokens"]
    res, _ = _run(cache)
    assert (res["built"], res["restored"]) == (0, 3), res  # the rebuilt entry loads


def test_a_key_change_misses_and_says_why(cold):
    cache, _ = cold
    res, log = _run(cache, dtype="bfloat16")
    assert (res["built"], res["restored"]) == (3, 0), res
    assert "config.model.dtype: 'float32' -> 'bfloat16'" in log, log[-3000:]
    # Another token bucket set: the 4-token stack and the head are the same programs
    # (same size, same row count), the 16-token stack is new.
    res, log = _run(cache, token_buckets=[4, 16], max_num_batched_tokens=16)
    assert (res["built"], res["restored"]) == (1, 2), res
    assert "stack.layers 16: no cached entry" in log


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    # Test workers share one cache: many threads storing the same program race on one
    # final name; each writes its own temporary file and renames it, so the survivor is
    # whole and loadable and no temporary file remains.
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.worker.executable_cache import ExecutableCache

    compiled = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.zeros(16)).compile()
    cache = ExecutableCache(tmp_path / "c")
    parts = {"family": "probe", "size": 16, "k": "v"}
    (tmp_path / "c").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a writer killed mid-write left its temporary behind
    (tmp_path / "c" / f".probe_16_x.{dead.pid}.abc.tmp").write_bytes(b"half")
    threads = [threading.Thread(target=cache.store, args=(parts, compiled)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in (tmp_path / "c").iterdir()] == [cache.path(parts).name]
    x = np.linspace(0, 1, 16, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(cache.load(parts)(x)), np.sin(x) * 2, rtol=1e-6)
    assert cache.load(dict(parts, k="other")) is None  # another key: a miss, not this entry


def test_programs_from_the_jax_compile_cache_are_not_stored(tmp_path):
    # XLA:CPU: an executable loaded from JAX's compile cache re-serializes without its
    # JIT-compiled kernels and fails when run ("Function wrapped_iota not found"), so
    # only fresh compiles go into the executable cache.
    cc = tmp_path / "cc"
    first, _ = _run(tmp_path / "unused", compile_cache=cc)  # fills the compile cache
    assert (first["built"], first["restored"]) == (3, 0), first
    ec = tmp_path / "ec"
    res, _ = _run(ec, compile_cache=cc)
    assert (res["built"], res["loaded"], res["restored"]) == (0, 3, 0), res
    assert not list(ec.glob("*.jxe"))  # nothing stored from compile-cache loads
    res, _ = _run(ec, compile_cache=cc)
    assert (res["loaded"], res["restored"]) == (3, 0) and res["tokens"] == first["tokens"]


def test_the_size_cap_evicts_the_least_recently_used_entries(tmp_path):
    import os

    import jax
    import jax.numpy as jnp

    from jaxserve.worker.executable_cache import ExecutableCache

    compiled = jax.jit(lambda x: jnp.cos(x) + 1).lower(jnp.zeros(8)).compile()
    probe = ExecutableCache(tmp_path / "probe", max_bytes=None)
    assert probe.store({"family": "p", "size": 0}, compiled)
    one = probe.path({"family": "p", "size": 0}).stat().st_size
    cache = ExecutableCache(tmp_path / "c", max_bytes=int(2.5 * one))  # room for two entries
    keys = [{"family": "p", "size": i} for i in range(3)]
    for i, k in enumerate(keys[:2]):
        assert cache.store(k, compiled)
        os.utime(cache.path(k), (1000 + i, 1000 + i))  # k0 older than k1
    assert cache.load(keys[0]) is not None  # k0 used again: now k1 is the oldest
    assert cache.store(keys[2], compiled)
    assert [cache.path(k).exists() for k in keys] == [True, False, True]
    assert cache.evict() == 0  # within the cap: nothing more goes
    tiny = ExecutableCache(tmp_path / "c", max_bytes=1)  # below one entry: only the new one stays
    assert tiny.store(keys[1], compiled)
    assert [p.name for p in (tmp_path / "c").glob("*.jxe")] == [cache.path(keys[1]).name]


def test_every_traced_module_is_in_the_source_digest():
    # A program traced from a file outside PROGRAM_SOURCES would be loaded stale after
    # that file changed.
    import inspect
    from pathlib import Path

    from jaxserve.model import llama
    from jaxserve.sample import sampler
    from jaxserve.worker import executable_cache, layer_stack, programs, scoring
    from jaxserve.attention import native_cpu, xla

    root = Path(executable_cache.__file__).resolve().parent.parent
    covered = set()
    for rel in executable_cache.PROGRAM_SOURCES:
        p = root / rel
        covered |= set(p.rglob("*.py")) if p.is_dir() else {p}
    fns = [programs._stack_fn, programs._head_fn, programs._score_fn,
           layer_stack.embed_fn, layer_stack.layers_fn, layer_stack.final_fn, sampler.sample,
           llama.decoder_layer, xla.XlaBackend, native_cpu.paged_decode, scoring.scoring_plan]
    for fn in fns:
        assert Path(inspect.getsourcefile(fn)).resolve() in covered, fn
