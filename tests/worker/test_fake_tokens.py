"""The fake device's tokens: `default_tokens` (a whole step's, hashed in NumPy) equals
`default_token` (one at a time, the tests' reference) and stays in [low, vocab_size)."""

from __future__ import annotations

import random

import numpy as np

from jaxserve.worker.fake_runner import default_token, default_tokens


def test_a_steps_tokens_at_once_equal_one_at_a_time():
    rng = random.Random(7)
    ids = [f"req-{rng.random():.6f}#{rng.randrange(4)}" for _ in range(300)] + ["r", ""]
    pos = [rng.randrange(0, 2**31) for _ in ids[:-2]] + [0, 2**31 - 1]
    for vocab, low in ((1000, 3), (98, 3), (49152, 0), (5, 4)):
        got = default_tokens(ids, pos, vocab_size=vocab, low=low)
        assert got.tolist() == [default_token(r, p, vocab_size=vocab, low=low)
                                for r, p in zip(ids, pos)]
        assert got.min() >= low and got.max() < vocab
    # a request's tokens spread over the vocabulary (not a constant, not a short cycle)
    seq = [default_token("r0", p) for p in range(400)]
    assert len(set(seq)) > 250 and np.diff(seq).any()
    assert default_tokens([], []).shape == (0,)


def test_the_runner_hashes_a_step_at_once_only_with_its_own_token_function():
    """With no token function the runner emits `default_token`'s tokens (hashed a step at
    once); a token function assigned afterwards is the one used."""
    from jaxserve.worker.fake_runner import FakeRunner, scripted
    from scheduler._util import make_req, make_scheduler

    for replace in (False, True):
        s = make_scheduler(num_kv_blocks=100)
        runner = FakeRunner(s)
        if replace:
            runner.token_fn = scripted({"a": [11, 12, 13], "b": [21, 22, 23]})
        s.add_request(make_req("a", 5, max_tokens=3))
        s.add_request(make_req("b", 7, max_tokens=3))
        done = runner.run()
        want = ({"a": [11, 12, 13], "b": [21, 22, 23]} if replace else
                {r: [default_token(r, i) for i in range(3)] for r in "ab"})
        assert {r: done[r].output_token_ids for r in "ab"} == want
