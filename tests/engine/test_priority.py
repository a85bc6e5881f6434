"""Priority scheduling through the engine (FakeRunner): admission order and the victim.

The scenario, checked by hand (block_size 4, num_kv_blocks 9 = 8 usable,
max_num_seqs 2, prefix caching off, every prompt 3 tokens, ignore_eos):

  L0..L3 arrive at t=0..3 with priority 5 (L0 max_tokens 24, the others 2).
  step 1: L0, L1 prefill (1 block each).      H (priority 0, 20 tokens) arrives.
  step 2: L1 decodes its 2nd token: finished.
  step 3: a slot is free. The waiting heap holds H(0), L2(5), L3(5): H is
          admitted although L2 and L3 came first; running = [H, L0].
  From then on each step writes one position of each: L0 writes position
  s + 1 at step s, H position s - 1, needing ceil((p + 1) / 4) blocks. At step
  13 the pool is full (L0: 4 blocks for positions 0..14, H: 4 for 0..12).
  step 15: L0 must write position 16 (a 5th block) and none is free: the
          victim is the tail of running by (priority, arrival) = L0 itself,
          the *oldest* request. H keeps running and finishes at step 22
          (20 tokens from step 3).
Under FCFS (all priority 0) the same arrivals admit L2 and L3 before H, and
the victim when the pool runs out (step 17) is H, the last admitted.
"""

from __future__ import annotations

import pytest

from conftest import tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, counting_token
from jaxserve.validation import ValidationError


def engine(policy: str, **kw) -> LLMEngine:
    # Steps planned at the step() that returns them, so the per-step running sets below
    # are those of the scheduler's policy (async scheduling plans one call ahead).
    args = dict(max_model_len=64, block_size=4, num_kv_blocks=9, max_num_seqs=2,
                max_num_batched_tokens=32, enable_prefix_caching=False, async_scheduling=False)
    config = make_engine_config(ModelConfig.tiny(), scheduling_policy=policy, **dict(args, **kw))
    runner = FakeRunner.for_config(config, token_fn=counting_token(67, config.max_logprobs))
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner)


def _add(eng: LLMEngine, rid: str, first_id: int, max_tokens: int, priority: int, t: float):
    eng.add_request(rid, [first_id, first_id + 1, first_id + 2],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                    priority=priority, arrival_time=t)


def run_scenario(policy: str, low: int) -> tuple[dict[int, list[str]], dict[str, int], dict]:
    """Per step: running ids; the step each request finished; the step of each preemption."""
    eng = engine(policy)
    for i, mt in enumerate((24, 2, 2, 2)):
        _add(eng, f"L{i}", 10 + 3 * i, mt, low, float(i))
    running, finished, preempted = {}, {}, {}
    s = eng.scheduler
    for step in range(1, 80):
        if step == 2:
            _add(eng, "H", 40, 20, 0, 10.0)
        before = {r.request_id: r.num_preemptions for r in s.running}
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = step
        running[step] = [r.request_id for r in s.running]
        for rid, n in before.items():
            req = s.get_request(rid)
            if req is not None and req.num_preemptions > n:
                preempted[step] = rid
        if not eng.has_unfinished_requests():
            break
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return running, finished, preempted


def test_late_high_priority_request_overtakes_and_the_low_one_is_preempted():
    running, finished, preempted = run_scenario("priority", low=5)
    assert running[1] == ["L0", "L1"] and finished["L1"] == 2
    assert running[3] == ["H", "L0"]  # H overtook L2 and L3, which arrived before it
    assert all(running[s] == ["H", "L0"] for s in range(3, 15))
    assert preempted == {15: "L0"}  # the oldest request, but the least important
    assert running[15] == ["H"] and finished["H"] == 22  # 20 tokens from step 3, never stopped
    assert finished["H"] < finished["L2"] < finished["L3"] and finished["L0"] > finished["H"]


def test_fcfs_admits_by_arrival_and_preempts_the_last_admitted():
    running, finished, preempted = run_scenario("fcfs", low=0)
    assert running[3] == ["L0", "L2"] and running[5] == ["L0", "L3"]
    assert running[7] == ["L0", "H"]
    assert list(preempted.values()) == ["H"]
    assert finished["L2"] < finished["L3"] < finished["H"]


def test_nonzero_priority_needs_the_priority_policy():
    eng = engine("fcfs")
    with pytest.raises(ValidationError, match=r"priority=3: must be 0 unless the engine runs "
                                              r"scheduling_policy='priority' \(it runs 'fcfs'\)"):
        eng.add_request("x", [4, 5], SamplingParams(max_tokens=1), priority=3)
    assert not eng.has_unfinished_requests()
    eng.add_request("ok", [4, 5], SamplingParams(max_tokens=1), priority=0)
    with pytest.raises(ValueError, match="must be 'fcfs' or 'priority'"):
        make_engine_config(ModelConfig.tiny(), scheduling_policy="lifo")
    with pytest.raises(ValueError, match="policy='priority'"):
        make_engine_config(ModelConfig.tiny(), scheduling_policy="lifo", policy="priority")


def test_llm_generate_priority_scalar_and_list():
    eng = engine("priority", max_num_seqs=1, num_kv_blocks=65)
    llm = LLM(engine=eng)
    sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    outs = llm.generate([[4, 5], [6, 7], [8, 9]], sp, priority=[2, 0, 1], use_tqdm=False)
    # One sequence at a time: the prompts run in priority order 1, 2, 0, not input order.
    starts = [o.metrics.first_scheduled_time for o in outs]
    assert starts[1] < starts[2] < starts[0]
    assert [o.outputs[0].token_ids for o in outs] == [[6, 7, 8], [8, 9, 10], [10, 11, 12]]
    llm.generate([[4, 5]], sp, priority=7, use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([[4, 5], [6, 7]], sp, priority=[1], use_tqdm=False)
    fcfs = LLM(engine=engine("fcfs"))
    with pytest.raises(ValueError, match=r"prompts\[1\]: priority=1: must be 0"):
        fcfs.generate([[4, 5], [6, 7]], sp, priority=[0, 1], use_tqdm=False)
    assert not fcfs.engine.has_unfinished_requests()  # all-or-nothing
