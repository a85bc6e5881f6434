"""Dry-run bucket benchmark: exact padding on a hand-scheduled trace; fitted vs pow2."""

from __future__ import annotations

import json

import pytest

from jaxserve.bench import buckets
from jaxserve.bench.replay import StepCost, dry_run, prompt_ids_for
from jaxserve.bench.traces import TraceRequest, synthetic_trace
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduler.buckets import BucketPolicy, pow2_buckets

# Three requests at t=0: prompts of 5, 3 and 9 tokens, outputs of 2, 4 and 1.
HAND = [TraceRequest("A", "a", 2, 0.0, prompt_tokens=5), TraceRequest("B", "b", 4, 0.0, prompt_tokens=3),
        TraceRequest("C", "c", 1, 0.0, prompt_tokens=9)]
SCHED = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
CACHE = CacheConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=False)


def _hand_run(token_buckets, seq_buckets=(1, 2, 4)):
    ids = prompt_ids_for(HAND, None, vocab_size=67, chat=False)
    assert [len(x) for x in ids] == [5, 3, 9]
    plans = []
    r = dry_run(HAND, ids, SCHED, CACHE, policy=BucketPolicy(token_buckets, seq_buckets),
                respect_arrivals=False, on_step=plans.append)
    return r, plans


def test_hand_checked_schedule_and_padding():
    # The schedule by hand (budget 16 tokens, decodes first, chunked prefill):
    #   step 1: A prefill 5 + B prefill 3 + C chunk 8 (budget left) = 16 tokens, 3 seqs
    #   step 2: A, B decode + C's last prompt token               =  3 tokens, 3 seqs
    #           (A has its 2 tokens, C its 1: both finish)
    #   step 3: B decode = 1 token; step 4: B decode = 1 token (B has 4)
    r, plans = _hand_run((1, 2, 4, 8, 16))
    assert [p.num_scheduled_tokens for p in plans] == [16, 3, 1, 1]
    assert [p.num_seqs for p in plans] == [3, 3, 1, 1]
    assert r.steps == 4 and r.output_tokens == 2 + 4 + 1
    s = r.summary()
    # Policy 1, pow2 from 1: 16->16, 3->4, 1->1, 1->1: 22 slots for 21 real tokens.
    assert (s["real_tokens"], s["padded_tokens"]) == (21, 22)
    assert s["padding_fraction"] == pytest.approx(1 / 22)
    assert s["per_bucket"]["16"] == {"steps": 1, "real_tokens": 16, "padded_tokens": 16,
                                     "padding_fraction": 0.0}
    assert s["per_bucket"]["4"]["padded_tokens"] == 4 and s["per_bucket"]["4"]["real_tokens"] == 3
    assert s["per_bucket"]["1"]["steps"] == 2 and s["per_bucket"]["8"]["steps"] == 0
    # Seqs 3, 3, 1, 1 padded to buckets (1, 2, 4): 4, 4, 1, 1.
    assert s["seq_padding_fraction"] == pytest.approx(1 - 8 / 10)
    # Rows that sampled: 2 + 3 + 1 + 1 = 7 of 4 steps x 4 slots.
    assert s["row_step_utilisation"] == pytest.approx(7 / 16)

    # Policy 2, explicit (8, 16): 16->16, 3->8, 1->8, 1->8: 40 slots, 19 of them padding.
    r2, plans2 = _hand_run((8, 16))
    s2 = r2.summary()
    assert [p.token_bucket for p in plans2] == [16, 8, 8, 8]
    assert (s2["real_tokens"], s2["padded_tokens"]) == (21, 40)
    assert s2["padding_fraction"] == pytest.approx(19 / 40)
    assert s2["per_bucket"]["8"] == {"steps": 3, "real_tokens": 5, "padded_tokens": 24,
                                     "padding_fraction": pytest.approx(19 / 24)}


def test_modeled_clock_follows_step_cost():
    cost = StepCost(fixed_ms=10.0, per_token_ms=1.0, per_seq_ms=0.0)
    r, _ = _hand_run((8, 16))
    ids = prompt_ids_for(HAND, None, vocab_size=67, chat=False)
    r = dry_run(HAND, ids, SCHED, CACHE, policy=BucketPolicy((8, 16), (1, 2, 4)), cost=cost,
                respect_arrivals=False)
    # Steps padded to 16, 8, 8, 8 tokens: 26 + 18 + 18 + 18 ms.
    assert r.duration_s == pytest.approx(0.080)
    # C's only token comes at the end of step 2; A's first at step 1.
    assert r.ttft_by_id == pytest.approx({"A": 0.026, "B": 0.026, "C": 0.044})
    assert sorted(r.tpot) == pytest.approx([0.018, 0.018])  # A: 1 gap of 18 ms; B: 3 gaps of 18 ms


