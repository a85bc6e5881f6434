"""Hypothesis properties over random arrivals, lengths, budgets, pools, policies
and aborts, checked on every step (no model: deterministic fake tokens)."""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduler.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.input_batch import build_batch
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.worker.fake_runner import check_invariants, default_token

from ._util import expected_tokens


@st.composite
def workloads(draw):
    budget = draw(st.integers(2, 40))
    cfg = dict(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_model_len=draw(st.integers(8, 80)),
        budget=budget,
        max_seqs=draw(st.integers(1, min(6, budget))),
        threshold=draw(st.sampled_from([0, 0, 3, 7])),
        prefix=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        static=draw(st.sampled_from([False, False, False, True])),
        num_kv_blocks=draw(st.integers(2, 40)),
    )
    families = [draw(st.lists(st.integers(10, 30), min_size=30, max_size=30)) for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 9))):
        fam = families[draw(st.integers(0, 1))]
        shared = draw(st.integers(0, 30))
        tail = draw(st.lists(st.integers(10, 30), min_size=0 if shared else 1, max_size=12))
        reqs.append(dict(
            rid=f"r{i}", tokens=fam[:shared] + tail,
            max_tokens=draw(st.one_of(st.none(), st.integers(1, 25))),
            arrival=draw(st.integers(0, 12)),
            abort_at=draw(st.one_of(st.none(), st.none(), st.integers(0, 40))),
            priority=draw(st.integers(0, 2))))
    return cfg, reqs


def _scheduler(cfg):
    sc = SchedulerConfig(max_num_batched_tokens=cfg["budget"], max_num_seqs=cfg["max_seqs"],
                         max_model_len=cfg["max_model_len"], policy=cfg["policy"],
                         long_prefill_token_threshold=cfg["threshold"],
                         static_batching=cfg["static"], min_token_bucket=1)
    cc = CacheConfig(block_size=cfg["block_size"], num_kv_blocks=cfg["num_kv_blocks"],
                     enable_prefix_caching=cfg["prefix"])
    return Scheduler(sc, cc)


def _valid_max_tokens(cfg, spec):
    """The clamped max_tokens, or None when add_request must reject the request."""
    P, M, B = len(spec["tokens"]), cfg["max_model_len"], cfg["block_size"]
    if P >= M:
        return None
    mt = M - P if spec["max_tokens"] is None else min(spec["max_tokens"], M - P)
    return None if -(-(P + mt - 1) // B) > cfg["num_kv_blocks"] - 1 else mt


def _check_step(s, cfg, out, readmit, model_computed):
    B = cfg["block_size"]
    assert out.num_scheduled_tokens <= cfg["budget"]
    assert len(out.scheduled) <= cfg["max_seqs"]
    for rid in out.preempted_ids:
        readmit[rid] = True
    kv = s.kv_cache_manager
    written = set()
    for r in out.scheduled:
        req = s.get_request(r.request_id)
        assert r.token_ids and list(r.token_ids) == req.all_token_ids[r.start_pos:r.end_pos]
        assert req.num_computed_tokens == r.end_pos
        assert r.sample == (r.end_pos == req.num_tokens) and r.output_pos == req.num_output_tokens
        if readmit.pop(r.request_id, False):
            # (Re)admission: from 0, or from a prefix-cache hit of whole blocks.
            assert r.start_pos % B == 0 and r.start_pos < req.num_tokens
            assert cfg["prefix"] or r.start_pos == 0
        else:
            assert r.start_pos == model_computed[r.request_id]  # resumes where it stopped
        model_computed[r.request_id] = r.end_pos
        for b in r.block_ids[r.start_pos // B:(r.end_pos - 1) // B + 1]:
            # Blocks written this step: one writer, not in the prefix cache.
            assert b not in written and kv.ref_count(b) == 1 and not kv.is_cached(b)
            written.add(b)
    if out.scheduled:
        batch = build_batch(out, block_size=B, max_blocks_per_seq=s.max_blocks_per_seq)
        real = batch.slot_mapping[:int(batch.num_tokens)]
        assert len(set(real.tolist())) == len(real) and (real >= B).all()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_exactly_and_leak_nothing(wl):
    cfg, specs = wl
    s = _scheduler(cfg)
    kv = s.kv_cache_manager
    initial_free = kv.num_free_blocks
    readmit, model_computed, aborted, added, want = {}, {}, set(), {}, {}
    done = {}
    last_arrival = max(sp["arrival"] for sp in specs)
    for step in range(3000):
        for sp in specs:
            if sp["arrival"] == step:
                req = Request(sp["rid"], sp["tokens"],
                              SamplingParams(max_tokens=sp["max_tokens"], ignore_eos=True),
                              priority=sp["priority"], arrival_time=float(step))
                mt = _valid_max_tokens(cfg, sp)
                if mt is None:
                    try:
                        s.add_request(req)
                        raise AssertionError(f"{sp} should have been rejected")
                    except ValueError:
                        continue
                s.add_request(req)
                added[sp["rid"]], want[sp["rid"]], readmit[sp["rid"]] = req, mt, True
            if sp["abort_at"] == step and sp["rid"] in added and s.abort(sp["rid"]):
                aborted.add(sp["rid"])
        if step > last_arrival and not s.has_unfinished_requests():
            break
        out = s.schedule()
        check_invariants(s)
        _check_step(s, cfg, out, readmit, model_computed)
        toks = {r.request_id: default_token(r.request_id, r.output_pos)
                for r in out.scheduled if r.sample}
        for r in s.update_from_output(out, toks):
            done[r.request_id] = r
        check_invariants(s)
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
    else:
        raise AssertionError("livelock: requests never finished")
    for rid, req in added.items():
        if rid in aborted:
            assert req.finish_reason == "abort"
            assert req.output_token_ids == expected_tokens(rid, req.num_output_tokens)
        else:
            assert done[rid] is req and req.finish_reason == "length"
            assert req.output_token_ids == expected_tokens(rid, want[rid])
    assert kv.num_free_blocks == initial_free == kv.num_blocks
    event(f"preempted={s.num_preemptions > 0}")
    event(f"aborted={bool(aborted)}")
    event(f"rejected={len(added) < len(specs)}")
    event(f"prefix_hits={kv.prefix_cache_hits > 0}")
    if not cfg["prefix"]:
        assert kv.num_cached_blocks == 0
