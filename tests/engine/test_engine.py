"""Engine-level checks on the tiny model (fp32, greedy unless stated).

The oracle is `reference_greedy`: the plain causal forward of
`jaxserve.model.llama.reference_logits` (no paging, no buckets, no batching)
re-run on the whole sequence for every token. The cases C01-C05, C11-C14 and
C24 of shared/cases.md are pinned here.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from conftest import tiny_engine, tiny_params
from jaxserve.sampling_params import SamplingParams

MAX_LEN = 256


def reference_greedy(prompt, n):
    """Greedy ids from the unpaged reference forward (padded to MAX_LEN: one compile)."""
    from jaxserve.model.llama import reference_logits

    cfg, params = tiny_params()
    ids, out = list(prompt), []
    for _ in range(n):
        arr = np.zeros(MAX_LEN, np.int32)
        arr[: len(ids)] = ids
        t = int(np.argmax(reference_logits(cfg, params, arr)[len(ids) - 1]))
        out.append(t)
        ids.append(t)
    return out


@functools.lru_cache(maxsize=None)
def cached_reference(prompt: tuple, n: int):
    return reference_greedy(prompt, n)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    rng = np.random.default_rng(1000 + 7 * length + salt)
    return [int(x) for x in rng.integers(3, 66, size=length)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_all(engine, requests, *, before_step=None):
    """requests: list of (id, prompt_ids, params). Returns {id: final RequestOutput}."""
    for rid, p, sp in requests:
        engine.add_request(rid, p, sp)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step(engine, step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 5000, "engine did not finish"
    return done


def assert_idle_and_clean(engine):
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    kv = engine.scheduler.kv_cache_manager
    # num_blocks excludes the null block; with prefix caching, freed blocks stay cached
    # but evictable, and count as free.
    assert kv.num_free_blocks == kv.num_blocks, (kv.num_free_blocks, kv.num_blocks)
    kv.check_invariants()


P = prompt_of(20, salt=1)
DISTRACTOR_LENS = (1, 3, 17, 64, 65, 130, 255)


def test_solo_greedy_matches_unpaged_reference():
    engine = tiny_engine()
    out = run_all(engine, [("a", P, greedy(32))])["a"]
    assert out.outputs[0].token_ids == cached_reference(tuple(P), 32)
    assert out.outputs[0].finish_reason == "length"
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("position", [0, 3, 7])
def test_c01_batch_invariance_at_positions(position):
    engine = tiny_engine()
    reqs = [(f"d{i}", prompt_of(n, salt=i), greedy(32)) for i, n in enumerate(DISTRACTOR_LENS)]
    reqs.insert(position, ("P", P, greedy(32)))
    done = run_all(engine, reqs)
    assert done["P"].outputs[0].token_ids == cached_reference(tuple(P), 32)
    for rid, p, _ in reqs:
        if rid != "P" and len(p) <= 65:
            assert done[rid].outputs[0].token_ids == cached_reference(tuple(p), 32), rid
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    assert_idle_and_clean(engine)


def test_c01_join_running_batch():
    engine = tiny_engine()
    reqs = [(f"d{i}", prompt_of(n, salt=i), greedy(40)) for i, n in enumerate(DISTRACTOR_LENS[:5])]

    def join(engine, step):
        if step == 6:
            engine.add_request("P", P, greedy(32))

    done = run_all(engine, reqs, before_step=join)
    assert done["P"].outputs[0].token_ids == cached_reference(tuple(P), 32)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("length", [15, 16, 17, 32, 49, 12])
def test_c03_chunked_prefill_equals_unchunked(length):
    prompt = prompt_of(length, salt=3)
    small = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    big = tiny_engine()
    a = run_all(small, [("x", prompt, greedy(16, logprobs=1))])["x"].outputs[0]
    b = run_all(big, [("x", prompt, greedy(16, logprobs=1))])["x"].outputs[0]
    assert a.token_ids == b.token_ids == cached_reference(tuple(prompt), 16)
    first_a = a.logprobs[0][a.token_ids[0]]
    first_b = b.logprobs[0][b.token_ids[0]]
    assert abs(first_a - first_b) < 1e-4


def test_c03_long_prompt_chunked_beside_decodes():
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    shorts = [(f"s{i}", prompt_of(3 + i, salt=i), greedy(24)) for i in range(3)]
    long_p = prompt_of(64, salt=9)
    for rid, p, sp in shorts:
        engine.add_request(rid, p, sp)
    for _ in range(2):
        engine.step()
    engine.add_request("L", long_p, greedy(8))
    done, steps, first_seen = {}, 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.request_id == "L" and first_seen is None:
                first_seen = (steps, len(out.outputs[0].token_ids))
            if out.finished:
                done[out.request_id] = out
    # 64 prompt tokens through a 16-token budget shared with 3 decodes: >= 5 steps, and
    # nothing is emitted before the last chunk.
    assert first_seen[0] >= 5 and first_seen[1] == 1
    assert done["L"].outputs[0].token_ids == cached_reference(tuple(long_p), 8)
    for rid, p, _ in shorts:
        assert done[rid].outputs[0].token_ids == cached_reference(tuple(p), 24)
    assert_idle_and_clean(engine)


def test_c04_preemption_by_recompute_keeps_outputs():
    # 8 prompts of 10-40 tokens x 64 new tokens need up to 26 blocks each; the pool holds 40.
    engine = tiny_engine(num_kv_blocks=40, enable_prefix_caching=False)
    before = engine.get_stats()["num_preemptions"]
    prompts = [prompt_of(10 + 4 * i, salt=20 + i) for i in range(8)]
    done = run_all(engine, [(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts)])
    assert engine.get_stats()["num_preemptions"] > before, "pool too large: no preemption happened"
    for i, p in enumerate(prompts):
        ids = done[f"r{i}"].outputs[0].token_ids
        assert len(ids) == 64
        assert done[f"r{i}"].outputs[0].finish_reason == "length"
        assert ids == cached_reference(tuple(p), 64), f"r{i}"
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("when", ["after_first_token", "computed_eq_prompt", "late", "twice",
                                  "mid_chunked_prefill"])
def test_c05_forced_preemption_resumes_exactly(when):
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    # (prompt length, steps before which "v" is preempted); budget 16, block_size 4.
    length, steps = {"after_first_token": (7, [1]), "computed_eq_prompt": (16, [1]),
                     "late": (7, [30]), "twice": (7, [3, 12]),
                     "mid_chunked_prefill": (40, [1])}[when]
    prompt = prompt_of(length, salt=5)
    before = engine.get_stats()["num_preemptions"]

    def hook(engine, step):
        if step in steps:
            engine.scheduler.preempt("v")

    done = run_all(engine, [("v", prompt, greedy(40))], before_step=hook)
    assert engine.get_stats()["num_preemptions"] - before == len(steps)
    assert done["v"].outputs[0].token_ids == cached_reference(tuple(prompt), 40)
    assert_idle_and_clean(engine)


def test_c24_bucket_schemes_agree_and_never_recompile():
    a = tiny_engine()
    b = tiny_engine(token_buckets=(8, 24, 40, 64), seq_buckets=(3, 8))
    # The engine's default bucket floor (tiny_engine pins 8): buckets down to 1 token and 1
    # row (the T_pad = 1 program writes its one KV row with a dynamic-update-slice and has
    # no prefill-tile loop).
    c = tiny_engine(min_token_bucket=1, min_seq_bucket=1)
    assert c.bucket_policy.token_buckets[:4] == (1, 2, 4, 8)
    assert c.bucket_policy.seq_buckets == (1, 2, 4, 8)
    prompts = [prompt_of(n, salt=n) for n in (1, 7, 8, 9, 23, 24, 25, 40, 41, 63, 64)]
    reqs = [(f"q{i}", p, greedy(12, logprobs=2)) for i, p in enumerate(prompts)]
    alone = [("solo", prompt_of(5, salt=99), greedy(20, logprobs=2))]  # T_pad 1 decode steps
    da, db, dc = run_all(a, reqs), run_all(b, reqs), run_all(c, reqs)
    da.update(run_all(a, alone))
    dc.update(run_all(c, alone))
    for rid, other in [(r, db) for r, _, _ in reqs] + [(r, dc) for r, _, _ in reqs + alone]:
        oa, ob = da[rid].outputs[0], other[rid].outputs[0]
        assert oa.token_ids == ob.token_ids, rid
        for la, lb in zip(oa.logprobs, ob.logprobs):
            for t in la:
                assert abs(la[t] - lb[t]) < 1e-5
    steps = c.get_stats()["bucket_stats"]
    assert steps[1]["steps"] > 0 and steps[2]["steps"] + steps[4]["steps"] > 0
    for e in (a, b, c):
        stats = e.get_stats()
        assert stats["num_compiles_after_warmup"] == 0
        used = {bk for bk, s in stats["bucket_stats"].items() if s["steps"] > 0}
        assert used <= set(e.bucket_policy.token_buckets)


def test_c14_max_tokens_one_finishes_in_prefill():
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [prompt_of(5, salt=1), prompt_of(40, salt=2)]  # the second is chunked
    done = run_all(engine, [(f"m{i}", p, greedy(1)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        o = done[f"m{i}"].outputs[0]
        assert o.token_ids == cached_reference(tuple(p), 1)
        assert o.finish_reason == "length"
    assert_idle_and_clean(engine)


def test_c11_max_model_len_boundaries():
    engine = tiny_engine()
    M = engine.config.scheduler.max_model_len
    out = run_all(engine, [("a", prompt_of(M - 1), greedy(1))])["a"].outputs[0]
    assert len(out.token_ids) == 1
    out = run_all(engine, [("b", prompt_of(M - 1), greedy(10))])["b"].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # clamped, documented
    for n in (M, M + 1):
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request("c", prompt_of(n), greedy(1))
    out = run_all(engine, [("d", prompt_of(M - 5), SamplingParams(temperature=0.0, max_tokens=None,
                                                                  ignore_eos=True))])["d"]
    assert len(out.outputs[0].token_ids) == 5
    assert run_all(engine, [("e", P, greedy(4))])["e"].outputs[0].token_ids == cached_reference(tuple(P), 4)
    assert_idle_and_clean(engine)


def test_bad_input_is_rejected_and_engine_keeps_serving():
    engine = tiny_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e1", [], greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e2", "", greedy(4))
    with pytest.raises(ValueError, match="vocab_size"):
        engine.add_request("e3", [1, 2, 67], greedy(4))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    engine.add_request("dup", P, greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", P, greedy(2))
    done = run_all(engine, [])
    assert done["dup"].outputs[0].token_ids == cached_reference(tuple(P), 2)
    assert_idle_and_clean(engine)


def test_abort_in_every_state_frees_blocks():
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    engine.add_request("run", prompt_of(6), greedy(50))
    engine.add_request("chunk", prompt_of(60), greedy(50))
    for _ in range(2):
        engine.step()
    engine.add_request("wait1", prompt_of(9), greedy(50))
    engine.add_request("wait2", prompt_of(9), greedy(50))
    for rid in ("run", "chunk", "wait1", "wait2"):
        assert engine.abort(rid)
    assert not engine.abort("nope")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_idle_and_clean(engine)


def test_n2_seeded_samples_equal_solo_seeded_runs():
    engine = tiny_engine()
    sp = SamplingParams(temperature=0.8, seed=42, max_tokens=16, ignore_eos=True, n=2)
    both = run_all(engine, [("n2", P, sp)])["n2"]
    assert [o.index for o in both.outputs] == [0, 1]
    for i in range(2):
        solo = run_all(engine, [(f"s{i}", P, sp.replace(n=1, seed=42 + i))])[f"s{i}"]
        assert both.outputs[i].token_ids == solo.outputs[0].token_ids
    assert both.outputs[0].token_ids != both.outputs[1].token_ids
    assert_idle_and_clean(engine)


def test_c21_seed_independent_of_batch_mates_and_preemption():
    sp = SamplingParams(temperature=0.8, seed=42, max_tokens=16, ignore_eos=True)
    engine = tiny_engine()
    alone = run_all(engine, [("R", P, sp)])["R"].outputs[0].token_ids
    mates = [("u", prompt_of(9), SamplingParams(temperature=1.0, max_tokens=16)),
             ("s7", prompt_of(13), SamplingParams(temperature=1.0, seed=7, max_tokens=16))]
    for pos in range(3):
        reqs = list(mates)
        reqs.insert(pos, ("R", P, sp))
        assert run_all(engine, reqs)["R"].outputs[0].token_ids == alone

    def hook(engine, step):
        if step == 5:
            engine.scheduler.preempt("R")

    small = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    before = small.get_stats()["num_preemptions"]
    assert run_all(small, [("R", P, sp)], before_step=hook)["R"].outputs[0].token_ids == alone
    assert small.get_stats()["num_preemptions"] == before + 1
    others = {tuple(run_all(engine, [("R", P, sp.replace(seed=s))])["R"].outputs[0].token_ids)
              for s in range(8)}
    assert len(others) >= 2


def test_c20_temperature_zero_equals_top_k_one():
    engine = tiny_engine()
    a = run_all(engine, [("a", P, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))])
    b = run_all(engine, [("b", P, SamplingParams(temperature=1.0, top_k=1, max_tokens=24,
                                                 ignore_eos=True, seed=3))])
    mixed = run_all(engine, [("g", P, greedy(24)),
                             ("s", P, SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                                                     ignore_eos=True))])
    ref = cached_reference(tuple(P), 24)
    assert a["a"].outputs[0].token_ids == b["b"].outputs[0].token_ids == ref
    assert mixed["g"].outputs[0].token_ids == ref


def test_stop_strings_and_eos(tokenizer):
    engine = tiny_engine()
    base = run_all(engine, [("t", P, greedy(24))])["t"].outputs[0]
    text = base.text
    assert text == tokenizer.decode(base.token_ids)
    stop = text[5:7]
    cut = text.index(stop)
    ex = run_all(engine, [("x", P, greedy(24, stop=(stop,)))])["x"].outputs[0]
    assert ex.text == text[:cut] and ex.finish_reason == "stop" and ex.stop_reason == stop
    inc = run_all(engine, [("y", P, greedy(24, stop=(stop,), include_stop_str_in_output=True))])["y"]
    assert inc.outputs[0].text == text[: cut + len(stop)]
    # A stop token id ends the request with that token included (vLLM).
    tok = base.token_ids[3]
    first = base.token_ids.index(tok)
    st = run_all(engine, [("z", P, SamplingParams(temperature=0.0, max_tokens=24,
                                                  stop_token_ids=(tok,)))])["z"].outputs[0]
    assert st.token_ids == base.token_ids[: first + 1] and st.finish_reason == "stop"
    assert_idle_and_clean(engine)


def test_streamed_deltas_concatenate_to_final_text():
    from jaxserve.llm import LLM

    llm = LLM(engine=tiny_engine())
    pieces: dict[str, list[str]] = {}
    finals = {}
    base = llm.generate(["Hello there"], greedy(20), use_tqdm=False)[0].outputs[0].text
    stop = base[8:10]  # held back while a stop prefix is pending, then cut
    params = [greedy(20, stop=(stop,)), greedy(20)]
    for out in llm.generate_stream(["Hello there", "abc"], params):
        pieces.setdefault(out.request_id, []).append(out.outputs[0].delta_text)
        if out.finished:
            finals[out.request_id] = out.outputs[0].text
    assert len(finals) == 2
    for rid, text in finals.items():
        assert "".join(pieces[rid]) == text
    assert stop not in finals["gen-1"] and finals["gen-1"] == base[: base.index(stop)]


def test_llm_generate_keeps_input_order_and_accepts_chat(tokenizer):
    from jaxserve.llm import LLM

    llm = LLM(engine=tiny_engine())
    chat = [{"role": "user", "content": "hi there"}]
    outs = llm.generate(["Hello", P, chat], greedy(6), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert outs[1].prompt_token_ids == P
    assert outs[2].prompt_token_ids == tokenizer.apply_chat_template(chat)
    assert outs[1].outputs[0].token_ids == cached_reference(tuple(P), 6)
    assert outs[0].metrics.ttft is not None and outs[0].metrics.ttft >= 0


def test_stop_string_completed_by_the_last_allowed_token_reports_stop():
    engine = tiny_engine()
    base = run_all(engine, [("t", P, greedy(24))])["t"].outputs[0].text
    # A suffix whose first occurrence is at the very end: it completes on token 24.
    stop = next(base[-k:] for k in range(2, 8) if base.index(base[-k:]) == len(base) - k)
    out = run_all(engine, [("u", P, greedy(24, stop=(stop,)))])["u"].outputs[0]
    assert len(out.token_ids) == 24
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: len(base) - len(stop)]


def test_engine_step_failure_is_retried_on_a_rebuilt_cache(monkeypatch):
    engine = tiny_engine()
    runner = engine.runner
    real_dispatch = runner.dispatch  # what the engine calls for a plan with rows
    calls = {"n": 0}

    def failing(out):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-decode, mid-stack: the caches donated so far are lost
            for a in jax.tree.leaves(runner.kv_cache)[:3]:
                a.delete()
            raise RuntimeError("injected device failure")
        return real_dispatch(out)

    monkeypatch.setattr(runner, "dispatch", failing)
    done = run_all(engine, [("x", P, greedy(8)), ("y", prompt_of(9), greedy(8))])
    # The one failure is retried (issue 13): both are recomputed on the rebuilt cache and
    # finish with the tokens of an undisturbed run.
    assert done["x"].outputs[0].token_ids == cached_reference(tuple(P), 8)
    assert done["y"].outputs[0].token_ids == cached_reference(tuple(prompt_of(9)), 8)
    assert engine.get_stats()["num_failed_steps"] == 1
    assert not any(a.is_deleted() for a in jax.tree.leaves(runner.kv_cache))  # reset() rebuilt the lost cache
    assert_idle_and_clean(engine)


def test_child_ids_logprobs_limit_and_prompt_types():
    engine = tiny_engine()
    engine.add_request("a", P, greedy(30, n=2))
    with pytest.raises(ValueError, match="a#1"):
        engine.add_request("a#1", P, greedy(2))
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.add_request("lp", P, greedy(2, logprobs=engine.config.max_logprobs + 1))
    with pytest.raises(ValueError, match="sequence of token ids"):
        engine.add_request("bad", 5, greedy(2))
    with pytest.raises(ValueError, match="not an integer"):
        engine.add_request("bad", [1, 2.5], greedy(2))
    engine.add_request("np", [np.int64(t) for t in P], greedy(3))
    done = run_all(engine, [])
    assert [len(o.token_ids) for o in done["a"].outputs] == [30, 30]
    assert done["np"].outputs[0].token_ids == cached_reference(tuple(P), 3)
    assert_idle_and_clean(engine)