def test_fitted_padding_not_worse_than_pow2_with_same_count():
    rows = synthetic_trace(48, request_rate=float("inf"), prompt_mean=40, output_mean=24, seed=3)
    ids = prompt_ids_for(rows, None, vocab_size=49152)
    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, max_model_len=1024)
    cache = CacheConfig(block_size=16, num_kv_blocks=1024)
    th, sh = buckets.fit_histograms(rows, ids, sched, cache, StepCost(), respect_arrivals=False)
    for min_size in (8, 32, 64):
        p2 = pow2_buckets(256, min_size)
        k = len(p2)
        cands = buckets.build_candidates(f"pow2:{min_size},fit:{k}", [], max_tokens=256, max_seqs=32,
                                         token_hist=th, seq_hist=sh)
        res = {c.name: dry_run(rows, ids, sched, cache, policy=c.policy(), respect_arrivals=False)
               for c in cands}
        a, b = res[f"pow2:{min_size}"], res[f"fit:{k}"]
        assert len(cands[1].token_buckets) <= k
        assert a.tokens_per_step == b.tokens_per_step == th  # buckets never change the schedule
        assert b.bucket_stats["padded_tokens"] <= a.bucket_stats["padded_tokens"]


def test_pareto_and_recommendation():
    assert buckets.pareto([(1, 5), (2, 2), (3, 3), (0.5, 9)]) == [True, True, False, True]
    rows = [dict(name="a", programs=30, warmup_cold_s=90, padding_fraction=0.2, output_tokens_per_s=100),
            dict(name="b", programs=10, warmup_cold_s=30, padding_fraction=0.3, output_tokens_per_s=98.5),
            dict(name="c", programs=4, warmup_cold_s=12, padding_fraction=0.5, output_tokens_per_s=97.9)]
    assert buckets.recommend(rows)["name"] == "b"  # c is 2.1% below the best


def test_cli_dry_run_end_to_end(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = synthetic_trace(24, request_rate=8.0, output_mean=20, seed=1)
    trace.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))
    out = tmp_path / "b.json"
    assert buckets.main([f"--trace={trace}", "--dry_run", "--tokenizer=none", f"--output_json={out}",
                         "--policies=single,pow2:8,fit:3", "--explicit=32,128,256"]) == 0
    doc = json.loads(out.read_text())
    names = [p["name"] for p in doc["policies"]]
    assert names == ["single", "pow2:8", "fit:3", "explicit:32,128,256"]
    for p in doc["policies"]:
        for key in ("programs", "warmup_cold_s", "warmup_cached_s", "padding_fraction", "per_bucket",
                    "steps", "output_tokens_per_s", "ttft_ms", "tpot_ms", "pareto_padding",
                    "pareto_throughput"):
            assert key in p, key
        assert p["programs"] == len(BucketPolicy(p["token_buckets"], p["seq_buckets"]).all_shapes())
        assert p["output_tokens_per_s"] > 0 and p["timing"] == "modeled"
    assert doc["policies"][0]["programs"] == 1
    assert sum(doc["tokens_per_step_histogram"].values()) > 0
    flags = doc["recommendation"]["flags"]
    kv = dict(f.lstrip("-").split("=") for f in flags.split())
    SchedulerConfig(max_num_batched_tokens=int(kv["max_num_batched_tokens"]),
                    max_num_seqs=int(kv["max_num_seqs"]),
                    token_buckets=tuple(int(x) for x in kv["token_buckets"].split(",")),
                    seq_buckets=tuple(int(x) for x in kv["seq_buckets"].split(",")))
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_bad_policy_names_the_entry():
    with pytest.raises(ValueError, match="'cubic:3'"):
        buckets.build_candidates("cubic:3", [], max_tokens=256, max_seqs=32)
    with pytest.raises(ValueError, match="last bucket"):
        buckets.build_candidates("", ["16,64"], max_tokens=256, max_seqs=32)


def test_fit_step_cost_recovers_a_linear_model():
    from jaxserve.bench.replay import fit_step_cost

    truth = StepCost(fixed_ms=12.0, per_token_ms=0.5, per_seq_ms=0.25)
    recs = [(t, s, truth.seconds(t, s)) for t, s in [(8, 1), (8, 8), (16, 4), (64, 8), (256, 32), (4, 2)]]
    got = fit_step_cost(recs)
    assert (got.fixed_ms, got.per_token_ms, got.per_seq_ms) == pytest.approx((12.0, 0.5, 0.25), abs=1e-6)
    with pytest.raises(ValueError, match="distinct"):
        fit_step_cost(recs[:2])
