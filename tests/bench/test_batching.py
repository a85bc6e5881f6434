"""bench_batching on the tiny model: serial > static > continuous in steps, by hand."""

from __future__ import annotations

import pytest

from jaxserve.bench import batching
from jaxserve.bench.traces import TraceRequest
from tests.conftest import tiny_engine

# Six requests at t=0 with one-character prompts (18 tokens with the tiny chat template).
LENGTHS = [2, 9, 3, 7, 4, 5]
ROWS = [TraceRequest(f"r{i}", chr(ord("a") + i), n, 0.0) for i, n in enumerate(LENGTHS)]


def _tiny(extra):
    # One program per engine (64 tokens x B rows) keeps compile time small; prefix caching
    # off because with it a request whose first block another row is computing this very
    # step waits one step (to hit it), which moves the hand schedule below by a step.
    return tiny_engine(**extra, enable_prefix_caching=False, token_buckets=(64,),
                       seq_buckets=(extra["max_num_seqs"],))


def test_steps_serial_static_continuous_on_tiny_model():
    runner = batching.engine_runner(_tiny, respect_arrivals=False)
    c = batching.compare_modes(ROWS, 3, runner)
    m = c["modes"]
    # Serial: each request's prefill step yields its first token, so steps = sum of lengths.
    assert m["serial"]["steps"] == sum(LENGTHS) == 30
    # Static, B=3: batches [2, 9, 3] and [7, 4, 5] last as long as their longest: 9 + 7.
    assert m["static"]["steps"] == 16
    # Continuous, B=3 (by hand): A,B,C start; A ends at step 2 and D starts at 3; C ends at 3,
    # E starts at 4; E ends at 7, F starts at 8; B and D end at 9; F's 5 tokens end at 12.
    assert m["continuous"]["steps"] == 12
    for s in m.values():
        assert s["output_tokens"] == sum(LENGTHS) and s["output_tokens_per_s"] > 0
    # Seeds' formula for static batches of 3: 30 / (3 * 9 + 3 * 7); measured: 30 rows / (3 x 16).
    assert c["seeds_formula_static_utilisation"] == pytest.approx(30 / 48)
    assert m["static"]["row_step_utilisation"] == pytest.approx(30 / 48)
    assert m["continuous"]["row_step_utilisation"] == pytest.approx(30 / 36)
    assert m["serial"]["row_step_utilisation"] == 1.0
    assert m["static"]["speedup_vs_static"] == 1.0 and m["serial"]["speedup_vs_serial"] == 1.0


def test_probe_waits_for_static_batch_only():
    # Dry run (fake runner, 10 ms + 1 ms/token steps): the probe arrives 50 ms in.
    runner = batching.dry_runner(cost=batching.StepCost(10.0, 1.0, 0.0), vocab_size=67,
                                 max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=160,
                                 block_size=4)
    rows = [TraceRequest(f"s{i}", "x" * 8, n, 0.0, prompt_tokens=20) for i, n in enumerate([40, 3, 6])]
    t = batching.probe_ttft(rows, 3, runner, delay_s=0.05, max_tokens=4)
    # Static: the probe starts only after the 40-step batch; continuous: once the 3-token row ends.
    assert t["static"] > 40 * 10
    assert t["continuous"] < 10 * 20
    assert t["static"] > 4 * t["continuous"]


def test_seeds_formula_and_mode_validation():
    assert batching.seeds_formula([1024, 12, 40, 96, 180, 256, 300, 60], 8) == pytest.approx(0.2402, abs=1e-4)
    with pytest.raises(ValueError, match="mode="):
        batching.mode_args("dynamic", 4)
    with pytest.raises(ValueError, match="batch="):
        batching.mode_args("static", 0)
