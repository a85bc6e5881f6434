"""Sleep and wake (issue 28) on the tiny model: the memory is really released, waking
recompiles nothing and gives bit-identical tokens and logprobs, in-flight requests
follow the sleep's pause mode, and bad calls are clear errors with nothing lost.

The engine has a 64 MiB KV pool (4097 blocks of 64 tokens x 16 KiB) so the freed
pages show in the process's RSS (`/proc/self/statm`); the device-side view is
`get_stats()["kv_cache_bytes"]` and the runner's buffers being deleted.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import drain, tiny_engine, tiny_params
from jaxserve import LLM
from jaxserve.errors import EngineSleepingError
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.kv_cache import kv_bytes_per_block

PROMPTS = {"a": [5, 9, 13, 2], "b": [7, 7, 3], "c": [11, 4, 6, 8, 1]}
N = 8
BIG_POOL = dict(block_size=64, num_kv_blocks=4097)


@functools.lru_cache(maxsize=None)
def params(seed):
    return tiny_params(seed)[1]


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sampling():
    """Greedy for "a" and "c", seeded sampling with logprobs for "b"."""
    return {"a": SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2),
            "b": SamplingParams(max_tokens=N, temperature=0.8, seed=7, ignore_eos=True,
                                logprobs=2),
            "c": SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)}


def run(eng, tag=""):
    """rid -> (token ids, logprobs) of PROMPTS run to the end."""
    sp = sampling()
    for rid, p in PROMPTS.items():
        eng.add_request(tag + rid, p, sp[rid])
    outs = drain(eng)
    return {rid: (outs[tag + rid].outputs[0].token_ids, outs[tag + rid].outputs[0].logprobs)
            for rid in PROMPTS}


@pytest.fixture
def eng():
    e = tiny_engine(**BIG_POOL)
    yield e
    if e.is_sleeping:
        e.update_params(params(0))  # discarded weights need new ones before waking
        e.wake_up()
    assert not e.is_paused and not e.has_unfinished_requests()
    e.update_params(params(0))


def live_kv(eng) -> list:
    return [a for a in jax.tree.leaves(eng.runner.kv_cache) if isinstance(a, jax.Array)]


@pytest.mark.parametrize("level,discard", [(1, False), (2, False), (2, True)])
def test_sleep_frees_memory_and_wake_gives_identical_tokens(eng, level, discard):
    eng.update_params(params(0))
    before = run(eng)
    kv = eng.get_stats()["kv_cache_bytes"]
    assert kv == 4097 * kv_bytes_per_block(eng.config.model, 64) == 4097 * 16384
    compiles = eng.get_stats()["num_compiles"]
    # Fill the pool: a fresh pool's zero pages are not resident (`TensorParallel.zeros`
    # hands them back), and filling it by generation would take 262k tokens. Writing
    # every block by hand makes the whole pool resident, as a full pool would be.
    eng.runner.kv_cache = jax.block_until_ready(
        jax.tree.map(lambda a: jnp.full_like(a, 0.5), eng.runner.kv_cache))
    old_kv = live_kv(eng)
    r0 = rss()
    eng.sleep(level, discard_weights=discard)
    freed = r0 - rss()
    assert freed >= kv, f"RSS fell {freed} bytes, the KV pool is {kv}"
    assert all(a.is_deleted() for a in old_kv) and live_kv(eng) == []
    st = eng.get_stats()
    assert st["is_sleeping"] and st["sleep_level"] == level and st["paused"]
    assert st["kv_cache_bytes"] == 0
    assert st["weights"] == {1: "device", 2: "discarded" if discard else "host"}[level]
    assert (st["weights_bytes"] == 0) == (level == 2)
    if discard:
        with pytest.raises(ValueError, match="discarded"):
            eng.wake_up()
        assert eng.is_sleeping
        eng.update_params(params(0))  # the trainer's new weights (here: the same)
    eng.wake_up()
    st = eng.get_stats()
    assert not st["is_sleeping"] and not st["paused"] and st["kv_cache_bytes"] == kv
    assert st["weights"] == "device" and st["weights_bytes"] > 0
    assert run(eng, "w-") == before  # token ids and logprobs, bit for bit
    assert eng.get_stats()["num_compiles"] == compiles  # strict_compiles is on, too


def test_requests_in_flight_follow_the_mode_and_new_ones_wait(eng):
    eng.update_params(params(0))
    ref = run(eng)
    sp = sampling()
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, sp[rid])
    for _ in range(3):
        eng.step()
    eng.sleep(1, mode="retract")  # their KV goes; they recompute after the wake
    eng.add_request("late", PROMPTS["a"], sp["a"])  # accepted, waits
    assert eng.step() == [] and eng.get_stats()["num_running"] == 0
    eng.wake_up()
    outs = drain(eng)
    for rid in PROMPTS:  # a recompute is a prefill, not decode steps: logprobs to rounding
        c = outs[rid].outputs[0]
        assert c.token_ids == ref[rid][0]
        if c.logprobs is not None:
            got = [v for d in c.logprobs for v in d.values()]
            want = [v for d in ref[rid][1] for v in d.values()]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert outs["late"].outputs[0].token_ids == ref["a"][0]
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, sp[rid])
    eng.step()
    eng.sleep(1, mode="wait")  # runs them to the end first; the sleep frees an idle pool
    assert eng.get_stats()["kv_cache_bytes"] == 0
    outs = drain(eng)  # their outputs come back from the next step
    assert {rid: outs[rid].outputs[0].token_ids for rid in PROMPTS} == {
        rid: ref[rid][0] for rid in PROMPTS}
    eng.wake_up()
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, sp[rid])
    eng.step()
    eng.sleep(1)  # "abort", vLLM's default
    outs = drain(eng)
    for rid in PROMPTS:
        c = outs[rid].outputs[0]
        assert c.finish_reason == "error" and "went to sleep (level 1)" in c.error
    eng.wake_up()
    assert eng.scheduler.kv_cache_manager.num_used_blocks == 0


def test_bad_calls_are_clear_errors_and_lose_nothing(eng):
    eng.update_params(params(0))
    with pytest.raises(ValueError, match="not asleep"):
        eng.wake_up()
    with pytest.raises(ValueError, match="mode='keep'"):
        eng.sleep(1, mode="keep")
    with pytest.raises(ValueError, match="unknown pause mode 'nap'"):
        eng.sleep(1, mode="nap")
    with pytest.raises(ValueError, match="level=3 must be 1"):
        eng.sleep(3)
    with pytest.raises(ValueError, match="needs level=2"):
        eng.sleep(1, discard_weights=True)
    assert not eng.is_sleeping and not eng.is_paused and live_kv(eng)
    eng.sleep(2, reject_new=True)
    with pytest.raises(ValueError, match="already asleep"):
        eng.sleep(1)
    with pytest.raises(ValueError, match="asleep; call wake_up"):
        eng.resume_generation()
    with pytest.raises(EngineSleepingError, match="'x' refused.*reject_new=True"):
        eng.add_request("x", PROMPTS["a"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"tags=\['kv'\]"):
        eng.wake_up(["kv"])
    llm = LLM(engine=eng)
    with pytest.raises(EngineSleepingError, match="llm.wake_up"):
        llm.generate([PROMPTS["a"]], use_tqdm=False)
    eng.wake_up(["kv_cache"])  # weights still on the host: still asleep
    assert eng.is_sleeping and eng.get_stats()["kv_cache_bytes"] > 0
    llm.wake_up(["weights"])
    assert not llm.is_sleeping and not eng.has_unfinished_requests()
    out = llm.generate([PROMPTS["a"]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    # sleeping inside a caller's pause keeps that pause; a kept request's KV forbids it
    eng.pause_generation("abort")
    eng.sleep(1)
    eng.wake_up()
    assert eng.is_paused
    eng.resume_generation()
    eng.add_request("k", PROMPTS["b"], SamplingParams(max_tokens=4, temperature=0))
    eng.step()
    eng.pause_generation("keep")
    with pytest.raises(ValueError, match="1 running requests holding KV"):
        eng.sleep(1)
    eng.resume_generation()
    assert len(drain(eng)["k"].outputs[0].token_ids) == 4
