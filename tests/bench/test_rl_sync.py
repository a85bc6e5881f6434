"""The RL weight-sync benchmark's accounting (jaxserve.bench.rl_sync) on the tiny model.

Rollouts of 6 tokens (EOS ignored) with an update every 3 steps: under "abort" none can
finish and every update discards tokens; "keep" and "retract" finish every rollout on
two weight versions, "wait" on one; only "retract" recomputes. Every finished rollout
has exactly max_tokens tokens, and the engine is left with no KV held.
"""

from __future__ import annotations

import pytest

from conftest import tiny_engine, tiny_params
from jaxserve.bench.rl_sync import run_mode

IDS = [[5, 9, 13, 2], [7, 7, 3], [11, 4, 6, 8, 1]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def rows():
    eng = tiny_engine()
    weights = [tiny_params(0)[1], tiny_params(1)[1]]
    out = {m: run_mode(eng, m, weights, IDS, n=2, max_tokens=MAX_TOKENS, update_every=3,
                       steps=20) for m in ("abort", "wait", "keep", "retract")}
    assert eng.scheduler.kv_cache_manager.num_used_blocks == 0
    eng.update_params(weights[0])
    return out


def test_each_mode_counts_what_it_throws_away(rows):
    for m, r in rows.items():
        assert r["updates"] == 6
        assert r["useful_tokens"] == r["rollouts_finished"] * MAX_TOKENS, m
        assert (r["discarded_tokens_per_update"] > 0) == (m == "abort"), m
        assert (r["recomputed_tokens_per_update"] > 0) == (m == "retract"), m
    assert rows["abort"]["rollouts_finished"] == 0
    assert rows["wait"]["rollouts_finished"] > 0 and rows["wait"]["rollouts_mixed_versions"] == 0
    for m in ("keep", "retract"):
        assert 0 < rows[m]["rollouts_finished"] == rows[m]["rollouts_mixed_versions"], m


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="mode='drop'"):
        run_mode(None, "drop", [1, 2], IDS)
    with pytest.raises(ValueError, match="at least 2"):
        run_mode(None, "keep", [1], IDS)
