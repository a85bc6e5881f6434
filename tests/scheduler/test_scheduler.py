"""Scheduler scenarios: budgets, decode-first, validation (C09 C11 C12 C13),
finishing (C14, EOS/stop/min_tokens), aborts in every state (C08), policies,
static batching and the engine-facing error paths."""

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduler.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.worker.fake_runner import FakeRunner, scripted

from ._util import assert_pool_clean, expected_tokens, make_req, make_scheduler, prompt


def run_all(s, **kw):
    steps = []
    done = FakeRunner(s, check_invariants=True, on_step=steps.append, **kw).run()
    return done, steps


def test_decode_kept_every_step_while_2048_prompt_chunks():
    s = make_scheduler(budget=64, max_seqs=4, max_model_len=4096, block_size=16, num_kv_blocks=300)
    s.add_request(make_req("dec", 10, max_tokens=200))
    fr = FakeRunner(s, check_invariants=True)
    fr.step()  # prefill of "dec"
    s.add_request(make_req("long", 2048, max_tokens=4))
    long_steps = 0
    while s.get_request("long") is not None and s.get_request("long").num_output_tokens == 0:
        res = fr.step()
        rows = {r.request_id: r for r in res.out.scheduled}
        assert rows["dec"].token_ids and len(rows["dec"].token_ids) == 1 and rows["dec"].sample
        assert res.out.num_scheduled_tokens <= 64
        if "long" in rows:
            long_steps += 1
            assert len(rows["long"].token_ids) == min(63, 2048 - rows["long"].start_pos)
            assert rows["long"].sample == (rows["long"].end_pos == 2048)
    assert long_steps == -(-2048 // 63)
    assert s.get_request("dec").num_output_tokens == 1 + long_steps


def test_decodes_first_even_when_an_older_request_is_chunking():
    # "long" is admitted first; "short" starts decoding while "long" still chunks.
    s = make_scheduler(budget=32, max_seqs=4, max_model_len=1024, block_size=8, num_kv_blocks=200,
                       threshold=24)
    s.add_request(make_req("long", 300, max_tokens=2))
    s.add_request(make_req("short", 5, max_tokens=40))
    fr = FakeRunner(s, check_invariants=True)
    first = fr.step().out
    assert [(r.request_id, len(r.token_ids)) for r in first.scheduled] == [("long", 24), ("short", 5)]
    while s.get_request("long").num_output_tokens == 0:
        out = fr.step().out
        ids = [r.request_id for r in out.scheduled]
        assert ids[0] == "short" and len(out.scheduled[0].token_ids) == 1  # decode row first
        assert ids[1] == "long"
        assert len(out.scheduled[1].token_ids) == min(24, 300 - out.scheduled[1].start_pos)  # cap


def test_budget_and_max_num_seqs_respected():
    s = make_scheduler(budget=16, max_seqs=3, num_kv_blocks=100)
    for i in range(7):
        s.add_request(make_req(f"r{i}", 6 + i, max_tokens=5))
    done, steps = run_all(s)
    for st in steps:
        assert st.out.num_scheduled_tokens <= 16 and len(st.out.scheduled) <= 3
        t, n = st.out.token_bucket, st.out.seq_bucket
        assert t >= st.out.num_scheduled_tokens and n >= len(st.out.scheduled)
    assert {k: v.output_token_ids for k, v in done.items()} == {
        f"r{i}": expected_tokens(f"r{i}", 5) for i in range(7)}
    assert_pool_clean(s)


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_small_pool_forces_preemption_and_all_finish_exactly(prefix, order):
    # C04: block_size 4; one request at full length needs ceil((40+64-1)/4) = 26 blocks.
    s = make_scheduler(budget=64, max_seqs=8, block_size=4, num_kv_blocks=40, prefix=prefix)
    lens = [10 + (i * 37) % 31 for i in range(8)]
    ids = list(range(8)) if order == "forward" else list(range(7, -1, -1))
    for i in ids:
        s.add_request(make_req(f"r{i}", lens[i], max_tokens=64))
    done, _ = run_all(s)
    assert s.num_preemptions > 0
    for i in range(8):
        r = done[f"r{i}"]
        assert r.output_token_ids == expected_tokens(f"r{i}", 64)
        assert r.finish_reason == "length" and r.num_tokens <= 256
    assert_pool_clean(s)


def test_request_larger_than_pool_rejected_at_once_while_others_run():
    # C09: 10 blocks of 4, 9 usable = 36 KV positions.
    s = make_scheduler(budget=16, max_seqs=4, block_size=4, num_kv_blocks=10, max_model_len=200)
    s.add_request(make_req("small0", 5, max_tokens=6))
    fr = FakeRunner(s, check_invariants=True)
    fr.step()
    with pytest.raises(ValueError, match=r"needs 10 KV blocks .* 9 usable blocks"):
        s.add_request(make_req("X", 30, max_tokens=8))  # 30 + 8 - 1 = 37 positions
    with pytest.raises(ValueError, match=r"needs 11 KV blocks"):
        s.add_request(make_req("X", 41, max_tokens=1))
    assert s.get_request("X") is None
    s.add_request(make_req("small1", 4, max_tokens=3))
    done = fr.run()
    assert set(done) == {"small0", "small1"}
    # Boundary: exactly the 9 usable blocks (36 positions) is accepted and completes.
    s.add_request(make_req("edge", 30, max_tokens=7))
    done = fr.run()
    assert done["edge"].output_token_ids == expected_tokens("edge", 7)
    assert_pool_clean(s)


@pytest.mark.parametrize("prefix", [False, True])
def test_two_requests_that_fit_alone_but_not_together_both_finish(prefix):
    # Each needs ceil((8 + 36 - 1) / 4) = 11 of the 12 usable blocks.
    s = make_scheduler(budget=32, max_seqs=4, block_size=4, num_kv_blocks=13, prefix=prefix)
    s.add_request(make_req("a", 8, max_tokens=36))
    s.add_request(make_req("b", 8, max_tokens=36))
    done, _ = run_all(s)
    assert s.num_preemptions > 0
    assert done["a"].output_token_ids == expected_tokens("a", 36)
    assert done["b"].output_token_ids == expected_tokens("b", 36)
    assert_pool_clean(s)


def test_max_tokens_one_finishes_in_its_prefill_step():
    s = make_scheduler(budget=16, max_seqs=8, num_kv_blocks=100)
    s.add_request(make_req("short", 5, max_tokens=1))
    s.add_request(make_req("chunked", 100, max_tokens=1))  # 7 chunks of <= 16
    s.add_request(make_req("sib#0", prompt(20, 3), max_tokens=1))
    s.add_request(make_req("sib#1", prompt(20, 3), max_tokens=1))
    done, steps = run_all(s)
    first = steps[0]
    assert [r.request_id for r in first.finished] == ["short"]
    assert first.out.scheduled[0].sample and first.out.scheduled[0].token_ids == tuple(
        done["short"].prompt_token_ids)
    for rid, r in done.items():
        assert r.output_token_ids == expected_tokens(rid, 1) and r.finish_reason == "length"
    fed = [(r.start_pos, len(r.token_ids), r.sample) for st in steps for r in st.out.scheduled
           if r.request_id == "chunked"]
    assert sum(n for _, n, _ in fed) == 100 and [x[2] for x in fed] == [False] * (len(fed) - 1) + [True]
    assert_pool_clean(s)


def _abort_scenarios():
    return ["waiting", "running", "mid_chunk", "preempted", "between_schedule_and_update"]


@pytest.mark.parametrize("state", _abort_scenarios())
@pytest.mark.parametrize("prefix", [False, True])
def test_abort_in_every_state_frees_everything(state, prefix):
    s = make_scheduler(budget=8, max_seqs=2, block_size=4, num_kv_blocks=30, prefix=prefix)
    fr = FakeRunner(s, check_invariants=True)
    victim = make_req("v", 40 if state == "mid_chunk" else 6, max_tokens=50)
    if state == "waiting":
        s.add_request(make_req("a", 6, max_tokens=50))
        s.add_request(make_req("b", 6, max_tokens=50))
        s.add_request(victim)
        fr.step()
        assert victim.status == RequestStatus.WAITING
    elif state == "running":
        s.add_request(victim)
        for _ in range(5):
            fr.step()
        assert victim.status == RequestStatus.RUNNING and victim.num_output_tokens == 5
    elif state == "mid_chunk":
        s.add_request(victim)
        fr.step()
        fr.step()
        assert victim.num_computed_tokens == 16 and victim.num_output_tokens == 0
    elif state == "preempted":
        s.add_request(victim)
        fr.step()
        s.preempt("v")
        fr.step()
        assert victim.status == RequestStatus.PREEMPTED and s.num_waiting == 1
    if state == "between_schedule_and_update":
        s.add_request(victim)
        fr.step()
        out = s.schedule()
        assert s.abort("v")
        assert s.update_from_output(out, {"v": 5}) == []
        assert victim.output_token_ids == expected_tokens("v", 1)
    else:
        assert s.abort("v")
    assert victim.status == RequestStatus.FINISHED_ABORTED and victim.finish_reason == "abort"
    assert not s.abort("v") and not s.abort("nope")
    assert "v" in s.schedule().finished_ids or state == "between_schedule_and_update"
    s.add_request(make_req("after", 5, max_tokens=3))
    done = _drain(s)
    assert done["after"].output_token_ids == expected_tokens("after", 3)
    assert_pool_clean(s)


def _drain(s):
    """Finish everything; the last schedule() may still be pending, so apply it first."""
    done = {}
    out = s.pending_output
    if out is not None:
        toks = {r.request_id: 7 for r in out.scheduled if r.sample}
        for r in s.update_from_output(out, toks):
            done[r.request_id] = r
    fr = FakeRunner(s, check_invariants=True)
    done.update(fr.run())
    return done


@pytest.mark.parametrize("M", [64])
def test_max_model_len_boundaries(M):
    # C11 / C12 / C13 against max_model_len = 64.
    s = make_scheduler(budget=32, max_seqs=4, max_model_len=M, block_size=4, num_kv_blocks=40)
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add_request(make_req("e", [], max_tokens=1))
    with pytest.raises(ValueError, match=f"prompt length {M} must be < max_model_len={M}"):
        s.add_request(make_req("m", M, max_tokens=1))
    with pytest.raises(ValueError, match=f"prompt length {M + 1}"):
        s.add_request(make_req("m1", M + 1, max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens=0 must be an int >= 1"):
        s.add_request(Request("z", [1, 2], SamplingParams(), max_tokens=0))
    s.add_request(make_req("a", M - 1, max_tokens=1))
    s.add_request(make_req("b", M - 1, max_tokens=10))  # clamped to 1
    s.add_request(make_req("c", M - 5, max_tokens=None))  # resolves to 5
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_req("c", 3))
    s.add_request(make_req("normal", 4, max_tokens=3))
    done, _ = run_all(s)
    assert done["a"].num_output_tokens == 1 and done["b"].num_output_tokens == 1
    assert done["b"].finish_reason == "length" and done["c"].num_output_tokens == 5
    assert done["normal"].num_output_tokens == 3
    assert all(r.num_tokens <= M for r in done.values())
    assert_pool_clean(s)


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_kv_blocks=None"):
        Scheduler(SchedulerConfig(), CacheConfig())
    with pytest.raises(ValueError, match="largest token bucket 128 must equal max_num_batched_tokens=256"):
        Scheduler(SchedulerConfig(), CacheConfig(num_kv_blocks=10),
                  bucket_policy=BucketPolicy([64, 128], [32]))
    with pytest.raises(ValueError, match="largest seq bucket 16 must be >= max_num_seqs=32"):
        Scheduler(SchedulerConfig(), CacheConfig(num_kv_blocks=10),
                  bucket_policy=BucketPolicy([256], [16]))


def test_eos_stop_ids_min_tokens_and_ignore_eos():
    EOS = 2
    s = make_scheduler(num_kv_blocks=100)
    script = {"eos": [11, EOS, 12], "ign": [EOS, EOS, 13], "stop": [14, 99, 15],
              "min": [EOS, EOS, EOS, 16, EOS], "last": [17, EOS]}
    s.add_request(make_req("eos", 5, max_tokens=10, ignore_eos=False, eos=(EOS,)))
    s.add_request(make_req("ign", 5, max_tokens=3, ignore_eos=True, eos=(EOS,)))
    s.add_request(make_req("stop", 5, max_tokens=10, eos=(EOS,), stop_token_ids=(99,)))
    s.add_request(make_req("min", 5, max_tokens=10, ignore_eos=False, eos=(EOS,), min_tokens=3))
    s.add_request(make_req("last", 5, max_tokens=2, ignore_eos=False, eos=(EOS,)))
    done, _ = run_all(s, token_fn=scripted(script))
    assert done["eos"].output_token_ids == [11, EOS] and done["eos"].finish_reason == "stop"
    assert done["eos"].stop_reason is None
    assert done["ign"].output_token_ids == [EOS, EOS, 13] and done["ign"].finish_reason == "length"
    assert done["stop"].output_token_ids == [14, 99] and done["stop"].stop_reason == 99
    # EOS at outputs 1 and 2 are below min_tokens=3; the one at output 3 stops.
    assert done["min"].output_token_ids == [EOS, EOS, EOS] and done["min"].status == RequestStatus.FINISHED_STOPPED
    assert done["last"].finish_reason == "stop"  # EOS wins over length on the last token
    assert_pool_clean(s)


def test_finish_requests_for_stop_strings_and_errors():
    s = make_scheduler(num_kv_blocks=50)
    for rid in ("a", "b", "c"):
        s.add_request(make_req(rid, 9, max_tokens=20))
    fr = FakeRunner(s, check_invariants=True)
    fr.step()
    done = s.finish_requests(["a", "zzz"], RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r in done] == ["a"] and done[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish_requests("b", RequestStatus.RUNNING)
    # The engine's error path: a step fails, its requests are finished, the next schedule works.
    out = s.schedule()
    s.finish_requests([r.request_id for r in out.scheduled], RequestStatus.FINISHED_ERROR)
    assert s.schedule().scheduled == () and not s.has_unfinished_requests()
    assert_pool_clean(s)


def test_engine_protocol_errors():
    s = make_scheduler(num_kv_blocks=50)
    s.add_request(make_req("a", 5, max_tokens=4))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        s.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        s.update_from_output(out, {})
    s.update_from_output(out, [42])  # tokens by row
    assert s.get_request("a").output_token_ids == [42]
    with pytest.raises(ValueError, match="does not match the pending plan"):
        s.update_from_output(out, [42])


def test_priority_policy_orders_admission_and_preempts_least_important():
    s = make_scheduler(budget=16, max_seqs=2, num_kv_blocks=100, policy="priority")
    s.add_request(make_req("low", 4, max_tokens=3, priority=5, arrival_time=0.0))
    s.add_request(make_req("hi_late", 4, max_tokens=3, priority=0, arrival_time=2.0))
    s.add_request(make_req("hi_early", 4, max_tokens=3, priority=0, arrival_time=1.0))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["hi_early", "hi_late"]
    # Tight pool: the victim is the largest (priority, arrival) among the running.
    s2 = make_scheduler(budget=32, max_seqs=3, block_size=4, num_kv_blocks=14, policy="priority")
    s2.add_request(make_req("p1", 8, max_tokens=30, priority=1, arrival_time=0.0))
    s2.add_request(make_req("p0", 8, max_tokens=30, priority=0, arrival_time=1.0))
    fr = FakeRunner(s2, check_invariants=True)
    first_preempted = None
    while s2.has_unfinished_requests():
        res = fr.step()
        if res.out.preempted_ids and first_preempted is None:
            first_preempted = res.out.preempted_ids[0]
    assert first_preempted == "p1"
    assert fr.finished["p0"].num_preemptions == 0
    assert fr.finished["p1"].output_token_ids == expected_tokens("p1", 30)


def test_fcfs_victim_is_the_last_admitted():
    s = make_scheduler(budget=32, max_seqs=3, block_size=4, num_kv_blocks=14)
    s.add_request(make_req("first", 8, max_tokens=30))
    s.add_request(make_req("second", 8, max_tokens=30))
    done, steps = run_all(s)
    victims = [p for st in steps for p in st.out.preempted_ids]
    assert victims and set(victims) == {"second"}
    assert done["first"].num_preemptions == 0


def test_static_batching_admits_nothing_until_the_batch_finishes():
    s = make_scheduler(budget=64, max_seqs=4, num_kv_blocks=200, static=True)
    lens = {"a": 40, "b": 3, "c": 20, "d": 7, "e": 5, "f": 5}
    for rid, n in lens.items():
        s.add_request(make_req(rid, 6, max_tokens=n))
    done, steps = run_all(s)
    batches = []
    for st in steps:
        ids = {r.request_id for r in st.out.scheduled}
        if ids & {"e", "f"}:
            batches.append(ids)
            assert not ids & {"a", "b", "c", "d"}  # second batch only after the first is done
    assert batches and all(d.output_token_ids == expected_tokens(k, lens[k]) for k, d in done.items())
    assert s.num_preemptions == 0
    # Continuous batching finishes the same work in fewer steps.
    c = make_scheduler(budget=64, max_seqs=4, num_kv_blocks=200)
    for rid, n in lens.items():
        c.add_request(make_req(rid, 6, max_tokens=n))
    _, csteps = run_all(c)
    assert len(csteps) < len(steps)


def test_request_seed_and_properties():
    r = Request("x", [5, 6, 7], SamplingParams(seed=123, max_tokens=4))
    assert r.seed == 123 and r.max_tokens == 4 and r.num_tokens == 3 and r.status == RequestStatus.WAITING
    r2 = Request("y", [5], SamplingParams())
    r3 = Request("z", [5], SamplingParams())
    assert isinstance(r2.seed, int) and 0 <= r2.seed < 2**63 and r2.seed != r3.seed
    r.append_output_token(9)
    assert r.all_token_ids == [5, 6, 7, 9] and r.output_token_ids == [9] and r.num_output_tokens == 1
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ERROR) and not RequestStatus.is_finished(
        RequestStatus.PREEMPTED)


def test_scheduler_package_never_imports_jax():
    import subprocess
    import sys
    code = ("import sys, jaxserve.scheduler, jaxserve.worker.fake_runner, jaxserve.scheduler.request; "
            "bad = [m for m in ('jax', 'flax') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
